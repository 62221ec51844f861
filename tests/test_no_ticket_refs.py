"""Code and docs say why, not which ticket.

"(issue 35)" tells a reader nothing unless they can open that tracker, and it stops meaning
anything once the tracker moves or the ticket is closed; the reason it stood for (what the
code must guarantee, which target a number is held to) belongs in the text itself. This scans
the source tree (code, tests, docs, notebooks, the changelog, build and CI files) for an issue
or ticket number.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUFFIXES = {".py", ".md", ".ipynb", ".toml", ".yml", ".yaml", ".cfg", ".ini"}
NAMES = {"Makefile"}
# folders that are not the project's text: VCS data, environments, caches, build output
SKIP_DIRS = {".git", "node_modules", "site", "build", "dist", "__pycache__"}
SKIP_PREFIXES = (".venv", ".pytest_cache", ".mypy_cache", ".ruff_cache")
# "issue 35", "Issue #13", "issues 33", "issue-35", "ticket 7", also broken over a line
# (continued comments and docstrings)
TICKET = re.compile(r"\b(?:issue|ticket)s?[\s#:-]*\d+", re.IGNORECASE)


def _sources() -> list[Path]:
    files = []
    for folder, dirs, names in os.walk(ROOT):
        dirs[:] = sorted(
            d
            for d in dirs
            if d not in SKIP_DIRS and not d.startswith(SKIP_PREFIXES) and not d.endswith(".egg-info")
        )
        here = Path(folder)
        in_ci = here.relative_to(ROOT).parts[:1] == (".ci",)
        for name in sorted(names):
            path = here / name
            if in_ci or name in NAMES or path.suffix in SUFFIXES:
                files.append(path)
    return files


def _citations(text: str) -> list[tuple[int, str]]:
    return [(text.count("\n", 0, m.start()) + 1, " ".join(m.group(0).split())) for m in TICKET.finditer(text)]


def test_the_pattern_finds_ticket_numbers_and_nothing_else() -> None:
    text = (
        "(issue 35)\nIssue #13's target\nthe issue-35 options\nissues 33\n# (issue\n# 36, item 3)\nticket 7\n"
    )
    assert [line for line, _ in _citations(text)] == [1, 2, 3, 4, 5, 7]
    assert not _citations("an issue with 2 ranks\nthe issues are\nissue_count = 3\ntissue 4\n")


def test_no_code_or_doc_cites_an_issue_number() -> None:
    sources = _sources()
    names = {p.relative_to(ROOT).as_posix() for p in sources}
    # the scan reaches every kind of file it is meant to
    assert {"CHANGELOG.md", "Makefile", "pyproject.toml", "docs/design.md", "compress/rules.py"} <= names
    assert any(n.startswith("notebooks/") and n.endswith(".ipynb") for n in names)
    assert any(n.startswith(".ci/") for n in names)
    this = Path(__file__).resolve()
    found = []
    for path in sources:
        if path.resolve() == this:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        found += [f"{path.relative_to(ROOT).as_posix()}:{line}: {hit!r}" for line, hit in _citations(text)]
    assert not found, (
        "say why instead of citing a ticket (what the reader needs to know, not where it was asked):\n"
        + "\n".join(found)
    )
