"""MLA caches (DeepSeek-V2/V3): one latent per token and layer, paged, stored through the
K/V halves ``cs.KVPages.mla`` views it as. Raw keeps every latent byte; a load writes the
latent back whole into other pages, on the kernels (interpreted on a CPU) and the torch path.
"""

from __future__ import annotations

import pytest
import torch

import cacheseek as cs
from cacheseek.quant import backend as kivi_codec
from paged_helpers import DEVICE, snapshot, stored_bytes, unchanged
from store_helpers import tokens_for

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # (the interpreter's padding lanes)

LATENT = 576  # kv_lora_rank 512 + rope dim 64, as DeepSeek-V2/V3
LAYOUT = cs.KVLayout.mla(num_layers=2, latent_dim=LATENT, dtype="bfloat16")
PAGE, PAGES, BLOCK = 16, 24, 64


@pytest.fixture(params=["triton", "torch"])
def backend(request, monkeypatch):
    monkeypatch.setenv(kivi_codec.BACKEND_ENV, request.param)
    return request.param


def latents(seed: int, num_pages: int = PAGES, page: int = PAGE) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(num_pages, page, LATENT, generator=gen) * 3).to(torch.bfloat16).to(DEVICE)
            for _ in range(LAYOUT.num_layers)]


def gather(layer: torch.Tensor, ids: list[int], tokens: int) -> torch.Tensor:
    """[tokens, C]: the latents a page table holds, in order."""
    return layer[ids].reshape(-1, layer.shape[-1])[:tokens]


def make_cache(codec=None):
    return cs.PrefixCache(model_id="deepseek-tiny", layout=LAYOUT, codec=codec or cs.Raw(), block_tokens=BLOCK,
                          tiers=cs.TierConfig(cpu_bytes="16MiB"))


