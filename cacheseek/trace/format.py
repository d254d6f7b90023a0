"""The request-trace format (the Mooncake FAST'25 release's): one JSON object a line.

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}

``hash_ids`` name the prompt's blocks of ``block_tokens`` tokens, chained: an id names its
whole prefix, so it always follows the same id (or always starts a request) and appears once
a request. :func:`load_trace` reads and checks the whole file before returning anything, so
nothing ever runs on a half-read trace.
"""

from __future__ import annotations

import json
import reprlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError

# Ids are below it: the replay keys an id by its 16 big-endian bytes, and 2^128 - 1 (all
# ones) is the key of its root, the parent of a request's first block.
ID_BOUND = (1 << 128) - 1
_START = -1  # the "parent" of a request's first id

@dataclass(frozen=True, slots=True)
class Request:
    timestamp: int  # ms from the start of the trace
    input_length: int  # tokens
    output_length: int
    hash_ids: tuple[int, ...]


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_SHOWN = reprlib.Repr()
_SHOWN.maxstring = _SHOWN.maxother = 60


def _shown(value: object) -> str:
    """``value`` for an error message, cut short: a line's field may be megabytes long."""
    return _SHOWN.repr(value)


def parse_line(text: str, lineno: int, where: str = "trace") -> Request:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{where}:{lineno}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    except ValueError as exc:  # an integer of more digits than Python converts
        raise InputError(f"{where}:{lineno}: cannot read the line ({str(exc).split(';')[0]})") from None
    except RecursionError:
        raise InputError(f"{where}:{lineno}: cannot read the line (nested too deeply)") from None
    if not isinstance(obj, dict):
        raise InputError(f"{where}:{lineno}: expected a JSON object, got {type(obj).__name__}")
    if "hash_ids" not in obj:
        raise InputError(f"{where}:{lineno}: no 'hash_ids'")
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or not all(_int(i) and i >= 0 for i in ids):
        bad = ids if not isinstance(ids, list) else next(i for i in ids if not (_int(i) and i >= 0))
        raise InputError(f"{where}:{lineno}: 'hash_ids' must be a list of non-negative integers, found {_shown(bad)}")
    if ids and max(ids) >= ID_BOUND:
        raise InputError(f"{where}:{lineno}: 'hash_ids' must be below 2^128 - 1 (the replay's root key), "
                         f"found {max(ids)}")
    fields = {}
    for name in ("timestamp", "input_length", "output_length"):
        value = obj.get(name, 0)
        if not _int(value) or value < 0:
            raise InputError(f"{where}:{lineno}: {name!r} must be a non-negative integer, got {_shown(value)}")
        fields[name] = value
    return Request(hash_ids=tuple(ids), **fields)


def parse_lines(lines: Iterable[str], where: str = "trace", block_tokens: int | None = None) -> list[Request]:
    """Every request of ``lines`` (blank lines skipped), or an ``InputError`` naming the
    first bad line; timestamps must not go backwards (arrival order is the trace's order).
    Ids must chain: an id reused after another id than before (or at another request's
    start) would give one key two prefixes, and the replay and the references would count
    different things with no error. With ``block_tokens``, a line's ``input_length`` (where
    given: not 0) must take as many blocks as it has ids: a trace of another block size
    read at this one counted every block as full, with no error."""
    out: list[Request] = []
    linenos: list[int] = []
    parent_of: dict[int, int] = {}
    last = 0
    for lineno, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        req = parse_line(text, lineno, where)
        if block_tokens is not None and req.input_length:
            _check_blocks(req, block_tokens, lineno, where)
        if req.timestamp < last:
            if req.timestamp == 0 and '"timestamp"' not in text:  # (absent, taken as 0: not "before")
                raise InputError(f"{where}:{lineno}: no 'timestamp', after lines that have one: give every line "
                                 "one, or none")
            raise InputError(f"{where}:{lineno}: timestamp {req.timestamp} is before the previous line's ({last})")
        last = req.timestamp
        parent = _START
        for i in req.hash_ids:  # a duplicate in the line shows as an id after another parent too
            if parent_of.setdefault(i, parent) != parent:
                _unchained(req.hash_ids, parent_of, out, linenos, lineno, where)
            parent = i
        out.append(req)
        linenos.append(lineno)
    if not out:
        raise InputError(f"{where}: no requests")
    return out


def _check_blocks(req: Request, block_tokens: int, lineno: int, where: str) -> None:
    need = -(-req.input_length // block_tokens)
    if need != len(req.hash_ids):
        raise InputError(f"{where}:{lineno}: 'input_length' {req.input_length} takes {need} block{'s' * (need != 1)} of {block_tokens} "
                         f"tokens, but 'hash_ids' has {len(req.hash_ids)}: are its blocks of another size "
                         "(block_tokens)?")


def _unchained(ids: tuple[int, ...], parent_of: dict[int, int], out: list[Request], linenos: list[int],
               lineno: int, where: str) -> None:
    """Raise the ``InputError`` for the first id of ``ids`` that appears twice or follows
    another id than it did on an earlier line."""
    parent = _START
    for pos, i in enumerate(ids):
        if i in ids[:pos]:
            raise InputError(f"{where}:{lineno}: id {i} appears twice in 'hash_ids' "
                             f"(positions {ids.index(i)} and {pos})")
        if parent_of.get(i, parent) != parent:
            break
        parent = i
    else:
        raise AssertionError("_unchained: the line chains")
    before = parent_of[i]
    first = next(n for req, n in zip(out, linenos) if i in req.hash_ids)
    after = lambda p: "at the start" if p == _START else f"after id {p}"  # noqa: E731
    raise InputError(f"{where}:{lineno}: id {i} is {after(parent)}, but line {first} has it {after(before)}: "
                     "an id names its whole prefix, so it always follows the same id")


def load_trace(path: str | Path, block_tokens: int | None = None) -> list[Request]:
    """The trace at ``path``, checked whole (see :func:`parse_lines`)."""
    path = Path(path)
    try:
        # Lines end at "\n" only, as grep -n and sed count them: a lone "\r" would shift
        # every later line number (a "\r\n" ending is whitespace to json). Read as bytes and
        # decoded a line at a time: a text stream decodes ahead in chunks, so its error
        # could not say which line holds the bad byte.
        with path.open("rb") as f:
            return parse_lines(_decoded(f, str(path)), where=str(path), block_tokens=block_tokens)
    except OSError as exc:
        raise InputError(f"trace: cannot read {path}: {exc.strerror or exc}") from None


def _decoded(lines: Iterable[bytes], where: str) -> Iterable[str]:
    for lineno, raw in enumerate(lines, start=1):
        try:
            yield raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InputError(f"{where}:{lineno}: not UTF-8 text ({exc.reason} at byte {exc.start + 1})") from None

