"""Device staging buffers lent with leases: the byte buffers the data path encodes into and
copies through on a device (an encoded batch before it goes to the host, the rows a decoder
copies frames into, an in-place ingest's staging), from a small pool per device.

``staging_pool(device).take(nbytes)`` returns a ``StagingLease`` (a ``store.lease.Lease``):
``lease.tensor`` is ``nbytes`` of uint8 on the device, the holder's until ``release()``,
exactly once (or ``with lease:``). A lease is taken for a stream (default: the current
one); the holder names every other stream that uses the buffer (``used_on``), and orders
those uses after work it queued on the stream it took the lease for (the data path's side
streams wait for the caller's stream, or an event on it, before they touch a buffer).

Release is stream-ordered, never a host wait: it records a CUDA event on each stream that
used the buffer, now (so the holder releases once it has *queued* its last use, not once
that use has run). The pool hands the buffer out again only after those events: a free
buffer whose events have all passed (``event.query()``) is taken first; failing one, a new
buffer is made while the pool is under its cap; at the cap, the taker's stream waits for a
free buffer's events (``wait_event``: the device orders it, the host goes on). So a buffer
is never written by one holder while another's work on it may still run.

Buffers come in size classes (four per power of two: at most 25% unused) of at least
``MIN_CLASS_BYTES``. The pool keeps up to ``cap_bytes`` of them (lent or free); a request
it cannot fit (larger than the cap, or the cap taken by lent buffers) gets a one-off
buffer, freed at its release (through the caching allocator, told of every stream that
used it with ``record_stream``). To make room for a new class, free buffers whose events
have passed are freed first. A lease dropped without a release keeps its buffer lent for
good (``leases_active`` says so), never freed under work still queued on it.

On a CPU device there are no streams or events: the same pool, leases and counts, so the
lifetimes are tested anywhere. Thread-safe: takes and releases from any thread.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from .lease import Lease, LeaseError, LeaseLedger
from .streams import current_stream, on_stream

MIN_CLASS_BYTES = 64 << 10  # the smallest buffer the pool makes
# Bytes each device's pool keeps (lent or free), by device type. On a CPU the buffers are
# host memory the process would otherwise give back: a small pool.
DEFAULT_CAP_BYTES = {"cuda": 1 << 30, "cpu": 64 << 20}


def size_class(nbytes: int) -> int:
    """The buffer size a request of ``nbytes`` gets: at least ``MIN_CLASS_BYTES``, rounded up
    to a quarter of the power of two below it (1, 1.25, 1.5, 1.75 x 2^k)."""
    if nbytes <= MIN_CLASS_BYTES:
        return MIN_CLASS_BYTES
    step = 1 << max(0, (nbytes - 1).bit_length() - 3)
    return -(-nbytes // step) * step


@dataclass(eq=False, slots=True)
class _Buffer:
    tensor: torch.Tensor  # uint8, ``nbytes`` on the pool's device
    nbytes: int  # its size class (the pooled bytes it counts for)
    pooled: bool  # False: a one-off, freed at its release
    streams: list = field(default_factory=list)  # streams of the holder (the first: the one it was taken for)
    # Recorded at its last release, one per stream, and recorded again at the next (the
    # events are kept: a wait already queued on one is not moved by a later record).
    events: list = field(default_factory=list)
    # nbytes -> its first nbytes (a slice costs more than a lookup); and views kept by ``memo``
    views: dict = field(default_factory=dict)


class StagingLease(Lease):
    """A device staging buffer lent by a ``DeviceStagingPool``: ``tensor`` (``nbytes`` uint8)
    until ``release()``, exactly once. ``used_on(stream)`` names a stream, other than the
    one it was taken for, that uses the buffer: the release marks it too."""

    __slots__ = ("tensor",)

    def __init__(self, pool: DeviceStagingPool, buf: _Buffer, nbytes: int) -> None:
        super().__init__(pool, buf.nbytes, buf)
        view = buf.views.get(nbytes)
        if view is None:
            if len(buf.views) >= 8:
                buf.views.clear()
            view = buf.views[nbytes] = buf.tensor[:nbytes]
        self.tensor = view

    def used_on(self, *streams: Any) -> StagingLease:
        """Streams that use the buffer (besides the one it was taken for), each marked at the
        release. Returns the lease. Raises ``LeaseError`` after the release."""
        buf = self._token
        if buf is None:
            raise LeaseError("StagingLease.used_on after its release")
        for stream in streams:
            if stream is not None and stream not in buf.streams:
                buf.streams.append(stream)
        return self

    def release(self) -> None:
        """Give the buffer back (see ``Lease.release``); ``tensor`` is None from then on, so a
        use after the release fails instead of writing into a buffer lent to another."""
        super().release()
        self.tensor = None

    def release_if_held(self) -> bool:
        released = super().release_if_held()
        self.tensor = None
        return released

    def memo(self, key: Any, make: Any) -> Any:
        """``make()`` (views of this buffer), kept with the buffer under ``key`` for its next
        holders: cutting a batch's views costs the host more than finding them."""
        buf = self._token
        if buf is None:
            raise LeaseError("StagingLease.memo after its release")
        got = buf.views.get(key)
        if got is None:
            if len(buf.views) >= 8:
                buf.views.clear()
            got = buf.views[key] = make()
        return got

    def rows(self, n: int, stride: int) -> torch.Tensor:
        """The buffer as ``[n, stride]`` (it must hold ``n * stride`` bytes)."""
        return self.tensor[: n * stride].view(n, stride)

    def row_blocks(self, shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
        """The buffer cut into consecutive ``[n, stride]`` blocks, one per ``(n, stride)`` of
        ``shapes`` (blocks of several codecs' payloads, each at its own stride)."""
        out, offset = [], 0
        for n, stride in shapes:
            out.append(self.tensor[offset : offset + n * stride].view(n, stride))
            offset += n * stride
        return out


class DeviceStagingPool:
    """Staging buffers on one device, lent with leases (see the module doc)."""

    def __init__(self, device: torch.device, *, cap_bytes: int | None = None) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.cuda = self.device.type == "cuda"
        self.cap_bytes = DEFAULT_CAP_BYTES.get(self.device.type, 64 << 20) if cap_bytes is None else cap_bytes
        self._lock = threading.Lock()
        self._free: dict[int, deque[_Buffer]] = {}  # size class -> free buffers, oldest release first
        self._lent: set[_Buffer] = set()  # kept here so a lease dropped unreleased keeps its buffer lent
        self.pooled_bytes = 0  # bytes of the pool's buffers, lent or free
        self.free_bytes = 0
        self.made = 0  # pooled buffers made
        self.reused = 0  # takes served by a free buffer
        self.waited = 0  # of those, takes whose stream was made to wait for the buffer's last users
        self.one_off = 0  # takes served by a one-off buffer (over the cap)
        self.dropped = 0  # free buffers freed to make room for another class
        self.ledger = LeaseLedger()

    # -- lending -----------------------------------------------------------------------

    def take(self, nbytes: int, *, stream: Any = None) -> StagingLease:
        """A lease on ``nbytes`` of device memory for use on ``stream`` (default: the current
        stream of the pool's device), reusable by that stream at once. Never waits on the host."""
        if nbytes < 0:
            raise ValueError(f"nbytes: expected >= 0, got {nbytes}")
        if self.cuda and stream is None:
            stream = current_stream(self.device)
        cls = size_class(nbytes)
        wait_for: list = []
        with self._lock:
            buf = self._reuse(cls, wait_for)
            fresh = buf is None and self._room_for(cls)
            if fresh:  # counted now, made below (outside the lock: an allocation may take a while)
                self.pooled_bytes += cls
                self.made += 1
            elif buf is None:
                self.one_off += 1
            else:
                buf.streams = [stream] if stream is not None else []
                self._lent.add(buf)
                self.ledger.on_grant(cls)
        if buf is None:
            # A new pooled buffer of the class, or over the cap one of its own (its exact
            # size), freed at its release.
            size = cls if fresh else nbytes
            try:
                try:
                    tensor = self._empty(size, stream)
                except torch.OutOfMemoryError:
                    if not self.trim():
                        raise
                    tensor = self._empty(size, stream)  # once more, with the pool's free buffers given back
            except BaseException:
                if fresh:
                    with self._lock:
                        self.pooled_bytes -= cls
                        self.made -= 1
                raise
            buf = _Buffer(tensor, size, pooled=fresh, streams=[stream] if stream is not None else [])
            with self._lock:
                self._lent.add(buf)
                self.ledger.on_grant(size)
        for event in wait_for:
            stream.wait_event(event)  # the device waits for the buffer's last users; the host does not
        return StagingLease(self, buf, nbytes)

    def _reuse(self, cls: int, wait_for: list) -> _Buffer | None:
        """A free buffer of class ``cls`` (under the lock): the oldest whose last users are
        done; else, at the cap, the oldest, its events appended to ``wait_for``."""
        free = self._free.get(cls)
        if not free:
            return None
        for i, buf in enumerate(free):
            if not buf.events or all(e.query() for e in buf.events):
                del free[i]
                break
        else:
            if self._room_for(cls, dropping=False):
                return None  # all still in use: a new buffer rather than a wait
            buf = free.popleft()
            wait_for.extend(buf.events)
            self.waited += 1
        self.free_bytes -= cls
        self.reused += 1
        return buf

    def _room_for(self, cls: int, *, dropping: bool = True) -> bool:
        """Whether a new pooled buffer of ``cls`` bytes fits under the cap; with ``dropping``,
        frees free buffers whose users are done to make it fit (under the lock)."""
        if self.pooled_bytes + cls <= self.cap_bytes:
            return True
        if not dropping or cls > self.cap_bytes:
            return False
        for other, free in self._free.items():
            keep: deque[_Buffer] = deque()
            while free and self.pooled_bytes + cls > self.cap_bytes:
                buf = free.popleft()
                if all(e.query() for e in buf.events):  # nothing queued on it: freed as it is
                    self.pooled_bytes -= other
                    self.free_bytes -= other
                    self.dropped += 1
                else:
                    keep.append(buf)
            keep.extend(free)
            self._free[other] = keep
        return self.pooled_bytes + cls <= self.cap_bytes

    def trim(self) -> int:
        """Free every free buffer whose last users are done (the device is short of memory,
        or the pool is not needed for a while). Returns the bytes freed."""
        freed = 0
        with self._lock:
            for size, free in self._free.items():
                keep = deque(buf for buf in free if not all(e.query() for e in buf.events))
                gone = len(free) - len(keep)
                freed += gone * size
                self.dropped += gone
                self._free[size] = keep
            self.pooled_bytes -= freed
            self.free_bytes -= freed
        return freed

    def _empty(self, nbytes: int, stream: Any) -> torch.Tensor:
        # A normal tensor even under torch.inference_mode(): the buffer is pooled for the
        # process, and an inference tensor could not be written by a later call outside it.
        with torch.inference_mode(False):
            if stream is None:
                return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            with on_stream(stream):  # the caching allocator ties the block to the taker's stream
                return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def lease_released(self, buf: _Buffer, nbytes: int) -> None:
        """(``Lease.release``.) Marks every stream that used the buffer, then gives it back:
        free for reuse after those marks, or (a one-off) to the caching allocator."""
        streams, buf.streams = buf.streams, []
        if not buf.pooled:
            for stream in streams[1:]:  # the allocator reuses the block after these streams' work
                buf.tensor.record_stream(stream)
        elif self.cuda:
            events = buf.events
            del events[len(streams):]
            for i, stream in enumerate(streams):
                if i == len(events):
                    events.append(torch.cuda.Event())
                events[i].record(stream)
        with self._lock:
            self._lent.discard(buf)
            self.ledger.on_release(nbytes)
            if buf.pooled:
                self._free.setdefault(buf.nbytes, deque()).append(buf)
                self.free_bytes += buf.nbytes

    # -- figures -----------------------------------------------------------------------

    def owns(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lies in one of this pool's buffers (lent now)."""
        ptr = t.untyped_storage().data_ptr()
        with self._lock:
            return any(buf.tensor.untyped_storage().data_ptr() == ptr for buf in self._lent)

    def stats(self) -> dict[str, Any]:
        """The pool's figures and its ledger (``leases_active`` back to 0 once every holder
        has released)."""
        with self._lock:
            return {"device": str(self.device), "cap_bytes": self.cap_bytes, "pooled_bytes": self.pooled_bytes,
                    "free_bytes": self.free_bytes, "free_buffers": sum(len(f) for f in self._free.values()),
                    "buffers_made": self.made, "reused": self.reused, "waited": self.waited,
                    "one_off": self.one_off, "dropped": self.dropped, **self.ledger.stats()}


_POOLS: dict[torch.device, DeviceStagingPool] = {}
_POOLS_LOCK = threading.Lock()


def staging_pool(device: torch.device) -> DeviceStagingPool:
    """The process's staging pool of ``device`` (one per device, like ``streams.work_stream``;
    "cuda" and "cuda:0" name one)."""
    pool = _POOLS.get(device)
    if pool is None:
        with _POOLS_LOCK:
            made = DeviceStagingPool(device)
            pool = _POOLS.setdefault(made.device, made)
            _POOLS[device] = pool
    return pool


def staging_stats() -> list[dict[str, Any]]:
    """Every device's pool figures (``PrefixCache.stats()["device_staging"]``)."""
    with _POOLS_LOCK:
        pools = {id(p): p for p in _POOLS.values()}.values()
    return [p.stats() for p in pools]


def is_staging(t: torch.Tensor) -> bool:
    """Whether ``t`` lies in a lent staging buffer (memory a tier must copy, never keep)."""
    pool = _POOLS.get(t.device)
    return pool is not None and pool.owns(t)


__all__ = ["DEFAULT_CAP_BYTES", "DeviceStagingPool", "MIN_CLASS_BYTES", "StagingLease", "is_staging",
           "size_class", "staging_pool", "staging_stats"]
