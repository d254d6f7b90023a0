"""Trusting an https server's certificate: a CA bundle named by path, and telling a
certificate a client does not trust from an outage. Every client says the same: RemoteCache,
the CLIs (``--cacert``), the demo and the vLLM connector (``ca_bundle``)."""

from __future__ import annotations

import ssl


def ca_bundle_context(path: str) -> ssl.SSLContext:
    """An SSL context that trusts the CA bundle (a file of PEM certificates) at ``path``;
    ``ValueError`` saying why where it cannot be used."""
    try:
        return ssl.create_default_context(cafile=path)
    except FileNotFoundError:
        raise ValueError(f"no file at {path!r}") from None
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"{path!r} is not a readable PEM bundle of CA certificates ({exc})") from None


def untrusted_certificate(exc: BaseException) -> bool:
    """Whether ``exc`` is a TLS handshake refused for the server's certificate (OpenSSL's
    reason, through this project's transport and httpx's alike): not an outage that passes,
    but a CA bundle to give."""
    return "CERTIFICATE_VERIFY_FAILED" in str(exc)
