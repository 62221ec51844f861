"""The decomposition study mode (cokit.bench.study.decompose): each row's configuration differs
from its parent's in its ingredient only, bad inputs are one clear error before anything runs,
and one toy run on 2 real gloo ranks writes every row, with bytes ratios from first principles."""

from __future__ import annotations

import argparse
import csv
import json
import math
import os

import pytest
import torch
from helpers import STATUS_ROW

from cokit.bench.study import decompose as dc
from cokit.bench.study import transfer
from cokit.compress.buckets import sends_dense
from cokit.compress.payload import get_codec
from cokit.triton_kernels import tiling
from cokit.validation import cli

LRS = {"muon": 0.03, "adamw": 0.003}
SETTING = "sparseloco-h5-k64-int2-muon"


def _opts(cfg: dc.DecomposeConfig, name: str) -> dict:
    return dict(cfg.rows[name].options)


@pytest.mark.parametrize("setting", [SETTING, "sparseloco-h10-k16-int2", "sparseloco-h15-k64-int2-nesterov"])
def test_every_row_differs_from_its_parent_in_its_ingredient_only(setting):
    cfg = dc.make_config(setting, "toy", horizon=10, lrs=LRS)
    full = dict(cfg.method(setting).options)
    h, k = full["sync_every"], full["topk"]
    nesterov = full.get("outer") == "nesterov"
    assert cfg.ingredients == list(dc.INGREDIENTS)
    assert cfg.dense == ("muon" if "muon" in setting else "adamw")
    assert cfg.other_dense == ("adamw" if "muon" in setting else "muon")
    for name, ing in dc.INGREDIENTS.items():
        if ing.parent is None:
            continue
        differ = dc.option_groups_differing(cfg.rows[ing.parent], cfg.rows[name])
        assert differ and differ <= set(ing.groups), (name, differ)
        if name != "local-average":  # the inner optimizer is the same in every row
            assert _opts(cfg, name).get("inner") == full.get("inner")
    # the ingredients themselves
    local = _opts(cfg, "local-average")
    assert (local["sync_every"], local["topk"], local["outer"]) == (1, None, "average")
    sparse = _opts(cfg, "sparsify")
    assert (sparse["sync_every"], sparse["topk"], sparse["payload"], sparse["value_dtype"]) == (
        1,
        k,
        "compact",
        "float32",
    )
    assert sparse["error_decay"] == 0.95 and sparse["outer"] == "average"
    quant = _opts(cfg, "quantize")
    expected = {**sparse, "payload": full["payload"]}
    del expected["value_dtype"]  # the setting's codec at its own value dtype
    assert quant == expected
    assert _opts(cfg, "no-error-feedback") == {**quant, "error_decay": 0.0}
    interval = _opts(cfg, "interval")
    assert (interval["sync_every"], interval["topk"], interval["outer"]) == (h, None, "average")
    outer = _opts(cfg, "outer")
    assert outer == {**interval, "outer": "nesterov", "outer_lr": 0.7, "outer_momentum": 0.9}
    # the full row is the setting (plus the defaults it leaves out)
    got = _opts(cfg, "full")
    assert {k: got[k] for k in full} == full
    assert got["error_decay"] == 0.95 and got["outer"] == ("nesterov" if nesterov else "average")
    assert _opts(cfg, "full-no-error-feedback") == {**got, "error_decay": 0.0}
    other = _opts(cfg, "full-other-outer")
    assert other["outer"] == ("average" if nesterov else "nesterov")
    assert dc.option_groups_differing(cfg.rows["full"], cfg.rows["full-other-outer"]) == {"outer"}
    assert dc.option_groups_differing(cfg.rows["quantize"], cfg.rows["full"]) == (
        {"interval", "outer"} if nesterov else {"interval"}
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ingredients": ["sparsify", "bogus"]}, "ingredients must be distinct names"),
        ({"ingredients": []}, "ingredients must be distinct names"),
        ({"horizon": 0}, "horizon must be a whole factor"),
        ({"horizon": 1.5}, "horizon must be a whole factor"),
        ({"horizon": 1}, "fewer than two syncs of H=5"),
        ({"workloads": ["nope"]}, "workloads must be distinct names"),
        ({"lr_rule": "best"}, "lr rule must be one of"),
        ({"seeds": 0}, "seeds must be in"),
        ({"world_size": 1}, "world size must be in"),
        ({"lrs": {"sgd-momentum": 0.1}}, "is not one of"),
        ({"lrs": {"muon": -1.0}}, "is not a positive number"),
    ],
)
def test_bad_inputs_are_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        dc.make_config(SETTING, "toy", **{"horizon": 3, **kwargs})


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("sparseloco-nope", "unknown setting"),
        ("adamw", "takes a SparseLoCo setting"),
        ("diloco-h10", "has no sparsification to take apart"),
    ],
)
def test_settings_that_cannot_be_taken_apart_are_refused(setting, message):
    with pytest.raises(ValueError, match=message):
        dc.make_config(setting, "toy", horizon=3)


def test_lrs_parse_and_the_cli_checks_its_options():
    assert dc.parse_lrs("muon=0.03, adamw=3e-3") == {"muon": 0.03, "adamw": 0.003}
    for bad in ("muon", "muon=x", "muon=0", "=1e-3"):
        with pytest.raises(ValueError, match="--lrs wants"):
            dc.parse_lrs(bad)
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    with pytest.raises(ValueError, match="drop --methods"):
        cli.config_from_args(p.parse_args(["--decompose", SETTING, "--methods", "adamw"]))
    with pytest.raises(ValueError, match="--ingredients belong to --decompose"):
        cli.config_from_args(p.parse_args(["--ingredients", "sparsify"]))
    cfg = cli.config_from_args(
        p.parse_args(
            ["--decompose", SETTING, "--preset", "toy", "--horizon", "3", "--ingredients", "full,sparsify"]
        )
    )
    assert cfg.ingredients == ["dense", "sparsify", "full"] and cfg.horizon == 3