def test_an_mla_layout_is_one_head_of_half_the_latent():
    assert LAYOUT == cs.KVLayout(num_layers=2, num_kv_heads=1, head_dim=LATENT // 2, dtype="bfloat16")
    assert LAYOUT.raw_nbytes(10) == 2 * 10 * LATENT * 2  # layers x tokens x C x bf16: the latent, once
    for bad in (575, 0, -2, 576.0, True):
        with pytest.raises(cs.ConfigError, match="latent_dim"):
            cs.KVLayout.mla(num_layers=2, latent_dim=bad)


def test_raw_latents_are_stored_byte_for_byte_and_loaded_whole_into_other_pages(backend):
    """Two requests' latents (a block spanning pages, pages out of order) ingested from the
    pages, then written into another cache's pages: every latent element equal, both halves,
    and the pages outside the page table untouched. The contiguous read gives the halves."""
    src = latents(0)
    pages = cs.KVPages.mla(src)
    assert (pages.num_kv_heads, pages.head_dim, pages.page_size) == (1, LATENT // 2, PAGE)
    toks = [tokens_for(1, 3 * BLOCK), tokens_for(2, 2 * BLOCK + 5)]
    tables = [[5, 2, 17, 9, 11, 0, 3, 8, 21, 1, 13, 7], [4, 6, 10, 12, 14, 15, 16, 18, 19]]
    with make_cache() as cache:
        res = cache.ingest_batch([cs.PagedRequest(t, ids) for t, ids in zip(toks, tables)], pages)
        assert [r.stored for r in res] == [3, 2]
        dst = latents(9)
        before = snapshot(dst)
        out_tables = [[23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13, 12], [0, 1, 2, 3, 4, 5, 6, 7, 8]]
        got = cache.materialize_into_batch([cs.PagedRequest(t, ids) for t, ids in zip(toks, out_tables)],
                                           cs.KVPages.mla(dst))
        assert [g.num_tokens for g in got] == [3 * BLOCK, 2 * BLOCK]
        for layer in range(LAYOUT.num_layers):
            for t, ids, out_ids, n in zip(toks, tables, out_tables, (3 * BLOCK, 2 * BLOCK)):
                assert torch.equal(gather(dst[layer], out_ids, n), gather(src[layer], ids, n))
            written = set(out_tables[0]) | set(out_tables[1][:8])  # (the 9th holds the partial block: not loaded)
            others = [p for p in range(PAGES) if p not in written]
            assert unchanged([before[layer][others]], [dst[layer][others]])
        whole = cache.materialize(toks[0], device=DEVICE)
        k, v = whole.layers[1]
        assert list(k.shape) == list(v.shape) == [1, 1, 3 * BLOCK, LATENT // 2]
        assert torch.equal(torch.cat([k, v], dim=-1)[0, 0], gather(src[1], tables[0], 3 * BLOCK))


def test_kivi_latents_in_pages_decode_as_the_contiguous_read_does(backend):
    """A codec other than Raw stores the halves as K and V (K per channel, V per token):
    what a load writes into pages is what the contiguous read decodes, bit for bit."""
    src = latents(3)
    toks = tokens_for(4, 2 * BLOCK)
    ids = [7, 3, 12, 0, 19, 5, 8, 1]
    with make_cache(cs.KIVI(bits=8, group_size=32)) as cache:
        assert cache.ingest(toks, cs.KVPages.mla(src).at(ids)).stored == 2
        dst = latents(5)
        assert cache.materialize_into(toks, cs.KVPages.mla(dst).at(ids)).num_tokens == 2 * BLOCK
        k, v = cache.materialize(toks, device=DEVICE).layers[0]
        assert torch.equal(gather(dst[0], ids, 2 * BLOCK), torch.cat([k, v], dim=-1)[0, 0])


def test_bad_latent_caches_are_refused_naming_the_layer():
    ok = latents(0)
    with pytest.raises(cs.InputError, match=r"pages layer 1: expected an MLA latent cache .* C even, got \[24, 16, 575\]"):
        cs.KVPages.mla([ok[0], ok[1][..., :575]])
    with pytest.raises(cs.InputError, match="pages layer 0: expected an MLA latent cache"):
        cs.KVPages.mla([ok[0][:, :, None], ok[1][:, :, None]])  # a head dim: not a latent
    with pytest.raises(cs.InputError, match="expected a sequence of per-layer tensors"):
        cs.KVPages.mla({"a": ok[0]})
    narrow = cs.KVPages.mla([t[..., :512] for t in ok])  # a latent of 512: another model's
    with make_cache() as cache:
        with pytest.raises(cs.InputError, match="pages: 1 KV heads of dim 256, the cache's layout has 1 of dim 288"):
            cache.ingest(tokens_for(1, BLOCK), narrow.at([0, 1, 2, 3]))
        assert cache.lookup(tokens_for(1, BLOCK)) == 0


def test_latents_saved_and_loaded_layer_by_layer_equal_the_whole_calls(backend):
    """A layer-wise save (a layer put as the forward writes it) stores the bytes a whole
    ingest stores, and a layer-wise load into pages writes, layer by layer as each is
    waited for, the latents a whole load writes."""
    src = latents(6)
    toks = tokens_for(7, 2 * BLOCK)
    ids = [9, 4, 15, 2, 11, 0, 20, 6]
    with make_cache() as layerwise, make_cache() as whole:
        writer = layerwise.ingest_batch([cs.PagedRequest(toks, ids)], cs.KVPages.mla(src), layerwise=True)
        for i in range(LAYOUT.num_layers):
            writer.put_layer(i)
        assert writer.finish()[0].stored == 2
        whole.ingest(toks, cs.KVPages.mla(src).at(ids))
        assert stored_bytes(layerwise, toks) == stored_bytes(whole, toks)
        dst = latents(8)
        load = layerwise.materialize_into_batch([cs.PagedRequest(toks, ids)], cs.KVPages.mla(dst), layerwise=True)
        with load:
            for i in range(LAYOUT.num_layers):
                load.wait(i)
                assert torch.equal(gather(dst[i], ids, 2 * BLOCK), gather(src[i], ids, 2 * BLOCK))
        assert load.requests[0].num_tokens == 2 * BLOCK


def test_a_token_pool_of_latents_is_pages_of_one_token(backend):
    """SGLang's MLA token pool, per layer ``[slots, 1, C]``: pages of one token, a request's
    page table its slots."""
    src = latents(10, num_pages=4 * BLOCK, page=1)
    toks = tokens_for(11, 2 * BLOCK)
    slots = torch.randperm(4 * BLOCK, generator=torch.Generator().manual_seed(12))[: 2 * BLOCK].tolist()
    with make_cache() as cache:
        pool = cs.KVPages.mla(src)
        assert pool.page_size == 1
        assert cache.ingest(toks, pool.at(slots)).stored == 2
        dst = latents(13, num_pages=4 * BLOCK, page=1)
        out = slots[::-1]
        assert cache.materialize_into(toks, cs.KVPages.mla(dst).at(out)).num_tokens == 2 * BLOCK
        for layer in range(LAYOUT.num_layers):
            assert torch.equal(dst[layer][out, 0], src[layer][slots, 0])
