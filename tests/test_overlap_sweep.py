"""cokit.overlap.sweep, cokit.sweeps and `cokit sweep`: records (CSV, JSON), plots (PNG),
progress lines, occupancy columns, and the physical bounds that flag timing noise."""

import csv
import io
import json

import pytest

from cokit.cli import main
from cokit.overlap.sweep import (
    CPU_OCCUPANCY,
    OCCUPANCY_FIELDS,
    SweepPoint,
    SweepProgress,
    best_row,
    bound_violations,
    check_point,
    config_grid,
    describe_point,
    flag_noise,
    rows_csv,
    rows_json,
    run_sweep,
    summary,
    sweep_meta,
    sweep_points,
)
from cokit.sweeps import (
    default_plots,
    heatmap_figure,
    plot_heatmap,
    plot_timeline,
    timeline_figure,
    write_csv,
    write_json,
)
from cokit.triton_kernels.gemm_config import GemmConfig

PNG = b"\x89PNG\r\n\x1a\n"


def test_emulated_sweep_in_process_writes_csv_json_png(tmp_path):
    base = GemmConfig(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, num_stages=1)
    configs = [base, base.replace(num_warps=8), base.replace(smem_bytes=65536)]
    points = sweep_points(configs, [32, 64], ["emulated"], chunks=[1])
    assert len(points) == 6
    seen = []
    rows = run_sweep(points, device="cpu", repeats=1, warmup=0, progress=lambda i, row: seen.append(i))
    assert len(rows) == 6 and not any(r.get("error") for r in rows)
    assert seen == list(range(6))  # called as each point finished, in order
    for r in rows:
        assert r["emulated"] is True and "EMULATED" in r["comm"] and "CPU run" in r["note"]
        assert r["speedup"] > 0 and r["compute_ms"] > 0 and r["message_bytes"] == r["size"] ** 2 * 4
        # CPU: no SM is occupied, and the row says so instead of inventing numbers
        assert all(r[k] is None for k in OCCUPANCY_FIELDS) and r["occupancy_source"] == CPU_OCCUPANCY
        assert r["noise"] == "; ".join(bound_violations(r))
    csv_path = write_csv(rows, tmp_path / "s.csv")
    with csv_path.open() as f:
        back = list(csv.DictReader(f))
    assert len(back) == 6 and {
        "num_warps",
        "smem_bytes",
        "speedup",
        "comm_hidden",
        "overlapped_iqr_ms",
        "blocks_per_sm",
        "limiter",
        "smem_per_block",
        "reserved_sms",
        "occupancy_source",
        "noise",
    } <= set(back[0])
    data = json.loads(write_json(rows, tmp_path / "s.json", {"k": 1}).read_text())
    assert data["meta"] == {"k": 1} and len(data["rows"]) == 6
    paths = default_plots(rows, tmp_path)
    names = sorted(p.name for p in paths)
    heatmaps = ["heatmap_chunks_message_emulated.png", "heatmap_warps_smem.png"]
    # the best timeline is drawn only from a point within the physical bounds (CPU timings
    # may all be noise; the synthetic tests below pin both cases)
    timeline = ["timeline_best.png"] if best_row(rows) is not None else []
    assert names == heatmaps + timeline
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
def test_cli_sweep_gloo_two_ranks(tmp_path, capfd):
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
    out = capfd.readouterr().out  # fd level: rank 0 is a spawned process and prints progress
    assert rc == 0, out
    assert "2 rank(s), backend gloo" in out and "change nothing here" in out and "speedup" in out
    progress = [ln for ln in out.splitlines() if ln.startswith("[")]
    assert [ln.split("]")[0] for ln in progress] == [f"[{n}/6" for n in range(1, 7)], out
    assert all(" ... " in ln and " ms" in ln for ln in progress)
    assert "(eta " in progress[0] and "(total " in progress[-1]
    assert out.index(progress[-1]) < out.index("rank 0 (times")  # before the table
    with (tmp_path / "sweep.csv").open() as f:
        rows = list(csv.DictReader(f))
    # 3 collectives x 2 num_warps, from both ranks
    assert len(rows) == 12 and {r["rank"] for r in rows} == {"0", "1"}
    assert {r["collective"] for r in rows} == {"all_reduce", "reduce_scatter", "all_gather"}
    assert all(float(r["speedup"]) > 0 for r in rows)
    assert all(r["blocks_per_sm"] == "" and r["occupancy_source"] == CPU_OCCUPANCY for r in rows)
    for r in rows:  # the CSV's noise column is the bound check of the row's own times
        times = {k: float(r[k]) for k in ("compute_ms", "communicate_ms", "overlapped_ms", "speedup")}
        assert r["noise"] == "; ".join(bound_violations(times))
    rank0 = [r for r in rows if r["rank"] == "0"]
    table = out[out.index("rank 0 (times") :]
    assert table.count("NOISE") >= sum(1 for r in rank0 if r["noise"])
    assert (tmp_path / "heatmap_warps_smem.png").read_bytes()[:8] == PNG
    clean = [r for r in rank0 if not r["noise"]]
    assert (tmp_path / "timeline_best.png").exists() == bool(clean)
    assert ("best within the physical bounds" in out) == bool(clean)
    meta = json.loads((tmp_path / "sweep.json").read_text())["meta"]
    assert (
        meta["world_size"] == 2 and meta["occupancy"] == CPU_OCCUPANCY and "ideal bound" in meta["noise_rule"]
    )
    assert meta["noise_rows"]["rank0"] == len(rank0) - len(clean)
    # telemetry by default: one step line per point on every rank, its config as the kernel
    from cokit.telemetry import read_jsonl

    for rank in (0, 1):
        records, bad = read_jsonl(tmp_path / "telemetry" / "sweep" / f"rank{rank}.jsonl")
        steps = [r for r in records if r["kind"] == "step"]
        assert bad == 0 and [r["step"] for r in steps] == list(range(1, 7))
        assert [r["kind"] for r in records][::7] == ["meta", "end"]
        ours = [r for r in rows if r["rank"] == str(rank)]
        assert [s["metrics"]["speedup"] for s in steps] == pytest.approx([float(r["speedup"]) for r in ours])
        assert [s["kernels"][0]["config"]["num_warps"] for s in steps] == [int(r["num_warps"]) for r in ours]


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


