"""``cacheseek admin``: the ``/v1/admin`` routes from a shell.

    cacheseek admin [--url URL ...] [--token T] [--json] namespaces | models | pins
    cacheseek admin flush [--namespace NS] [--model M]
    cacheseek admin delete-chain HASH [--namespace NS]
    cacheseek admin pin HASH [--namespace NS] [--ttl SECONDS]
    cacheseek admin unpin HASH [--namespace NS]

The options before the command may come after it too (those after it win: ``--url`` given
on both sides is the ones after it).

The token comes from ``--token`` or ``CACHESEEK_ADMIN_TOKEN``. ``--url`` may be given more
than once: each replica's own tiers are its own, so a flush, delete or pin goes to each.
Exit status: 0 done everywhere; 1 a server refused (its reason printed) or answered with
something that is not a CacheSeek answer; 2 bad arguments (no token, a malformed ``--url`` or HASH,
a token that is not printable ASCII, a namespace out of the server's pattern too); 3 a server could not be reached.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import ssl
import sys
import time
from typing import Any

import httpx

from cacheseek.errors import InputError
from cacheseek.hashing import NAMESPACE_PATTERN, from_hex
from cacheseek.tls import ca_bundle_context, untrusted_certificate
from cacheseek.transport import BulkTransport

NAMESPACE_HEADER = "X-CacheSeek-Namespace"
# The longest answer read: a CacheSeek answer to these commands is a few KiB to a few MiB
# (a usage table, every pin, /v1/stats with its owners).
MAX_ANSWER_BYTES = 256 << 20


def url_problem(url: str) -> str | None:
    """Why ``url`` is not a server's base URL (``http(s)://host[:port]``), or None."""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError, ValueError) as exc:
        return f"{url!r} is not a URL ({exc})"
    if parsed.scheme not in ("http", "https") or not parsed.host:
        return f"{url!r} is not an http:// or https:// URL with a host"
    return None


def token_problem(token: str) -> str | None:
    """Why ``token`` cannot be sent as a bearer token, or None. A header carries printable
    ASCII: anything else (a pasted ellipsis, a non-breaking space) failed in the HTTP library
    with a traceback, and a newline was said as the server being unreachable."""
    if token.isascii() and token.isprintable():
        return None
    bad = next(c for c in token if not (c.isascii() and c.isprintable()))
    return f"holds {bad!r}, which no HTTP header carries (printable ASCII only)"


def cacert_context(path: str | None) -> ssl.SSLContext:
    """The TLS settings of ``--cacert``: the CA bundle ``path`` (a file of PEM certificates)
    trusts the server's certificate, or, without one, httpx's trust store (certifi, or
    SSL_CERT_FILE/SSL_CERT_DIR). ``ValueError`` saying why where the bundle is unusable."""
    return httpx.create_ssl_context() if path is None else ca_bundle_context(path)


def tls_hint(exc: BaseException) -> str:
    """What to do about ``exc`` where it is a certificate the client does not trust (a
    server's self-signed or private-CA certificate), else ''. "certificate verify failed"
    alone left a user with no way out: SSL_CERT_FILE worked, and no document said so."""
    if not untrusted_certificate(exc):
        return ""
    return (" (the server's TLS certificate is not trusted: give --cacert FILE, the CA bundle that signed it, "
            "or set SSL_CERT_FILE=FILE)")


def answer_client(seconds: float, verify: ssl.SSLContext | None = None, **kw: Any) -> httpx.Client:
    """A client whose every exchange, from connecting to the answer's last byte, is held to
    ``seconds`` (``BulkTransport``'s ``exchange_timeout``). httpx's timeouts bound each read:
    a server, or anything at its URL, sending the answer's head a byte now and then held a
    command for as long as it liked. Through a proxy (httpx's own transport) the head is
    bounded per read only; the body, by ``whole_answer``, either way. ``verify``: as
    ``cacert_context`` makes it (default: without ``--cacert``)."""
    transport = BulkTransport(max_connections=4, verify=verify or cacert_context(None), exchange_timeout=seconds)
    return httpx.Client(transport=transport, timeout=seconds, **kw)


class AnswerTooLarge(ValueError):
    """An answer longer than any of CacheSeek's (``MAX_ANSWER_BYTES``)."""


