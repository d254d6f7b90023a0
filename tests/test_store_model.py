"""The tiered store against a model of what was ingested (the state machine comes next);
first, the regressions it found, each a plain test.

KV is a function of the tokens up to each block's end (as a model's is), so a block's key
names its content."""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest
import torch

import cacheseek as cs

LAYOUT = cs.KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16")
BLOCK = 32


def block_kv(tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The KV of the last block of ``tokens`` (a prefix ending at a block boundary): a
    function of every token before, as a model's is. [H, BLOCK, D] per layer."""
    seed = zlib.crc32(torch.tensor(tokens, dtype=torch.int64).numpy().tobytes())
    gen = torch.Generator().manual_seed(seed)
    shape = (LAYOUT.num_kv_heads, BLOCK, LAYOUT.head_dim)
    return [(torch.randn(shape, generator=gen).to(LAYOUT.torch_dtype),
             torch.randn(shape, generator=gen).to(LAYOUT.torch_dtype)) for _ in range(LAYOUT.num_layers)]


def prompt_kv(tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """KV of a whole prompt: its full blocks' ``block_kv``, then zeros for the tokens past
    the last full block (never stored)."""
    n = len(tokens) // BLOCK
    blocks = [block_kv(tokens[: (i + 1) * BLOCK]) for i in range(n)]
    rest = len(tokens) - n * BLOCK
    tail = torch.zeros((LAYOUT.num_kv_heads, rest, LAYOUT.head_dim), dtype=LAYOUT.torch_dtype)
    return [(torch.cat([b[layer][0] for b in blocks] + [tail], dim=1),
             torch.cat([b[layer][1] for b in blocks] + [tail], dim=1)) for layer in range(LAYOUT.num_layers)]


def _sizes(tmp_path: Path) -> tuple[int, int]:
    """A Raw frame of LAYOUT's blocks, and what a disk tier under ``tmp_path`` charges for one."""
    probe = cs.PrefixCache(model_id="m", layout=LAYOUT, codec=cs.Raw(), block_tokens=BLOCK,
                           tiers=cs.TierConfig(cpu_bytes="1MiB", disk_path=tmp_path / "probe", disk_bytes="1GiB",
                                               pin_memory=False))
    probe.ingest(list(range(BLOCK)), prompt_kv(list(range(BLOCK))))
    frame = probe.stats()["used_bytes"]
    charge = probe.store.tier("disk").charge(frame)
    probe.close()
    return frame, charge


@pytest.mark.parametrize("split", ["in place, then put_many", "put_many in batches"])
def test_an_ingest_the_disk_can_hold_whole_keeps_every_block_it_acknowledges(tmp_path, split):
    """Found by ``StoreMachine``: an ingest written to the disk in pieces had its later pieces
    evict its earlier ones there (ARC's once-used blocks, the chain's tail, before blocks used
    twice), though the disk had room for the whole chain: every block was acknowledged
    durable, and the tail was on disk no more. The pieces: the tail committed into the CPU
    tier's slots in place (room to reserve for it only) and the rest put (the first shrunk
    example), or the put path's batches (a GPU tier on top; here the disk, with one-block
    batches). Each piece now makes room for the rest of the call, in every tier it goes to."""
    frame, charge = _sizes(tmp_path)
    if split == "in place, then put_many":
        tiers = cs.TierConfig(cpu_bytes=3 * frame, disk_path=tmp_path / "d", disk_bytes=6 * charge, pin_memory=False)
        batch = "1GiB"
    else:
        tiers = cs.TierConfig(cpu_bytes=0, disk_path=tmp_path / "d", disk_bytes=6 * charge, pin_memory=False)
        batch = LAYOUT.raw_nbytes(BLOCK)
    cache = cs.PrefixCache(model_id="m", layout=LAYOUT, codec=cs.Raw(), block_tokens=BLOCK, tiers=tiers,
                           max_batch_bytes=batch)
    used = list(range(1000, 1000 + 2 * BLOCK))
    cache.ingest(used, prompt_kv(used))
    assert cache.materialize(used).num_tokens == 2 * BLOCK  # used twice: ARC keeps these over new blocks
    chain = list(range(2000, 2000 + 5 * BLOCK))
    res = cache.ingest(chain, prompt_kv(chain))
    assert (res.stored, res.failed, res.durability) == (5, 0, "durable")
    assert cache.store.tier("disk").contains_many(cache.block_hashes(chain)) == [True] * 5
    cache.close()
    again = cs.PrefixCache(model_id="m", layout=LAYOUT, codec=cs.Raw(), block_tokens=BLOCK, tiers=tiers)
    assert again.lookup(chain) == 5 * BLOCK
    got = again.materialize(chain)
    for (k, v), (k0, v0) in zip(got.layers, prompt_kv(chain)):
        assert torch.equal(k[0], k0) and torch.equal(v[0], v0)
    again.close()


@pytest.mark.parametrize("piece", ["put_many", "commit_many"])
def test_a_call_stored_in_pieces_makes_room_for_the_rest_in_the_tiers_written_through(tmp_path, piece):
    """The store's side of the fix above, as a server stores a batch (groups put, frames
    received in place committed one by one, each with ``room_for`` the rest of the batch):
    the write-through disk made room for each piece alone, and the last piece evicted the
    first (its once-used tail, ARC's first victim), though the disk had room for all."""
    from cacheseek.store.cpu import CpuTier
    from cacheseek.store.disk import DiskTier, allocation_unit, block_charge
    from cacheseek.store.frame import parse_frame
    from cacheseek.store.tier import BlockFrame
    from cacheseek.store.tiered import TieredStore
    from server_helpers import raw_chain

    def frames(seed: int, n: int) -> list[tuple[bytes, BlockFrame]]:
        return [(h, BlockFrame(parse_frame(buf := bytearray(f)), host=memoryview(buf))) for h, f in raw_chain(seed, n)]

    used, chain = frames(1, 2), frames(2, 5)
    size = chain[0][1].nbytes
    cpu = CpuTier(3 * size, reserve_bytes=size)
    disk = DiskTier(tmp_path / "d", 6 * block_charge(size, allocation_unit(tmp_path)), fsync=False)
    store = TieredStore([cpu, disk], write_through=["disk"])
    store.put_many(used)
    store.touch_chain([k for k, _ in used])  # used again: ARC keeps these over new blocks
    tail, rest = chain[-1], chain[:-1]
    if piece == "put_many":
        first = store.put_many([tail], room_for=4 * size)[0]
    else:
        reservation = store.reserve(size)
        reservation.view()[:] = tail[1].to_bytes()
        first = store.commit_many([(tail[0], reservation, tail[1].meta)], room_for=4 * size)[0]
    assert first.stored
    assert all(r.stored for r in store.put_many(rest[::-1]))
    assert disk.contains_many([k for k, _ in chain]) == [True] * 5
    store.close()
