"""The one root of every error CacheSeek raises on purpose.

Bad arguments are also ``ValueError`` (so ``except ValueError`` in caller code keeps
working); a broken invariant inside the library is a ``RuntimeError`` with the reason.
"""

from __future__ import annotations


class CacheSeekError(Exception):
    """Root of all CacheSeek errors."""


class ConfigError(CacheSeekError, ValueError):
    """A parameter, layout or codec setting that cannot work. The message names it."""


class InputError(CacheSeekError, ValueError):
    """KV or keys handed to the cache that do not fit its layout, or hold garbage."""


class FrameError(CacheSeekError, ValueError):
    """A frame that cannot be parsed: truncated, malformed, or from another version."""


class ChecksumError(FrameError):
    """A frame whose payload does not match the checksum in its header."""


class StorageError(CacheSeekError):
    """A tier could not complete a write (disk full, unwritable directory, backend down)."""
