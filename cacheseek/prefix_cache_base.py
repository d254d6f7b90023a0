"""``PrefixCacheBase``: what ``PrefixCache`` and ``RemoteCache`` share: their configuration,
their keys and frames, and the shape of their answers. The two differ only in where the
tiers are."""

from __future__ import annotations

from typing import Any

import torch

from .block_format import BlockFormat
from .hashing import SINGLE, BlockHash, Shard
from .layerwise import LayerwiseIngest, LayerwiseWriter
from .layout import KVLayout
from .pages import KVPages, PagedKV
from .prefix_keys import PrefixKeys, as_index
from .quant import backend
from .quant.codec import KVLayerCodec
from .quant.kivi import KIVI
from .quant.policy import PrecisionPolicy
from .errors import ConfigError, InputError
from .results import Located, Materialized
from .units import parse_size


class PrefixCacheBase:
    """Configuration, keys and frames of one cache: a model, a KV layout, a codec, a block size."""

    def __init__(
        self,
        *,
        model_id: str,
        layout: KVLayout,
        codec: KVLayerCodec | PrecisionPolicy | None,
        block_tokens: int,
        namespace: str,
        hash_algo: str,
        max_batch_bytes: int | str,
        shard: Shard = SINGLE,
    ) -> None:
        if not isinstance(layout, KVLayout):
            raise ConfigError(f"layout: expected a cs.KVLayout, got {layout!r}")
        if codec is not None and (isinstance(codec, type)
                                  or not isinstance(codec, (KVLayerCodec, PrecisionPolicy))):
            raise ConfigError(f"codec: expected a codec such as cs.Raw() or cs.KIVI(bits=4), or a "
                              f"cs.PrecisionPolicy, got {codec!r}")
        self.model_id = model_id
        self.shard = shard
        self.layout = layout
        self.codec = codec if codec is not None else KIVI(bits=4, group_size=32)
        self.block_tokens = block_tokens
        self.namespace = namespace
        self.hash_algo = hash_algo
        self.keys = PrefixKeys.create(namespace=namespace, model_id=model_id, layout=layout, codec=self.codec,
                                      block_tokens=block_tokens, hash_algo=hash_algo, shard=shard)
        self.root = self.keys.root
        self.block_format = BlockFormat(self.codec, layout, block_tokens)
        self._codec_spec = self.block_format.codec_spec
        batch = parse_size(max_batch_bytes, name="max_batch_bytes")
        self._batch_blocks = max(1, batch // layout.raw_nbytes(block_tokens))
        self._closed = False
        if backend.forced_triton():
            backend.kernel_backend()  # raises now, naming the reason, if the kernels cannot load

    def _check_paged(self) -> None:
        """Paged KV (an engine's pages) is stored with one codec: a precision policy is refused."""
        if not self.block_format.uniform:
            raise ConfigError(f"paged KV: not supported with a precision policy ({self.codec!r}); "
                              "use a single codec for paged calls")

    def _check_layerwise(self) -> None:
        """Layer groups are decoded with one codec over all blocks: a precision policy's mixed
        chains are loaded whole."""
        if not self.block_format.uniform:
            raise ConfigError(f"layer-wise loads: not supported with a precision policy ({self.codec!r}); "
                              "load the chain whole (layerwise=False)")

    def _config_stats(self) -> dict[str, Any]:
        """What ``stats()`` says of this cache's configuration: the model, the codec, the block
        size, and which kernels encode and decode KV on a GPU (``kernels``: "triton", or
        "torch-reference" with ``kernels_reason``)."""
        kernels, why = backend.kernel_backend()
        out = {"model_id": self.model_id, "namespace": self.namespace, "codec": self._codec_spec,
               "block_tokens": self.block_tokens, "kernels": kernels}
        if why is not None:
            out["kernels_reason"] = why
        return out

    def block_hashes(self, keys: Any) -> list[BlockHash]:
        """Chained hashes of the full blocks of ``keys`` (token ids, or one bytes per block)."""
        return self.keys.block_hashes(keys)

    def _num_keys(self, keys: Any) -> int:
        """Tokens named by ``keys``; raises on an empty input."""
        return self.keys.num_tokens(keys)

    @staticmethod
    def _max_tokens(max_tokens: Any) -> int | None:
        """``max_tokens`` as an int (any integer type) or None; ``InputError`` otherwise."""
        if max_tokens is None:
            return None
        n = as_index(max_tokens)
        if n is None or n < 0:
            # (a negative one, often meant as "no limit", loaded nothing without a word)
            raise InputError(f"max_tokens: expected an int number of tokens >= 0, or None for no limit, "
                             f"got {type(max_tokens).__name__} {max_tokens!r:.40}")
        return n

    def _limit(self, hashes: list[BlockHash], max_tokens: Any) -> list[BlockHash]:
        max_tokens = self._max_tokens(max_tokens)
        if max_tokens is None:
            return hashes
        return hashes[: max_tokens // self.block_tokens]

    @staticmethod
    def _device(device: Any) -> torch.device:
        if device is not None and not isinstance(device, (str, int, torch.device)):
            # (torch's own error lists its constructor's overloads over several lines; a
            # request's pages here are a paged load asked of the contiguous call)
            hint = "; to write into an engine's pages: materialize_into(keys, pages.at(page_ids))" \
                if isinstance(device, (PagedKV, KVPages)) else ""
            raise InputError(f"device: expected a torch.device, a str or an int, got {type(device).__name__}{hint}")
        try:
            device = torch.device(device if device is not None else "cpu")
        except (RuntimeError, TypeError) as exc:
            raise InputError(f"device: {exc}") from None
        if device.type not in ("cpu", "cuda"):  # (meta holds no data: a load "into" it loads nothing)
            raise InputError(f"device: {device.type} holds no data the cache can write; expected cpu or cuda")
        if device.type == "cuda":
            # (else torch's AssertionError without CUDA, or a failure part way into the load)
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if not count or (device.index is not None and device.index >= count):
                raise InputError(f"device: {device} is not one of this process's {count} CUDA devices")
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
        return device

    def _materialized(self, k: torch.Tensor, v: torch.Tensor, tiers: list[str], device: torch.device) -> Materialized:
        """The result for decoded K and V of shape [L, H, n*B, D]."""
        n = len(tiers)
        # unbind: one call for all layers' views (a Python loop of views cost ~0.3 ms).
        layers = list(zip(k.unsqueeze(1).unbind(0), v.unsqueeze(1).unbind(0), strict=True))
        return Materialized(n * self.block_tokens, n, layers, tiers, device)

    @staticmethod
    def _nothing(device: torch.device) -> Materialized:
        return Materialized(0, 0, [], [], device)

    def ingest_layerwise(self, keys: Any) -> LayerwiseWriter:
        """A writer that takes the KV of ``keys`` one layer at a time (``put_layer(i, k, v)``,
        as a forward produces them) and stores the full blocks on ``finish()``, once every
        layer is there: nothing of a block is stored before, and ``abort()`` stores nothing."""
        self._check_open()  # (else a writer, refused only at finish, once the forward had put every layer)
        self._num_keys(keys)
        return LayerwiseIngest(self.ingest, keys, self.layout, lambda tokens: self.keys.check_ingest(keys, tokens))

    def ingest(self, keys: Any, kv: Any) -> Any:  # pragma: no cover - each cache implements it
        raise NotImplementedError

    def locate(self, keys: Any) -> Located:  # pragma: no cover - each cache implements it
        raise NotImplementedError

    def lookup(self, keys: Any) -> int:
        """Tokens covered by stored full blocks, from the start."""
        return self.locate(keys).num_tokens

    def locate_batch(self, keys: Any) -> list[Located]:  # pragma: no cover - each cache implements it
        raise NotImplementedError

    def _hash_batch(self, keys: Any) -> tuple[list[list[BlockHash]], list[int]]:
        """Each keys' chained hashes and tokens, for ``locate_batch(keys)`` (a list of keys,
        one per request); ``InputError`` naming the request (``keys[2]: ...``), before anything
        is looked up."""
        if not isinstance(keys, (list, tuple)):
            raise InputError(f"keys: expected a list of keys (token ids, a Prompt or bytes per block, one per "
                             f"request), got {type(keys).__name__}")
        chains, tokens = [], []
        for i, one in enumerate(keys):
            try:
                tokens.append(self._num_keys(one))
                chains.append(self.block_hashes(one))
            except InputError as exc:
                raise InputError(f"keys[{i}]: {exc}") from None
            except TypeError as exc:  # (keys of no type the hashing knows, past its own checks)
                raise InputError(f"keys[{i}]: expected token ids, a Prompt or bytes per block, "
                                 f"got {type(one).__name__} ({exc})") from None
        return chains, tokens

    def close(self) -> None:  # pragma: no cover - each cache implements it
        raise NotImplementedError

    def _check_open(self) -> None:
        """``RuntimeError`` once ``close`` was called: every call but ``close`` and the
        figures then raises it, before it touches anything (a closed store's tiers, or
        connections, would fail half-way, each in its own way)."""
        if self._closed:
            raise self._closed_error()

    def _closed_error(self) -> RuntimeError:
        return RuntimeError(f"{type(self).__name__}: closed (close() was called, or its with block ended); "
                            "make a new one")

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