# ---------------------------------------------------------------------- physical bounds
def test_config_grid_is_the_product_of_the_knobs_each_validated():
    base = GemmConfig(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, num_stages=1)
    grid = config_grid(base, num_warps=[4, 8], num_sms=[None, 6])
    assert [(c.num_warps, c.num_sms, c.persistent) for c in grid] == [
        (4, None, False),
        (4, 6, True),
        (8, None, False),
        (8, 6, True),
    ]
    assert config_grid(base) == [base]  # no axis given: the base config alone
    with pytest.raises(ValueError, match=r"config .*num_warps=3.*: "):
        config_grid(base, num_warps=[4, 3])


def test_points_travel_to_ranks_as_dicts_and_rows_as_text():
    cfg = GemmConfig(BLOCK_M=32, num_warps=8, smem_bytes=65536)
    points = sweep_points([cfg], [32], ["emulated", "all_reduce"], chunks=[2], comm_sms=[4])
    back = [SweepPoint.from_dict(json.loads(json.dumps(p.to_dict()))) for p in points]
    assert back == points and back[0].comm_sms == 4 and back[1].chunks == 2
    rows = [{"a": 1, "b": None}, {"b": 2.5, "c": "x"}]
    assert list(csv.DictReader(io.StringIO(rows_csv(rows)))) == [
        {"a": "1", "b": "", "c": ""},
        {"a": "", "b": "2.5", "c": "x"},
    ]
    assert json.loads(rows_json(rows, {"k": 1})) == {"meta": {"k": 1}, "rows": rows}


