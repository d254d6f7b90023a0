import pytest

from cacheseek.errors import ConfigError
from cacheseek.units import format_size, parse_size


@pytest.mark.parametrize("text, expect", [
    ("4GiB", 4 << 30), ("512MB", 512_000_000), ("1.5 GiB", 3 << 29), ("0", 0), (123, 123), ("64kib", 65536),
    ("9007199254740993", (1 << 53) + 1), ("0.001KB", 1), ("1.25 KiB", 1280), ("000012", 12),
    (str((1 << 63) - 1), (1 << 63) - 1),
])
def test_parse_size(text, expect):
    assert parse_size(text) == expect


@pytest.mark.parametrize("bad", ["four GiB", "-1", -5, "4 parsecs", True, None, 1.5])
def test_parse_size_rejects_with_the_name(bad):
    with pytest.raises(ConfigError, match="cpu_bytes"):
        parse_size(bad, name="cpu_bytes")


def test_format_size():
    assert format_size(3 << 30) == "3.00 GiB"
    assert format_size(100) == "100 B"


@pytest.mark.parametrize("bad, says", [
    ("0.5", "'0.5' is not a whole number of bytes (0.5)"),
    ("1.0001KB", "not a whole number of bytes (1000.1)"),
    (str(1 << 63), "is more than 9223372036854775807 bytes"),
    ("9" * 400, "has more digits than any size"),
    ("9" * 5000 + "GiB", "has more digits than any size"),
    ("0." + "1" * 5000, "has more digits than any size"),
    ("8388608TiB", "is more than"),
    (1 << 63, "is more than"),
])
def test_parse_size_refuses_fractions_of_a_byte_and_sizes_past_2_63(bad, says):
    with pytest.raises(ConfigError, match="cpu_bytes") as err:
        parse_size(bad, name="cpu_bytes")
    assert says in str(err.value)
