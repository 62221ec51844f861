"""The cokit command line."""

import json

import pytest

from cokit.cli import main


def test_info_prints_paths_and_limits(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "kernel path: CPU tensors -> interpreter" in out
    assert "232448" in out and "gfx942" in out


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
