"""Replay a request trace through the real ``TieredStore``, with byte budgets scaled for a
model layout and codec, and small payloads standing in for KV.

Scaling: a tier of B bytes holds ``B // frame_nbytes(layout, codec)`` blocks of the real
model. The replay stores frames of ``stand_in_nbytes`` instead and gives each tier
``blocks x stand-in frame size`` bytes, so it evicts exactly when the real tier would, and
it runs on a laptop. Bytes written and read are reported in real bytes (blocks x real frame).

Per request, the replay makes the calls an engine makes through ``PrefixCache``:
``locate`` (the hit: the longest stored prefix, and the tier of each block), ``get_many``
on that prefix and ``touch_chain`` (materialize), then ``contains_many``, ``touch_chain``
of the blocks already stored, and ``put_many`` of the missing blocks tail first (ingest).

Counting (``ReplaySpec.full_blocks_only``): the issue's, every block of a request stored;
or the store's, a request's partial last block requested and counted but never stored nor
hit (``PrefixCache`` stores full blocks only). The references take the same flag.

Block keys: the trace's ids are chained already (an id names a whole prefix), so a block's
key is its id in 16 bytes, and its parent's key the previous id's.
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..config import TierConfig
from ..errors import ConfigError
from ..layout import KVLayout
from ..store.arena import ALIGN as ARENA_ALIGN
from ..store.disk import allocation_unit, block_charge
from ..store.frame import ALIGN, build_frame, plan_frame, replan_frame, seal_frame
from ..store.tier import BlockFrame
from ..store.tiered import TieredStore
from ..units import format_size
from .format import Request
from .reference import cached_blocks, distinct_blocks, hit_tokens, requested_tokens

KEY_BYTES = 16
ROOT = b"\xff" * KEY_BYTES  # never an id's key: format.ID_BOUND keeps ids below it
STAND_IN_NBYTES = 64  # payload bytes of a stand-in frame
# What the replay's store keeps in Python objects for a block beside its stand-in frame (the
# tier's record, the eviction index, the residency map): about 2.0-2.1 KiB a CPU-tier block and
# 0.8-1.0 KiB a disk-tier block on CPython 3.11 (tests/test_trace.py measures it), rounded up.
CPU_BLOCK_BOOKKEEPING = 2560
DISK_BLOCK_BOOKKEEPING = 1280
MAX_BLOCK_TOKENS = 1 << 24  # the most a frame header may carry (store.frame refuses more)
MAX_POSITION = 1 << 30  # the deepest block a stand-in frame keeps its size at


def check_block_tokens(value: int, what: str = "block_tokens") -> int:
    """``value`` if it is a block size a frame can carry, else a ``ConfigError`` naming ``what``:
    0 or a negative size would replay into meaningless figures with no error."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_BLOCK_TOKENS:
        raise ConfigError(f"{what}: must be an integer from 1 to {MAX_BLOCK_TOKENS} tokens, got {value!r}")
    return value


def frame_nbytes(layout: KVLayout, codec: Any, block_tokens: int) -> int:
    """Bytes a tier counts for one block of ``layout`` encoded by ``codec`` (header and payload)."""
    L, H, D = layout.num_layers, layout.num_kv_heads, layout.head_dim
    codec.check_layout(layout, block_tokens)
    encoded = codec.template((L, H, block_tokens, D), layout.dtype)
    specs = [(name, spec.dtype, spec.shape) for name, spec, _ in encoded.named_buffers()]
    meta = plan_frame(block_hash=bytes(KEY_BYTES), parent_hash=bytes(KEY_BYTES), position=1 << 20, layout=layout,
                      block_tokens=block_tokens, codec=codec.spec(), buffers=specs)
    return meta.nbytes


def key_of(block_id: int) -> bytes:
    return block_id.to_bytes(KEY_BYTES, "big")


class StandInFrames:
    """Frames of ``STAND_IN_NBYTES`` payload for any block, derived from one template."""

    def __init__(self, block_tokens: int) -> None:
        check_block_tokens(block_tokens)
        self.layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16")
        self.payload = bytes(STAND_IN_NBYTES)
        # Every frame must take the bytes a tier is given per block, or a tier holds more
        # blocks than the real one: a position takes 1 to 5 bytes of header, which can
        # cross the payload's alignment (small block sizes). The codec spec is padded until
        # the first position and the largest a trace may reach make frames of one size.
        for pad in range(ALIGN):
            self.template = plan_frame(block_hash=bytes(KEY_BYTES), parent_hash=ROOT, position=0,
                                       layout=self.layout, block_tokens=block_tokens,
                                       codec={"name": "stand-in", **({"pad": "-" * pad} if pad else {})},
                                       buffers=[("kv", "uint8", (STAND_IN_NBYTES,))])
            self.nbytes = replan_frame(self.template, block_hash=bytes(KEY_BYTES), parent_hash=ROOT,
                                       position=MAX_POSITION).nbytes
            if self.template.nbytes == self.nbytes:
                break

    def frame(self, key: bytes, parent: bytes, position: int) -> BlockFrame:
        meta = replan_frame(self.template, block_hash=key, parent_hash=parent, position=position)
        buf = build_frame(meta, [self.payload])
        meta = seal_frame(meta, buf)
        return BlockFrame(meta, host=memoryview(buf), sealed=True)


