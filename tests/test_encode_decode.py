"""The batched data path: the staged (GPU-style) and direct (host) encodings give the same frames."""

import pytest
import torch

import cacheseek as cs
from cacheseek.block_format import BlockFormat
from cacheseek.decode import decode_frames
from cacheseek.encode import encode_blocks
from cacheseek.store.device import frame_to_host
from store_helpers import BLOCK, LAYOUT, block_parents, make_kv


@pytest.mark.parametrize("codec", [cs.Raw(), cs.KIVI(bits=4, group_size=32), cs.KIVI(k_bits=2, v_bits=8)])
def test_staged_and_direct_encodings_give_identical_frames(codec):
    kv = make_kv(5 * BLOCK + 3, 21)
    hashes = [bytes([i]) * 16 for i in range(1, 4)]
    args = dict(first_block=1, hashes=hashes, parents=block_parents(b"\x00" * 16, hashes))
    staged = encode_blocks(BlockFormat(codec, LAYOUT, BLOCK), kv, staging=True, **args)
    direct = encode_blocks(BlockFormat(codec, LAYOUT, BLOCK), kv, staging=False, **args)
    for a, b in zip(staged, direct):
        assert frame_to_host(a).to_bytes() == frame_to_host(b).to_bytes()
        assert a.meta.position == b.meta.position
    k, v = decode_frames(BlockFormat(codec, LAYOUT, BLOCK), [frame_to_host(f) for f in staged], torch.device("cpu"))
    assert k.shape == (LAYOUT.num_layers, LAYOUT.num_kv_heads, 3 * BLOCK, LAYOUT.head_dim)
    if codec.name == "raw":
        for layer, (k0, v0) in enumerate(kv):
            assert torch.equal(k[layer], k0[:, BLOCK : 4 * BLOCK]) and torch.equal(v[layer], v0[:, BLOCK : 4 * BLOCK])


def test_batch_rows_given_to_a_device_tier_do_not_pin_the_batch():
    from cacheseek.store.device import payload_on_device

    kv = make_kv(2 * BLOCK, 22)
    hashes = [b"\x01" * 16, b"\x02" * 16]
    frames = encode_blocks(BlockFormat(cs.Raw(), LAYOUT, BLOCK), kv, staging=True, first_block=0, hashes=hashes,
                           parents=block_parents(b"\x00" * 16, hashes))
    owned = payload_on_device(frames[1], torch.device("cpu"))
    assert owned.untyped_storage().nbytes() == owned.numel()
    assert torch.equal(owned, frames[1].device_payload)


@pytest.mark.parametrize("codec", [cs.KIVI(bits=4, group_size=32), cs.KIVI(k_bits=2, v_bits=8, group_size=32)])
def test_the_kernels_read_the_layers_in_place_and_give_the_stacked_frames(codec, monkeypatch):
    pytest.importorskip("triton")
    from cacheseek.quant import backend

    device = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on a CPU
    kv = make_kv(4 * BLOCK + 5, 23, device=device)
    hashes = [bytes([i]) * 16 for i in range(1, 4)]
    args = dict(first_block=1, hashes=hashes, parents=block_parents(b"\x00" * 16, hashes), staging=True)
    monkeypatch.setenv(backend.BACKEND_ENV, "triton")
    in_place = encode_blocks(BlockFormat(codec, LAYOUT, BLOCK), kv, **args)
    # Layers of different strides cannot share one table: the same frames, through a stacked copy.
    mixed = list(kv)
    mixed[0] = (torch.empty(LAYOUT.num_kv_heads, 9 * BLOCK, LAYOUT.head_dim, dtype=kv[0][0].dtype,
                            device=device)[:, : kv[0][0].shape[1]].copy_(kv[0][0]), kv[0][1])
    stacked = encode_blocks(BlockFormat(codec, LAYOUT, BLOCK), mixed, **args)
    monkeypatch.setenv(backend.BACKEND_ENV, "torch")
    reference = encode_blocks(BlockFormat(codec, LAYOUT, BLOCK), kv, **args)
    for a, b, c in zip(in_place, stacked, reference):
        assert frame_to_host(a).to_bytes() == frame_to_host(b).to_bytes() == frame_to_host(c).to_bytes()
    kv[1][0][0, 2 * BLOCK, 0] = float("nan")  # block 2
    monkeypatch.setenv(backend.BACKEND_ENV, "triton")
    with pytest.raises(cs.InputError, match="NaN or Inf"):
        encode_blocks(BlockFormat(codec, LAYOUT, BLOCK), kv, **args)


