"""The request-trace format (the Mooncake FAST'25 release's): one JSON object a line.

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}

``hash_ids`` name the prompt's blocks of ``block_tokens`` tokens, chained: equal ids at the
same position mean the same prefix. :func:`load_trace` reads and checks the whole file
before returning anything, so nothing ever runs on a half-read trace.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError


@dataclass(frozen=True, slots=True)
class Request:
    timestamp: int  # ms from the start of the trace
    input_length: int  # tokens
    output_length: int
    hash_ids: tuple[int, ...]

    def to_json(self) -> str:
        return json.dumps({"timestamp": self.timestamp, "input_length": self.input_length,
                           "output_length": self.output_length, "hash_ids": list(self.hash_ids)})


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_line(text: str, lineno: int, where: str = "trace") -> Request:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{where}:{lineno}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise InputError(f"{where}:{lineno}: expected a JSON object, got {type(obj).__name__}")
    if "hash_ids" not in obj:
        raise InputError(f"{where}:{lineno}: no 'hash_ids'")
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or not all(_int(i) and i >= 0 for i in ids):
        bad = ids if not isinstance(ids, list) else next(i for i in ids if not (_int(i) and i >= 0))
        raise InputError(f"{where}:{lineno}: 'hash_ids' must be a list of non-negative integers, found {bad!r}")
    fields = {}
    for name in ("timestamp", "input_length", "output_length"):
        value = obj.get(name, 0)
        if not _int(value) or value < 0:
            raise InputError(f"{where}:{lineno}: {name!r} must be a non-negative integer, got {value!r}")
        fields[name] = value
    return Request(hash_ids=tuple(ids), **fields)


def parse_lines(lines: Iterable[str], where: str = "trace") -> list[Request]:
    """Every request of ``lines`` (blank lines skipped), or an ``InputError`` naming the
    first bad line; timestamps must not go backwards (arrival order is the trace's order)."""
    out: list[Request] = []
    last = 0
    for lineno, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        req = parse_line(text, lineno, where)
        if req.timestamp < last:
            raise InputError(f"{where}:{lineno}: timestamp {req.timestamp} is before the previous line's ({last})")
        last = req.timestamp
        out.append(req)
    if not out:
        raise InputError(f"{where}: no requests")
    return out


def load_trace(path: str | Path) -> list[Request]:
    path = Path(path)
    try:
        with path.open(encoding="utf-8") as f:
            return parse_lines(f, where=str(path))
    except OSError as exc:
        raise InputError(f"trace: cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise InputError(f"trace: {path} is not UTF-8 text ({exc.reason})") from None


def write_trace(path: str | Path, requests: Iterable[Request]) -> None:
    Path(path).write_text("".join(r.to_json() + "\n" for r in requests))
