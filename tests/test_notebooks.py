"""Every notebook executes headless at its tiny default parameters, and is committed clean.

The kernel runs with Jupyter's own matplotlib backend (inline; nothing forces Agg here), so
a library that switched the backend, or a figure that is drawn but not displayed, shows up
as a missing image output: every cell tagged ``figures`` must produce as many image/png
outputs as it displays, and a final probe cell checks the backend is still inline after
``import cokit`` and everything the notebook called.
"""

from __future__ import annotations

import html
import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.notebook, pytest.mark.slow]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
#: notebooks whose figures and dashboard cell are checked (the overlap and training ones)
FIGURE_NOTEBOOKS = ("01_occupancy_sweep", "02_compressed_training")
PROBE = "import matplotlib\nprint('COKIT-BACKEND', matplotlib.get_backend())"
#: a cell source that draws or shows a figure
DRAWS = re.compile(r"plt\.\w+\(|savefig\(|plot_\w+\(|default_plots\(|display\(Image")


def test_dev_extras_bring_nbconvert():
    """`jupyter nbconvert --execute` (docs/notebooks.md's way to render a notebook) is installed."""
    assert importlib.util.find_spec("nbconvert") is not None


def test_there_are_notebooks():
    assert [p.name[:2] for p in NOTEBOOKS] == ["01", "02", "03"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name} has outputs"


def _tags(cell) -> list[str]:
    return list(cell.get("metadata", {}).get("tags", []))


def _text(cell) -> str:
    parts = []
    for o in cell.outputs:
        if o.output_type == "stream":
            parts.append(o.text)
        elif "data" in o and "text/plain" in o.data:
            parts.append(o.data["text/plain"])
    return "".join(parts)


def _count(cell, mime: str) -> int:
    return sum(1 for o in cell.outputs if mime in o.get("data", {}))


#: the results folder a notebook writes by default: OUT = os.environ.get("COKIT_NOTEBOOK_OUT", "...")
DEFAULT_OUT = re.compile(r"""os\.environ\.get\(\s*["']COKIT_NOTEBOOK_OUT["']\s*,\s*["']([^"']+)["']""")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_what_a_notebook_writes_by_default_is_gitignored(path):
    """A notebook run from Jupyter (whose working folder is the notebook's) writes its results
    beside it, under notebooks/results/, which git ignores: running them leaves no untracked
    files (they used to leave notebooks/results/ untracked)."""
    nb = nbformat.read(path, as_version=4)
    source = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    outs = DEFAULT_OUT.findall(source)
    if not outs:
        assert "open(" not in source and "savefig" not in source, f"{path.name} writes files: give OUT"
        return
    git = shutil.which("git")
    if git is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    for out in outs:
        target = (path.parent / out / "dashboard.html").resolve().relative_to(ROOT)
        assert str(target).startswith("notebooks/results/"), target
        ignored = subprocess.run([git, "check-ignore", "-q", str(target)], cwd=ROOT, check=False)
        assert ignored.returncode == 0, f"{path.name} writes {target}, which .gitignore does not ignore"


@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if p.stem in FIGURE_NOTEBOOKS], ids=lambda p: p.stem)
def test_notebook_is_tagged_where_it_draws(path):
    """Cells that draw are tagged ``figures`` (so the run below counts their images)."""
    nb = nbformat.read(path, as_version=4)
    drawing = [c for c in nb.cells if c.cell_type == "code" and DRAWS.search(c.source)]
    assert drawing and all("figures" in _tags(c) for c in drawing), path.name
    assert sum("dashboard" in _tags(c) for c in nb.cells) == 1


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, tmp_path, monkeypatch):
    # The kernels take the torch path in the notebook kernel (the interpreter is for tests).
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.delenv("MPLBACKEND", raising=False)  # Jupyter's default: the inline backend
    monkeypatch.setenv("COKIT_NOTEBOOK_OUT", str(tmp_path / "out"))
    monkeypatch.setenv("COKIT_CACHE_DIR", str(tmp_path / "cache"))  # compile cache of notebook 01
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    nb = nbformat.read(path, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(PROBE))
    client = nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
    )
    client.execute()  # raises CellExecutionError, with the cell and traceback, on any error
    probe = _text(nb.cells[-1])
    assert "COKIT-BACKEND" in probe and "inline" in probe, probe  # nothing switched the backend
    if path.stem not in FIGURE_NOTEBOOKS:
        return
    images = 0
    for cell in nb.cells:
        if "figures" not in _tags(cell):
            continue
        n = _count(cell, "image/png")
        said = re.search(r"figures: (\d+)", _text(cell))
        want = int(said.group(1)) if said else cell.source.count("display(")
        assert want >= 1 and n == want, f"{path.name}: a figure cell shows {n} image(s), expected {want}"
        images += n
    assert images >= (4 if path.stem.startswith("01") else 2)
    (dash,) = [c for c in nb.cells if "dashboard" in _tags(c)]
    if importlib.util.find_spec("cokit.dashboard") is None:
        assert "cokit.dashboard is not available" in _text(dash)
    else:  # the runs (02) and the sweep (01) write telemetry: the page is built and shown
        assert _count(dash, "text/html") == 2, _text(dash)  # the link and the inline frame
        assert "note: no dashboard" not in _text(dash)
        pages = list((tmp_path / "out").rglob("dashboard.html"))
        assert pages and all(p.stat().st_size > 100_000 for p in pages)  # plotly.js inline: offline
        # the frame holds the page itself (srcdoc), not a path that breaks once the file moves
        (frame,) = [
            o.data["text/html"] for o in dash.outputs if "<iframe" in o.get("data", {}).get("text/html", "")
        ]
        assert frame.startswith("<iframe srcdoc=") and " src=" not in frame, frame[:200]
        assert html.unescape(frame.split('"')[1]) == pages[0].read_text(encoding="utf-8")
