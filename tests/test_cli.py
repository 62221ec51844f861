"""The cokit command line."""

import json

import pytest

from cokit.cli import main


def test_info_prints_paths_and_limits(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "kernel path: CPU tensors -> interpreter" in out
    assert "232448" in out and "gfx942" in out


@pytest.mark.slow  # compiles the 22 shipped sm_90 builds (~20 s on 2 cores)
def test_info_kernels_prints_the_resource_table(capsys):
    assert main(["info", "--kernels", "sm_90"]) == 0
    out = capsys.readouterr().out
    assert "stack B" in out and "spill st/ld B" in out
    assert "dct_encode_2d[w4s1-tf32x3]" in out and "ef_decode_2d[w8s1-tf32x3]" in out
    # no sm_90 build spills (tests/test_compile_targets.py), and the report says so
    assert "\nspills: none\n" in out
    # the static estimate: bf16 in, fp32 out = 6 B per element; 6 / 4800 GB/s = 1.25 ms per 1e9 on an H200
    assert "H100 ms/1e9" in out and "H200 ms/1e9" in out
    row = next(line for line in out.splitlines()[::-1] if line.startswith("dct_encode_2d[w4s1-tf32x3] "))
    assert row.split()[-3:] == ["6", "1.79", "1.25"], row


def test_info_kernels_rejects_an_unknown_target():
    with pytest.raises(ValueError, match="sm_75"):
        main(["info", "--kernels", "sm_75"])


def test_info_json(capsys):
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["paths"]["cpu tensors"] == "interpreter"
    assert info["targets"]["sm_80"]["max_shared_per_block"] == 166912
    assert set(info["kernels"]) == {"dct", "topk", "error_feedback"}


def test_unknown_flag_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["info", "--bogus"])
    assert exc.value.code == 2


def test_bench_gpu_check_refuses_without_gpu(tmp_path, monkeypatch, capsys):
    """`cokit bench gpu-check` runs the installed module (no checkout lookup) and says why not."""
    assert (
        main(["bench", "gpu-check", "--quick", "--out", str(tmp_path)]) == 2
    )  # conftest sets TRITON_INTERPRET
    assert "TRITON_INTERPRET is set" in capsys.readouterr().err
    monkeypatch.delenv("TRITON_INTERPRET")
    assert main(["bench", "gpu-check", "--quick", "--out", str(tmp_path)]) == 2
    assert "no GPU visible" in capsys.readouterr().err


def test_bench_gemm_runs_the_module(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("TRITON_INTERPRET")  # the torch path: fast
    out = tmp_path / "gemm.json"
    assert main(["bench", "gemm", "--quick", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["summary"]["correctness_ok"] is True
    assert "[gemm] correctness" in capsys.readouterr().out


@pytest.mark.slow
def test_occupancy_many_configs_and_a_second_call_from_the_compile_cache(tmp_path):
    """`cokit occupancy` with repeated --config and a --grid: one result per config; the
    second call reads every build from the compile cache ($COKIT_CACHE_DIR) instead of
    compiling. Runs the installed CLI in subprocesses without TRITON_INTERPRET."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(COKIT_CACHE_DIR=str(tmp_path / "cokit"), TRITON_CACHE_DIR=str(tmp_path / "triton"))
    argv = [sys.executable, "-m", "cokit", "occupancy", "--target", "sm_90", "--dtype", "bf16"]
    argv += ["--config", "BLOCK_M=64,BLOCK_N=64,BLOCK_K=32,num_stages=2"]
    argv += ["--config", "BLOCK_M=128,BLOCK_N=128,BLOCK_K=64,num_stages=3"]
    argv += ["--grid", "num_warps=4,8", "--grid", "smem_bytes=none,115840"]

    def call(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([*argv, *extra], env=env, capture_output=True, text=True, timeout=600)

    first = call("--json")
    assert first.returncode == 0, first.stderr
    runs = [json.loads(line) for line in first.stdout.splitlines()]
    assert len(runs) == 8  # 2 configs x 2 num_warps x 2 smem_bytes, none dropped
    assert [r["config"]["BLOCK_M"] for r in runs] == [64] * 4 + [128] * 4
    # smem_bytes does not change the build: 4 compiles, the shaped twins from the cache
    assert [r["compile"]["cached"] for r in runs] == [False, True] * 4
    assert all(r["shared_bytes"] == 115840 for r in runs[1::2])
    assert all(r["blocks_per_sm"] == 1 for r in runs[1::2])
    assert len(list((tmp_path / "cokit" / "compile").glob("*.json"))) == 4
    second = call("--json")
    again = [json.loads(line) for line in second.stdout.splitlines()]
    assert [r["compile"]["cached"] for r in again] == [True] * 8
    strip = [{k: v for k, v in r.items() if k != "compile"} for r in again]
    assert strip == [{k: v for k, v in r.items() if k != "compile"} for r in runs]
    table = call()
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert sum(1 for ln in lines if ln.startswith("BLOCK_M=")) == 8
    assert "8 config(s)" in lines[-1] and "8 from the cache, 0 compiled" in lines[-1]
