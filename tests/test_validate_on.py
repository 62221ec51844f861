"""``cokit bench validate --on module:factory``: the calibration grid on the user's own model and
data (real gloo ranks), its Pareto table and recommendation, and the factory's errors."""

from __future__ import annotations

import json
import textwrap

import pytest

from cokit.cli import main
from cokit.validation.report import recommend

FACTORY = """
import torch
import torch.nn.functional as F

W = torch.randn(12, 4, generator=torch.Generator().manual_seed(3))


def make_workload():
    def batch(gen):
        x = torch.randn(16, 12, generator=gen)
        return x, (x @ W).argmax(1)

    return {
        "model": lambda: torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)),
        "batch": batch,
        "heldout": [batch(torch.Generator().manual_seed(99 + i)) for i in range(2)],
        "loss": lambda model, b: F.cross_entropy(model(b[0]), b[1]),
    }


def not_a_dict():
    return [1, 2]


def missing_loss():
    d = make_workload()
    del d["loss"]
    return d


def raises():
    raise RuntimeError("no data here")
"""


@pytest.fixture
def factory_module(tmp_path, monkeypatch):
    (tmp_path / "calib_factory.py").write_text(textwrap.dedent(FACTORY))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the spawned ranks import it too
    return "calib_factory"


@pytest.mark.distributed
def test_on_runs_the_calibration_grid_and_recommends(factory_module, tmp_path, capsys):
    out = tmp_path / "cal"
    argv = ["bench", "validate", "--on", f"{factory_module}:make_workload", "--steps", "10"]
    argv += [
        "--lr-points",
        "1",
        "--methods",
        "adamw,demo-sign-k32-c64,sparseloco-h5-k64-int2",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    shown = capsys.readouterr().out
    doc = json.loads((out / "study.json").read_text())
    rows = {r["method"]: r for r in doc["tables"]["yours"]}
    assert set(rows) == {"adamw", "demo-sign-k32-c64", "sparseloco-h5-k64-int2"}
    assert all(r["seeds"] == 1 and r["final_heldout_loss_mean"] > 0 for r in rows.values())
    assert rows["demo-sign-k32-c64"]["ratio_to_dense"] > 1 and doc["world_size"] == 2
    assert doc["recommendation"] and doc["recommendation"] in (out / "table.md").read_text()
    assert doc["recommendation"] in shown and "Pareto front of **yours**" in shown
    # the finished runs are reused: a second call runs nothing
    assert main(argv) == 0
    assert "0 to run" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("not_a_dict", "must return a dict"),
        ("missing_loss", "lacks ['loss']"),
        ("raises", "raised RuntimeError: no data here"),
        ("nowhere", "cannot import"),
    ],
)
def test_a_bad_factory_is_a_one_line_error_before_any_rank_starts(
    factory_module, tmp_path, capsys, name, message
):
    assert main(["bench", "validate", "--on", f"{factory_module}:{name}", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_on_refuses_the_studys_own_options(factory_module, capsys):
    assert main(["bench", "validate", "--on", f"{factory_module}:make_workload", "--quick"]) == 2
    assert "--on runs its own grid" in capsys.readouterr().err


def _row(method, loss, ratio, lr=1e-3, edge=False):
    return {
        "method": method,
        "final_heldout_loss_mean": loss,
        "ratio_to_dense": ratio,
        "best_lr": lr,
        "lr_at_edge": edge,
        "baseline": "adamw",
    }


def test_recommend_picks_the_most_compressed_within_tolerance_or_the_closest():
    rows = [_row("adamw", 1.0, 1.0), _row("a", 1.02, 30.0), _row("b", 1.029, 150.0), _row("c", 1.2, 500.0)]
    assert recommend(rows, 0.03, 100).startswith("Recommendation: b at lr 0.001: 150x fewer bytes")
    far = [_row("adamw", 1.0, 1.0), _row("a", 1.1, 30.0, edge=True), _row("c", 1.2, 500.0)]
    text = recommend(far, 0.03, 100)
    assert (
        text.startswith(
            "No compressed method came within 3% of the best dense run: adamw (dense all-reduce) wins. Closest: a"
        )
        and "edge of the grid" in text
    )
    assert recommend([_row("a", 1.0, 9.0)], 0.03, 10).startswith("No recommendation")
