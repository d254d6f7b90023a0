"""KV encoding: torch-free payload schemas, the codec protocol, KIVI and Raw, precision policies."""

from .codec import KVLayerCodec, canonical_fingerprint
from .kivi import KIVI
from .payload import BufferSpec, EncodedLayer, EncodedTensor
from .policy import PrecisionPolicy, setting_from_spec
from .raw import Raw
from .registry import codec_from_spec

__all__ = [
    "KIVI",
    "BufferSpec",
    "EncodedLayer",
    "EncodedTensor",
    "KVLayerCodec",
    "PrecisionPolicy",
    "Raw",
    "canonical_fingerprint",
    "codec_from_spec",
    "setting_from_spec",
]