def test_summary_and_meta_name_noise_and_the_best_point():
    impossible, good = _row(2.9, 4.1, 3.7, num_warps=8), _row(2.0, 2.0, 2.5)
    failed = {"collective": "all_gather", "size": 64, "chunks": 1, "error": "boom", "rank": 0}
    rows = [*flag_noise([impossible, good]), failed, {**good, "rank": 1, "noise": "x"}]
    text = summary(rows[:3])
    lines = text.splitlines()
    assert lines[0].startswith("rank 0 (times: medians in ms") and "blk/SM" in lines[1]
    assert lines[2].split()[-1] == "NOISE" and "NOISE" not in lines[3]  # the flag column
    assert "error at all_gather size 64 chunks 1: boom" in text
    assert "NOISE: 1 point(s) break the physical bounds" in text
    assert lines[-1] == f"best within the physical bounds: {describe_point(good)}, speedup 1.600"
    assert summary([impossible]).endswith("no point within the physical bounds: no best point")
    meta = sweep_meta(
        rows, world_size=2, backend="gloo", gpu=False, dtype="fp32", repeats=3, warmup=1, seconds=1.234
    )
    assert (
        meta["occupancy"] == CPU_OCCUPANCY and meta["seconds"] == 1.23 and "ideal bound" in meta["noise_rule"]
    )
    assert meta["noise_rows"] == {"rank0": 1, "all_ranks": 2}


def _row(tc, tm, to, **extra):
    """A measured row with these median times (ms) and the speedup they imply."""
    return {
        "collective": "all_reduce",
        "size": 256,
        "chunks": 2,
        "num_warps": 4,
        "smem_bytes": None,
        "message_bytes": 262144,
        "compute_ms": tc,
        "communicate_ms": tm,
        "overlapped_ms": to,
        "compute_under_overlap_ms": tc,
        "speedup": (tc + tm) / to,
        "speedup_iqr": 0.05,
        "device": "cpu",
        "rank": 0,
        **extra,
    }


def test_bound_violations_on_the_issue_numbers():
    """The issue's CPU sweep: compute 2.9 ms, communication 4.1 ms, overlapped 3.7 ms: a
    speedup of 1.892 above the ideal bound 7.0 / 4.1 = 1.707, and T_ovl below comm alone."""
    reasons = bound_violations(_row(2.9, 4.1, 3.7))
    assert reasons == [
        "speedup 1.892 above the ideal bound 1.707",
        "T_ovl 3.700 ms below communication alone 4.100 ms",
    ]
    # below compute alone too (compute is the longer part here)
    assert bound_violations(_row(5.0, 1.0, 4.0)) == [
        "speedup 1.500 above the ideal bound 1.200",
        "T_ovl 4.000 ms below compute alone 5.000 ms",
    ]
    # a stated speedup above the bound is flagged even when the times alone look fine
    assert bound_violations({**_row(2.0, 1.0, 2.0), "speedup": 1.6}) == [
        "speedup 1.600 above the ideal bound 1.500"
    ]


def test_physical_points_are_not_flagged():
    assert bound_violations(_row(2.0, 1.0, 2.0)) == []  # perfect overlap: exactly the bound
    assert bound_violations(_row(2.0, 1.0, 2.5)) == []
    assert bound_violations(_row(2.0, 1.0, 3.5)) == []  # slower than sequential: bad, not noise
    assert bound_violations({"error": "RuntimeError: x"}) == []  # nothing measured
    assert bound_violations({**_row(1.0, 1.0, 1.0), "overlapped_ms": None}) == []


def test_best_row_never_picks_noise():
    impossible = _row(2.9, 4.1, 3.7)  # the largest speedup of all, and impossible
    good, worse = _row(2.0, 2.0, 2.5), _row(2.0, 2.0, 3.5)
    failed = {"error": "x", "speedup": 9.0}
    rows = flag_noise([worse, impossible, failed, good])
    assert [r["noise"] != "" for r in rows] == [False, True, False, False]
    assert best_row(rows) is good
    # the check does not trust a missing or stale noise column
    assert best_row([{k: v for k, v in impossible.items() if k != "noise"}, worse]) is worse
    assert best_row([impossible]) is None and best_row([]) is None


def test_default_plots_mark_noise_and_skip_it_as_best(tmp_path):
    impossible = _row(2.9, 4.1, 3.7, num_warps=8)
    good = _row(2.0, 2.0, 2.5)
    rows = flag_noise([impossible, good])
    names = sorted(p.name for p in default_plots(rows, tmp_path))
    assert names == ["heatmap_chunks_message_all_reduce.png", "heatmap_warps_smem.png", "timeline_best.png"]
    # only noise: heatmaps still drawn (marked), no best timeline
    only = tmp_path / "only"
    names = sorted(p.name for p in default_plots(flag_noise([_row(2.9, 4.1, 3.7)]), only))
    assert names == ["heatmap_chunks_message_all_reduce.png"]
    # the timeline of a noisy row says so, in red
    fig = timeline_figure(impossible)
    title = fig.axes[0].get_title()
    assert title.startswith("NOISE (not a real result): speedup 1.892 above the ideal bound 1.707")


