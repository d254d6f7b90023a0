"""Redis URLs, and the redis-py client each one makes.

    redis://[[user]:password@]host[:port][/db]       one Redis (also rediss:// for TLS, unix:///path)
    redis+cluster://[[user]:password@]host[:port][,host[:port]...]
                                                     Redis Cluster, from one or more seed nodes
                                                     (rediss+cluster:// for TLS)

Clients are built with short timeouts and at most ``retries`` immediate retries on a
connection error (never a sleep): the tier's circuit breaker, not the client, decides when
to try a backend that keeps failing. (redis-py's pool already replaces a connection that
died with a restarted server as it hands it out; the retry covers one that dies in a call.
A call sent again may have run: the index script answers it with its first reply.) redis-py is imported only when a client is made, or to check a
standalone URL's options.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse

from ..errors import ConfigError

DEFAULT_PORT = 6379
SOCKET_READ_NBYTES = 1 << 20
# A socket's timeout is held in int64 nanoseconds: a longer one (inf) raised OverflowError at
# the first connection, out of a server's start, not as a bad setting.
MAX_TIMEOUT_SECONDS = ((1 << 63) - 1) // 10**9
_STANDALONE = ("redis", "rediss", "unix")
_CLUSTER = ("redis+cluster", "rediss+cluster")
# Options of a standalone URL that change what a reply is (str instead of bytes) or how a
# key name is encoded: redis-py lets a URL's options win over the client's own settings, and
# with ``decode_responses=True`` every read of a frame raised UnicodeDecodeError out of the
# tier (a server's 500).


@dataclass(frozen=True, slots=True)
class RedisTarget:
    url: str
    cluster: bool
    seeds: tuple[tuple[str, int], ...] = ()  # cluster only
    username: str | None = None
    password: str | None = None
    tls: bool = False

    def redacted(self) -> str:
        """The URL with any password replaced (in its userinfo or its query: redis-py reads
        ``?password=`` too), for stats and logs."""
        return _hide_secrets(self.url, keep_user=True)


@dataclass(frozen=True, slots=True)
class RedisTimeouts:
    connect_seconds: float = 1.0
    socket_seconds: float = 2.0

    def __post_init__(self) -> None:
        for name in ("connect_seconds", "socket_seconds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_TIMEOUT_SECONDS:
                raise ConfigError(f"redis timeout {name}: must be a number of seconds > 0 and at most "
                                  f"{MAX_TIMEOUT_SECONDS:,}, got {value!r}")


def _hide_secrets(url: str, *, keep_user: bool) -> str:
    """``url`` with its password hidden: all before the *last* ``@`` is userinfo, whatever
    it holds (a cluster URL takes a password with ``?``, ``/`` or ``#`` in it, and one split
    at the first ``?`` first was shown whole), and a ``password=`` in the query after it.
    ``keep_user``: a ``user:`` before the password stays readable."""
    # A query's password first, whatever it holds (an "@" in it read as the userinfo's end
    # showed the rest of it): then every "@" left is the userinfo's, or a harmless option's.
    url = re.sub(r"(?i)([?&]password=)[^&#]*", r"\1***", url)
    scheme, sep, rest = url.partition("://")
    userinfo, at, after = rest.rpartition("@")
    shown = ""
    if at:
        user, colon, _ = userinfo.partition(":")
        shown = f"{user}:***@" if keep_user and colon and not any(c in user for c in "/?#") else "***@"
    return f"{scheme}{sep}{shown}{after}"


def _masked(url: str) -> str:
    """``url`` with any user:password part and its whole query hidden, for error messages."""
    if not isinstance(url, str):
        return url
    hidden = _hide_secrets(url, keep_user=False)
    head, question, query = hidden.partition("?")
    return f"{head}{question}{'***' if query else ''}"


_ENCODE_HINT = ("; a password holding '/', '?', '#' or '@' must be percent-encoded in the URL "
                "(%2F, %3F, %23, %40)")


def _hint(url: str) -> str:
    """The percent-encoding hint, where an unencoded character cut the userinfo short (the
    URL's ``@`` after its first ``/``, ``?`` or ``#``: a standalone URL is read as the
    standard reads it, and the password's tail became its host, port or query)."""
    rest = url.partition("://")[2]
    cut = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    return _ENCODE_HINT if "@" in rest[cut:] else ""


def parse_redis_url(url: str) -> RedisTarget:
    if not isinstance(url, str) or "://" not in url:
        raise ConfigError(f"redis_url: expected redis://host:port or redis+cluster://host:port[,host:port...], got {_masked(url)!r}")
    scheme, _, rest = url.partition("://")
    scheme = scheme.lower()
    if scheme in _STANDALONE:
        if "," in rest:
            raise ConfigError(f"redis_url: several hosts need redis+cluster://, got {_masked(url)!r}")
        parsed = urlparse(url)
        try:
            port = parsed.port  # (raises for a port that is not a number in range)
        except ValueError:
            # (its text quotes the URL's netloc: a password's, where one cut it short)
            raise ConfigError(f"redis_url: the port is not a number in range (1-65535) in {_masked(url)!r}"
                              f"{_hint(url)}") from None
        if scheme != "unix":
            # redis-py takes no host for localhost and skips a database that is not a number:
            # a URL made from an unset variable (redis://${HOST}:6379) reached another Redis.
            if not parsed.hostname:
                raise ConfigError(f"redis_url: empty host in {_masked(url)!r}{_hint(url)}")
            if port == 0:
                raise ConfigError(f"redis_url: port 0 out of range in {_masked(url)!r}")
            db = unquote(parsed.path).strip("/")
            if db and not db.isdecimal():
                hint = _hint(url)  # (then the "database" is a password's tail: not shown)
                raise ConfigError(f"redis_url: database {'' if hint else repr(db) + ' '}is not a number in "
                                  f"{_masked(url)!r}{hint}")
        _check_options(url)
        return RedisTarget(url=url, cluster=False, username=parsed.username, password=parsed.password,
                           tls=scheme == "rediss")
    if scheme not in _CLUSTER:
        raise ConfigError(f"redis_url: scheme must be one of {_STANDALONE + _CLUSTER}, got {scheme!r}")
    userinfo, at, hosts = rest.rpartition("@")
    username = password = None
    if at:
        user, colon, pw = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(pw) if colon else None
    hosts = hosts.rstrip("/")
    seeds = tuple(_host_port(h, url) for h in hosts.split(","))
    return RedisTarget(url=url, cluster=True, seeds=seeds, username=username, password=password,
                       tls=scheme == "rediss+cluster")


def _check_options(url: str) -> None:
    """redis-py reads a standalone URL's options (``?db=1&socket_timeout=0.5``) only as it
    makes a connection, and raises for one it cannot read (``ValueError``) or does not take
    (``TypeError``): that would fail every call of the tier, so it is refused here, by
    building (not connecting) one connection. Without redis-py, ``connect`` says what is missing."""
    # decode_responses makes every reply a str (redis-py lets a URL's options win over the
    # client's own, and takes this one's value as a string: "false" is as true as "True"):
    # every read of a frame would fail. The encoding options alone apply only to decoding,
    # and to str arguments (the tier's key names are ASCII): taken.
    for name in parse_qs(urlparse(url).query, keep_blank_values=True):
        if name.lower() == "decode_responses":
            raise ConfigError(f"redis_url: the option {name!r} is not taken, whatever its value: the tier reads "
                              f"values as bytes, and redis-py decodes every reply to str with it in the URL; remove "
                              f"it ({_masked(url)!r})")
    try:
        import redis
    except ImportError:
        return
    try:
        redis.ConnectionPool.from_url(url).make_connection()
    except (TypeError, ValueError, redis.exceptions.RedisError) as exc:
        raise ConfigError(f"redis_url: {exc} ({_masked(url)!r})") from None


def _host_port(text: str, url: str) -> tuple[str, int]:
    text = text.strip()
    if text.startswith("["):  # [IPv6]:port
        host, _, tail = text[1:].partition("]")
        port = tail[1:] if tail.startswith(":") else ""
    else:
        host, _, port = text.partition(":")
    if not host:
        raise ConfigError(f"redis_url: empty host in {_masked(url)!r}")
    try:
        number = int(port) if port else DEFAULT_PORT
    except ValueError:
        raise ConfigError(f"redis_url: bad port {port!r} in {_masked(url)!r}") from None
    if not 0 < number < 65536:
        raise ConfigError(f"redis_url: port {number} out of range in {_masked(url)!r}")
    return host, number


def connect(target: RedisTarget, timeouts: RedisTimeouts, *, retries: int = 1) -> Any:
    """A redis-py ``Redis`` or ``RedisCluster``. A cluster client contacts its seeds here,
    so this raises (a redis-py error) when none answers; a standalone one connects lazily."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    retry = Retry(NoBackoff(), retries, supported_errors=(redis.exceptions.ConnectionError,))
    common: dict[str, Any] = dict(
        # Frames are megabytes: read them in 1 MiB recv() calls rather than redis-py's 64 KiB.
        socket_read_size=SOCKET_READ_NBYTES,
        socket_connect_timeout=timeouts.connect_seconds,
        socket_timeout=timeouts.socket_seconds,
        retry=retry,
        decode_responses=False,
        health_check_interval=0,
    )
    if not target.cluster:
        return redis.Redis.from_url(target.url, **common)
    from redis.cluster import ClusterNode, RedisCluster

    # No retry at the cluster's level: redis-py's cluster client retries timeouts too, each
    # after reloading the slot map, so one call to a hung master cost several socket
    # timeouts before the breaker heard of it. A connection lost in a failover fails that
    # call; the client reloads the slot map for the next.
    common["retry"] = Retry(NoBackoff(), 0)
    return RedisCluster(
        startup_nodes=[ClusterNode(host, port) for host, port in target.seeds],
        username=target.username, password=target.password, ssl=target.tls, **common,
    )


__all__ = ["RedisTarget", "RedisTimeouts", "connect", "parse_redis_url"]
