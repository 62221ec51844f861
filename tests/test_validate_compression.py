"""``cokit bench validate`` at toy size (2 gloo ranks, a few steps): output files and schema,
resuming, one-line errors; and the digits workload. Checks the shape of the results, not the
numbers."""

import csv
import json
import shutil

import numpy as np
import pytest
import torch

from cokit.bench.study.digits import DigitsWorkload, DigitsWorkloadConfig, split_indices
from cokit.bench.study.presets import make_config
from cokit.cli import main
from cokit.validation.grid import method_catalog
from cokit.validation.report import RUN_FIELDS, SUMMARY_FIELDS, TABLE_FIELDS, pareto_front
from cokit.validation.runs import heldout_accuracy

METHODS = ["adamw", "powersgd-r4", "demo-compact-k32-c64", "sparseloco-h10-k64-int2"]
STEPS = 12  # SparseLoCo syncs once (H=10)
PNG = b"\x89PNG\r\n\x1a\n"

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # spawns 4 gloo ranks per study


TOY = ["bench", "validate", "--preset", "toy", "--steps", str(STEPS), "--methods", ",".join(METHODS)]
SEEDS = ["--seeds", "2", "--workloads", "digits"]


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """Every workload, one seed, with the longer horizon; then a copy resumed with a second seed
    for digits only."""
    out = tmp_path_factory.mktemp("validation")
    code = main([*TOY, "--out", str(out), "--long-horizon", "on"])
    seeded = tmp_path_factory.mktemp("validation") / "seeded"
    shutil.copytree(out, seeded)
    code2 = main([*TOY, *SEEDS, "--out", str(seeded)])
    return code, out, code2, seeded


def test_study_writes_tables_plots_and_run_jsons(study):
    code, out, _, _ = study
    assert code == 0
    for wl in ("text", "digits", "digits-ae"):
        for plot in ("heldout_vs_step", "heldout_vs_bytes", "pareto"):
            assert (out / f"{wl}_{plot}.png").read_bytes()[:8] == PNG
    doc = json.loads((out / "study.json").read_text())
    assert set(doc) >= {
        "preset",
        "world_size",
        "backend",
        "machine",
        "date",
        "tables",
        "pareto_front",
        "files",
        "table_markdown",
        "workload_info",
        "lr_selection",
    }
    assert doc["world_size"] == 2 and doc["backend"] == "gloo" and doc["seeds"] == 1
    assert set(doc["machine"]) >= {"cpu", "cores", "torch", "triton"}
    for wl in ("text", "digits", "digits-ae"):
        rows = {r["method"]: r for r in doc["tables"][wl]}
        assert list(rows) == METHODS
        for m in METHODS:
            assert rows[m]["best_lr"] is not None and rows[m]["lrs_tried"] == 1 and rows[m]["seeds"] == 1
        assert rows["adamw"]["ratio_to_dense"] == 1.0
        assert rows["demo-compact-k32-c64"]["bytes_per_step"] < rows["adamw"]["bytes_per_step"]
        assert set(doc["pareto_front"][wl]) <= set(METHODS)
    md = (out / "table.md").read_text()
    assert "best of" in md and "gloo" in md and all(m in md for m in METHODS)
    with open(out / "table.csv") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == TABLE_FIELDS
        assert len(list(reader)) == 3 * len(METHODS)
    # phase 3: AdamW and the only method at >= 100x fewer bytes (SparseLoCo), 3x the steps
    longer = doc["long_horizon_rows"]["text"]
    assert [r["method"] for r in longer] == ["adamw", "sparseloco-h10-k64-int2"]
    assert all(r["status"] == "ok" and r["steps"] == 3 * STEPS for r in longer)
    assert longer[1]["gap_vs_adamw"] and "longer horizon" in md
    assert doc["target_check"]["method"] == "sparseloco-h10-k64-int2" and "**Target**" in md
    n_long = sum(len(rows) for rows in doc["long_horizon_rows"].values())
    with open(out / "runs.csv") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == RUN_FIELDS
        assert len(list(reader)) == 3 * len(METHODS) + n_long  # 3 workloads x 1 seed, + phase 3


def test_headline_methods_get_more_seeds_at_their_best_lr(study):
    _, _, code, seeded = study
    assert code == 0
    doc = json.loads((seeded / "study.json").read_text())
    assert list(doc["tables"]) == ["digits"] and doc["seeds"] == 2
    for row in doc["tables"]["digits"]:  # all three are headline methods
        assert row["seeds"] == 2 and row["final_heldout_loss_std"] is not None
        assert (
            row["final_heldout_loss_min"] <= row["final_heldout_loss_mean"] <= row["final_heldout_loss_max"]
        )
    assert "±" in (seeded / "table.md").read_text()


