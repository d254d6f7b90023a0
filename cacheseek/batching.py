"""How an ingest cuts its new blocks into batches: the one batching policy of the data path.

Two paths use it, each with the shape that measured best for it on the H200:

- the put path (``encode.iter_encoded``: ``PrefixCache`` for tiers that take frames through
  ``put_many``, and ``RemoteCache``): on a GPU, up to ``PIPELINE_DEPTH`` batches, so only
  the first batch's encode is not hidden behind the copies of the one before
  (:func:`pipelined_batch_blocks`);
- the in-place ingest (``ingest_in_place``): a first batch of ``MIN_BATCH_BYTES`` of raw
  KV, then batches that double (:func:`growing`), so the copy engine starts after a short
  encode and each copy lasts long enough for the host to launch the next; a long run is
  copied in two pieces, the last one ``LAST_PIECE`` frames (:func:`copy_pieces`).

Both keep every batch at or above ``MIN_BATCH_BYTES`` where they can: each batch costs the
host a fixed ~0.5 ms of launches and bookkeeping, which must stay under the time its
copies take. Both go tail first, so a chain that overflows a tier keeps its head.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

MIN_BATCH_BYTES = 128 << 20  # raw KV per batch below which the host's fixed costs dominate
PIPELINE_DEPTH = 3  # batches the put path cuts an ingest into on a GPU, so copies overlap encoding
LAST_PIECE = 4  # frames in the last copy of a long in-place run: the commit that ends the call is short
# The in-place ingest's guessed tail is at least this share of the chain. On the H200 the
# host hashes and plans a 64-block int4 chain (16K tokens) in ~1.1 ms after launching the
# guess; an eighth of that chain's payload takes ~1.5 ms to copy (the first batch alone,
# 4 blocks, 0.75 ms: the copy engine sat idle ~0.3 ms). Wasted when the tail turns out
# stored: a share, not all, of a call that stores nothing.
GUESS_SHARE = 8


def runs(flags: Sequence[bool], max_len: int) -> Iterator[tuple[int, int]]:
    """[start, stop) ranges of consecutive True flags, each at most ``max_len`` long."""
    i = 0
    while i < len(flags):
        if not flags[i]:
            i += 1
            continue
        j = i
        while j < len(flags) and flags[j] and j - i < max_len:
            j += 1
        yield i, j
        i = j


def pipelined_batch_blocks(missing: int, batch_blocks: int, block_raw_nbytes: int) -> int:
    """Blocks per batch of the put path on a GPU: at most ``batch_blocks``, and small enough
    that ``missing`` blocks make ``PIPELINE_DEPTH`` batches; but not below
    ``MIN_BATCH_BYTES`` of raw KV."""
    floor = max(1, -(-MIN_BATCH_BYTES // block_raw_nbytes))
    return max(1, min(batch_blocks, max(floor, -(-missing // PIPELINE_DEPTH))))


def first_batch_blocks(block_raw_nbytes: int) -> int:
    """Blocks in the in-place ingest's first batch (and in the tail it launches early)."""
    return max(1, MIN_BATCH_BYTES // block_raw_nbytes)


def guessed_tail_blocks(num_blocks: int, block_raw_nbytes: int) -> int:
    """Blocks of a chain's tail that the in-place ingest launches before the keys are known:
    the first batch, or ``1 / GUESS_SHARE`` of the chain if that is more. While they are
    copied the host hashes the whole prompt and plans its frames (work that grows with the
    chain), and the copy engine should not run dry before the next batch is launched."""
    return max(first_batch_blocks(block_raw_nbytes), num_blocks // GUESS_SHARE)


def growing(batches: list[tuple[int, int]], first: int) -> list[tuple[int, int]]:
    """``batches`` (tail first) with the first cut into batches of ``first`` blocks, then
    twice as many, and so on (a launch costs the host the same for any size)."""
    start, stop = batches[0]
    out = []
    size = first
    while stop - start > size + size // 2:
        out.append((stop - size, stop))
        stop -= size
        size *= 2
    return [*out, (start, stop), *batches[1:]]


def copy_pieces(count: int) -> list[tuple[int, int]]:
    """The frames [a, b) of an in-place run of ``count`` frames per device-to-host copy, in
    copy order: a long run goes in two, its head end last and small, so the commit that
    waits for the last copy (and ends the call) has only a few frames to do."""
    return [(LAST_PIECE, count), (0, LAST_PIECE)] if count >= 2 * LAST_PIECE else [(0, count)]


__all__ = ["GUESS_SHARE", "LAST_PIECE", "MIN_BATCH_BYTES", "PIPELINE_DEPTH", "copy_pieces", "first_batch_blocks",
           "growing", "guessed_tail_blocks", "pipelined_batch_blocks", "runs"]