@pytest.mark.parametrize("staging", [False, True], ids=["direct", "staged"])
@pytest.mark.parametrize("codec", [cs.Raw(), cs.KIVI(bits=4, group_size=32)])
def test_nan_outside_the_blocks_encoded_is_not_theirs(codec, staging):
    """Only the blocks encoded are checked, whatever the codec and device: Raw on the host
    checked its whole layers, so a NaN in a block already stored or in the partial tail
    (neither of them encoded) refused the blocks between, which KIVI, and Raw on a GPU, stored."""
    kv = make_kv(4 * BLOCK + 5, 24)
    kv[1][0][0, BLOCK - 1, 3] = float("nan")  # block 0, before the blocks encoded
    kv[2][1][1, 4 * BLOCK + 2, 0] = float("inf")  # the partial tail
    hashes = [bytes([i]) * 16 for i in range(1, 4)]
    frames = encode_blocks(BlockFormat(codec, LAYOUT, BLOCK), kv, first_block=1, hashes=hashes,
                           parents=block_parents(b"\x00" * 16, hashes), staging=staging)
    assert len(frames) == 3
    kv[0][1][1, 2 * BLOCK, 7] = float("nan")  # block 2, encoded
    with pytest.raises(cs.InputError, match="NaN or Inf"):
        encode_blocks(BlockFormat(codec, LAYOUT, BLOCK), kv, first_block=1, hashes=hashes,
                      parents=block_parents(b"\x00" * 16, hashes), staging=staging)


@pytest.mark.parametrize("codec", [cs.Raw(), cs.KIVI(bits=4, group_size=32)])
def test_on_the_host_frames_decode_from_their_own_bytes_and_misaligned_ones_through_staging(codec, monkeypatch):
    """On the CPU each frame is decoded from its own bytes as it is added (no copy into
    staging); a frame whose buffers are not aligned for their dtypes (its bytes at an odd
    address) goes through staging, and both give the same KV."""
    from cacheseek import decode

    kv = make_kv(3 * BLOCK, 24)
    hashes = [bytes([i]) * 16 for i in range(1, 4)]
    fmt = BlockFormat(codec, LAYOUT, BLOCK)
    frames = [frame_to_host(f) for f in encode_blocks(fmt, kv, first_block=0, hashes=hashes,
                                                      parents=block_parents(b"\x00" * 16, hashes))]
    odd = []
    for f in frames:
        buf = bytearray(1 + len(f.host))
        buf[1:] = f.host
        odd.append(decode.BlockFrame(f.meta, host=memoryview(buf)[1:]))
    staged = []
    real_copy = decode.BatchDecoder._copy
    monkeypatch.setattr(decode.BatchDecoder, "_copy", lambda self, frame, dst: (staged.append(frame),
                                                                                real_copy(self, frame, dst)))
    k, v = decode_frames(fmt, frames, torch.device("cpu"))
    assert staged == []
    k_odd, v_odd = decode_frames(fmt, odd, torch.device("cpu"))
    assert staged == odd
    assert torch.equal(k, k_odd) and torch.equal(v, v_odd)
    if codec.name == "raw":
        assert all(torch.equal(k[i], kv[i][0]) and torch.equal(v[i], kv[i][1]) for i in range(LAYOUT.num_layers))


@pytest.mark.parametrize("codec", [cs.Raw(), cs.KIVI(bits=4, group_size=32),
                                   cs.PrecisionPolicy(first=cs.KIVI(bits=8, group_size=32), first_blocks=1,
                                                      rest=cs.KIVI(k_bits=4, v_bits=2, group_size=32))],
                         ids=["raw", "int4", "policy"])
def test_a_host_materialize_leases_staging_only_for_frames_it_copies_there(codec):
    """On the CPU, frames decoded from their own bytes take no staging from the pool; a
    misaligned one (copied into staging) takes one lease, shared by a precision policy's
    runs, given back by the time the decode returns. The KV is the same every way."""
    from cacheseek.store.device_staging import staging_pool
    from cacheseek.store.tier import BlockFrame

    kv = make_kv(3 * BLOCK, 25)
    hashes = [bytes([i]) * 16 for i in range(1, 4)]
    fmt = BlockFormat(codec, LAYOUT, BLOCK)
    frames = [frame_to_host(f) for f in encode_blocks(fmt, kv, first_block=0, hashes=hashes,
                                                      parents=block_parents(b"\x00" * 16, hashes))]

    def misaligned(f: BlockFrame) -> BlockFrame:  # its bytes at an odd address
        buf = bytearray(1 + len(f.host))
        buf[1:] = f.host
        return BlockFrame(f.meta, host=memoryview(buf)[1:])

    pool = staging_pool(torch.device("cpu"))
    granted, active = pool.stats()["leases_granted"], pool.stats()["leases_active"]
    k, v = decode_frames(fmt, frames, torch.device("cpu"))
    assert pool.stats()["leases_granted"] == granted
    # Frame 1 through staging (under the policy, in the second codec's rows), frame 2 too
    # (it waits behind frame 1 there), frame 0 from its own bytes.
    for mixed in ([frames[0], misaligned(frames[1]), frames[2]], [misaligned(f) for f in frames]):
        granted = pool.stats()["leases_granted"]
        k_mixed, v_mixed = decode_frames(fmt, mixed, torch.device("cpu"))
        assert pool.stats()["leases_granted"] == granted + 1
        assert pool.stats()["leases_active"] == active
        assert torch.equal(k, k_mixed) and torch.equal(v, v_mixed)
    if codec.name == "raw":
        assert all(torch.equal(k[i], kv[i][0]) and torch.equal(v[i], kv[i][1]) for i in range(LAYOUT.num_layers))
