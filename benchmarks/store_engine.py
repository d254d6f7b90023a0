"""The store as a serving engine uses it: paged KV, batches of requests, and the cost of one
call with a fresh prompt. Each mode measures its baseline in the same run.

    python -m benchmarks.store --paged [--blocks 16]   ingest / materialize of contiguous KV against the same
                                                       KV in vLLM's flash layout (page size 16, pages scattered
                                                       by a random page table): ingest from pages and
                                                       materialize_into pages; the ratio paged / contiguous
    python -m benchmarks.store --paged --mla           the same for DeepSeek-V3's MLA latent cache (61 layers,
                                                       576 bf16 per token, pages of 64: cs.KVPages.mla)
    python -m benchmarks.store --batches               8 requests of 2K tokens in pages: one ingest_batch
                                                       against 8 ingest calls; materialize_into_batch against
                                                       8 materialize_into; the ratio
    python -m benchmarks.store --fresh [--blocks 16]   a fresh prompt per call, as a server sees them: new token
                                                       ids, new KV tensors, nothing of it stored yet, and a CPU
                                                       tier in its steady state (full: every call evicts); vs
                                                       the pinned device-to-host copy of the same KV, and
                                                       beside the tier benchmark's own protocol (one KV,
                                                       the previous call's blocks deleted)
    python -m benchmarks.store --fresh --policy arc,lru   the eviction policies' cost on that path: a cache
                                                       per policy, full, taking turns call by call (each
                                                       ingest evicts a call's blocks, then its prompt is
                                                       materialized); the ratio to the last policy

Shapes are Llama-3-8B's (32 layers, 8 KV heads, head dim 128, fp16, blocks of 256 tokens)
unless ``--tiny`` (2 layers, 2 heads, 64, blocks of 32: a smoke test on a CPU). Every call
with a fresh prompt; ``--reps`` calls after one warm-up; medians.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

import cacheseek as cs


@dataclass(frozen=True)
class Shape:
    layout: cs.KVLayout
    block: int
    page: int
    mla: bool = False  # pages of latents (KVPages.mla), the layout one head of half the latent

    def kv(self, tokens: int, device: torch.device, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
        gen = torch.Generator(device=device).manual_seed(seed)
        shape = (self.layout.num_kv_heads, tokens, self.layout.head_dim)
        return [(torch.randn(shape, device=device, generator=gen, dtype=self.layout.torch_dtype),
                 torch.randn(shape, device=device, generator=gen, dtype=self.layout.torch_dtype))
                for _ in range(self.layout.num_layers)]


LLAMA = Shape(cs.KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype="float16"), 256, 16)
TINY = Shape(cs.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16"), 32, 16)
# DeepSeek-V3's MLA cache: 61 layers, a latent of 512 + 64 per token, bf16, FlashMLA's pages of 64
DEEPSEEK = Shape(cs.KVLayout.mla(num_layers=61, latent_dim=576, dtype="bfloat16"), 256, 64, mla=True)
TINY_MLA = Shape(cs.KVLayout.mla(num_layers=2, latent_dim=128, dtype="bfloat16"), 32, 16, mla=True)
CODECS = {"raw": cs.Raw(), "int4": cs.KIVI(bits=4, group_size=32), "int2": cs.KIVI(bits=2, group_size=32),
          "int8": cs.KIVI(bits=8, group_size=32)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


class Prompts:
    """Token ids never used before in this process: every call stores a fresh prompt."""

    def __init__(self, tokens: int) -> None:
        self.tokens, self.next = tokens, 0

    def __call__(self) -> list[int]:
        self.next += 1
        base = self.next * 7_919
        return [(base + j * 31) % 120_000 for j in range(self.tokens)]


def make_cache(shape: Shape, codec: Any, call_blocks: int, *, calls_held: int = 4,
               eviction: str = "lru") -> cs.PrefixCache:
    """A CPU tier that holds ``calls_held`` calls' blocks: from then on every ingest evicts,
    as in a server's steady state. Its reserve (host memory lent to blocks being written)
    holds one call, as the default reserve of a 4 GiB tier (512 MiB) holds a 4K-token int4
    call three times over. LRU, so that the oldest call is the one evicted whatever the
    protocol reads back: under ARC (the default) a prompt read back once outranks one only
    written, so which call goes would depend on the reads."""
    frame = CODECS[codec].encoded_nbytes(shape.layout, shape.block) + 4096
    tiers = cs.TierConfig(cpu_bytes=frame * call_blocks * calls_held, cpu_reserve_bytes=frame * call_blocks,
                          eviction=eviction)
    return cs.PrefixCache(model_id="bench", layout=shape.layout, codec=CODECS[codec], block_tokens=shape.block,
                          tiers=tiers)


def vllm_pages(shape: Shape, num_pages: int, device: torch.device) -> tuple[cs.KVPages, list[torch.Tensor]]:
    """vLLM's flash layout, or for an MLA layout (one head) its latent pages, [pages, page, C]."""
    L, H, D = shape.layout.num_layers, shape.layout.num_kv_heads, shape.layout.head_dim
    if shape.mla:
        tensors = [torch.zeros(num_pages, shape.page, 2 * D, dtype=shape.layout.torch_dtype, device=device)
                   for _ in range(L)]
        return cs.KVPages.mla(tensors), tensors
    tensors = [torch.zeros(2, num_pages, shape.page, H, D, dtype=shape.layout.torch_dtype, device=device)
               for _ in range(L)]
    return cs.KVPages.vllm(tensors), tensors


