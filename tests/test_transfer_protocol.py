"""The held-out protocol (cokit.bench.study.transfer): its rules on hand-made run records, its
argument checks, and one toy run end to end on real gloo ranks."""

import json
import math
import os
from pathlib import Path

import pytest

from cokit.bench.study import transfer
from cokit.bench.study import transfer_report as tr


def rec(method, lr, seed, loss, ratio=1.0, status="ok", evals=None):
    """A run record as cokit.validation.runs.run_record writes it (the fields the protocol reads)."""
    return {
        "method": method,
        "lr": lr,
        "seed": seed,
        "status": status,
        "summary": {
            "final_heldout_loss": loss,
            "ratio_to_dense": ratio,
            "bytes_per_step": 100,
            "mean_bytes_per_step": 100.0 / ratio,
        },
        "evals": evals
        if evals is not None
        else [{"step": 0, "heldout_loss": 3.0}, {"step": 8, "heldout_loss": loss}],
    }


def test_adamw_lr_is_chosen_by_its_seed_mean_and_a_failed_seed_rules_an_lr_out():
    runs = [
        rec("adamw", 1e-3, 0, 1.0),
        rec("adamw", 1e-3, 1, 1.6),  # mean 1.3
        rec("adamw", 3e-3, 0, 1.1),
        rec("adamw", 3e-3, 1, 1.2),  # mean 1.15: best by the mean, not by seed 0
        rec("adamw", 1e-2, 0, 0.5),
        rec("adamw", 1e-2, 1, None, status="diverged"),  # a diverged seed: never chosen
    ]
    assert tr.choose_lr(runs, 1) == 1e-2
    assert tr.choose_lr(runs, 2) == 3e-3
    assert tr.lr_means(runs, 2)[1e-2] == math.inf
    assert tr.choose_lr([rec("adamw", 1e-3, 0, None, status="failed")], 1) is None


def test_a_winning_grid_edge_gets_the_next_half_decade_and_interior_wins_do_not():
    grid = [1e-3, 3e-3, 1e-2, 3e-2]
    assert tr.extend_grid(grid, 3e-2) == 0.1
    assert tr.extend_grid(grid, 1e-3) == 3e-4
    assert tr.extend_grid([*grid, 0.1], 0.1) == 0.3
    assert tr.extend_grid(grid, 3e-3) is None
    assert tr.extend_grid([1e-3], 1e-3) is None
    assert tr.extend_grid(grid, None) is None
    assert tr.at_edge(grid, 1e-3) and not tr.at_edge(grid, 1e-2)


def test_selection_takes_the_smallest_mean_gap_among_candidates_at_the_tier_ratio_everywhere():
    records = {
        "a-x3": [
            rec("adamw", 1e-3, 0, 1.0),
            rec("adamw", 3e-3, 0, 1.2),
            rec("close", 1e-3, 0, 1.01, ratio=50),
            rec("small", 1e-3, 0, 1.05, ratio=150),
            rec("small", 3e-3, 0, 1.02, ratio=150),  # its best lr
            rec("tiny", 1e-3, 0, 1.20, ratio=400),
        ],
        "b-x3": [
            rec("adamw", 1e-3, 0, 2.0),
            rec("close", 1e-3, 0, 2.02, ratio=40),
            rec("small", 1e-3, 0, 2.10, ratio=120),
            rec("tiny", 1e-3, 0, 2.20, ratio=90),  # under 100x here: not a >= 100x candidate
        ],
    }
    scores = {s["method"]: s for s in tr.selection_scores(records, ["close", "small", "tiny", "absent"])}
    assert scores["small"]["gaps"] == pytest.approx({"a-x3": 0.02, "b-x3": 0.05})
    assert scores["small"]["mean_gap"] == pytest.approx(0.035) and scores["small"][
        "max_gap"
    ] == pytest.approx(0.05)
    assert scores["tiny"]["min_ratio"] == 90
    assert scores["absent"]["mean_gap"] is None
    chosen = tr.choose_per_tier(list(scores.values()), [(30.0, 0.01), (100.0, 0.03), (300.0, 0.05)])
    assert chosen == {30.0: "close", 100.0: "small", 300.0: None}


