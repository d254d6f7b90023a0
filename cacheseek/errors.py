"""The one root of every error CacheSeek raises on purpose.

Bad arguments are also ``ValueError`` (so ``except ValueError`` in caller code keeps
working); a broken invariant inside the library is a ``RuntimeError`` with the reason.
"""

from __future__ import annotations

from typing import Any


class CacheSeekError(Exception):
    """Root of all CacheSeek errors."""


class ConfigError(CacheSeekError, ValueError):
    """A parameter, layout or codec setting that cannot work. The message names it."""


class InputError(CacheSeekError, ValueError):
    """KV or keys handed to the cache that do not fit its layout, or hold garbage."""

    names_request = False  # the message names the request of a batch (``paged_io.raise_bad_input``)


class FrameError(CacheSeekError, ValueError):
    """A frame that cannot be parsed: truncated, malformed, or from another version."""


class FrameVersionError(FrameError):
    """A frame of another format version: whole as far as this release can tell (its magic,
    its header's length and checksum, a msgpack map whose ``v`` is another integer), written
    by an older or newer release. Not this release's to read, nor damage to delete: a tier
    keeps it (a counted ``foreign_version`` miss) for the release that reads it."""


class ChecksumError(FrameError):
    """A frame whose payload does not match the checksum in its header."""


class LoadError(CacheSeekError):
    """A layer-wise load failed after it had started (a decode that raised, a frame found
    bad): raised by ``LayerwiseLoad.wait`` for the layers not loaded. The KV of those layers
    is not there; the caller recomputes the prefix."""


class StorageError(CacheSeekError):
    """A tier could not complete a write (disk full, unwritable directory, backend down)."""


class TierUnavailable(StorageError):
    """A tier could not be asked (a Redis down, hung or behind an open circuit breaker), so
    what it holds is not known: an outage to retry, not an answer that the block is absent."""


class RemoteError(CacheSeekError):
    """The CacheSeek server answered a request with an error.

    ``status`` is the HTTP status (None when no answer came), ``reason`` the server's
    reason, as in its JSON body ``{"error": reason}``; ``fields`` the rest of that body (a
    limit's ``limit`` and ``limit_value``, a batch's ``frame``: docs/http-api.md), empty
    where it had none (an older server, a proxy's answer)."""

    def __init__(self, reason: str, *, status: int | None = None, url: str = "",
                 fields: dict[str, Any] | None = None) -> None:
        self.status = status
        self.reason = reason
        self.url = url
        self.fields = fields or {}
        where = f" ({url})" if url else ""
        super().__init__(f"HTTP {status}: {reason}{where}" if status is not None else f"{reason}{where}")


class RemoteUnavailable(RemoteError, ConnectionError):
    """The CacheSeek server could not be reached (down, wrong address, timed out)."""


class PoolExhausted(RemoteUnavailable):
    """No connection of this client's pool came free within the timeout: more calls at once
    than its ``max_connections``, each waiting for one. Not the server's failure: it neither
    opens the circuit breaker nor starts an outage; under ``on_unavailable="miss"`` a miss or
    a dropped write, as an outage is. Raise ``max_connections``, or make fewer calls at once."""


class RemoteBusy(RemoteUnavailable):
    """The server is up but refused the request for now (its request bodies in flight are at
    their cap: a ``503`` with ``X-CacheSeek-Busy``): retry later. Under
    ``on_unavailable="miss"`` a miss or a dropped write, as an outage is, but it never opens
    the circuit breaker nor starts an outage."""
