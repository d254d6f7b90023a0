"""The codecs by name: rebuilding a codec from its spec (as frame headers and configs store it).

Apart from ``codec``, so that the codecs import the protocol module and this module imports
the codecs, never the other way round.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import ConfigError
from .codec import KVLayerCodec
from .kivi import KIVI
from .raw import Raw

CODECS: dict[str, Callable[[dict[str, Any]], KVLayerCodec]] = {"kivi": KIVI.from_spec, "raw": Raw.from_spec}


def codec_from_spec(spec: Any) -> KVLayerCodec:
    """Rebuild a codec from ``codec.spec()`` (as stored in frame headers and configs)."""
    if not isinstance(spec, dict) or not all(isinstance(k, str) for k in spec) or not isinstance(spec.get("name"), str):
        raise ConfigError(f"codec spec: expected a dict of str keys with a 'name', got {spec!r:.200}")
    make = CODECS.get(spec["name"])
    if make is None:
        raise ConfigError(f"codec spec: unknown codec {spec['name']!r}; known: {sorted(CODECS)}")
    return make(spec)


__all__ = ["CODECS", "codec_from_spec"]