# ----------------------------------------------------------------------------- one toy run

STEPS = 12  # the toy prose workload (4 steps) at horizon 3: syncs of H=5 at steps 5 and 10
WORLD = 2


def _aligned(n: int) -> int:
    return -(-n // 8) * 8


def _shapes() -> list[tuple[int, ...]]:
    wl = transfer.make_workloads("toy")["prose"].factory.build("cpu")
    return [tuple(p.shape) for p in wl.build_model(0).parameters()]


def _expected_ratio(h: int, topk: int | None, payload: str) -> float:
    """Dense bytes over bytes sent across the run, from first principles: the first step's
    status row and parameter check (8 bytes a tensor); each sync's status row, the ring
    all-gather of the compressed tensors' payload (one bucket: int16 indices, then 2-bit codes
    and a bf16 scale per tile, or fp32 values) and the ring all-reduce of the others (fp32)."""
    shapes = _shapes()
    ring = lambda numel: (2 * (WORLD - 1) * 4 * numel) // WORLD  # noqa: E731
    total = sum(math.prod(s) for s in shapes)
    if topk is None:
        sync = (WORLD - 1) * STATUS_ROW + ring(total)
    else:
        dtype = torch.float32 if payload == "compact" else torch.bfloat16
        codec = get_codec(payload)
        sparse = [s for s in shapes if not sends_dense(s, 64, topk, codec, dtype, WORLD)]
        tilings = [tiling.TensorTiling.of(s, 64) for s in sparse]
        slots = sum(t.n_tiles * t.k_eff(topk) for t in tilings)
        tiles = sum(t.n_tiles for t in tilings)
        if payload == "compact":
            nbytes = _aligned(2 * slots) + _aligned(4 * slots)
        else:
            nbytes = _aligned(2 * slots) + _aligned(-(-slots // 4)) + _aligned(2 * tiles)
        dense_numel = total - sum(math.prod(s) for s in sparse)
        assert sparse  # (a vector compresses too at world 2: its payload is under half its fp32 bytes)
        sync = (WORLD - 1) * (STATUS_ROW + nbytes) + ring(dense_numel)
    sent = (WORLD - 1) * (STATUS_ROW + 8 * len(shapes)) + (STEPS // h) * sync
    return STEPS * ring(total) / sent


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("decompose"))
    cfg = dc.make_config(SETTING, "toy", out_dir=out, horizon=3, lrs=LRS)
    return cfg, dc.run_decomposition(cfg)


@pytest.mark.distributed
def test_a_toy_run_has_every_row_and_writes_files_that_parse(toy_run):
    cfg, doc = toy_run
    rows = doc["tables"]["prose@3x"]
    assert [r["ingredient"] for r in rows] == [*dc.INGREDIENTS, "dense (adamw)"]
    for r in rows:
        assert r["statuses"] == ["ok"] and r["heldout_mean"] is not None, r
        assert len(r["heldout_per_seed"]) == 1 and r["heldout_per_seed"][0] == r["heldout_mean"]
        assert r["lr"] == (0.003 if r["method"] == "adamw" else 0.03)  # the lr rule "dense"
    by = {r["ingredient"]: r for r in rows}
    assert by["dense"]["gap_vs_own_dense"] == 0.0
    best = min(by["dense"]["heldout_mean"], by["dense (adamw)"]["heldout_mean"])
    for r in rows:
        assert r["gap_vs_best_dense"] == pytest.approx(r["heldout_mean"] / best - 1)
    out = cfg.out_dir
    assert set(doc["files"]) == {"decompose.md", "decompose.csv", "decompose.json", "decompose_prose_3x.png"}
    for f in doc["files"]:
        assert os.path.getsize(os.path.join(out, f)) > 0
    with open(os.path.join(out, "decompose.json")) as f:
        saved = json.load(f)
    assert saved["tables"] == json.loads(json.dumps(doc["tables"]))
    with open(os.path.join(out, "decompose.csv"), newline="") as f:
        table = list(csv.DictReader(f))
    assert [r["ingredient"] for r in table] == [r["ingredient"] for r in rows]
    assert float(table[3]["heldout_mean"]) == pytest.approx(rows[3]["heldout_mean"])
    md = doc["markdown"]
    assert all(f"| {r['ingredient']} |" in md for r in rows)
    # nothing reruns: the report rebuilds from the run JSONs
    again = dc.run_decomposition(cfg, report_only=True)
    assert again["tables"] == doc["tables"]


@pytest.mark.distributed
def test_bytes_ratios_match_first_principles(toy_run):
    _, doc = toy_run
    by = {r["ingredient"]: r["ratio_to_dense"] for r in doc["tables"]["prose@3x"]}
    expected = {
        "dense": 1.0,
        "dense (adamw)": 1.0,
        "local-average": _expected_ratio(1, None, "int2"),
        "sparsify": _expected_ratio(1, 64, "compact"),
        "quantize": _expected_ratio(1, 64, "int2"),
        "no-error-feedback": _expected_ratio(1, 64, "int2"),
        "interval": _expected_ratio(5, None, "int2"),
        "outer": _expected_ratio(5, None, "int2"),
        "full": _expected_ratio(5, 64, "int2"),
        "full-no-error-feedback": _expected_ratio(5, 64, "int2"),
        "full-other-outer": _expected_ratio(5, 64, "int2"),
    }
    for name, ratio in expected.items():
        assert by[name] == pytest.approx(ratio, rel=2e-4), name