def test_held_out_rows_gap_curves_and_targets_say_met_or_missed_by_how_much():
    def curve(v4, v8):
        return [
            {"step": 0, "heldout_loss": 3.0},
            {"step": 4, "heldout_loss": v4},
            {"step": 8, "heldout_loss": v8},
        ]

    runs = [
        rec("adamw", 1e-3, 0, 1.0, evals=curve(2.0, 1.0)),
        rec("adamw", 1e-3, 1, 1.2, evals=curve(2.2, 1.2)),
        rec("adamw", 3e-3, 0, 1.5, evals=curve(2.5, 1.5)),
        rec("adamw", 3e-3, 1, 1.5, evals=curve(2.5, 1.5)),
        rec("m", 1e-3, 0, 1.122, ratio=150, evals=curve(2.31, 1.122)),
        rec("m", 1e-3, 1, 1.078, ratio=150, evals=curve(2.09, 1.078)),
        rec("m", 3e-3, 0, 1.3, ratio=150),
    ]
    grids = {"adamw": [1e-3, 3e-3], "m": [1e-3, 3e-3]}
    rows = tr.result_rows(runs, ["adamw", "m"], 2, grids)
    base, m = rows
    assert base["lr"] == 1e-3 and base["heldout_mean"] == pytest.approx(1.1) and base["seeds"] == 2
    assert m["heldout_mean"] == pytest.approx(1.1) and m["gap_vs_adamw"] == pytest.approx(0.0)
    assert m["heldout_std"] == pytest.approx(math.sqrt(2) * 0.022) and m["lr_at_edge"]
    gaps = tr.gap_curve(runs, rows, 2)
    assert gaps["m"] == pytest.approx({4: 2.2 / 2.1 - 1, 8: 0.0})
    out = tr.tier_results({"w@3x": rows}, {100.0: "m", 300.0: "m"}, [(100.0, 0.03), (300.0, 0.05)])
    assert out[0]["met"] and out[0]["gap_over_tolerance"] == 0.0
    assert not out[1]["met"] and out[1]["ratio_short"] == pytest.approx(150.0)
    rows[1]["gap_vs_adamw"] = 0.08
    worse = tr.tier_results({"w@3x": rows}, {100.0: "m"}, [(100.0, 0.03)])[0]
    assert not worse["met"] and worse["gap_over_tolerance"] == pytest.approx(0.05)
    assert tr.gap_range(out, 100.0, "@3x") == (0.0, 0.0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"preset": "huge"}, "unknown preset"),
        ({"select": ["text"], "heldout": ["text"]}, "both selection and held-out"),
        ({"heldout": ["nope"]}, "held-out workloads must be distinct names"),
        ({"candidates": ["adamw"]}, "candidates must be distinct compressed methods"),
        ({"candidates": ["sparseloco-h5-k64-int2", "sparseloco-h5-k64-int2"]}, "candidates"),
        ({"seeds": 0}, r"seeds must be in \[1, 10\]"),
        ({"world_size": 1}, "compression needs ranks"),
    ],
)
def test_bad_protocol_settings_fail_before_anything_runs(kwargs, match, tmp_path):
    preset = kwargs.pop("preset", "toy")
    with pytest.raises(ValueError, match=match):
        transfer.make_config(preset, out_dir=str(tmp_path / "out"), **kwargs)
    assert not (tmp_path / "out").exists()


def test_a_partial_report_tells_rows_not_run_yet_from_failed_ones():
    grids = {"adamw": [1e-3], "sparseloco": [1e-3]}
    rows = tr.result_rows([rec("adamw", 1e-3, 0, None, status="failed")], ["adamw", "sparseloco"], 1, grids)
    assert [transfer.loss_cell(r) for r in rows] == ["failed", "not run yet"]
    rows = tr.result_rows([rec("adamw", 1e-3, s, 2.0 + s) for s in range(2)], ["adamw"], 2, grids)
    assert transfer.loss_cell(rows[0]) == "2.5000 ± 0.7071"


def test_the_full_protocol_holds_out_three_kinds_and_sizes_a_1m_parameter_lm():
    cfg = transfer.make_config("full")
    assert [w.name for w in cfg.select] == ["text", "digits", "digits-ae"]
    assert [w.name for w in cfg.heldout] == ["prose", "c-1m", "digits-cnn"]
    assert cfg.long == ("digits-cnn", 10) and cfg.seeds == 3 and cfg.horizons == (1, 3)
    sizes = {}
    for w in cfg.select + cfg.heldout:
        model = w.factory.build("cpu").build_model(0)
        sizes[w.name] = sum(p.numel() for p in model.parameters())
    assert sizes["c-1m"] >= 1_000_000 and sizes["prose"] > sizes["text"]
    for name, w in transfer.make_workloads("toy").items():  # the toy corpora split too (prose: few files)
        assert w.factory.build("cpu").heldout_batches(), name
    sources = {w.factory.corpus.source for w in cfg.select + cfg.heldout if hasattr(w.factory, "corpus")}
    assert sources == {"python", "prose", "c"}


