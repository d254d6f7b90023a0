"""Engine KV caches for the paged tests: every layout ``cs.KVPages`` takes, filled with
garbage, and a way to put a request's KV into its pages as an engine's forward would."""

from __future__ import annotations

import torch

import cacheseek as cs
from cacheseek.quant.tensors import host_view

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KINDS = ["flash", "nhd", "hnd", "pool"]


def engine_tensors(kind: str, L: int, H: int, D: int, num_pages: int, page: int, dtype, seed: int = 0,
                   device: str = DEVICE) -> list[torch.Tensor]:
    """The engine's own tensors for ``kind`` (per layer), random."""
    gen = torch.Generator().manual_seed(seed)

    def make(*shape):
        return (torch.randn(*shape, generator=gen) * 3).to(dtype).to(device)

    if kind == "flash":
        return [make(2, num_pages, page, H, D) for _ in range(L)]
    if kind == "flashinfer-hnd":
        return [make(num_pages, 2, H, page, D) for _ in range(L)]
    if kind == "nhd":
        return [make(num_pages, page, H, D) for _ in range(2 * L)]
    if kind == "hnd":
        return [make(num_pages, H, page, D) for _ in range(2 * L)]
    assert kind == "pool" and page == 1, kind
    return [make(num_pages, H, D) for _ in range(2 * L)]


def kv_pages(kind: str, tensors: list[torch.Tensor]) -> cs.KVPages:
    L = len(tensors) if kind.startswith("flash") else len(tensors) // 2
    if kind == "flash":
        return cs.KVPages.vllm(tensors)
    if kind == "flashinfer-hnd":
        return cs.KVPages.flashinfer(tensors, "HND")
    if kind == "pool":
        return cs.KVPages.token_pool(tensors[:L], tensors[L:])
    return cs.KVPages(tensors[:L], tensors[L:], layout=kind.upper())


def engine_pages(kind: str, L: int, H: int, D: int, num_pages: int, page: int, dtype, seed: int = 0):
    """(KVPages, the engine's tensors) for ``kind``."""
    tensors = engine_tensors(kind, L, H, D, num_pages, page, dtype, seed)
    return kv_pages(kind, tensors), tensors


def write_tokens(pages: cs.KVPages, kv, ids: list[int]) -> None:
    """Put per-layer (K, V), each [H, T, D], into the pages named by ``ids``."""
    T = kv[0][0].shape[1]
    g = torch.arange(T)
    page = torch.tensor(ids, dtype=torch.long)[g // pages.page_size].to(pages.device)
    slot = (g % pages.page_size).to(pages.device)
    for layer, (k, v) in enumerate(kv):
        pages.k[layer][page, slot] = k.transpose(0, 1).to(pages.device)
        pages.v[layer][page, slot] = v.transpose(0, 1).to(pages.device)


def read_tokens(pages: cs.KVPages, ids: list[int], tokens: int):
    """Per-layer (K, V) [H, tokens, D] read back from the pages named by ``ids``."""
    g = torch.arange(tokens)
    page = torch.tensor(ids, dtype=torch.long)[g // pages.page_size].to(pages.device)
    slot = (g % pages.page_size).to(pages.device)
    return [(k[page, slot].transpose(0, 1), v[page, slot].transpose(0, 1)) for k, v in zip(pages.k, pages.v)]


def page_tables(sizes: list[int], page: int, num_pages: int, seed: int) -> list[list[int]]:
    """Disjoint, shuffled page tables holding ``sizes[r]`` tokens each."""
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
    out, at = [], 0
    for tokens in sizes:
        n = -(-tokens // page)
        out.append(perm[at : at + n])
        at += n
    assert at <= num_pages
    return out


def ingest_pages(cache, requests: list[cs.PagedRequest], pages: cs.KVPages, layerwise: bool):
    """``cache.ingest_batch(requests, pages)``, whole or (``layerwise``) layer by layer."""
    if not layerwise:
        return cache.ingest_batch(requests, pages)
    with cache.ingest_batch(requests, pages, layerwise=True) as writer:
        for layer in range(cache.layout.num_layers):
            writer.put_layer(layer)
        return writer.finish()


def snapshot(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().clone() for t in tensors]


def unchanged(before: list[torch.Tensor], tensors: list[torch.Tensor]) -> bool:
    """Byte for byte (NaN included) what ``snapshot`` saw."""
    return all(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
               for a, b in zip(before, tensors))


def stored_bytes(cache, keys) -> list[bytes]:
    """Each block's frame payload as stored (a GPU tier's copied to the host), in chain order."""
    out = []
    for got in cache.store.get_many(cache.block_hashes(keys)):
        assert got is not None
        frame, _ = got
        payload = frame.payload_view() if frame.host is not None else host_view(frame.device_payload.cpu())
        out.append(bytes(payload))
    return out