def _texts(fig):
    return [t.get_text() for ax in fig.axes for t in ax.texts] + [t.get_text() for t in fig.texts]


def test_heatmap_cells_show_median_and_iqr_and_one_title():
    rows = flag_noise(
        [
            _row(2.0, 2.0, 2.5, num_warps=4, speedup_iqr=0.125),
            _row(2.0, 2.0, 4.0, num_warps=4, speedup_iqr=0.25, size=512),  # same cell: pooled
            _row(2.9, 4.1, 3.7, num_warps=8),  # the only row of its cell: noise
            _row(2.0, 2.0, 2.0, num_warps=4, smem_bytes=98304),
            _row(2.9, 4.1, 3.7, num_warps=4, smem_bytes=98304),  # noise next to a clean row
        ]
    )
    fig = heatmap_figure(rows, "num_warps", "smem_bytes", title="speedup over sequential")
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert titles == ["speedup over sequential [CPU]"]  # one title; no suptitle
    assert fig._suptitle is None
    cells = [t for ax in fig.axes for t in (x.get_text() for x in ax.texts)]
    # (4, none): median of speedups 1.6 and 1.0 = 1.3, and the larger IQR of the two
    assert "1.30\nIQR 0.25" in cells
    assert "1.89\nIQR 0.05\nNOISE" in cells  # (8, none): only noise, shown and marked
    assert "2.00\nIQR 0.05\n(+1 noise)" in cells  # (4, 98304): the noise row left out
    footer = " ".join(t.get_text() for t in fig.texts)
    assert "IQR over repeats" in footer and "2 row(s) flagged as noise" in footer


# ---------------------------------------------------------------------- progress
def test_progress_lines_with_eta():
    now = [100.0]
    out = io.StringIO()
    prog = SweepProgress(3, stream=out, clock=lambda: now[0])
    now[0] = 102.0
    prog(0, _row(2.0, 2.0, 2.5))
    now[0] = 104.0
    prog(1, _row(2.9, 4.1, 3.7, noise="speedup 1.892 above the ideal bound 1.707"))
    now[0] = 106.5
    prog(2, {"collective": "all_gather", "size": 64, "chunks": 1, "priority": "high", "error": "boom"})
    lines = out.getvalue().splitlines()
    assert lines[0] == (
        "[1/3] all_reduce size=256 chunks=2 num_warps=4 smem_bytes=none prio=None ... "
        "2.50 ms, speedup 1.600 (eta 4 s)"
    )
    assert lines[1].startswith("[2/3] ") and "3.70 ms, speedup 1.892 [NOISE: speedup 1.892" in lines[1]
    assert lines[1].endswith("(eta 2 s)")
    assert lines[2] == "[3/3] all_gather size=64 chunks=1  prio=high ... error: boom (total 6 s)"
    with pytest.raises(ValueError, match="total=0"):
        SweepProgress(0)


def test_cli_sweep_one_device_prints_progress_and_occupancy_meta(tmp_path, capsys):
    """In-process (1 rank, emulated communication): a progress line per point, as it ends."""
    argv = ["sweep", "--world-size", "1", "--collectives", "emulated", "--sizes", "32,64"]
    argv += ["--chunks", "1", "--repeats", "1", "--warmup", "0", "--no-plots", "--out", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    progress = [ln for ln in out.splitlines() if ln.startswith("[")]
    assert len(progress) == 2 and progress[0].startswith("[1/2] emulated size=32 chunks=1 ")
    assert progress[1].startswith("[2/2] emulated size=64") and "(total " in progress[1]
    with (tmp_path / "sweep.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["occupancy_source"] for r in rows] == [CPU_OCCUPANCY] * 2
    assert "flag" in out and "blk/SM" in out
