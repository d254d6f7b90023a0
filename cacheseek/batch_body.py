"""The framing of batch bodies: several frames in one HTTP body, both ways (the wire contract
shared by the server and ``RemoteCache``).

    | length (u64 LE) | frame (length bytes) | length | frame | ... |

Used by ``POST /v1/blocks`` (request) and ``GET /v1/prefixes/{hash}`` (response). Each frame
is a complete block frame (``cacheseek.store.frame``). A reader never allocates for a
declared length before checking it against the frame and body limits.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from typing import Any

FRAME_CONTENT_TYPE = "application/octet-stream"
BATCH_CONTENT_TYPE = "application/vnd.cacheseek.frames"
LENGTH = struct.Struct("<Q")
MIN_FRAME_BYTES = 16  # a frame's preamble


class _Refused(ValueError):
    """``fields``: what the server's error answer carries beside the reason, for a client
    to read rather than parse the sentence (docs/http-api.md, "Error answers")."""

    def __init__(self, reason: str, **fields: Any) -> None:
        super().__init__(reason)
        self.fields = fields


class BatchFormatError(_Refused):
    """The body is not a well-formed sequence of length-prefixed frames (``fields``:
    ``frame``, the index of the frame it is about)."""


class BatchTooLarge(_Refused):
    """A declared frame length, or the body, is over its limit (``fields``: ``limit``, the
    setting's name, ``limit_value``, and the ``frame`` that passed it, where one did)."""


def check_frame_length(index: int, length: int, consumed: int, *, max_frame_bytes: int, max_body_bytes: int) -> None:
    """Frame ``index`` declares ``length`` bytes, starting at body offset ``consumed``."""
    where = f"frame {index}"
    if length > max_frame_bytes:
        raise BatchTooLarge(f"{where}: declared length {length} exceeds max_frame_bytes ({max_frame_bytes})",
                            frame=index, limit="max_frame_bytes", limit_value=max_frame_bytes)
    if consumed + length > max_body_bytes:
        raise BatchTooLarge(f"{where}: declared length {length} runs past max_body_bytes ({max_body_bytes})",
                            frame=index, limit="max_body_bytes", limit_value=max_body_bytes)
    if length < MIN_FRAME_BYTES:
        raise BatchFormatError(f"{where}: declared length {length} is shorter than a frame preamble", frame=index)


class BatchReader:
    """Incremental reader: ``feed`` chunks as they arrive, get each frame once it is whole."""

    def __init__(self, *, max_frame_bytes: int, max_body_bytes: int) -> None:
        self.max_frame_bytes = max_frame_bytes
        self.max_body_bytes = max_body_bytes
        self.received = 0
        self.frames = 0
        self._head = bytearray()
        self._frame: bytearray | None = None
        self._filled = 0

    def feed(self, chunk: bytes | bytearray | memoryview) -> list[bytearray]:
        view = memoryview(chunk).cast("B")
        self.received += view.nbytes
        if self.received > self.max_body_bytes:
            raise BatchTooLarge(f"body exceeds max_body_bytes ({self.max_body_bytes})", limit="max_body_bytes",
                                limit_value=self.max_body_bytes)
        done: list[bytearray] = []
        while view.nbytes:
            if self._frame is None:
                need = LENGTH.size - len(self._head)
                self._head += view[:need]
                view = view[need:]
                if len(self._head) < LENGTH.size:
                    break
                (length,) = LENGTH.unpack(self._head)
                self._head.clear()
                self._check(length, consumed=self.received - view.nbytes)
                self._frame = bytearray(length)
                self._filled = 0
                continue
            n = min(view.nbytes, len(self._frame) - self._filled)
            self._frame[self._filled : self._filled + n] = view[:n]
            self._filled += n
            view = view[n:]
            if self._filled == len(self._frame):
                done.append(self._frame)
                self._frame = None
                self.frames += 1
        return done

    def _check(self, length: int, consumed: int) -> None:
        check_frame_length(self.frames, length, consumed, max_frame_bytes=self.max_frame_bytes,
                           max_body_bytes=self.max_body_bytes)

    def finish(self) -> None:
        """The body ended: it must end on a frame boundary."""
        if self._frame is not None:
            raise BatchFormatError(
                f"frame {self.frames}: body ended after {self._filled} of {len(self._frame)} declared bytes")
        if self._head:
            raise BatchFormatError(f"frame {self.frames}: body ended inside a length prefix")


def iter_frames(response: Any, *, max_frame_bytes: int,
                take: Callable[[int], memoryview] | None = None) -> Iterator[bytearray | memoryview]:
    """The frames of a streamed batch response (an ``httpx.Response`` opened with ``stream``).

    With ``BulkTransport`` and a body of known length, each frame is read straight into a
    buffer of its own (one copy, exactly sized): ``take(length)``'s writable memory where
    given (the caller's reused buffers; the frame is its first ``length`` bytes), else a new
    one. Otherwise (another transport, a chunked body) the chunks go through a ``BatchReader``."""
    body = getattr(response, "extensions", {}).get("cacheseek_body")  # BulkTransport's (see there)
    read_exactly = getattr(body, "read_exactly", None) if getattr(body, "sized", False) else None
    if read_exactly is None:
        reader = BatchReader(max_frame_bytes=max_frame_bytes, max_body_bytes=1 << 62)
        for chunk in response.iter_raw():
            yield from reader.feed(chunk)
        reader.finish()
        return
    index = 0
    while (head := read_exactly(LENGTH.size)) is not None:
        (length,) = LENGTH.unpack(head)
        if length > max_frame_bytes:
            raise BatchTooLarge(f"frame {index}: declared length {length} exceeds {max_frame_bytes}")
        if length < MIN_FRAME_BYTES:
            raise BatchFormatError(f"frame {index}: declared length {length} is shorter than a frame preamble")
        frame = read_exactly(length) if take is None else read_exactly(length, take(length))
        if frame is None:
            raise BatchFormatError(f"frame {index}: body ended before it")
        yield frame
        index += 1