def fill_pages(pages: cs.KVPages, kv, ids: list[int]) -> None:
    T = kv[0][0].shape[1]
    g = torch.arange(T)
    page = torch.tensor(ids)[g // pages.page_size].to(pages.device)
    slot = (g % pages.page_size).to(pages.device)
    for layer, (k, v) in enumerate(kv):
        pages.k[layer][page, slot] = k.transpose(0, 1)
        pages.v[layer][page, slot] = v.transpose(0, 1)


def scattered_ids(num_pages: int, seed: int) -> list[int]:
    """A page table as an engine's allocator leaves it after a while: pages anywhere."""
    return torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).tolist()


def _row(name: str, times: list[float], raw_bytes: int, **extra: Any) -> dict[str, Any]:
    t = statistics.median(times)
    return {"case": name, "ms": t * 1e3, "gbps": raw_bytes / t / 1e9, "ms_each": [round(x * 1e3, 3) for x in times],
            **extra}


# -- paged ----------------------------------------------------------------------------------


def run_paged(shape: Shape, blocks: int, codecs: list[str], reps: int, device: torch.device) -> list[dict]:
    """Contiguous KV against the same KV in vLLM's pages, calls interleaved."""
    tokens = blocks * shape.block
    raw = shape.layout.raw_nbytes(tokens)
    kv = shape.kv(tokens, device)
    num_pages = tokens // shape.page
    src, _ = vllm_pages(shape, num_pages, device)
    src_ids = scattered_ids(num_pages, 1)
    fill_pages(src, kv, src_ids)
    dest, _ = vllm_pages(shape, num_pages, device)
    dest_ids = scattered_ids(num_pages, 2)
    rows = []
    for codec in codecs:
        contiguous, paged = (make_cache(shape, codec, blocks, calls_held=2) for _ in range(2))
        prompts = Prompts(tokens)
        t_c, t_p, m_c, m_p = [], [], [], []
        for i in range(reps + 1):
            pc, pp = prompts(), prompts()
            a = timed(lambda: contiguous.ingest(pc, kv), device)
            b = timed(lambda: paged.ingest(pp, src.at(src_ids)), device)
            c = timed(lambda: contiguous.materialize(pc, device=device), device)
            d = timed(lambda: paged.materialize_into(pp, dest.at(dest_ids)), device)
            if paged.lookup(pp) != tokens or contiguous.lookup(pc) != tokens:
                raise RuntimeError(f"{codec}: a call stored less than the whole prompt")
            if i:
                t_c.append(a), t_p.append(b), m_c.append(c), m_p.append(d)
        contiguous.close(), paged.close()
        for op, cont, pag in (("ingest", t_c, t_p), ("materialize", m_c, m_p)):
            row_c = _row(f"{codec} {op} contiguous", cont, raw, codec=codec, op=op, kv="contiguous")
            where = f"{'MLA latent' if shape.mla else 'vLLM'} pages of {shape.page}"
            row_p = _row(f"{codec} {op} paged", pag, raw, codec=codec, op=op, kv=where)
            row_p["paged_vs_contiguous"] = row_p["gbps"] / row_c["gbps"]
            rows += [row_c, row_p]
            print(f"  {codec:4s} {op:11s} contiguous {row_c['gbps']:7.1f} GB/s  paged {row_p['gbps']:7.1f} GB/s  "
                  f"({row_p['paged_vs_contiguous']:.3f}x)", flush=True)
    return rows


# -- batches --------------------------------------------------------------------------------