@dataclass(frozen=True)
class ReplaySpec:
    """What to replay: the tiers' budgets in blocks of the real model (0: tier off), the
    eviction policy, the disk tier's admission threshold, and the counting (see the module doc)."""

    cpu_blocks: int
    disk_blocks: int = 0
    policy: str = "arc"
    disk_admit_after_uses: int = 1
    write_through: bool = True
    promote_on_hit: bool = True
    full_blocks_only: bool = False


@dataclass
class ReplayResult:
    spec: ReplaySpec
    requests: int = 0
    requested_blocks: int = 0
    hit_blocks: int = 0
    requested_tokens: int = 0
    hit_tokens: int = 0
    hits_by_tier: dict[str, int] = field(default_factory=dict)
    tiers: list[dict[str, Any]] = field(default_factory=list)  # store stats, bytes in stand-in units
    seconds: float = 0.0

    @property
    def block_hit_rate(self) -> float:
        return self.hit_blocks / self.requested_blocks if self.requested_blocks else 0.0

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.requested_tokens if self.requested_tokens else 0.0


class StoreClient:
    """The calls ``PrefixCache`` makes, made on a ``TieredStore`` directly, with stand-in frames."""

    def __init__(self, store: TieredStore, frames: StandInFrames) -> None:
        self.store = store
        self.frames = frames

    def request(self, ids: Sequence[int]) -> list[str]:
        keys = [key_of(i) for i in ids]
        store = self.store
        tiers = store.locate(keys)  # lookup
        n = len(tiers)
        if n:  # materialize the hit
            got = store.get_many(keys[:n])
            for g in got:
                if g is not None:
                    g[0].release()  # the replay reads nothing: the memory goes back at once
            served = next((i for i, g in enumerate(got) if g is None), n)
            tiers = tiers[:served]
            store.touch_chain(keys[: len(tiers)])
        present = store.contains_many(keys)  # ingest
        missing = [i for i in range(len(keys) - 1, -1, -1) if not present[i]]
        found = [k for k, p in zip(keys, present) if p]
        if found:  # before the puts, as PrefixCache.ingest: else they may evict these
            store.touch_chain(found, count_use=False)
        if missing:
            frames = self.frames
            head = next((i for i, p in enumerate(present) if not p), len(keys))  # its stored prefix
            store.put_many([(keys[i], frames.frame(keys[i], keys[i - 1] if i else ROOT, i)) for i in missing],
                           spare=frozenset(keys[:head]))
        return tiers