def whole_answer(client: httpx.Client, method: str, url: str, seconds: float, **kw: Any) -> httpx.Response:
    """The answer to ``method url``, read whole within about ``seconds`` of the request
    (``httpx.ReadTimeout`` past them; ``client``: an ``answer_client``), and at most
    ``MAX_ANSWER_BYTES`` long (``AnswerTooLarge``: a server, or anything at its URL, sending
    without end filled the command's memory until the deadline, gigabytes on a fast link)."""
    deadline = time.monotonic() + seconds
    too_large = f"an answer over {_size(MAX_ANSWER_BYTES)}, which no CacheSeek answer is"
    try:
        with client.stream(method, url, timeout=seconds, **kw) as r:
            body = bytearray()
            length = r.headers.get("content-length")
            if length and length.isdigit() and int(length) > MAX_ANSWER_BYTES:
                raise AnswerTooLarge(too_large)
            for chunk in r.iter_raw():
                if len(body) + len(chunk) > MAX_ANSWER_BYTES:
                    raise AnswerTooLarge(too_large)
                body += chunk
                # (An answer that came whole just past the deadline, a long flush's, is taken.)
                if time.monotonic() > deadline and not (length and length.isdigit() and len(body) >= int(length)):
                    raise httpx.ReadTimeout(f"no whole answer within {seconds:g} s", request=r.request)
            return httpx.Response(r.status_code, headers=r.headers, content=bytes(body), request=r.request)
    except (httpx.ReadTimeout, httpx.WriteTimeout) as exc:  # (the transport's deadline, or a read's own)
        raise httpx.ReadTimeout(f"no whole answer within {seconds:g} s", request=exc.request) from None


def parse_json(response: httpx.Response) -> Any:
    """The answer's body as JSON; ``ValueError`` where it is not. JSON nested past Python's
    recursion limit (100 KB of ``[``) raised ``RecursionError`` out of the parser, which
    ended a command in a traceback."""
    try:
        return response.json()
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def printable(text: str) -> str:
    """``text`` with every character that is not printable escaped (``\\x1b``). A server's
    words (a reason, a name) went to the terminal as sent: escape sequences in them could
    retitle the window, clear the screen or hide lines."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def reason(response: httpx.Response) -> str:
    """A server's reason for an answer, short: its JSON ``error``, else the start of the body."""
    try:
        body = parse_json(response)
    except ValueError:
        body = None
    if isinstance(body, dict) and "error" in body:
        return printable(str(body["error"]))
    text = " ".join(response.text.split())
    return repr(text[:80] + ("..." if len(text) > 80 else "")) if text else "(empty body)"


def _common_options(p: Any, *, defaults: bool) -> None:
    """The options of every admin command. They are taken after the command too (where an
    operator types them, beside a flush's ``--namespace``), with no default there: one given
    before the command is kept."""
    def default(value: Any) -> Any:
        return value if defaults else argparse.SUPPRESS

    p.add_argument("--url", action="append", default=default(None),
                   help="a server; repeat for every replica (default http://127.0.0.1:8080)")
    p.add_argument("--token", default=default(os.environ.get("CACHESEEK_ADMIN_TOKEN")),
                   help="the admin token [env CACHESEEK_ADMIN_TOKEN]")
    p.add_argument("--json", action="store_true", default=default(False), help="print the servers' answers as JSON")
    p.add_argument("--cacert", metavar="FILE", default=default(None),
                   help="CA bundle (PEM) that signed an https server's certificate, a self-signed one too "
                        "(default: certifi's CA bundle, as httpx's, or SSL_CERT_FILE)")
    p.add_argument("--timeout", type=float, default=default(60.0),
                   help="seconds to wait for each server's answer (default 60; a flush of many blocks takes long)")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("admin", help="usage, flush, delete and pin on a running server (admin token)",
                       description="Admin operations over /v1/admin (docs/operations.md).")
    _common_options(p, defaults=True)
    common = argparse.ArgumentParser(add_help=False)
    _common_options(common, defaults=False)
    cmds = p.add_subparsers(dest="admin_command", required=True, metavar="COMMAND")
    cmds.add_parser("namespaces", help="usage per namespace (and per model within it)", parents=[common])
    cmds.add_parser("models", help="usage per model (and per namespace)", parents=[common])
    cmds.add_parser("pins", help="every pinned prefix", parents=[common])
    f = cmds.add_parser("flush", help="delete every block of a namespace, a model, or a model in a namespace",
                        parents=[common])
    f.add_argument("--namespace", help="the namespace ('' is the default one)")
    f.add_argument("--model", help="the model")
    for name, help_ in (("delete-chain", "delete the chain ending at HASH (and what extends it)"),
                        ("pin", "never evict the chain ending at HASH"), ("unpin", "give a pinned chain back")):
        c = cmds.add_parser(name, help=help_, parents=[common])
        c.add_argument("hash", help="the chain's last block hash (hex)")
        c.add_argument("--namespace", default="", help="its namespace (default '')")
        if name == "pin":
            c.add_argument("--ttl", type=float, default=None, help="unpin after this many seconds (default: never)")
    p.set_defaults(func=main)