def test_run_json_schema(study):
    _, _, _, seeded = study
    runs = sorted(p for wl in ("text", "digits", "digits-ae") for p in (seeded / "runs" / wl).rglob("*.json"))
    assert len(runs) == 4 * len(METHODS)  # text and digits-ae seed 0, digits seeds 0 and 1
    for path in runs:
        doc = json.loads(path.read_text())
        assert set(doc) >= {
            "key",
            "workload",
            "method",
            "family",
            "lr",
            "seed",
            "steps",
            "world_size",
            "status",
            "summary",
            "evals",
            "series",
        }
        assert doc["status"] == "ok" and doc["steps"] == STEPS and doc["world_size"] == 2
        assert set(doc["summary"]) == set(SUMMARY_FIELDS)
        assert doc["summary"]["max_replica_diff"] == 0.0  # every method keeps replicas identical
        assert [e["step"] for e in doc["evals"]][0] == 0 and doc["evals"][-1]["step"] == STEPS
        for series in ("train_loss", "bytes_sent", "step_s", "opt_s"):
            assert len(doc["series"][series]) == STEPS
        # 2 dense warm-up steps, then low-rank payloads (the toy autoencoder's tensors are too
        # small for PowerSGD's min_compression_rate: they all stay dense)
        if doc["method"] == "powersgd-r4" and doc["workload"] != "digits-ae":
            sent = doc["series"]["bytes_sent"]
            assert sent[0] == sent[1] == doc["summary"]["dense_bytes_per_step"] > sent[3] > 0


