"""Packaging: the wheel installs one import root (``cokit``), leaves other packages' names
alone, ships no benchmark code nor the validation study's own workloads and protocols (a
checkout's), needs no plotting library, and refuses torch/triton versions older than the GPU
image's (torch 2.11, triton 3.6)."""

from __future__ import annotations

import email
import json
import subprocess
import sys
import sysconfig
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


#: the validation study's own workloads and protocol modules, and the network testbed
CHECKOUT_ONLY_MODULES = (
    "digits",
    "digits_cnn",
    "digits_ae",
    "presets",
    "transfer",
    "transfer_report",
    "netbed",
)


def _wheel_files(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        return [n for n in zf.namelist() if not n.split("/")[0].endswith(".dist-info")]


def test_wheel_ships_no_benchmark_code_nor_the_studys_workloads(wheel):
    """benchmarks/ (cokit.bench: the benchmarks, the netbed, the study's workloads and
    protocols) stays in the checkout; the demo's workload and the calibration runner ship."""
    names = _wheel_files(wheel)
    assert [n for n in names if n.startswith("cokit/bench/")] == []
    stems = {Path(n).stem for n in names}
    assert stems.isdisjoint(CHECKOUT_ONLY_MODULES), stems & set(CHECKOUT_ONLY_MODULES)
    modules = {
        Path(rel).stem for rel in _source_files() if rel.startswith("benchmarks/") and rel.endswith(".py")
    }
    assert set(CHECKOUT_ONLY_MODULES) <= modules  # the list names what the checkout has
    for kept in ("workloads/text.py", "workloads/model.py", "validation/calibrate.py", "validation/grid.py"):
        assert f"cokit/{kept}" in names


def test_wheel_needs_no_plotting_library(wheel):
    """matplotlib and plotly are extras (plot, dashboard); dev brings both."""
    with zipfile.ZipFile(wheel) as zf:
        (meta,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        msg = email.message_from_bytes(zf.read(meta))
    requires = msg.get_all("Requires-Dist") or []
    core = [r for r in requires if "extra ==" not in r]
    assert any(r.startswith("torch") for r in core)
    assert not [r for r in core if r.lower().startswith(("matplotlib", "plotly"))], core

    def extra(name: str) -> list[str]:
        return [r.split(";")[0].strip().lower() for r in requires if f'extra == "{name}"' in r]

    assert any(r.startswith("matplotlib") for r in extra("plot"))
    assert any(r.startswith("plotly") for r in extra("dashboard"))
    assert {"matplotlib", "plotly"} <= {r.split(">")[0].split("=")[0] for r in extra("dev")}


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """The wheel installed into a folder of its own."""
    site = tmp_path_factory.mktemp("installed") / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
        check=True,
        capture_output=True,
    )
    return site


def _clean_python(site: Path, *args: str, cwd: Path, extra_path: str = "") -> subprocess.CompletedProcess:
    """Run ``python -S args`` on the installed wheel, with this environment's packages on the
    path but without their .pth files: a checkout's editable install (whose finder maps
    cokit.bench to its benchmarks/) must not stand in for the wheel."""
    purelib = sysconfig.get_paths()["purelib"]
    path = ":".join(p for p in (str(site), extra_path, purelib) if p)
    return subprocess.run(
        [sys.executable, "-S", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": path, "PATH": "/usr/bin:/bin"},
    )


def test_installed_wheel_coexists_with_another_triton_kernels(installed, tmp_path):
    """With the wheel installed, a separate top-level ``triton_kernels`` (Triton's own, which vLLM
    imports) still imports, ``compress``/``overlap`` are not ours, and cokit's subpackages import."""
    other = tmp_path / "other" / "triton_kernels"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("")
    (other / "matmul_ogs.py").write_text("OWNER = 'triton'\n")
    probe = textwrap.dedent("""
        import importlib.util, sys
        import cokit, cokit.compress, cokit.overlap, cokit.triton_kernels, cokit.validation.calibrate
        from triton_kernels.matmul_ogs import OWNER
        assert OWNER == "triton", OWNER
        assert importlib.util.find_spec("compress") is None
        assert importlib.util.find_spec("overlap") is None
        assert importlib.util.find_spec("cokit.bench") is None
        print(cokit.__file__); print(cokit.compress.__file__); print(cokit.triton_kernels.__file__)
    """)
    res = _clean_python(installed, "-c", probe, cwd=tmp_path, extra_path=str(other.parent))
    assert res.returncode == 0, res.stderr
    for line in res.stdout.split():
        assert line.startswith(str(installed)), f"{line} imported from outside the installed wheel"


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "gpu-check", "--quick"],
        ["bench", "gemm"],
        ["bench", "resilience", "--quick", "--out", "x"],
        ["bench", "validate", "--quick"],
        ["bench", "validate", "--protocol", "transfer"],
    ],
)
def test_installed_wheel_says_which_commands_need_a_checkout(installed, tmp_path, argv):
    """A command that needs the checkout's benchmarks/ is a one-line error saying how to get
    one, not an ImportError; nothing is written."""
    res = _clean_python(installed, "-m", "cokit", *argv, cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    err = res.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "needs a source checkout of cokit" in err and "clone the cokit repository" in err
    assert list(tmp_path.iterdir()) == []


def test_installed_wheel_help_lists_every_command(installed, tmp_path):
    res = _clean_python(installed, "-m", "cokit", "--help", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    for command in ("demo", "bench", "plan", "dashboard", "sweep"):
        assert command in res.stdout
    res = _clean_python(installed, "-m", "cokit", "bench", "resilience", "--help", cwd=tmp_path)
    assert res.returncode == 0 and "needs a source checkout" in res.stdout


@pytest.mark.distributed
def test_installed_wheel_calibrates_on_your_model(installed, tmp_path):
    """``cokit bench validate --on`` runs from the wheel alone (2 gloo ranks, a few steps)."""
    factory = textwrap.dedent("""
        import torch
        import torch.nn.functional as F

        def make_workload():
            def batch(gen):
                x = torch.randn(8, 6, generator=gen)
                return x, (x.sum(1) > 0).long()

            return {
                "model": lambda: torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)),
                "batch": batch,
                "heldout": [batch(torch.Generator().manual_seed(7))],
                "loss": lambda model, b: F.cross_entropy(model(b[0]), b[1]),
            }
    """)
    (tmp_path / "my_factory.py").write_text(factory)
    argv = ["bench", "validate", "--on", "my_factory:make_workload", "--steps", "4", "--lr-points", "1"]
    argv += ["--methods", "adamw,demo-sign-k32-c64", "--out", str(tmp_path / "cal"), "--no-telemetry"]
    res = _clean_python(installed, "-m", "cokit", *argv, cwd=tmp_path, extra_path=str(tmp_path))
    assert res.returncode == 0, res.stderr[-3000:]
    doc = json.loads((tmp_path / "cal" / "study.json").read_text())
    assert {r["method"] for r in doc["tables"]["yours"]} == {"adamw", "demo-sign-k32-c64"}
    assert doc["recommendation"]


def test_source_checkout_maps_the_same_names():
    """A plain checkout (no install; how the GPU machine gets the tree) imports the same names,
    and its benchmarks/ as cokit.bench (the benchmarks, the netbed and the study)."""
    probe = (
        "import cokit.compress, cokit.overlap, cokit.triton_kernels, cokit.bench.timing, "
        "cokit.bench.gpu_check, cokit.bench.netbed, cokit.bench.study.presets; print(cokit.compress.__file__)"
    )
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
