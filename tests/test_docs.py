"""The docs: README.md is a short front page that leads to every docs page, its links work, every
``#anchor`` link of README.md and docs/ lands on a heading by GitHub's rules (where readers
follow them; mkdocs checks its own), and the mkdocs site (docs/, mkdocs.yml) builds with
--strict (broken links, anchors and docstring references fail it)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_README_LINES = 250
# [text](target) outside code; the target ends at whitespace or ')'
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _nav_pages() -> list[str]:
    """The pages of mkdocs.yml's nav, relative to docs/ (read as text: no YAML parser needed)."""
    text = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    nav = text.split("\nnav:\n", 1)
    assert len(nav) == 2, "mkdocs.yml has no nav"
    pages = []
    for line in nav[1].splitlines():
        if line and not line[0].isspace():  # the next top-level key ends the nav
            break
        m = re.search(r"(?:^\s*-\s+|:\s+)([\w./-]+\.md)\s*$", line)
        if m:
            pages.append(m.group(1))
    return pages


def _prose(text: str) -> str:
    """Markdown without fenced code blocks and code spans (links there are not links)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def _relative_links(text: str) -> list[str]:
    targets = [m.group(1) for m in LINK.finditer(_prose(text))]
    return [t for t in targets if not re.match(r"^([a-z][a-z0-9+.-]*:|#)", t, re.I)]


def test_readme_is_a_front_page() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, (
        f"README.md has {len(lines)} lines (at most {MAX_README_LINES}): move reference material to docs/"
    )
    text = "\n".join(lines)
    # the two commands, as the Makefile runs them
    assert "## The two commands" in text
    assert re.search(r"^make run +# the main job", text, re.M)
    assert re.search(r"^make test +# ", text, re.M)


def test_readme_links_to_every_docs_page() -> None:
    pages = _nav_pages()
    assert "index.md" in pages and len(pages) >= 15, pages
    assert "docs/design.md" in {f"docs/{p}" for p in pages}, "the design document is in the nav"
    for page in pages:
        assert (ROOT / "docs" / page).is_file(), f"mkdocs.yml's nav names docs/{page}, which does not exist"
    linked = {t.split("#", 1)[0] for t in _relative_links(README.read_text(encoding="utf-8"))}
    missing = [p for p in pages if f"docs/{p}" not in linked]
    assert not missing, f"README.md does not link to these docs pages of the nav: {missing}"


def test_readme_relative_links_point_to_existing_files() -> None:
    targets = _relative_links(README.read_text(encoding="utf-8"))
    assert targets, "no relative links found in README.md"
    broken = [t for t in targets if not (ROOT / t.split("#", 1)[0]).exists()]
    assert not broken, f"README.md links to files that do not exist: {broken}"


# GitHub's heading anchors (github-slugger): the heading's text (markup dropped, code spans kept)
# lowercased, every character but letters, digits, '_', '-' and spaces removed, each space a
# '-' (so "a: `--b`" is "a---b"; mkdocs' own slugs collapse the hyphens); the n-th repeat of a
# slug gets "-n"
_NOT_SLUG = re.compile(r"[^\w\- ]")


def github_slug(heading: str) -> str:
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links and images: their text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    return _NOT_SLUG.sub("", text.strip().lower()).replace(" ", "-")


def github_anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of the markdown file ``path``."""
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.S | re.M)
    seen: dict[str, int] = {}
    anchors = set()
    for m in re.finditer(r"^#{1,6}[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$", text, re.M):
        slug = github_slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def test_github_slug_rules() -> None:
    assert github_slug("Held-out protocol: `--protocol transfer`") == "held-out-protocol---protocol-transfer"
    assert github_slug("Calibrate on your own model: `cokit bench validate --on`") == (
        "calibrate-on-your-own-model-cokit-bench-validate---on"
    )
    assert github_slug("10. The exchange core, the strategies and the threat model") == (
        "10-the-exchange-core-the-strategies-and-the-threat-model"
    )
    assert github_slug("[Link](x.md) and **bold** `dense_params`") == "link-and-bold-dense_params"


def test_anchor_links_land_on_a_github_heading() -> None:
    """README.md's ``docs/validation-study.md#held-out-protocol-protocol-transfer`` did not land on
    GitHub (whose anchor for "Held-out protocol: `--protocol transfer`" keeps three hyphens)."""
    pages = [README, *sorted((ROOT / "docs").rglob("*.md"))]
    checked, bad = 0, []
    for page in pages:
        for target in (m.group(1) for m in LINK.finditer(_prose(page.read_text(encoding="utf-8")))):
            if "#" not in target or re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
                continue
            file, anchor = target.split("#", 1)
            dest = (page.parent / file).resolve() if file else page
            if dest.suffix != ".md" or not dest.is_file():
                continue  # a missing file is test_readme_relative_links_point_to_existing_files' (and mkdocs')
            checked += 1
            if anchor not in github_anchors(dest):
                bad.append(f"{page.relative_to(ROOT)}: {target}")
    assert checked >= 10, checked  # the links were found
    assert not bad, f"these #anchors match no heading by GitHub's rules: {bad}"


def test_link_parser() -> None:
    text = "[a](docs/x.md#y) [b](https://e.org) [c](#top) `[d](no.md)` ![i](img.png)\n```\n[e](no2.md)\n```\n"
    assert _relative_links(text) == ["docs/x.md#y"]


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    missing = [m for m in ("mkdocs", "mkdocstrings", "material") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"docs tooling not installed ({', '.join(missing)}): pip install -e '.[docs]'")
    site = tmp_path / "site"
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml")]
    cmd += ["--site-dir", str(site)]
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert (site / "index.html").is_file()
    # the API reference was generated from the docstrings, not left empty
    api = (site / "api" / "compress" / "index.html").read_text(encoding="utf-8")
    assert 'id="cokit.compress.DeMo"' in api and 'id="cokit.compress.SparseLoCo"' in api
    hooks = (site / "api" / "hooks" / "index.html").read_text(encoding="utf-8")
    assert 'id="cokit.compress.hooks.dct_topk_hook"' in hooks
