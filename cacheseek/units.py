"""Byte sizes as users write them: ``"4GiB"``, ``"512 MB"``, ``1 << 30``."""

from __future__ import annotations

import re
from fractions import Fraction

from .errors import ConfigError

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "ki": 1 << 10, "kib": 1 << 10, "mi": 1 << 20, "mib": 1 << 20,
    "gi": 1 << 30, "gib": 1 << 30, "ti": 1 << 40, "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


MAX_SIZE = (1 << 63) - 1  # bytes: what an offset or a length in the OS (off_t, ssize_t) can hold


def parse_size(value: int | str, *, name: str = "size") -> int:
    """Return ``value`` in bytes. Ints pass through; strings take SI or IEC units and a
    decimal fraction that makes whole bytes (``1.5KiB``, not ``0.5``); at most ``MAX_SIZE``."""
    if isinstance(value, bool):
        raise ConfigError(f"{name}: expected a byte count or a string like '4GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{name}: must be >= 0 bytes, got {value}")
        return _at_most_max(value, value, name)
    if isinstance(value, str):
        m = _SIZE.match(value)
        if m and m.group(2).lower() in _UNITS:
            number = m.group(1)
            # Exact arithmetic, never through a float (2^53 + 1 bytes stays that); a number of
            # more digits than any size is refused before int() is asked to convert it.
            if len(number.lstrip("0")) > 40:
                raise ConfigError(f"{name}: {value[:40]!r}... has more digits than any size (at most {MAX_SIZE} "
                                  "bytes, 2^63 - 1)")
            nbytes = Fraction(number) * _UNITS[m.group(2).lower()]
            if nbytes.denominator != 1:
                raise ConfigError(f"{name}: {value!r} is not a whole number of bytes ({float(nbytes):g})")
            return _at_most_max(int(nbytes), value, name)
    raise ConfigError(f"{name}: cannot read {value!r} as a size; use bytes or a string like '4GiB' or '512MB'")


def _at_most_max(nbytes: int, value: int | str, name: str) -> int:
    if nbytes > MAX_SIZE:
        raise ConfigError(f"{name}: {value!r} is more than {MAX_SIZE} bytes (2^63 - 1)")
    return nbytes


def format_size(nbytes: int | float) -> str:
    """Human-readable IEC size, for logs and tables."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
