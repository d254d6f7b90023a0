"""``RemoteCache``: the methods and results of ``PrefixCache``, over HTTP to ``cacheseek serve``.

Keys are computed here, by the same code as ``PrefixCache`` (``PrefixKeys``). Ingest asks
the server which blocks are new (one ``/v1/lookup`` round trip), encodes only those, on the
KV's own device, moves each compact frame to the host just before it is sent, and streams
them all in one ``POST /v1/blocks``. Materialize asks for the longest stored prefix, streams
its frames from ``GET /v1/prefixes/{last hash}``, checks each (checksum, hash, codec, layout),
and decodes them on the target device. One ``httpx.Client`` (keep-alive, a connection pool)
serves every call, over ``BulkTransport`` (keep-alive, a connection pool, bodies moved with
one copy); the object is safe to share between threads.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import httpx

from .batch_body import BATCH_CONTENT_TYPE, FRAME_CONTENT_TYPE, LENGTH, BatchFormatError, iter_frames
from .decode import decode_frames
from .encode import encode_missing
from .errors import FrameError, RemoteError, RemoteUnavailable
from .hashing import DEFAULT_ALGO, BlockHash, to_hex
from .kv_input import check_layers, kv_layers
from .layout import KVLayout
from .prefix_cache_base import PrefixCacheBase
from .quant.codec import KVLayerCodec
from .results import IngestResult, Located, Materialized
from .store.device import frame_to_host
from .store.frame import parse_frame
from .store.tier import BlockFrame
from .transport import BulkTransport

NAMESPACE_HEADER = "X-CacheSeek-Namespace"
# For the server's figures only (hit rate per model, in tokens): it sees hashes, not models.
MODEL_HEADER = "X-CacheSeek-Model"
BLOCK_TOKENS_HEADER = "X-CacheSeek-Block-Tokens"
TOKENS_HEADER = "X-CacheSeek-Tokens"
_UNLIMITED = 1 << 62


class RemoteCache(PrefixCacheBase):
    """A ``PrefixCache`` whose tiers live in a CacheSeek server at ``url``."""

    def __init__(
        self,
        url: str,
        *,
        model_id: str,
        layout: KVLayout,
        codec: KVLayerCodec | None = None,
        block_tokens: int = 256,
        namespace: str = "",
        hash_algo: str = DEFAULT_ALGO,
        token: str | None = None,
        timeout: float = 60.0,
        max_connections: int = 16,
        max_batch_bytes: int | str = "1GiB",
    ) -> None:
        super().__init__(model_id=model_id, layout=layout, codec=codec, block_tokens=block_tokens,
                         namespace=namespace, hash_algo=hash_algo, max_batch_bytes=max_batch_bytes)
        self.url = url.rstrip("/")
        headers = {NAMESPACE_HEADER: namespace} if namespace else {}
        if model_id.isascii() and model_id.isprintable():
            headers[MODEL_HEADER] = model_id[:128]
        headers[BLOCK_TOKENS_HEADER] = str(block_tokens)
        if token:
            headers["Authorization"] = f"Bearer {token}"
        timeouts = httpx.Timeout(timeout, connect=min(timeout, 10.0))
        self._transport = BulkTransport(max_connections=max_connections)
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeouts, transport=self._transport)
        self._headers = headers
        self._timeouts = timeouts.as_dict()

    # -- the three calls -----------------------------------------------------------------

    def ingest(self, keys: Any, kv: Any) -> IngestResult:
        """Store the full blocks of ``kv`` that the server does not hold yet. Nothing is sent
        if the input is bad (wrong layout, lengths that disagree, NaN/Inf)."""
        layers = kv_layers(kv)
        self.keys.check_ingest(keys, check_layers(layers, self.layout))
        hashes = self.block_hashes(keys)
        result = IngestResult(blocks=len(hashes), stored=0, present=0, tokens=len(hashes) * self.block_tokens)
        if not hashes:
            return result
        found = self._lookup(hashes, each=True)
        present = found["present"]
        result.present = sum(present)
        result.durability = found.get("durability", result.durability)
        # Encode everything first: a bad block (NaN, Inf) then sends nothing.
        frames = encode_missing(self.block_format, layers, hashes, self.keys.parents(hashes), present,
                                self._batch_blocks)
        if not frames:
            return result
        frames.reverse()  # tail first, as PrefixCache stores them: a chain that overflows keeps its head
        for report in self._post_frames(frames):
            result.durability = report.get("durability", result.durability)
            status = report.get("status")
            if status == "stored":
                result.stored += 1
            elif status == "present":
                result.present += 1
            else:
                result.failed += 1
            for tier, reason in (report.get("errors") or {}).items():
                result.errors.setdefault(tier, reason)
        return result

    def locate(self, keys: Any) -> Located:
        tokens = self._num_keys(keys)
        found = self._lookup(self.block_hashes(keys), tokens=tokens)
        n = found["matched"]
        return Located(num_blocks=n, num_tokens=n * self.block_tokens, tiers=list(found["tiers"]))

    def materialize(self, keys: Any, device: Any = None, *, max_tokens: int | None = None) -> Materialized:
        """KV of the longest stored prefix (at most ``max_tokens``), decoded on ``device``.

        If a block vanishes between the lookup and the transfer (evicted, or found corrupt),
        the prefix ends before it, as in ``PrefixCache``."""
        tokens = self._num_keys(keys)
        device = self._device(device)
        hashes = self._limit(self.block_hashes(keys), max_tokens)
        if max_tokens is not None:
            tokens = min(tokens, max(0, max_tokens))
        found = self._lookup(hashes, tokens=tokens) if hashes else {"matched": 0, "tiers": []}
        frames = self._fetch_chain(hashes[: found["matched"]]) if found["matched"] else []
        if not frames:
            return self._nothing(device)
        k, v = decode_frames(self.block_format, frames, device)
        return self._materialized(k, v, list(found["tiers"][: len(frames)]), device)

    # -- operations ----------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """The server's per-tier figures, in the shape of ``PrefixCache.stats()``."""
        server = self._request("GET", "/v1/stats").json()
        return {**self._config_stats(), **server}

    def close(self) -> None:
        self._http.close()

    # -- HTTP ----------------------------------------------------------------------------

    def _lookup(self, hashes: list[BlockHash], *, each: bool = False, tokens: int | None = None) -> dict[str, Any]:
        """``POST /v1/lookup``, sent to the transport directly: a lookup comes before every
        request a worker serves, and httpx.Client's own request path (URL merging, auth
        and redirect flows, text decoding) cost ~0.3 ms of a ~1 ms lookup."""
        path, content, headers = lookup_request(hashes, each=each)
        if tokens is not None:  # the query's length, partial last block included: the hit rate's denominator
            headers[TOKENS_HEADER] = str(tokens)
        request = httpx.Request("POST", self.url + path, content=content, headers={**self._headers, **headers},
                                extensions={"timeout": self._timeouts})
        try:
            response = self._transport.handle_request(request)
            response.read()
        except httpx.TransportError as exc:
            raise RemoteUnavailable(f"cannot reach the CacheSeek server: {exc!r}", url=self.url + path) from None
        self._raise_for_status(response, path)
        return json.loads(response.content)

    def _post_frames(self, frames: list[BlockFrame]) -> list[dict[str, Any]]:
        """Send ``frames`` in one streamed POST. Takes them over: the list is emptied, so each
        frame's device buffers are freed once it has been sent."""
        total = sum(LENGTH.size + f.meta.nbytes for f in frames)
        queue = deque(frames)
        frames.clear()

        def body() -> Iterator[bytes | memoryview]:
            # One frame on the host at a time: each is copied off the device just before it is sent.
            while queue:
                host = frame_to_host(queue.popleft())
                yield LENGTH.pack(host.meta.nbytes)
                yield from host.wire_segments()
                del host

        return self._request("POST", "/v1/blocks", content=body(),
                             headers={"Content-Type": BATCH_CONTENT_TYPE, "Content-Length": str(total)}).json()

    def _fetch_chain(self, hashes: list[BlockHash]) -> list[BlockFrame]:
        """The frames of ``hashes`` (a chain from its head), as far as they arrive whole and valid."""
        frames: list[BlockFrame] = []
        path = f"/v1/prefixes/{to_hex(hashes[-1])}"
        try:
            with self._http.stream("GET", path) as response:
                if response.status_code == 404:
                    return []  # the chain lost a block since the lookup
                self._raise_for_status(response, path, streamed=True)
                for buf in iter_frames(response, max_frame_bytes=_UNLIMITED):
                    i = len(frames)
                    if i >= len(hashes):
                        break
                    meta = parse_frame(buf, verify=True)
                    self.block_format.check_fetched(meta, hashes[i])
                    frames.append(BlockFrame(meta, host=memoryview(buf).cast("B"), sealed=True))
        except (FrameError, BatchFormatError, httpx.RemoteProtocolError, httpx.ReadError):
            pass  # a bad or cut-short frame ends the prefix; the whole ones before it stand
        except httpx.TransportError as exc:
            raise RemoteUnavailable(f"cannot reach the CacheSeek server: {exc!r}", url=self.url + path) from None
        return frames

    def _request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            response = self._http.request(method, path, **kw)
        except httpx.TransportError as exc:
            raise RemoteUnavailable(f"cannot reach the CacheSeek server: {exc!r}", url=self.url + path) from None
        self._raise_for_status(response, path)
        return response

    def _raise_for_status(self, response: httpx.Response, path: str, streamed: bool = False) -> None:
        if response.is_success:
            return
        if streamed:
            response.read()
        try:
            reason = response.json().get("error") or response.text
        except ValueError:
            reason = response.text or response.reason_phrase
        raise RemoteError(str(reason), status=response.status_code, url=self.url + path)


def lookup_request(hashes: Sequence[bytes], *, each: bool = False) -> tuple[str, bytes, dict[str, str]]:
    """``POST /v1/lookup`` as ``RemoteCache`` sends it (path, body, headers): the hashes as raw
    bytes end to end, which the server splits without parsing JSON or hex."""
    query = []
    if hashes and len(hashes[0]) != 16:
        query.append(f"hash_bytes={len(hashes[0])}")
    if each:
        query.append("each=true")
    path = "/v1/lookup" + ("?" + "&".join(query) if query else "")
    return path, b"".join(hashes), {"Content-Type": FRAME_CONTENT_TYPE}


__all__ = ["RemoteCache", "lookup_request"]
