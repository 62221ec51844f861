"""``cokit.bench.gpu_check`` without a GPU: refusals, the CPU path, phase isolation, outputs.

The script runs in subprocesses without ``TRITON_INTERPRET`` (conftest sets it for this
process), except the phase-isolation test, which calls ``main`` with its own phase list.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cokit.bench import gpu_check
from cokit.bench.timing import Budget, KernelWatch, compiled_kernels, kernel_resources, resources_text

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU behaviour")


def _run(args, cwd=ROOT, env_extra=None, timeout=120):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-m", "cokit.bench.gpu_check", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_no_gpu_exits_2_with_one_line(tmp_path):
    res = _run(["--quick", "--out", str(tmp_path / "o")])
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "no GPU visible" in lines[0] and "--allow-cpu" in lines[0]
    assert not (tmp_path / "o" / "gpu_check.json").exists()


def test_triton_interpret_exits_2(tmp_path):
    res = _run(["--allow-cpu", "--quick", "--out", str(tmp_path)], env_extra={"TRITON_INTERPRET": "1"})
    assert res.returncode == 2
    assert "TRITON_INTERPRET is set" in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_unwritable_out_fails_fast(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    res = _run(["--allow-cpu", "--quick", "--out", str(blocker / "sub")])
    assert res.returncode == 2
    assert "is not writable" in res.stderr
    assert "[gpu-check]" not in res.stdout  # no phase started


def test_allow_cpu_quick_runs_the_quick_phases(tmp_path):
    """--quick: the compression kernels, GEMM/Linear and one overlap phase (<= 3 min on an H200)."""
    out = tmp_path / "out"
    res = _run(["--allow-cpu", "--quick", "--out", str(out)], timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    log = (out / "gpu_check.log").read_text()
    names = [p["name"] for p in report["phases"]]
    quick = [p for p in gpu_check.default_phases() if p.in_quick]
    assert names == [p.name for p in quick] and sum(p.budget_quick for p in quick) <= 180
    assert "tp_layers" not in names and "train_step_overlap" not in names and "linear.compile" in names
    status = {p["name"]: p["status"] for p in report["phases"]}
    assert all(s in ("OK", "SKIPPED") for s in status.values()), status
    assert status["gemm.perf"] == "SKIPPED" and status["kernels.dct"] == "OK" and status["overlap"] == "OK"
    assert report["complete"] is True and report["mode"].startswith("cpu")
    env = next(p for p in report["phases"] if p["name"] == "env")["result"]
    assert env["torch"] == torch.__version__ and "triton" in env
    dct_row = next(p for p in report["phases"] if p["name"] == "kernels.dct")["result"]["rows"][0]
    assert dct_row["n_regs"] == "-" and dct_row["rel_err"] < 1e-5
    # the log is everything printed, the summary table ends stdout
    assert "[gpu-check] summary" in res.stdout and "[gpu-check] summary" in log
    n_phases = len(quick)
    assert (
        f"[gpu-check] [1/{n_phases}] env: start" in log
        and "kernels.ef_decode" in res.stdout.split("summary")[-1]
    )
    assert not [f for f in os.listdir(out) if f.endswith(".tmp")]


def test_only_runs_phases_left_out_of_quick(tmp_path):
    out = tmp_path / "out"
    argv = ["--allow-cpu", "--quick", "--only", "tp_layers", "train_step_overlap", "--out", str(out)]
    res = _run(argv, timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert {p["name"]: p["status"] for p in report["phases"]} == {
        "train_step_overlap": "OK",
        "tp_layers": "OK",
    }


def test_copy_targets_and_the_chips_data_sheet_bandwidth():
    from cokit.triton_kernels.roofline import datasheet_gbs

    assert gpu_check.copy_target("dct_encode", 75.0) == ">=70%: met"
    assert gpu_check.copy_target("ef_decode", 48.4) == ">=60%: missed by 12 pts"
    assert gpu_check.copy_target("topk", 10.0) is None and gpu_check.copy_target("dct_decode", None) is None
    assert (
        datasheet_gbs("NVIDIA H200") == ("H200", 4800.0)
        and datasheet_gbs("NVIDIA H100 80GB HBM3")[0] == "H100"
    )
    assert datasheet_gbs("AMD Instinct MI300X") == ("MI300X", 5300.0) and datasheet_gbs("Tesla T4") is None


def test_failing_phase_is_reported_and_later_phases_run(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    calls = []

    def boom(ctx):
        calls.append("boom")
        raise ValueError("injected failure")

    def slow(ctx):
        calls.append("slow")
        while not ctx.budget.stop():
            pass
        return {"key": "stopped"}

    def fine(ctx):
        calls.append("fine")
        return {"key": "42 GB/s", "value": 42}

    phases = [
        gpu_check.Phase("boom", boom, 5, 5),
        gpu_check.Phase("slow", slow, 0.2, 0.2),
        gpu_check.Phase("fine", fine, 5, 5),
        gpu_check.Phase("gpu-only", fine, 5, 5, needs_gpu=True),
    ]
    rc = gpu_check.main(["--allow-cpu", "--quick", "--out", str(tmp_path)], phases=phases)
    assert rc == 1 and calls == ["boom", "slow", "fine"]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    by = {p["name"]: p for p in report["phases"]}
    assert by["boom"]["status"] == "FAILED" and "ValueError: injected failure" in by["boom"]["traceback"]
    assert by["slow"]["status"] == "BUDGET" and by["slow"]["cut"] == 1
    assert (
        by["fine"]["status"] == "OK"
        and by["fine"]["result"]["value"] == 42
        and by["fine"]["key"] == "42 GB/s"
    )
    assert by["gpu-only"]["status"] == "SKIPPED"
    log = (tmp_path / "gpu_check.log").read_text()
    assert "Traceback" in log and "injected failure" in log
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-1].startswith("[gpu-check] wrote")
    assert "FAILED" in out.split("summary")[-1]


def test_env_hook_fails_a_named_phase(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("COKIT_GPU_CHECK_FAIL", "first")
    phases = [gpu_check.Phase("first", lambda ctx: {}, 5, 5), gpu_check.Phase("second", lambda ctx: {}, 5, 5)]
    assert gpu_check.main(["--allow-cpu", "--out", str(tmp_path)], phases=phases) == 1
    status = [p["status"] for p in json.loads((tmp_path / "gpu_check.json").read_text())["phases"]]
    assert status == ["FAILED", "OK"]


def test_only_selects_phases_by_prefix():
    names = [p.name for p in gpu_check._selected(gpu_check.default_phases(), ["kernels", "gemm.perf"])]
    assert names == ["kernels.dct", "kernels.topk", "kernels.ef_encode", "kernels.ef_decode", "gemm.perf"]


def test_help_from_outside_the_checkout(tmp_path):
    res = _run(["--help"], cwd=tmp_path, timeout=60)
    assert res.returncode == 0 and "--allow-cpu" in res.stdout and "--quick" in res.stdout


class _Meta:
    name, num_warps, num_stages, shared = "_k", 4, 3, 1024


class _Kernel:
    """A loaded CompiledKernel as triton 3.6 / 3.9 leave it in the JIT cache."""

    metadata = _Meta()

    def __init__(self, regs):
        self.module, self.n_regs, self.n_spills = object(), regs, 0


class _Jit:
    """The JITFunction layout both versions share: device_caches[dev] = (kernels, keys, target, backend, binder)."""

    def __init__(self):
        self.fn = lambda: None
        self.device_caches = {0: ({}, {}, None, None, None)}


def test_kernel_watch_reads_registers_of_new_kernels():
    import types

    mod = types.ModuleType("fake_kernels")
    mod._kernel = _Jit()
    mod._kernel.device_caches[0][0]["old"] = _Kernel(32)
    assert len(compiled_kernels([mod])) == 1
    with KernelWatch([mod]) as w:
        mod._kernel.device_caches[0][0]["a"] = _Kernel(128)
        mod._kernel.device_caches[0][0]["b"] = _Kernel(96)
    assert w.text() == {"n_regs": "96/128", "n_spills": "0"}
    assert kernel_resources(_Kernel(40))["n_regs"] == 40
    assert resources_text([], "n_regs") == "-"


def test_budget_counts_cut_work():
    b = Budget(0.0)
    assert b.spent() and b.stop(3) and b.cut == 3
    assert not Budget(None).stop()


def test_overlap_summary_never_headlines_a_point_beyond_the_physical_bounds(monkeypatch, capsys):
    """A speedup above (T_comp + T_comm) / max(T_comp, T_comm) is noise: flagged, never best."""
    from cokit.bench import overlap_bench
    from cokit.bench.timing import Budget

    impossible = {"T_comp": 10.0, "T_comm": 10.0, "T_ovl": 1.5, "speedup": 20 / 1.5, "pct_of_ideal": 3912.0}
    physical = {"T_comp": 10.0, "T_comm": 8.0, "T_ovl": 12.0, "speedup": 1.5, "pct_of_ideal": 75.0}
    monkeypatch.setattr(
        overlap_bench, "_cpu", lambda rows, quick, tiny=False: rows.extend([impossible, physical])
    )
    ctx = gpu_check.Context(device="cpu", on_gpu=False, quick=True, budget=Budget(30))
    result = gpu_check.phase_overlap(ctx)
    assert "above the ideal bound" in impossible["noise"] and physical["noise"] == ""
    assert result["summary"]["best"]["speedup"] == 1.5 and result["summary"]["noise_points"] == 1
    assert "1 beyond the physical bounds" in result["key"] and "best speedup 1.5" in result["key"]
    monkeypatch.setattr(overlap_bench, "_cpu", lambda rows, quick, tiny=False: rows.append(dict(impossible)))
    result = gpu_check.phase_overlap(ctx)
    assert "best" not in result["summary"] and "none within the physical bounds" in result["key"]
