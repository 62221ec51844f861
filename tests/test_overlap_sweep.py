"""cokit.overlap.sweep, cokit.sweeps and `cokit sweep`: records (CSV, JSON) and plots (PNG)."""

import csv
import json

import pytest

from cokit.cli import main
from cokit.overlap.sweep import check_point, run_sweep, sweep_points
from cokit.sweeps import default_plots, plot_heatmap, plot_timeline, write_csv, write_json
from cokit.triton_kernels.gemm_config import GemmConfig

PNG = b"\x89PNG\r\n\x1a\n"


def test_emulated_sweep_in_process_writes_csv_json_png(tmp_path):
    base = GemmConfig(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, num_stages=1)
    configs = [base, base.replace(num_warps=8), base.replace(smem_bytes=65536)]
    points = sweep_points(configs, [32, 64], ["emulated"], chunks=[1])
    assert len(points) == 6
    rows = run_sweep(points, device="cpu", repeats=1, warmup=0)
    assert len(rows) == 6 and not any(r.get("error") for r in rows)
    for r in rows:
        assert r["emulated"] is True and "EMULATED" in r["comm"] and "CPU run" in r["note"]
        assert r["speedup"] > 0 and r["compute_ms"] > 0 and r["message_bytes"] == r["size"] ** 2 * 4
    csv_path = write_csv(rows, tmp_path / "s.csv")
    with csv_path.open() as f:
        back = list(csv.DictReader(f))
    assert len(back) == 6 and {
        "num_warps",
        "smem_bytes",
        "speedup",
        "comm_hidden",
        "overlapped_iqr_ms",
    } <= set(back[0])
    data = json.loads(write_json(rows, tmp_path / "s.json", {"k": 1}).read_text())
    assert data["meta"] == {"k": 1} and len(data["rows"]) == 6
    paths = default_plots(rows, tmp_path)
    names = sorted(p.name for p in paths)
    assert names == ["heatmap_chunks_message_emulated.png", "heatmap_warps_smem.png", "timeline_best.png"]
    for p in paths:
        assert p.read_bytes()[:8] == PNG


def test_plot_errors(tmp_path):
    with pytest.raises(ValueError, match="no successful rows"):
        plot_heatmap([{"error": "x"}], "a", "b", tmp_path / "h.png")
    with pytest.raises(ValueError, match="compute_ms"):
        plot_timeline({"communicate_ms": 1.0, "overlapped_ms": 1.0}, tmp_path / "t.png")


def test_sweep_points_validation():
    cfg = GemmConfig()
    with pytest.raises(ValueError, match="collective 'bcast'"):
        sweep_points([cfg], [64], ["bcast"])
    with pytest.raises(ValueError, match="size 0"):
        sweep_points([cfg], [0], ["emulated"])
    with pytest.raises(ValueError, match="sizes is empty"):
        sweep_points([cfg], [], ["emulated"])
    with pytest.raises(TypeError, match="GemmConfig"):
        sweep_points(["cfg"], [64], ["emulated"])
    p = sweep_points([cfg], [10], ["reduce_scatter"], chunks=[2])[0]
    with pytest.raises(ValueError, match="divisible by world_size x chunks = 3 x 2"):
        check_point(p, 3)
    with pytest.raises(ValueError, match=">= 2 ranks"):
        check_point(p, 1)


@pytest.mark.distributed
def test_cli_sweep_gloo_two_ranks(tmp_path, capsys):
    rc = main(
        [
            "sweep",
            "--sizes",
            "32",
            "--chunks",
            "2",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--num-warps",
            "4,8",
            "--out",
            str(tmp_path),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "2 rank(s), backend gloo" in out and "change nothing here" in out and "speedup" in out
    with (tmp_path / "sweep.csv").open() as f:
        rows = list(csv.DictReader(f))
    # 3 collectives x 2 num_warps, from both ranks
    assert len(rows) == 12 and {r["rank"] for r in rows} == {"0", "1"}
    assert {r["collective"] for r in rows} == {"all_reduce", "reduce_scatter", "all_gather"}
    assert all(float(r["speedup"]) > 0 for r in rows)
    assert (tmp_path / "heatmap_warps_smem.png").read_bytes()[:8] == PNG
    assert (tmp_path / "timeline_best.png").exists()
    assert json.loads((tmp_path / "sweep.json").read_text())["meta"]["world_size"] == 2


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--collectives", "bcast"], "unknown"),
        (["--sizes", "30", "--chunks", "4", "--collectives", "reduce_scatter"], "divisible"),
        (["--comm-sms", "4"], "emulated only"),
        (["--priority", "urgent"], "priority"),
        (["--sizes", "0"], "must be >= 1"),
        (["--repeats", "0"], "repeats"),
        (["--num-warps", "3"], "num_warps=3"),
        (["--collectives", "emulated"], "world-size 1"),
        (["--backend", "nccl"], "needs 2 GPUs"),
        (["--world-size", "1", "--collectives", "all_reduce"], ">= 2 ranks"),
    ],
)
def test_cli_sweep_bad_input(argv, match, capsys, tmp_path):
    assert main(["sweep", "--out", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert "cokit sweep: error:" in err and match in err, err


def test_cli_sweep_help(capsys):
    with pytest.raises(SystemExit):
        main(["sweep", "--help"])
    out = capsys.readouterr().out
    assert "EMULATED" in out and "--smem-bytes" in out and "heatmap" in out
