"""A TCP connection to a host name within one time budget: ``open_socket``.

``socket.create_connection`` bounds neither part of it that can hang. Its name lookup
(``getaddrinfo``) knows no timeout at all: with a dead resolver glibc waits 5 s per try and
name server, so every connect (and every breaker probe after an outage, the pooled
connections being gone) waited ~10 s whatever the client's ``timeout``. And it gives each
address the whole timeout in turn: a name whose first address drops packets (a dual-stack
host whose IPv6 route is dead) took the whole budget there, or twice it.

Here the lookup runs on a helper thread, waited for until the budget's deadline; a late one
is a ``TimeoutError`` that names the resolver (at most one lookup per name is in flight: a
call that finds one running waits for it rather than start another, so a dead resolver
holds one thread per name, never one per call). Where the resolver fails for now (late, or
``EAI_AGAIN``), the last addresses it gave for the name are used. The addresses are then
tried as Happy Eyeballs does (RFC 8305, section 5): the next one starts if the ones under
way have not connected within ``STAGGER_SECONDS``, or at once when one fails, and the first
to connect wins, all within the same deadline; the address that connected last time is
tried first. The errors name every address tried.
"""

from __future__ import annotations

import errno
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout  # (TimeoutError itself from Python 3.11)

STAGGER_SECONDS = 0.25  # RFC 8305's "Connection Attempt Delay"
# How often a connect under way asks whether it was cut off (``cut_off``): a close() from
# another thread ends it within this, not at the end of its connect timeout.
CUT_CHECK_SECONDS = 0.1
_AddrInfo = tuple  # (family, type, proto, canonname, sockaddr), as socket.getaddrinfo gives them
CUT_OFF = "cut off while connecting (the client was closed, or its time for exchanges is over)"


class Resolver:
    """Name lookups bounded by a deadline, one in flight per name, with the last good answer
    of each name kept for a resolver that fails for now, and the address that connected last."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_flight: dict[tuple[str, int], Future] = {}
        self._last_good: dict[tuple[str, int], list[_AddrInfo]] = {}
        self._failing: set[tuple[str, int]] = set()  # names whose last lookup failed for now, or was late
        self._preferred: dict[tuple[str, int], tuple] = {}

    def addresses(self, host: str, port: int, deadline: float | None,
                  cut_off: Callable[[], bool] | None = None) -> list[_AddrInfo]:
        """``host``'s addresses for TCP, the one that connected last first."""
        key = (host, port)
        try:  # an address literal: nothing to look up, nothing that can hang
            found = socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM, 0, socket.AI_NUMERICHOST)
        except socket.gaierror:
            found = self._look_up(key, deadline, cut_off)
        preferred = self._preferred.get(key)
        if preferred is not None:
            found = sorted(found, key=lambda info: info[4] != preferred)  # (stable: the rest keep their order)
        return found

    def forget_lookups(self) -> None:
        """Drop the lookups in flight (a forked child: their threads are not in it, and a
        name's every later lookup would have waited on one that never ends)."""
        self._lock = threading.Lock()
        self._in_flight = {}

    def connected(self, host: str, port: int, address: tuple) -> None:
        """``address`` of ``host`` connected: tried first next time."""
        self._preferred[(host, port)] = address

    def _look_up(self, key: tuple[str, int], deadline: float | None,
                 cut_off: Callable[[], bool] | None) -> list[_AddrInfo]:
        with self._lock:
            future = self._in_flight.get(key)
            joined = future is not None
            if future is None:
                future = self._in_flight[key] = Future()
                threading.Thread(target=self._run, args=(key, future), name="cacheseek-resolve", daemon=True).start()
            stale = self._last_good.get(key)
            # The resolver failing for now (its last lookup late or failed, and this one
            # joined, still out): the last good answer at once, the lookup left to refresh it.
            # Each connect waited half its budget for the same dead resolver.
            if stale is not None and joined and key in self._failing:
                return stale
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        # With a last good answer to fall back on, half the budget at most for the lookup:
        # the rest is the connect's (waited whole, a late lookup left none for it).
        wait = left if stale is None or left is None else left / 2
        try:
            found: list[_AddrInfo] = _result(future, wait, cut_off)
        except (TimeoutError, FutureTimeout):
            self._failing.add(key)
            if stale is not None:
                return stale
            raise TimeoutError(f"the name lookup (DNS) of {key[0]} took longer than the connect timeout "
                               f"({_seconds(left)}): the resolver is slow or unreachable") from None
        except socket.gaierror as exc:
            if stale is not None and exc.errno == socket.EAI_AGAIN:  # (a failure for now, not "no such name")
                self._failing.add(key)
                return stale
            raise socket.gaierror(exc.errno, f"the name lookup (DNS) of {key[0]} failed: {exc.strerror}") from None
        return found

    def _run(self, key: tuple[str, int], future: Future) -> None:
        try:
            found = socket.getaddrinfo(key[0], key[1], 0, socket.SOCK_STREAM)
        except BaseException as exc:  # (handed to every waiter, as the call's own error)
            with self._lock:
                self._in_flight.pop(key, None)
            future.set_exception(exc)
            return
        with self._lock:
            self._in_flight.pop(key, None)
            self._last_good[key] = found
            self._failing.discard(key)
        future.set_result(found)


