"""Bearer tokens and namespaces: who may do what, where.

- No token configured: anyone may read and write, in the namespace named by the
  ``X-CacheSeek-Namespace`` header (default ``""``). For trusted networks.
- ``read_token`` / ``write_token``: the operator's tokens. Reads need either; writes need
  the write token. The caller picks the namespace with the header.
- ``tenants``: tokens bound to one namespace each. A tenant's token works only in its own
  namespace: no header means that namespace, any other header is a 403.
- ``/metrics`` names every namespace and model with their traffic: with tokens set it takes
  ``metrics_token`` (a scraper's, good for nothing else) or the operator's read, write or
  admin token, never a tenant's; ``metrics_open`` lets it take none.

Tokens are compared in constant time (SHA-256 digests of equal length through
``hmac.compare_digest``, every configured token tried).
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from .config import NAMESPACE_PATTERN, ServerSettings
from .errors import BadRequest, Forbidden, Unauthenticated


def header_value(value: str | None) -> str | None:
    """A header's value without the spaces and tabs around it, which are not part of it (RFC
    9110 5.5): h11 strips them and httptools does not, so ``X-CacheSeek-Namespace: team-a ``
    was team-a on one and a 400 on the other, and a model header two labels."""
    return None if value is None else value.strip(" \t")

NAMESPACE_HEADER = "X-CacheSeek-Namespace"


@dataclass(frozen=True, slots=True)
class Caller:
    namespace: str
    can_write: bool
    bound: bool = False  # holds a tenant's token: sees only its own namespace's figures


@dataclass(frozen=True, slots=True)
class _Token:
    digest: bytes
    namespace: str | None  # None: any namespace (the operator's tokens)
    can_write: bool


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class Authenticator:
    def __init__(self, settings: ServerSettings) -> None:
        tokens = []
        if settings.read_token is not None:
            tokens.append(_Token(_digest(settings.read_token.get_secret_value()), None, False))
        if settings.write_token is not None:
            tokens.append(_Token(_digest(settings.write_token.get_secret_value()), None, True))
        for namespace, tenant in settings.tenants.items():
            if tenant.read_token is not None:
                tokens.append(_Token(_digest(tenant.read_token.get_secret_value()), namespace, False))
            tokens.append(_Token(_digest(tenant.write_token.get_secret_value()), namespace, True))
        self._tokens = tokens
        self._scrape_open = not settings.metrics_need_token
        self._scrapers = [_digest(t.get_secret_value()) for t in
                          (settings.metrics_token, settings.read_token, settings.write_token, settings.admin_token)
                          if t is not None]

    @property
    def enabled(self) -> bool:
        return bool(self._tokens)

    def caller(self, token: str | None, namespace: str | None, *, write: bool) -> Caller:
        """Who is calling: ``token`` from ``Authorization: Bearer <token>``, ``namespace`` from
        the namespace header (None when absent)."""
        namespace = header_value(namespace)
        if namespace is not None and not NAMESPACE_PATTERN.match(namespace):
            raise BadRequest(f"{NAMESPACE_HEADER}: 0-128 printable ASCII characters, no spaces")
        if not self._tokens:
            return Caller(namespace or "", True)
        if not token:
            raise Unauthenticated("a bearer token is required (Authorization: Bearer <token>)")
        found = self._match(token)
        if found is None:
            raise Forbidden("token not accepted")
        if write and not found.can_write:
            raise Forbidden("this token may only read")
        if found.namespace is None:
            return Caller(namespace or "", found.can_write)
        if namespace is not None and namespace != found.namespace:
            # (the holder's own namespace, named: a client that named none, RemoteCache's
            # default, makes its keys without it, so it must name it to share them)
            raise Forbidden(f"this token is bound to namespace {found.namespace!r}, not {namespace!r}: name it "
                            "(RemoteCache(namespace=...), X-CacheSeek-Namespace)")
        return Caller(found.namespace, found.can_write, bound=True)

    def scraper(self, token: str | None) -> None:
        """Raises unless ``token`` may read ``/metrics``. The refusal never holds the token."""
        if self._scrape_open:
            return
        if not token:
            raise Unauthenticated("a bearer token is required for /metrics (metrics_token, or the read, write or "
                                  "admin token)")
        digest = _digest(token)
        found = False
        for candidate in self._scrapers:  # no early exit, as in _match
            found |= hmac.compare_digest(candidate, digest)
        if not found:
            raise Forbidden("token not accepted for /metrics (it shows every namespace: a tenant's token reads "
                            "its own figures in /v1/stats)")

    def _match(self, token: str) -> _Token | None:
        digest = _digest(token)
        found = None
        for candidate in self._tokens:  # no early exit: the time does not depend on which one matches
            if hmac.compare_digest(candidate.digest, digest):
                found = candidate
        return found
