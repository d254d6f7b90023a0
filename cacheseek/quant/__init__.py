"""KV encoding: torch-free payload schemas, the codec protocol, KIVI and Raw."""

from .codec import KVLayerCodec, canonical_fingerprint
from .kivi import KIVI
from .payload import BufferSpec, EncodedLayer, EncodedTensor
from .raw import Raw
from .registry import codec_from_spec

__all__ = [
    "KIVI",
    "BufferSpec",
    "EncodedLayer",
    "EncodedTensor",
    "KVLayerCodec",
    "Raw",
    "canonical_fingerprint",
    "codec_from_spec",
]