RESOLVER = Resolver()  # the process's: one lookup in flight per name, whichever client asks
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=RESOLVER.forget_lookups)


def open_socket(host: str, port: int, timeout: float | None, *, resolver: Resolver = RESOLVER,
                cut_off: Callable[[], bool] | None = None) -> socket.socket:
    """A TCP connection to ``host``, its name looked up and its addresses tried within
    ``timeout`` seconds in all (None: no bound); the socket's timeout is then ``timeout``.
    ``TimeoutError`` past the deadline, else the ``OSError`` of the last address tried,
    each naming the addresses tried. ``cut_off``: asked every ``CUT_CHECK_SECONDS`` while
    the lookup or the connect waits; once it says so, ``TimeoutError`` (``CUT_OFF``)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    addresses = resolver.addresses(host, port, deadline, cut_off)
    if not addresses:
        raise OSError(f"{host}:{port}: the name has no address to connect to")
    sock, address = _first_to_connect(host, port, addresses, deadline, timeout, cut_off)
    resolver.connected(host, port, address)
    sock.settimeout(timeout)
    return sock


def _first_to_connect(host: str, port: int, addresses: list[_AddrInfo], deadline: float | None,
                      timeout: float | None, cut_off: Callable[[], bool] | None) -> tuple[socket.socket, tuple]:
    pending: dict[int, tuple[socket.socket, tuple]] = {}  # fd -> (socket, address): connects under way
    tried: list[str] = []
    error: OSError | None = None
    poller = select.poll()
    todo = list(addresses)
    next_start = time.monotonic()
    try:
        while True:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                break
            if cut_off is not None and cut_off():
                raise TimeoutError(CUT_OFF)
            if todo and (now >= next_start or not pending):
                family, kind, proto, _, address = todo.pop(0)
                tried.append(_written(address))
                try:
                    sock = socket.socket(family, kind, proto)
                except OSError as exc:  # (an IPv6 address on a host without IPv6: EAFNOSUPPORT)
                    error, next_start = OSError(exc.errno, f"{_written(address)}: {exc.strerror}"), now
                    continue
                sock.setblocking(False)
                code = sock.connect_ex(address)
                if code == 0:
                    sock.setblocking(True)
                    return sock, address
                if code in (errno.EINPROGRESS, errno.EWOULDBLOCK, errno.EALREADY):
                    pending[sock.fileno()] = (sock, address)
                    poller.register(sock, select.POLLOUT)
                    next_start = now + STAGGER_SECONDS
                else:
                    sock.close()
                    error = OSError(code, f"{_written(address)}: {os.strerror(code)}")
                    next_start = now  # (a failed try hands its turn on at once)
                continue
            if not pending:
                break  # every address failed
            until = [t for t in (deadline, next_start if todo else None) if t is not None]
            if cut_off is not None:
                until.append(now + CUT_CHECK_SECONDS)
            wait_ms = None if not until else max(min(until) - now, 0.0) * 1000
            for fd, _ in poller.poll(wait_ms):
                sock, address = pending.pop(fd)
                poller.unregister(fd)
                code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if code == 0:
                    sock.setblocking(True)
                    return sock, address
                sock.close()
                error = OSError(code, f"{_written(address)}: {os.strerror(code)}")
                next_start = time.monotonic()  # (a failed try hands its turn on at once)
    finally:
        for sock, _ in pending.values():
            sock.close()
    where = f"{host}:{port}" if not tried or tried == [f"{host}:{port}"] else f"{host}:{port} ({', '.join(tried)})"
    if error is None or (deadline is not None and time.monotonic() >= deadline):
        raise TimeoutError(f"timed out connecting to {where} within {_seconds(timeout)}")
    raise OSError(error.errno, f"cannot connect to {where}: {error.strerror}")


def _result(future: Future, wait: float | None, cut_off: Callable[[], bool] | None) -> list[_AddrInfo]:
    """``future.result(wait)``, asking ``cut_off`` every ``CUT_CHECK_SECONDS`` meanwhile."""
    if cut_off is None:
        return future.result(timeout=wait)
    end = None if wait is None else time.monotonic() + wait
    while True:
        piece = CUT_CHECK_SECONDS if end is None else min(CUT_CHECK_SECONDS, max(end - time.monotonic(), 0.0))
        try:
            return future.result(timeout=piece)
        except (TimeoutError, FutureTimeout):
            if cut_off():
                raise TimeoutError(CUT_OFF) from None
            if end is not None and time.monotonic() >= end:
                raise


def _written(address: tuple) -> str:
    """A socket address as a URL writes it: an IPv6 one in brackets."""
    host, port = address[0], address[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _seconds(value: float | None) -> str:
    return "no bound" if value is None else f"{value:g} s"


__all__ = ["RESOLVER", "STAGGER_SECONDS", "Resolver", "open_socket"]
