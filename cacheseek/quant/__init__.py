"""KV encoding: torch-free payload schemas, the codec protocol, KIVI and Raw."""

from .codec import KVLayerCodec, canonical_fingerprint, codec_from_spec
from .kivi import KIVI
from .payload import BufferSpec, EncodedLayer, EncodedTensor
from .raw import Raw

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
