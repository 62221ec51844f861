"""Packaging: the wheel installs one import root (``cokit``), leaves other packages' names
alone, and refuses torch/triton versions older than the GPU image's (torch 2.11, triton 3.6)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from cokit import _source_tree, _versions

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # builds a wheel (~10 s)


def _source_files() -> list[str]:
    """Tracked and untracked-but-not-ignored files: what a fresh clone of this tree would hold."""
    out = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout
    return [line for line in out.splitlines() if (ROOT / line).is_file()]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of the tree (so the build leaves nothing in the checkout)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    for rel in _source_files():
        dest = src / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes((ROOT / rel).read_bytes())
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp / "dist"),
            str(src),
        ],
        check=True,
        capture_output=True,
    )
    (built,) = (tmp / "dist").glob("cokit-*.whl")
    return built


def test_wheel_top_level_is_only_cokit(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        (top_level,) = [n for n in names if n.endswith(".dist-info/top_level.txt")]
        assert zf.read(top_level).decode().split() == ["cokit"]
    roots = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert roots == {"cokit"}
    assert "cokit/py.typed" in names


def test_wheel_carries_every_module_of_the_mapped_folders(wheel):
    """Each .py file of triton_kernels/, compress/, overlap/, benchmarks/ and cokit/ is in the
    wheel under cokit/ (a subpackage missing from pyproject's list would silently drop out)."""
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    expected = set()
    for rel in _source_files():
        parts = Path(rel).parts
        if not rel.endswith(".py"):
            continue
        if parts[0] == "cokit":
            expected.add(rel)
        for sub, folder in _source_tree.SUBPACKAGE_FOLDERS.items():
            if parts[0] == folder:
                expected.add("/".join(("cokit", sub, *parts[1:])))
    assert expected - names == set()


def test_installed_wheel_coexists_with_another_triton_kernels(wheel, tmp_path):
    """With the wheel installed, a separate top-level ``triton_kernels`` (Triton's own, which vLLM
    imports) still imports, ``compress``/``overlap`` are not ours, and cokit's subpackages import."""
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
        check=True,
        capture_output=True,
    )
    other = tmp_path / "other" / "triton_kernels"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("")
    (other / "matmul_ogs.py").write_text("OWNER = 'triton'\n")
    probe = textwrap.dedent("""
        import importlib.util, sys
        import cokit, cokit.compress, cokit.overlap, cokit.triton_kernels, cokit.bench.timing
        from triton_kernels.matmul_ogs import OWNER
        assert OWNER == "triton", OWNER
        assert importlib.util.find_spec("compress") is None
        assert importlib.util.find_spec("overlap") is None
        print(cokit.__file__); print(cokit.compress.__file__); print(cokit.triton_kernels.__file__)
    """)
    env_path = f"{site}:{other.parent}"
    res = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"},
    )
    assert res.returncode == 0, res.stderr
    for line in res.stdout.split():
        assert line.startswith(str(site)), f"{line} imported from outside the installed wheel"


def test_source_checkout_maps_the_same_names():
    """A plain checkout (no install; how the GPU machine gets the tree) imports the same names."""
    probe = "import cokit.compress, cokit.overlap, cokit.triton_kernels, cokit.bench.timing; print(cokit.compress.__file__)"
    res = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=ROOT / "tests",
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == str(ROOT / "compress" / "__init__.py")


@pytest.mark.parametrize(
    ("found", "message"),
    [
        ({"torch": "2.10.1+cu128", "triton": "3.6.0"}, "upgrade torch"),
        ({"torch": "2.11.0", "triton": "3.5.1"}, "upgrade triton"),
        ({"torch": "2.9.0", "triton": "3.4.0"}, "upgrade torch and triton"),
    ],
)
def test_old_versions_are_one_line_errors(found, message):
    problem = _versions.version_problem(found)
    assert problem is not None and "\n" not in problem
    assert message in problem and "torch >= 2.11" in problem and "triton >= 3.6" in problem
    for version in found.values():
        assert version in problem


@pytest.mark.parametrize(
    "found",
    [
        {"torch": "2.11.0+cu130", "triton": "3.6.0"},
        {"torch": "2.13.0+cpu", "triton": "3.9.0"},
        {"torch": "2.12.0a0+git1234", "triton": None},
    ],
)
def test_supported_versions_pass(found):
    assert _versions.version_problem(found) is None


def test_import_fails_with_the_sentence_on_an_old_torch(tmp_path):
    """``import cokit`` with an old torch distribution visible: ImportError naming both versions."""
    fake = tmp_path / "torch-2.10.0.dist-info"
    fake.mkdir()
    (fake / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.10.0\n")
    res = subprocess.run(
        [sys.executable, "-c", "import cokit"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin"},
    )
    assert res.returncode != 0
    assert "cokit needs torch >= 2.11, triton >= 3.6; found torch 2.10.0" in res.stderr