def test_cli_refuses_grid_options_with_the_transfer_protocol_and_the_reverse(capsys):
    from cokit.cli import main

    assert main(["bench", "validate", "--protocol", "transfer", "--methods", "adamw"]) == 2
    assert "drop --methods" in capsys.readouterr().err
    assert main(["bench", "validate", "--select", "text"]) == 2
    assert "belong to --protocol transfer" in capsys.readouterr().err


@pytest.mark.slow  # about a minute: 2 gloo ranks, selection, 1x/3x/10x held-out, 2 seeds
def test_toy_protocol_selects_on_one_workload_reports_on_another_and_resumes(tmp_path, capsys):
    from cokit.cli import main

    out = tmp_path / "transfer"
    argv = [
        "bench",
        "validate",
        "--protocol",
        "transfer",
        "--preset",
        "toy",
        "--select",
        "digits",
        "--heldout",
        "digits-cnn",
        "--candidates",
        "sparseloco-h5-k64-int2,demo-ns-k32-c64",
        "--seeds",
        "2",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    doc = json.loads((out / "transfer.json").read_text())
    assert set(doc["heldout_tables"]) == {"digits-cnn@1x", "digits-cnn@3x", "digits-cnn@10x"}
    assert [s["method"] for s in doc["selection"]] == ["muon", "sparseloco-h5-k64-int2", "demo-ns-k32-c64"]
    picked = [m for m in doc["chosen"].values() if m]
    assert "muon" not in picked  # a dense baseline is scored, never chosen
    for name, rows in doc["heldout_tables"].items():
        assert [r["method"] for r in rows] == ["adamw", "muon", *dict.fromkeys(picked)]
        assert rows[0]["seeds"] == rows[1]["seeds"] == 2 and rows[0]["gap_vs_adamw"] == 0.0, name
        best = min(rows[:2], key=lambda r: r["heldout_mean"])["method"]
        for r in rows:
            assert r["best_dense"] == best and r["baseline"] == ("muon" if r["method"] == "muon" else "adamw")
    runs = [os.path.join(d, f) for d, _, fs in os.walk(out / "runs") for f in fs]
    assert any("digits-cnn-x10" in p for p in runs) and any("digits-x3" in p for p in runs)
    for p in runs:  # warm-up and cosine decay for every method alike
        assert json.loads(Path(p).read_text())["schedule"] == {"name": "cosine", "warmup": 0.05}, p
    md = (out / "transfer.md").read_text()
    assert "Targets" in md and "| vs own dense | vs best dense |" in md
    before = {p: os.path.getmtime(p) for p in runs}
    capsys.readouterr()
    assert main([*argv, "--report-only"]) == 0  # nothing re-runs; the same report
    assert {p: os.path.getmtime(p) for p in runs} == before
    assert json.loads((out / "transfer.json").read_text())["heldout_tables"] == doc["heldout_tables"]


def test_the_variants_map_to_sparseloco_options_that_fit_every_model():
    import torch

    from cokit.train import end_layers

    methods = transfer.transfer_methods()
    assert all(c in methods for c in transfer.CANDIDATES)
    warm = methods["sparseloco-h5-k64-int2-warm1"].spec(1e-3, 0, 750).options
    assert warm["dense_warmup"] == 8 and "dense_warmup_fraction" not in warm
    assert methods["sparseloco-h15-k64-int2-muon"].family == "sparseloco-muon"
    lm = transfer.make_workloads("toy")["text"]
    assert lm.grid("sparseloco-muon", 4) == (3e-3, 1e-2, 3e-2, 0.1)
    assert lm.grid("sparseloco", 4) == lm.grid("adamw", 4)

    def names(model):
        return end_layers(list(model.named_parameters()))

    assert names(lm.factory.build("cpu").build_model(0)) == ("pos_emb", "tok_emb.weight", "head.weight")
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    assert names(mlp) == ("0.weight", "1.weight")
    with pytest.raises(ValueError, match="no parameter of 2 or more dimensions"):
        names(torch.nn.LayerNorm(4))
