"""The docs hold together: every relative link and image in README.md, CHANGELOG.md and
docs/*.md names a file in the repository (and an anchor, a heading of that file), every
plot in docs/ is shown by some doc, and README.md stays a front door (under 250 lines)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").glob("*.md")])
README_MAX_LINES = 250

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
    assert lines < README_MAX_LINES, f"README.md has {lines} lines; details belong under docs/"


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