def arena_slack(cpu_bytes: int, frame_nbytes_: int) -> int:
    """Room for the CPU tier's arena beyond its budget (its reserve; the replay reserves
    nothing), so that it holds the budget's ``cpu_bytes // frame_nbytes_`` frames. The
    arena maps the budget in power-of-two chunks, each of which ends in a gap smaller than a
    frame: without it, a tier of 10,922 stand-in blocks held 10,921, and every put into it
    full scanned the tier for room the arena could not give (78 s for the trace instead of
    a few)."""
    if cpu_bytes <= 0:
        return 0
    chunks = cpu_bytes // (1 << 30) + cpu_bytes.bit_length() + 2  # the most the arena maps
    return chunks * -(-frame_nbytes_ // ARENA_ALIGN) * ARENA_ALIGN


def build_store(spec: ReplaySpec, frame_nbytes_: int, disk_dir: str | None) -> TieredStore:
    if spec.cpu_blocks <= 0 and spec.disk_blocks <= 0:
        raise ConfigError("replay: give a CPU or a disk budget")
    if spec.disk_blocks > 0 and disk_dir is None:
        raise ConfigError("replay: a disk tier needs a directory")
    # The disk budget counts a block's files in whole allocation units (its sidecar too):
    # ``disk_blocks`` stand-in blocks take that many charges.
    disk_charge = block_charge(frame_nbytes_, allocation_unit(Path(disk_dir).parent)) if disk_dir else 0
    cpu_bytes = max(spec.cpu_blocks, 0) * frame_nbytes_
    disk_bytes = max(spec.disk_blocks, 0) * disk_charge
    config = TierConfig(
        cpu_bytes=cpu_bytes, cpu_reserve_bytes=arena_slack(cpu_bytes, frame_nbytes_), pin_memory=False,
        disk_path=disk_dir if spec.disk_blocks > 0 else None, disk_bytes=disk_bytes,
        disk_fsync=False, eviction=spec.policy, disk_admit_after_uses=spec.disk_admit_after_uses,
        write_through=None if spec.write_through else (), promote_on_hit=spec.promote_on_hit,
    )
    store = config.build()
    if disk_dir is not None and spec.disk_blocks > 0:
        # A disk tier clamps a budget larger than its filesystem's free space (with a log
        # line only): the replay would hold fewer blocks than the budget it reports.
        disk = store.tier("disk")
        if disk.capacity_bytes < disk_bytes:
            store.close()
            raise ConfigError(
                f"replay: a disk tier of {spec.disk_blocks} blocks takes {format_size(disk_bytes)} of "
                f"stand-in files ({disk_charge} bytes a block) under {Path(disk_dir).parent}, but that filesystem "
                f"has room for {format_size(disk.capacity_bytes)}: give the replay more room (TMPDIR)")
    return store


def check_disk_room(disk_blocks: int, block_tokens: int) -> None:
    """A ``ConfigError`` now, before any replay, if a disk tier of ``disk_blocks`` stand-in
    blocks does not fit the temporary directory's filesystem (see ``build_store``)."""
    if disk_blocks <= 0:
        return
    frames = StandInFrames(block_tokens)
    with tempfile.TemporaryDirectory(prefix="cacheseek-replay-") as tmp:
        build_store(ReplaySpec(cpu_blocks=0, disk_blocks=disk_blocks), frames.nbytes, str(Path(tmp) / "disk")).close()


Progress = Callable[[int, int], None]


class ReplayStopped(Exception):
    """A replay given ``stop`` found it true: it ended between two requests, its store closed
    and its temporary directory removed."""


def replay(trace: Sequence[Request], spec: ReplaySpec, *, block_tokens: int = 512,
           progress: Progress | None = None, client_factory: Callable[..., Any] | None = None,
           stop: Callable[[], bool] | None = None) -> ReplayResult:
    """Replay ``trace`` through a fresh store built for ``spec``; ``progress(done, total)``
    is called now and then. ``stop()`` is asked before every request: true, the replay ends
    with ``ReplayStopped`` (how a signal stops it: an exception raised by a signal handler
    can land in a garbage-collector callback, which swallows it, or inside a disk call before
    its guard, and the store's close then waits for that call for ever)."""
    frames = StandInFrames(block_tokens)
    result = ReplayResult(spec=spec)
    start = time.perf_counter()
    # A CPU tier past the trace's distinct blocks never evicts: built at that size, the replay
    # is the same, and a budget larger than this machine's memory replays a trace that fits it.
    # (The disk tier keeps its budget: its admission window is sized by it.)
    built = replace(spec, cpu_blocks=min(spec.cpu_blocks, max(1, distinct_blocks(trace, block_tokens,
                                                                                 spec.full_blocks_only))))
    with tempfile.TemporaryDirectory(prefix="cacheseek-replay-") as tmp:
        store = build_store(built, frames.nbytes, str(Path(tmp) / "disk") if spec.disk_blocks > 0 else None)
        try:
            client = (client_factory or StoreClient)(store, frames)
            total = len(trace)
            step = max(1, total // 50)
            for t, req in enumerate(trace):
                if stop is not None and stop():
                    raise ReplayStopped(f"stopped after {t} of {total} requests")
                ids = req.hash_ids
                tiers = client.request(ids[: cached_blocks(req, block_tokens, True)] if spec.full_blocks_only else ids)
                n = len(tiers)
                result.requests += 1
                result.requested_blocks += len(req.hash_ids)
                result.hit_blocks += n
                result.requested_tokens += requested_tokens(req, block_tokens)
                result.hit_tokens += hit_tokens(req, n, block_tokens)
                for name in tiers:
                    result.hits_by_tier[name] = result.hits_by_tier.get(name, 0) + 1
                if progress is not None and (t % step == 0 or t == total - 1):
                    progress(t + 1, total)
            result.tiers = store.stats()["tiers"]
        finally:
            store.close()
    result.seconds = time.perf_counter() - start
    return result


class ProgressBar:
    """A one-line progress bar on stderr (no dependency), redrawn in place on a terminal;
    elsewhere (a log file, a CI job) only its last state, once: the redraws, carriage
    returns on one line, made a log line of fifty bars a replay."""

    def __init__(self, label: str, stream: Any = None, width: int = 30) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.start = time.perf_counter()
        isatty = getattr(self.stream, "isatty", None)
        self.redraw = bool(isatty and isatty())

    def __call__(self, done: int, total: int) -> None:
        if not self.redraw and done < total:
            return
        frac = done / total if total else 1.0
        bar = "#" * int(frac * self.width)
        elapsed = time.perf_counter() - self.start
        start = "\r" if self.redraw else ""
        self.stream.write(f"{start}{self.label} [{bar:<{self.width}}] {done}/{total} {elapsed:5.1f}s")
        if done >= total:
            self.stream.write("\n")
        self.stream.flush()