def _request(args: Any) -> tuple[str, str, dict[str, Any]]:
    cmd = args.admin_command
    if cmd in ("namespaces", "models", "pins"):
        return "GET", f"/v1/admin/{cmd}", {}
    if cmd == "flush":
        params = {k: v for k, v in (("namespace", args.namespace), ("model", args.model)) if v is not None}
        return "POST", "/v1/admin/flush", {"params": params}
    headers = {NAMESPACE_HEADER: args.namespace} if args.namespace else {}
    if cmd == "delete-chain":
        return "DELETE", f"/v1/admin/chains/{args.hash}", {"headers": headers}
    if cmd == "pin":
        return "PUT", f"/v1/admin/pins/{args.hash}", {"headers": headers, "json": {"ttl_seconds": args.ttl}}
    return "DELETE", f"/v1/admin/pins/{args.hash}", {"headers": headers}


def main(args: Any) -> int:
    if args.admin_command == "flush" and args.namespace is None and args.model is None:
        print("cacheseek admin flush: give --namespace, --model, or both", file=sys.stderr)
        return 2
    if args.admin_command == "pin" and args.ttl is not None and not (math.isfinite(args.ttl) and args.ttl > 0):
        print("cacheseek admin pin: --ttl must be a finite number of seconds > 0 (omit it: until unpinned)",
              file=sys.stderr)
        return 2
    if getattr(args, "hash", None) is not None:
        # Checked here, not by the server: it goes into the path as given, where "../chains/H"
        # made an unpin a delete of the chain.
        try:
            from_hex(args.hash)
        except InputError as exc:
            print(f"cacheseek admin {args.admin_command}: HASH: {exc}", file=sys.stderr)
            return 2
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        print("cacheseek admin: --timeout must be a finite number of seconds > 0", file=sys.stderr)
        return 2
    if not args.token:
        print("cacheseek admin: an admin token is needed (--token or CACHESEEK_ADMIN_TOKEN)", file=sys.stderr)
        return 2
    problem = token_problem(args.token)
    if problem:
        print(f"cacheseek admin: --token (or CACHESEEK_ADMIN_TOKEN) {problem}", file=sys.stderr)
        return 2
    namespace = getattr(args, "namespace", None)
    if namespace is not None and not NAMESPACE_PATTERN.match(namespace):
        # As the server's pattern: out of it, a header could not carry it (a traceback) or the
        # server refused it, and a flush answered 404 for a namespace that cannot exist.
        print(f"cacheseek admin {args.admin_command}: --namespace {namespace!r}: 0-128 printable ASCII characters, "
              "no spaces", file=sys.stderr)
        return 2
    urls = args.url or ["http://127.0.0.1:8080"]
    for url in urls:
        problem = url_problem(url)
        if problem:
            print(f"cacheseek admin: --url: {problem}", file=sys.stderr)
            return 2
    try:
        verify = cacert_context(args.cacert)  # (said once, before any server is asked)
    except ValueError as exc:
        print(f"cacheseek admin: --cacert: {exc}", file=sys.stderr)
        return 2
    method, path, kw = _request(args)
    worst = 0
    answers = {}
    never_written = []  # replicas a flush found nothing of the namespace or model on (a 404)
    for url in urls:
        headers = {"Authorization": f"Bearer {args.token}", **kw.get("headers", {})}
        try:
            with answer_client(args.timeout, verify) as client:
                r = whole_answer(client, method, url.rstrip("/") + path, args.timeout, headers=headers,
                                 **{k: v for k, v in kw.items() if k != "headers"})
        except httpx.ReadTimeout:
            # Reached, and busy: a flush or a delete goes on to its end on the server.
            print(f"cacheseek admin: {url}: no answer within {args.timeout:g} s (it may still be carrying it out: "
                  "see its log, or ask again with a longer --timeout)", file=sys.stderr)
            worst = max(worst, 3)
            continue
        except httpx.HTTPError as exc:
            print(f"cacheseek admin: {url}: unreachable: {exc}{tls_hint(exc)}", file=sys.stderr)
            worst = max(worst, 3)
            continue
        except AnswerTooLarge as exc:
            print(f"cacheseek admin: {url}: {exc}: is this a CacheSeek server?", file=sys.stderr)
            worst = max(worst, 1)
            continue
        if args.admin_command == "flush" and r.status_code == 404 and len(urls) > 1:
            # A replica that never held it has nothing to flush: done there, unless none held it.
            print(f"cacheseek admin: {url}: nothing to flush ({reason(r)})", file=sys.stderr)
            never_written.append(url)
            continue
        if not r.is_success:
            print(f"cacheseek admin: {url}: {r.status_code}: {reason(r)}", file=sys.stderr)
            worst = max(worst, 1)
            continue
        try:
            body = parse_json(r)
            # (printed once every server is asked, made now: dumping JSON nests as deep as parsing it)
            table = json.dumps({"url": url, "answer": body}) if args.json else _table(args.admin_command, body)
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            # A wrong port or a proxy's page: said as such, not a traceback from the table.
            print(f"cacheseek admin: {url}: {r.status_code} with an answer that is not CacheSeek's "
                  f"({reason(r)}): is this a CacheSeek server?", file=sys.stderr)
            worst = max(worst, 1)
            continue
        answers[url] = (body, table)
        if args.admin_command in ("pin", "unpin") and isinstance(body, dict) and body.get("saved") is not True:
            # Done, but only for this server process: a restart goes back to the pins file.
            why = ("it has no disk tier, so no pins file" if body.get("saved") is None
                   else "its pins file could not be written: see its log")
            print(f"cacheseek admin: {url}: {args.admin_command}ned until the server restarts only ({why})",
                  file=sys.stderr)
    if never_written and len(never_written) == len(urls):
        worst = max(worst, 1)  # no replica held it: a 404, as from one server
    for url, (_, table) in answers.items():
        if len(urls) > 1 and not args.json:
            print(f"# {url}")
        print(table)
    return worst


