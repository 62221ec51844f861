"""``cokit demo`` and the training runner, at toy size on 2 spawned gloo ranks."""

import csv
import json
import math

import pytest
import torch

from cokit.cli import main
from cokit.compress.stats import ring_allreduce_bytes
from cokit.launch import free_port
from cokit.train import MethodSpec, RunResult, run_distributed, run_methods
from tests.helpers import toy_workload

TOY_ARGS = ["--model", "toy", "--max-chars", "100000", "--batch-size", "4", "--eval-every", "3", "--quiet"]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    argv = ["demo", "--ranks", "2", "--steps", "6", "--sync-every", "3", "--price-per-hour", "2.5"]
    code = main([*argv, "--out", str(out), *TOY_ARGS])
    return code, out


def test_demo_writes_json_csv_png(demo_run, capsys):
    code, out = demo_run
    assert code == 0
    for name in ("demo.json", "demo.csv", "demo.png"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    doc = json.loads((out / "demo.json").read_text())
    assert set(doc) >= {"cokit_version", "created", "config", "summary", "methods"}
    cfg = doc["config"]
    assert cfg["world_size"] == 2 and cfg["device"] == "cpu" and cfg["backend"] == "gloo"
    assert cfg["steps"] == 6 and cfg["workload"]["corpus"]["chars"] == 100_000
    summary = {s["method"]: s for s in doc["summary"]}
    assert set(summary) == {"demo", "sparseloco", "adamw"}
    for s in summary.values():
        assert set(s) >= {
            "final_train_loss",
            "final_heldout_loss",
            "bytes_per_step",
            "compression_ratio",
            "time_per_step_s",
            "max_replica_diff",
        }
        assert math.isfinite(s["final_train_loss"]) and math.isfinite(s["final_heldout_loss"])
        assert s["max_replica_diff"] == 0.0  # every rank ends with the same parameters
    demo, adamw = summary["demo"], summary["adamw"]
    assert 0 < demo["bytes_per_step"] < adamw["bytes_per_step"] / 4
    n_params = cfg["num_params"]
    assert adamw["bytes_per_step"] == ring_allreduce_bytes(4 * n_params, 2)
    assert demo["compression_ratio"] > 4 and adamw["compression_ratio"] == 1.0
    sparse = summary["sparseloco"]  # two syncs in six steps; nothing sent in between
    assert 0 < sparse["bytes_per_step"] < adamw["bytes_per_step"] / 4
    sent = next(m for m in doc["methods"] if m["spec"]["name"] == "sparseloco")["series"]["bytes_sent"]
    assert sent[1] == sent[3] == sent[4] == 0 < sent[5]  # steps 3 and 6 sync
    assert sent[2] > sent[0] > 0  # step 1 carries the first-step settings check
    cost = cfg["cost_per_epoch"]  # --price-per-hour: an epoch is the training text once over the ranks
    steps = math.ceil(cfg["workload"]["corpus"]["train_chars"] / (4 * cfg["workload"]["seq_len"] * 2))
    assert cost["price_per_hour"] == 2.5 and {r["method"] for r in cost["rows"]} == set(summary)
    for row in cost["rows"]:
        series = next(m for m in doc["methods"] if m["summary"]["method"] == row["method"])["series"][
            "step_s"
        ]
        assert row["mean_step_s"] == pytest.approx(sum(series[1:]) / len(series[1:]))
        assert row["steps_per_epoch"] == steps
        assert row["cost_per_epoch"] == pytest.approx(row["mean_step_s"] * steps / 3600 * 2 * 2.5)
    for m in doc["methods"]:
        # the test process runs the Triton interpreter; spawned demo ranks take the torch path
        assert m["environment"]["kernel_path"] == "torch" and m["environment"]["backend"] == "gloo"
        assert [e["step"] for e in m["evals"]] == [0, 3, 6]
        assert len(m["series"]["train_loss"]) == len(m["series"]["bytes_sent"]) == 6
    # both methods start from the same weights and see the same held-out text
    assert doc["methods"][0]["evals"][0] == doc["methods"][1]["evals"][0]

    rows = list(csv.DictReader((out / "demo.csv").open()))
    assert len(rows) == 3 * 7
    assert set(rows[0]) >= {"method", "step", "train_loss", "heldout_loss", "bytes_sent", "cum_bytes_sent"}
    last = {r["method"]: r for r in rows if r["step"] == "6"}
    assert int(last["demo"]["cum_bytes_sent"]) < int(last["adamw"]["cum_bytes_sent"])


def test_runner_is_deterministic_and_counts_dense_bytes():
    specs = [
        MethodSpec("adamw", 3e-3),
        MethodSpec("adamw", 3e-3, label="again"),
        MethodSpec("sgd", 0.1, options={"momentum": 0.9}),
    ]
    results = run_distributed(run_methods, specs, toy_workload(), 4, 1, 2, "cpu", False, world_size=2)
    a, b, sgd = results
    assert isinstance(a, RunResult) and a.steps == 4 and a.world_size == 2
    assert a.train_loss == b.train_loss and a.evals == b.evals  # same seed, same data order
    assert sgd.evals[0] == a.evals[0] and sgd.train_loss[0] == a.train_loss[0]
    assert sgd.train_loss[1:] != a.train_loss[1:]
    assert set(a.bytes_sent) == {ring_allreduce_bytes(4 * a.num_params, 2)}
    assert [s for s, _ in a.evals] == [0, 2, 4]
    assert a.max_replica_diff == 0.0
    assert all(t >= o >= 0 for t, o in zip(a.step_s, a.opt_s, strict=True))
    assert a.wall_s == sorted(a.wall_s)


def test_torchrun_environment_runs_in_process(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    assert main(["demo", "--steps", "2", "--methods", "adamw", "--out", str(tmp_path), *TOY_ARGS]) == 0
    assert not torch.distributed.is_initialized()  # the group it created is gone
    doc = json.loads((tmp_path / "demo.json").read_text())
    assert doc["config"]["torchrun"] is True and doc["config"]["world_size"] == 1
    assert capsys.readouterr().err == ""


BAD = [
    (["--steps", "0"], "--steps"),
    (["--steps", "-3"], "--steps"),
    (["--ranks", "0"], "--ranks"),
    (["--ranks", "100000"], "--ranks"),
    (["--topk", "0"], "--topk"),
    (["--topk", "5000", "--chunk", "64"], "--topk"),
    (["--chunk", "0"], "--chunk"),
    (["--demo-lr", "-1"], "--demo-lr"),
    (["--eval-every", "0"], "--eval-every"),
    (["--methods", "demo,bogus"], "--methods"),
    (["--sync-every", "0"], "--sync-every"),
    (["--sparseloco-topk", "0"], "--sparseloco-topk"),
    (["--sparseloco-lr", "nan"], "--sparseloco-lr"),
    (["--d-model", "30", "--heads", "4"], "divisible"),
    (["--price-per-hour", "nan"], "--price-per-hour"),
]


@pytest.mark.parametrize("argv,needle", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_arguments_give_one_line_errors(argv, needle, capsys, tmp_path):
    assert main(["demo", "--out", str(tmp_path / "x"), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("cokit demo: error:") and needle in err[0], err
    assert not (tmp_path / "x").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_cuda_without_gpu_is_a_one_line_error(capsys):
    assert main(["demo", "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "GPU" in err[0]


def test_torchrun_rank_mismatch_is_a_one_line_error(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert main(["demo", "--ranks", "2"]) == 2
    assert "WORLD_SIZE=3" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--bogus"], ["--payload", "zip"], ["--steps", "ten"]])
def test_usage_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["demo", *argv])
    assert exc.value.code == 2
    assert "Traceback" not in capsys.readouterr().err