def run_batches(shape: Shape, requests: int, request_tokens: int, codecs: list[str], reps: int,
                device: torch.device) -> list[dict]:
    """``requests`` requests of ``request_tokens`` in pages: one batched call against one
    call per request, each with fresh prompts, interleaved."""
    tokens = requests * request_tokens
    raw = shape.layout.raw_nbytes(tokens)
    per = request_tokens // shape.page
    num_pages = requests * per
    src, _ = vllm_pages(shape, num_pages, device)
    ids = scattered_ids(num_pages, 3)
    tables = [ids[r * per : (r + 1) * per] for r in range(requests)]
    for r, table in enumerate(tables):
        fill_pages(src, shape.kv(request_tokens, device, seed=r), table)
    dest, _ = vllm_pages(shape, num_pages, device)
    dest_ids = scattered_ids(num_pages, 4)
    dest_tables = [dest_ids[r * per : (r + 1) * per] for r in range(requests)]
    blocks = tokens // shape.block
    rows = []
    for codec in codecs:
        batched, separate = (make_cache(shape, codec, blocks, calls_held=2) for _ in range(2))
        prompts = Prompts(request_tokens)
        times: dict[str, list[float]] = {"ingest batch": [], "ingest each": [], "load batch": [], "load each": []}
        for i in range(reps + 1):
            pb = [prompts() for _ in range(requests)]
            ps = [prompts() for _ in range(requests)]
            got = {
                "ingest batch": timed(lambda: batched.ingest_batch(
                    [cs.PagedRequest(p, t) for p, t in zip(pb, tables)], src), device),
                "ingest each": timed(lambda: [separate.ingest(p, src.at(t)) for p, t in zip(ps, tables)], device),
                "load batch": timed(lambda: batched.materialize_into_batch(
                    [cs.PagedRequest(p, t) for p, t in zip(pb, dest_tables)], dest), device),
                "load each": timed(lambda: [separate.materialize_into(p, dest.at(t)) for p, t in zip(ps, dest_tables)],
                                   device),
            }
            if any(c.lookup(p) != request_tokens for c, ps_ in ((batched, pb), (separate, ps)) for p in ps_):
                raise RuntimeError(f"{codec}: a request's blocks were evicted before they were loaded")
            if i:
                for name, t in got.items():
                    times[name].append(t)
        batched.close(), separate.close()
        for op in ("ingest", "load"):
            each = _row(f"{codec} {op}: {requests} calls", times[f"{op} each"], raw, codec=codec, op=op, calls=requests)
            one = _row(f"{codec} {op}: one batched call", times[f"{op} batch"], raw, codec=codec, op=op, calls=1)
            one["batch_vs_calls"] = one["gbps"] / each["gbps"]
            rows += [each, one]
            print(f"  {codec:4s} {op:6s} {requests} calls {each['ms']:8.2f} ms  one batch {one['ms']:8.2f} ms  "
                  f"({one['batch_vs_calls']:.3f}x)", flush=True)
    return rows


# -- fresh prompts --------------------------------------------------------------------------