def test_rerun_skips_finished_runs(study, capsys):
    _, _, _, seeded = study
    capsys.readouterr()
    assert main([*TOY, *SEEDS, "--out", str(seeded)]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "to run" in ln]
    assert len(lines) == 2 and all(", 0 to run" in ln for ln in lines)  # 2 phases x 1 workload


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--methods", "adamw,nope"], "unknown method 'nope'"),
        (["--methods", "adamw,adamw"], "without repeats"),
        (["--workloads", "images"], "workloads must be"),
        (["--world-size", "0"], "world size"),
        (["--seeds", "0"], "seeds"),
        (["--steps", "0"], "steps"),
        (["--quick", "--preset", "full"], "conflicts"),
    ],
)
def test_bad_arguments_are_one_line_errors(argv, needle, capsys, tmp_path):
    assert main(["bench", "validate", "--out", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


def test_presets_cover_the_issue():
    full = make_config("full")
    assert full.world_size == 4 and full.seeds == 3 and full.lr_points == 4
    assert set(full.methods) == set(method_catalog())
    assert full.headline == ["adamw", "muon", "powersgd-r4", "demo-compact-k32-c64"]
    labels = set(full.methods)
    assert {f"demo-compact-k{k}-c{c}" for k in (4, 8, 16, 32, 64) for c in (32, 64)} <= labels
    assert {"sgd-momentum", "muon", "powersgd-r1", "demo-reference-k32-c64", "demo-sign-k32-c64"} <= labels
    for wl in full.workloads:
        for m in full.methods:
            assert len(wl.grid(full.method(m).family, 4)) == 4
    quick = make_config("quick")
    assert quick.seeds == 1 and {w.name for w in quick.workloads} == {"text", "digits", "digits-ae"}
    assert full.long_horizon and not quick.long_horizon


def test_pareto_front():
    pts = [("a", 100.0, 2.0), ("b", 10.0, 2.5), ("c", 50.0, 2.6), ("d", 1000.0, 1.9), ("e", 10.0, 2.4)]
    assert pareto_front(pts) == ["e", "a", "d"]


def test_digits_split_and_batches_are_deterministic():
    y = np.repeat(np.arange(10), 20)
    tr, ho = split_indices(y, 0.25, seed=0)
    assert len(ho) == 50 and not set(tr) & set(ho) and len(tr) + len(ho) == 200
    assert all((y[ho] == c).sum() == 5 for c in range(10))  # stratified
    tr2, ho2 = split_indices(y, 0.25, seed=0)
    assert np.array_equal(tr, tr2) and np.array_equal(ho, ho2)
    assert not np.array_equal(ho, split_indices(y, 0.25, seed=1)[1])

    w = DigitsWorkload(DigitsWorkloadConfig(hidden=(16,), batch_size=5))
    x, lab = w.train_batch(seed=1, step=3, rank=1, world_size=2)
    assert x.shape == (5, 64) and lab.shape == (5,) and x.dtype == torch.float32
    assert float(x.min()) >= -1 and float(x.max()) <= 1
    x2, _ = w.train_batch(1, 3, 1, 2)
    assert torch.equal(x, x2) and not torch.equal(x, w.train_batch(1, 4, 1, 2)[0])
    shard = w.shard(1, 2)
    rows = {tuple(r.tolist()) for r in w.train_x[shard]}
    assert all(tuple(r.tolist()) in rows for r in x)  # sampled from this rank's shard
    m1, m2 = w.build_model(3), w.build_model(3)
    assert all(torch.equal(a, b) for a, b in zip(m1.parameters(), m2.parameters(), strict=True))
    assert sum(b[1].numel() for b in w.heldout_batches()) == w.heldout_y.numel()
    assert w.loss(m1, (x, lab)).ndim == 0
    acc = heldout_accuracy(m1, [(x, lab)], rank=0, world=1)
    assert acc in {c / 5 for c in range(6)}  # correct / total over the 5 examples


def _rec(method, family, lr, loss, ratio, seed=0, evals=None, steps=10):
    summary = {
        "final_heldout_loss": loss,
        "ratio_to_dense": ratio,
        "bytes_per_step": 0,
        "mean_bytes_per_step": 5.0,
    }
    return {
        "method": method,
        "family": family,
        "lr": lr,
        "seed": seed,
        "steps": steps,
        "status": "ok",
        "summary": summary,
        "evals": [{"step": s, "heldout_loss": v} for s, v in (evals or {}).items()],
    }


def test_headline_and_long_horizon_pick_per_family_bests_and_the_best_at_100x():
    from cokit.validation.grid import headline_methods, long_methods

    cfg = make_config(
        "full",
        methods=[
            "adamw",
            "demo-compact-k32-c64",
            "demo-compact-k8-c64",
            "demo-rms-k32-c64",
            "sparseloco-h10-k64-int2",
        ],
    )
    recs = [
        _rec("adamw", "adamw", 1e-3, 2.0, 1.0),
        _rec("adamw", "adamw", 3e-3, 1.9, 1.0),
        _rec("demo-compact-k32-c64", "demo", 1e-3, 2.1, 32.0),
        _rec("demo-compact-k8-c64", "demo", 1e-3, 2.3, 126.0),
        _rec("demo-rms-k32-c64", "demo-rms", 1e-3, 2.05, 32.0),
        _rec("sparseloco-h10-k64-int2", "sparseloco", 1e-3, 2.2, 900.0),
        _rec("sparseloco-h10-k64-int2", "sparseloco", 3e-3, 2.0, 900.0, seed=1),  # not a sweep run
    ]
    # fixed headline first, then per family the best and the best at >= 100x
    assert headline_methods(cfg, recs) == [
        "adamw",
        "demo-compact-k32-c64",
        "demo-compact-k8-c64",
        "demo-rms-k32-c64",
        "sparseloco-h10-k64-int2",
    ]
    assert long_methods(cfg, recs) == ["adamw", "sparseloco-h10-k64-int2"]  # 2.2 beats k8's 2.3 at >= 100x


def test_target_check_and_horizon_table():
    from cokit.validation.report import horizon_markdown, horizon_rows, target_check, target_markdown

    rows = [
        {
            "method": "adamw",
            "final_heldout_loss_mean": 2.0,
            "final_heldout_loss_std": 0.02,
            "seeds": 3,
            "ratio_to_dense": 1.0,
            "final_heldout_loss_min": 1.98,
        },
        {
            "method": "a",
            "final_heldout_loss_mean": 2.04,
            "final_heldout_loss_std": 0.01,
            "seeds": 3,
            "ratio_to_dense": 150.0,
            "final_heldout_loss_min": 2.03,
        },
        {
            "method": "b",
            "final_heldout_loss_mean": 2.01,
            "final_heldout_loss_std": None,
            "seeds": 1,
            "ratio_to_dense": 50.0,
            "final_heldout_loss_min": 2.01,
        },
    ]
    target = {"workload": "text", "max_delta_vs_adamw": 0.03, "min_ratio_to_dense": 100.0}
    t = target_check({"text": rows}, target)
    assert t["method"] == "a" and t["relative_delta"] == pytest.approx(0.02) and t["met"]
    assert "**met**" in target_markdown(t)
    rows[1]["final_heldout_loss_mean"] = 2.1
    t = target_check({"text": rows}, target)
    assert not t["met"] and "missed** by 2.0 percentage points" in target_markdown(t)
    rows[1]["ratio_to_dense"] = 99.0
    assert target_check({"text": rows}, target)["method"] is None
    assert target_check({"digits": rows}, target) is None

    longer = [
        _rec("a", "demo", 1e-3, 2.5, 150.0, evals={0: 4.0, 10: 3.0, 20: 2.8, 30: 2.5}, steps=30),
        _rec("adamw", "adamw", 1e-3, 2.0, 1.0, evals={0: 4.0, 10: 2.5, 20: 2.2, 30: 2.0}, steps=30),
    ]
    h = horizon_rows(rows, longer)
    assert [r["method"] for r in h] == ["adamw", "a"]
    assert h[1]["gap_vs_adamw"][30] == pytest.approx(0.25) and h[1]["gap_vs_adamw"][10] == pytest.approx(0.2)
    md = horizon_markdown("text", h)
    assert "2.500 (+25.0%)" in md and "held-out @ 30" in md