def _size(n: float | None) -> str:
    # In the unit that reads (a few KiB showed as "0.000 GiB"); `cacheseek top` uses it too.
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return "-"


def _span(seconds: float) -> str:
    seconds = abs(seconds)
    for unit, size, up_to in (("s", 1, 120), ("min", 60, 120), ("h", 3600, 48)):
        if seconds < size * up_to:
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds / 86400:.0f} days"


def _when(at: Any, now: float) -> str:
    """A Unix time as a UTC time and how long ago or from now: the raw number (``1796628249
    (unix)``) read as nothing to an operator."""
    if at is None:
        return "-"
    stamp = datetime.datetime.fromtimestamp(float(at), datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    return f"{stamp} ({_span(now - at)} ago)" if at <= now else f"{stamp} (in {_span(at - now)})"


def _table(cmd: str, body: Any, now: float | None = None) -> str:
    if cmd in ("namespaces", "models", "pins") and not isinstance(body, list):
        raise TypeError(f"{cmd}: expected a list, got {type(body).__name__}")
    if cmd not in ("namespaces", "models", "pins") and not isinstance(body, dict):
        raise TypeError(f"{cmd}: expected an object, got {type(body).__name__}")
    if cmd in ("namespaces", "models"):
        by, label = ("namespace", "models") if cmd == "namespaces" else ("model", "namespaces")
        within = "model" if cmd == "namespaces" else "namespace"
        lines = [f"{by:<28}{within:<28}{'blocks':>10}{'stored':>14}{'raw KV':>14}"]
        for g in body:
            name = "(unattributed)" if g[by] is None else (g[by] or "(default)")
            lines.append(f"{name:<28}{'*':<28}{g['blocks']:>10,}{_size(g['used_bytes']):>14}{_size(g['raw_bytes']):>14}")
            for sub in g[label]:
                # The default namespace is "" and reads the same at either level.
                unnamed = "(default)" if within == "namespace" else "-"
                inner = "(unattributed)" if sub[within] is None else (sub[within] or unnamed)
                lines.append(f"{'':<28}{inner:<28}{sub['blocks']:>10,}{_size(sub['used_bytes']):>14}"
                             f"{_size(sub['raw_bytes']):>14}")
        return "\n".join(printable(line) for line in lines)
    if cmd == "pins":
        # ``stored`` below ``blocks``: blocks of the chain deleted since (a block DELETE)
        now = time.time() if now is None else now
        lines = [f"{'namespace':<20}{'hash':<34}{'blocks':>8}{'stored':>8}{'bytes':>14}  {'since':<38}expires"]
        for pin in body:
            expires = "never" if pin["expires_at"] is None else _when(pin["expires_at"], now)
            if pin.get("waiting"):
                expires += " (not made yet: Redis unreachable at the server's start)"
            lines.append(f"{(pin['namespace'] or '(default)'):<20}{pin['hash'] or '?':<34}{pin['blocks']:>8}"
                         f"{pin.get('stored_blocks', pin['blocks']):>8}{_size(pin['bytes']):>14}  "
                         f"{_when(pin.get('pinned_at'), now):<38}{expires}")
        return "\n".join(printable(line) for line in lines)
    return json.dumps(body)
