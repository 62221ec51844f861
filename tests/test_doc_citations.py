"""Citations of the design document point at a file and a section that exist.

Code and the docs (README.md, CONTRIBUTING.md, the pages in docs/) cite docs/design.md by section
(``docs/design.md §1.1``; a page in docs/ may write ``design.md``); a citation of another file
name (``DESIGN.md``) or of a section the document does not have sends the reader nowhere.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = (
    "triton_kernels",
    "compress",
    "overlap",
    "cokit",
    "benchmarks",
    "tests",
    "notebooks",
    "examples",
    "docs",
)
SUFFIXES = (".py", ".md", ".ipynb")
# a mention of the design document, with the section it cites if any ("§1.1", "section 1.1", "1.2")
MENTION = re.compile(
    r"(?P<path>[\w./-]*design\.md)(?:\s*(?:§|section\s+)?(?P<section>\d+(?:\.\d+)?[a-z]?))?", re.I
)


def _sources() -> list[Path]:
    files = [ROOT / name for name in ("README.md", "CONTRIBUTING.md") if (ROOT / name).exists()]
    for folder in FOLDERS:
        files += [p for p in sorted((ROOT / folder).rglob("*")) if p.suffix in SUFFIXES and p.is_file()]
    return files


def _sections() -> set[str]:
    """Section numbers of docs/design.md's headings ("0", "1", "1.1", "1.1b", ...)."""
    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    return set(re.findall(r"^#{2,3} (\d+(?:\.\d+)?[a-z]?)\.? ", text, re.M))


def test_design_citations_name_the_file_and_an_existing_section() -> None:
    sections = _sections()
    assert {"0", "1.1", "1.2", "3", "7"} <= sections  # the parser reads the headings
    sources = _sources()
    assert ROOT / "docs" / "optimizers.md" in sources  # the docs pages are read too
    bad = []
    for path in sources:
        if path.resolve() == Path(__file__).resolve():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        for m in MENTION.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            where = f"{path.relative_to(ROOT)}:{line}: {m.group(0)!r}"
            name = m.group("path")
            if not (
                name.endswith("docs/design.md") or (name == "design.md" and path.parent == ROOT / "docs")
            ):
                bad.append(f"{where} (cite docs/design.md)")
            elif m.group("section") is not None and m.group("section").rstrip(".") not in sections:
                bad.append(f"{where} (no such section in docs/design.md)")
    assert not bad, "design document citations that lead nowhere:\n" + "\n".join(bad)
