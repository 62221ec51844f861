"""matplotlib and plotly are extras (``cokit[plot]``, ``cokit[dashboard]``): without them cokit
imports and its CLI starts; the demo and ``--on`` calibration skip their figures with a note,
``cokit sweep`` asks for the extra before running; and no library code picks a backend."""

from __future__ import annotations

import ast
import importlib.abc
import inspect
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cokit.cli import main
from cokit.train import MethodSpec, RunResult

ROOT = Path(__file__).resolve().parents[1]
BLOCKED = ("matplotlib", "plotly")


class _NoPlotting(importlib.abc.MetaPathFinder):
    """A meta-path finder that refuses the plotting libraries, as if they were not installed."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        return None


# the same finder, first on the meta path of a fresh interpreter
BLOCKER = (
    f"import importlib.abc, sys\nBLOCKED = {BLOCKED!r}\n"
    + inspect.getsource(_NoPlotting)
    + "sys.meta_path.insert(0, _NoPlotting())\n"
)


@pytest.fixture
def no_plot_libraries(monkeypatch):
    """In this process: matplotlib and plotly cannot be imported (their loaded modules are
    hidden for the test and put back after it)."""
    for name in list(sys.modules):
        if name.split(".")[0] in BLOCKED:
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_NoPlotting(), *sys.meta_path])


def test_import_and_help_need_no_plotting_library():
    """``import cokit`` and its packages, and ``cokit --help`` and every command's help, in a
    fresh interpreter where matplotlib and plotly do not import."""
    probe = BLOCKER + textwrap.dedent("""
        import cokit, cokit.compress, cokit.overlap, cokit.triton_kernels
        import cokit.validation.calibrate, cokit.validation.report, cokit.train_report, cokit.telemetry
        from cokit.cli import main, SUBCOMMANDS
        for argv in (["--help"], *[[c, "--help"] for c in SUBCOMMANDS], ["bench", "validate", "--help"]):
            try:
                main(argv)
            except SystemExit as exc:
                assert exc.code == 0, (argv, exc.code)
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("matplotlib", "plotly"))
        assert not loaded, loaded
        print("ok")
    """)
    res = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"}
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().endswith("ok")


def test_sweep_asks_for_the_plot_extra_before_running(no_plot_libraries, tmp_path, capsys):
    assert main(["sweep", "--out", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install 'cokit[plot]'" in err and "--no-plots" in err
    assert not (tmp_path / "s").exists()


def _result(name: str, label: str, sent: int) -> RunResult:
    return RunResult(
        spec=MethodSpec(name, 1e-3, label=label),
        world_size=2,
        seed=0,
        train_loss=[4.0, 3.5, 3.2],
        bytes_sent=[sent] * 3,
        dense_bytes=[4000] * 3,
        step_s=[0.1] * 3,
        opt_s=[0.01] * 3,
        wall_s=[0.1, 0.2, 0.3],
        evals=[(0, 4.1), (3, 3.3)],
        num_params=500,
    )


def test_demo_skips_its_figure_with_a_note(no_plot_libraries, tmp_path, monkeypatch, capsys):
    """The demo's JSON and CSV are written; demo.png is not drawn (an earlier one is removed,
    it would describe another run) and one line says how to get it."""
    import cokit.train

    def fake_run(fn, specs, *args, **kw):
        return [_result(s.name, s.label, 100 if s.name != "adamw" else 4000) for s in specs]

    monkeypatch.setattr(cokit.train, "run_distributed", fake_run)
    out = tmp_path / "demo"
    out.mkdir()
    (out / "demo.png").write_bytes(b"an earlier run's figure")
    argv = ["demo", "--ranks", "2", "--steps", "3", "--model", "toy", "--max-chars", "60000", "--quiet"]
    assert main([*argv, "--no-telemetry", "--overwrite", "--out", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "demo.png not drawn: matplotlib is not installed (pip install 'cokit[plot]')" in shown
    assert json.loads((out / "demo.json").read_text())["summary"]
    assert (out / "demo.csv").is_file() and not (out / "demo.png").exists()


def _record(method: str, family: str, loss: float, sent: int) -> dict:
    summary = {
        "final_train_loss": loss,
        "final_heldout_loss": loss,
        "heldout_accuracy": None,
        "bytes_per_step": sent,
        "mean_bytes_per_step": sent,
        "total_bytes_sent": 4 * sent,
        "dense_bytes_per_step": 4000,
        "ratio_to_dense": 4000 / sent,
        "time_per_step_s": 0.1,
        "opt_time_per_step_s": 0.01,
        "total_time_s": 0.4,
        "max_replica_diff": 0.0,
    }
    return {
        "workload": "yours",
        "method": method,
        "family": family,
        "lr": 1e-3,
        "seed": 0,
        "steps": 4,
        "world_size": 2,
        "status": "ok",
        "summary": summary,
        "evals": [{"step": 0, "heldout_loss": 2.0}, {"step": 4, "heldout_loss": loss}],
        "series": {"bytes_sent": [sent] * 4},
    }


def test_calibration_report_skips_its_plots_with_a_note(no_plot_libraries, tmp_path):
    """``--on``'s report without matplotlib: tables, JSON and the recommendation, no figures
    (an earlier report's removed), and ``plots_skipped`` says why."""
    from cokit.validation.grid import StudyConfig, WorkloadDef
    from cokit.validation.plots import plot_names
    from cokit.validation.report import write_report

    lrs = (("adamw", (1e-3,)), ("demo", (1e-3,)))
    wl = WorkloadDef("yours", None, 4, 2, lrs)
    cfg = StudyConfig(
        preset="quick",
        out_dir=str(tmp_path),
        world_size=2,
        workloads=[wl],
        methods=["adamw", "demo-sign-k32-c64"],
        headline=[],
        seeds=1,
        lr_points=1,
        recommend_within=0.03,
    )
    records = {
        "yours": [_record("adamw", "adamw", 1.0, 4000), _record("demo-sign-k32-c64", "demo", 1.01, 100)]
    }
    info = {
        "preset": "quick",
        "date": "2026-01-01",
        "world_size": 2,
        "backend": "gloo",
        "device": "cpu",
        "lr_points": 1,
        "machine": {"cpu": "cpu", "cores": 2, "torch": "2", "triton": "3"},
    }
    for name in plot_names("yours"):
        (tmp_path / name).write_bytes(b"an earlier report's figure")
    doc = write_report(str(tmp_path), info, records, cfg)
    assert doc["plots_skipped"] == "matplotlib is not installed (pip install 'cokit[plot]')"
    assert doc["files"] == ["table.md", "table.csv", "runs.csv", "study.json"]
    assert doc["recommendation"].startswith("Recommendation: demo-sign-k32-c64")
    assert not [p for p in tmp_path.iterdir() if p.suffix == ".png"]


# what picks a matplotlib backend; only the CLI's entry point may (headless figures)
_BACKEND_SETTERS = ("use", "switch_backend")


def test_library_code_never_picks_a_matplotlib_backend():
    found = []
    folders = ("triton_kernels", "compress", "overlap", "cokit")
    for path in sorted(p for f in folders for p in (ROOT / f).rglob("*.py")):
        if path == ROOT / "cokit" / "cli.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                owner = ast.unparse(node.func.value)
                if node.func.attr in _BACKEND_SETTERS and owner in ("matplotlib", "mpl", "plt", "pyplot"):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {owner}.{node.func.attr}")
            if isinstance(node, ast.Constant) and node.value == "MPLBACKEND":  # os.environ[...] and the like
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} sets MPLBACKEND")
    assert found == []
