import pytest

from cacheseek.errors import ConfigError
from cacheseek.units import format_size, parse_size


@pytest.mark.parametrize("text, expect", [
    ("4GiB", 4 << 30), ("512MB", 512_000_000), ("1.5 GiB", 3 << 29), ("0", 0), (123, 123), ("64kib", 65536),
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
