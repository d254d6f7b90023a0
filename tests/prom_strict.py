"""A strict reader of the Prometheus text exposition format (version 0.0.4), for tests.

``prometheus_client.parser`` is lenient: it takes duplicate series, families split in two,
samples before their TYPE, NaN counters and histograms whose buckets go down. This one
raises ``ExpositionError`` (naming the line) on any of them, and on what this server
promises besides: counters named ``*_total``, never NaN, never negative."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
TYPES = ("counter", "gauge", "histogram", "summary", "untyped")


class ExpositionError(AssertionError):
    pass


@dataclass
class Family:
    name: str
    type: str = "untyped"
    help: str | None = None
    typed: bool = False  # a TYPE line was read
    samples: list[tuple[str, dict[str, str], float]] = field(default_factory=list)


def _float(text: str, where: str) -> float:
    if text in ("+Inf", "Inf"):
        return math.inf
    if text == "-Inf":
        return -math.inf
    if text == "NaN":
        return math.nan
    try:
        return float(text)
    except ValueError:
        raise ExpositionError(f"{where}: {text!r} is not a value") from None


def _labels(text: str, i: int, where: str) -> tuple[dict[str, str], int]:
    """The label set starting after ``{`` at ``text[i]``; returns it and the index after ``}``."""
    labels: dict[str, str] = {}
    while True:
        if text[i:i + 1] == "}":
            return labels, i + 1
        m = LABEL_NAME.match(text, i)
        if m is None:
            raise ExpositionError(f"{where}: bad label name at column {i}")
        name = m.group()
        if name.startswith("__"):
            raise ExpositionError(f"{where}: reserved label name {name!r}")
        if name in labels:
            raise ExpositionError(f"{where}: label {name!r} twice")
        i = m.end()
        if text[i:i + 2] != '="':
            raise ExpositionError(f"{where}: expected =\" after label {name!r}")
        i += 2
        value = []
        while True:
            if i >= len(text):
                raise ExpositionError(f"{where}: label value of {name!r} not closed")
            c = text[i]
            if c == "\\":
                nxt = text[i + 1:i + 2]
                if nxt not in ("\\", '"', "n"):
                    raise ExpositionError(f"{where}: bad escape \\{nxt} in label {name!r}")
                value.append("\n" if nxt == "n" else nxt)
                i += 2
            elif c == '"':
                i += 1
                break
            else:
                value.append(c)
                i += 1
        labels[name] = "".join(value)
        if text[i:i + 1] == ",":
            i += 1
        elif text[i:i + 1] != "}":
            raise ExpositionError(f"{where}: expected , or }} after label {name!r}")


def _unescape_help(text: str, where: str) -> str:
    out, i = [], 0
    while i < len(text):
        if text[i] == "\\":
            nxt = text[i + 1:i + 2]
            if nxt not in ("\\", "n"):
                raise ExpositionError(f"{where}: bad escape in HELP")
            out.append("\n" if nxt == "n" else "\\")
            i += 2
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def _family_of(sample: str, families: dict[str, Family]) -> str | None:
    if sample in families:
        return sample
    for suffix in ("_bucket", "_sum", "_count"):
        base = sample.removesuffix(suffix)
        if base != sample and families.get(base) is not None and families[base].type in ("histogram", "summary"):
            return base
    return None


def parse(text: str) -> dict[str, Family]:
    """Every family of ``text``, checked; raises ``ExpositionError`` at the first fault."""
    if text and not text.endswith("\n"):
        raise ExpositionError("the exposition does not end with a newline")
    families: dict[str, Family] = {}
    finished: set[str] = set()  # families whose lines ended: one more line of theirs is a split
    current: str | None = None
    series: set[tuple[str, tuple[tuple[str, str], ...]]] = set()

    def enter(name: str, where: str) -> Family:
        nonlocal current
        if name != current:
            if name in finished:
                raise ExpositionError(f"{where}: lines of family {name!r} are not together")
            if current is not None:
                finished.add(current)
            current = name
        return families.setdefault(name, Family(name))

    for n, line in enumerate(text.split("\n")[:-1] if text else [], 1):
        where = f"line {n}: {line[:120]!r}"
        if not line.strip():
            continue
        if line.startswith("#"):
            parts = line.split(" ", 3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                name = parts[2]
                if not NAME.fullmatch(name):
                    raise ExpositionError(f"{where}: bad metric name")
                fam = enter(name, where)
                if parts[1] == "HELP":
                    if fam.help is not None:
                        raise ExpositionError(f"{where}: a second HELP for {name!r}")
                    fam.help = _unescape_help(parts[3] if len(parts) > 3 else "", where)
                else:
                    kind = parts[3] if len(parts) > 3 else ""
                    if kind not in TYPES:
                        raise ExpositionError(f"{where}: unknown type {kind!r}")
                    if fam.samples or fam.typed:
                        raise ExpositionError(f"{where}: TYPE after samples, or twice, for {name!r}")
                    fam.type = kind
                    fam.typed = True
            continue
        m = NAME.match(line)
        if m is None:
            raise ExpositionError(f"{where}: bad metric name")
        sample = m.group()
        i = m.end()
        labels: dict[str, str] = {}
        if line[i:i + 1] == "{":
            labels, i = _labels(line, i + 1, where)
        if line[i:i + 1] != " ":
            raise ExpositionError(f"{where}: expected a space before the value")
        rest = line[i + 1:].split(" ")
        if not 1 <= len(rest) <= 2 or (len(rest) == 2 and not re.fullmatch(r"-?[0-9]+", rest[1])):
            raise ExpositionError(f"{where}: expected a value and at most a timestamp")
        value = _float(rest[0], where)
        base = _family_of(sample, families) or sample
        fam = enter(base, where)
        key = (sample, tuple(sorted(labels.items())))
        if key in series:
            raise ExpositionError(f"{where}: duplicate series {sample}{dict(key[1])}")
        series.add(key)
        fam.samples.append((sample, labels, value))
    for fam in families.values():
        _check_family(fam)
    return families


def _check_family(fam: Family) -> None:
    where = f"family {fam.name!r}"
    if fam.help is None:
        raise ExpositionError(f"{where}: no HELP")
    if not fam.typed:
        raise ExpositionError(f"{where}: no TYPE")
    for sample, labels, value in fam.samples:
        if math.isnan(value):
            raise ExpositionError(f"{where}: {sample}{labels} is NaN")
    if fam.type == "counter":
        if not fam.name.endswith("_total"):
            raise ExpositionError(f"{where}: a counter not named *_total")
        for sample, labels, value in fam.samples:
            if sample != fam.name:
                raise ExpositionError(f"{where}: sample {sample!r} in a counter family")
            if value < 0:
                raise ExpositionError(f"{where}: {labels} is negative")
    elif fam.type == "gauge":
        for sample, _, _ in fam.samples:
            if sample != fam.name:
                raise ExpositionError(f"{where}: sample {sample!r} in a gauge family")
    elif fam.type == "histogram":
        _check_histogram(fam)


def _check_histogram(fam: Family) -> None:
    where = f"histogram {fam.name!r}"
    by: dict[tuple, dict[str, object]] = {}
    for sample, labels, value in fam.samples:
        suffix = sample[len(fam.name):]
        if suffix not in ("_bucket", "_sum", "_count"):
            raise ExpositionError(f"{where}: sample {sample!r}")
        rest = {k: v for k, v in labels.items() if k != "le"}
        entry = by.setdefault(tuple(sorted(rest.items())), {"buckets": []})
        if suffix == "_bucket":
            if "le" not in labels:
                raise ExpositionError(f"{where}: a bucket without le")
            entry["buckets"].append((_float(labels["le"], where), value))  # type: ignore[union-attr]
        else:
            if "le" in labels:
                raise ExpositionError(f"{where}: le on {sample}")
            entry[suffix] = value
    for rest, entry in by.items():
        buckets: list = entry["buckets"]  # type: ignore[assignment]
        if "_count" not in entry or "_sum" not in entry:
            raise ExpositionError(f"{where}{dict(rest)}: no _count or _sum")
        bounds = [b for b, _ in buckets]
        if bounds != sorted(bounds) or len(set(bounds)) != len(bounds):
            raise ExpositionError(f"{where}{dict(rest)}: bucket bounds not increasing: {bounds}")
        if not bounds or bounds[-1] != math.inf:
            raise ExpositionError(f"{where}{dict(rest)}: no +Inf bucket")
        counts = [c for _, c in buckets]
        if any(b < a for a, b in zip(counts, counts[1:])):
            raise ExpositionError(f"{where}{dict(rest)}: buckets not cumulative: {counts}")
        if counts[-1] != entry["_count"]:
            raise ExpositionError(f"{where}{dict(rest)}: +Inf bucket {counts[-1]} != _count {entry['_count']}")


def value(families: dict[str, Family], sample: str, **labels: str) -> float:
    """The one sample named ``sample`` with (at least) ``labels``."""
    base = _family_of(sample, families) or sample
    found = [v for s, lab, v in families[base].samples if s == sample
             and all(lab.get(k) == want for k, want in labels.items())] if base in families else []
    if len(found) != 1:
        raise AssertionError(f"{sample}{labels}: {len(found)} samples")
    return found[0]