def pinned_copy_seconds(nbytes: int, reps: int, device: torch.device, *, to_host: bool = True) -> float:
    """A pinned copy of ``nbytes``: device to host (an ingest's direction), or host to
    device (a materialize's)."""
    dev = torch.empty(nbytes // 2, dtype=torch.float16, device=device).normal_()
    host = torch.empty(nbytes // 2, dtype=torch.float16, pin_memory=device.type == "cuda")
    dst, src = (host, dev) if to_host else (dev, host)
    times = [timed(lambda: dst.copy_(src, non_blocking=True), device) for _ in range(reps + 1)][1:]
    return statistics.median(times)


def run_fresh(shape: Shape, blocks: int, codecs: list[str], reps: int, device: torch.device) -> list[dict]:
    """Ingest and materialize with a fresh prompt and fresh KV per call, into a full tier;
    beside the tier benchmark's protocol (one KV, the previous call's blocks deleted)."""
    tokens = blocks * shape.block
    raw = shape.layout.raw_nbytes(tokens)
    template = shape.kv(tokens, device)
    copy = pinned_copy_seconds(raw, reps, device)
    # A materialize moves the other way: its baseline is the host-to-device copy (the tier
    # benchmark's too), measured in the same run.
    copy_in = pinned_copy_seconds(raw, reps, device, to_host=False)
    print(f"  pinned copies of {raw / 1e9:.2f} GB: device to host {raw / copy / 1e9:.1f} GB/s, "
          f"host to device {raw / copy_in / 1e9:.1f} GB/s", flush=True)
    rows = []
    for codec in codecs:
        fresh, reused = make_cache(shape, codec, blocks), make_cache(shape, codec, blocks, calls_held=2)
        prompts = Prompts(tokens)
        for _ in range(4):  # fill the tier: every measured call evicts
            fresh.ingest(prompts(), template)
        t_fresh, t_reused, m_fresh = [], [], []
        previous = None
        for i in range(reps + 1):
            # A server's prefill made this KV just now: new tensors (made before the clock).
            kv = [(k.clone(), v.clone()) for k, v in template]
            p = prompts()
            a = timed(lambda: fresh.ingest(p, kv), device)
            c = timed(lambda: fresh.materialize(p, device=device), device)
            if fresh.lookup(p) != tokens:
                raise RuntimeError(f"{codec}: a fresh call's blocks were evicted before it was read back")
            del kv
            q = prompts()
            if previous is not None:
                for key in reused.block_hashes(previous):
                    reused.store.delete(key)
            b = timed(lambda: reused.ingest(q, template), device)
            previous = q
            if i:
                t_fresh.append(a), t_reused.append(b), m_fresh.append(c)
        evictions = fresh.stats()["tiers"][0]["evictions"]
        fresh.close(), reused.close()
        for name, times, op in (("fresh prompt, fresh KV, full tier", t_fresh, "ingest"),
                                ("same KV, previous blocks deleted", t_reused, "ingest"),
                                ("fresh prompt, just stored", m_fresh, "materialize")):
            row = _row(f"{codec} {op}: {name}", times, raw, codec=codec, op=op, tokens=tokens)
            row["vs_pinned_copy"] = (copy_in if op == "materialize" else copy) / statistics.median(times)
            row["evictions"] = evictions if "full" in name else 0
            rows.append(row)
            print(f"  {codec:4s} {tokens:6d} tokens {op:11s} {name:34s} {row['gbps']:7.1f} GB/s "
                  f"({row['vs_pinned_copy']:.2f}x the copy)  ms each: {row['ms_each']}", flush=True)
    return rows


def run_policies(shape: Shape, blocks: int, codecs: list[str], reps: int, device: torch.device,
                 policies: list[str]) -> list[dict]:
    """What an eviction policy costs on the hot path: a cache per policy, each full, taking
    turns call by call (the order alternating): a fresh prompt and fresh KV ingested (every
    ingest evicts a call's blocks: the policy picks victims, adds a call's blocks), then
    materialized (the policy marks them used). Every policy evicts the oldest call here (each
    call is read back once), so they do the same work but for their bookkeeping. Ratios:
    each policy's time against the last one's."""
    tokens = blocks * shape.block
    raw = shape.layout.raw_nbytes(tokens)
    template = shape.kv(tokens, device)
    rows = []
    for codec in codecs:
        caches = {p: make_cache(shape, codec, blocks, eviction=p) for p in policies}
        prompts = Prompts(tokens)
        for cache in caches.values():
            for _ in range(4):  # fill the tier: every measured call evicts
                p = prompts()
                cache.ingest(p, template)
                cache.materialize(p, device=device)
        times: dict[str, tuple[list[float], list[float]]] = {p: ([], []) for p in policies}
        for i in range(reps + 1):
            for policy in policies if i % 2 else policies[::-1]:
                cache = caches[policy]
                kv = [(k.clone(), v.clone()) for k, v in template]
                p = prompts()
                a = timed(lambda: cache.ingest(p, kv), device)
                b = timed(lambda: cache.materialize(p, device=device), device)
                if cache.lookup(p) != tokens:
                    raise RuntimeError(f"{codec} {policy}: a fresh call's blocks were evicted before it was read back")
                kv = None  # (its memory back before the next call's clone)
                if i:
                    times[policy][0].append(a), times[policy][1].append(b)
        evictions = {p: c.stats()["tiers"][0]["evictions"] for p, c in caches.items()}
        for cache in caches.values():
            cache.close()
        ref = policies[-1]
        for policy in policies:
            for j, op in enumerate(("ingest", "materialize")):
                row = _row(f"{codec} {op}: {policy}", times[policy][j], raw, codec=codec, op=op, tokens=tokens,
                           policy=policy, evictions=evictions[policy])
                row[f"vs_{ref}"] = statistics.median(times[ref][j]) / statistics.median(times[policy][j])
                rows.append(row)
                print(f"  {codec:4s} {tokens:6d} tokens {op:11s} {policy:4s} {row['gbps']:7.1f} GB/s "
                      f"({row[f'vs_{ref}']:.3f}x {ref})  ms each: {row['ms_each']}", flush=True)
    return rows
