"""DeMo checkpoints: records, checks before anything changes, strict=False, and DCP resume.

The gloo scenarios run in four spawned worlds (tests/gloo_cases.py, fixture ``worlds``):
world 2 saves, world 3 loads those files and saves its own, then each world resumes (and
loads the other's DCP checkpoint) in fresh processes.
"""

from __future__ import annotations

import copy
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    get_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from cokit.compress import DeMo
from cokit.compress.checkpoint import records, relaxed_loading
from tests.gloo_cases import Case, run_cases
from tests.helpers import dcp_load, dcp_save

KW = dict(lr=3e-3, compression_topk=4, compression_chunk=8)


def _model(seed: int = 0, hidden: int = 20) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 3))


def _step(model, opt, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(16, 12, generator=g), torch.randn(16, 3, generator=g)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


@pytest.fixture(autouse=True)
def _torch_path(monkeypatch):
    """In-process tests: kernels take the torch path on CPU tensors (restored afterwards, so
    later tests in this process still run the interpreter)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _trained(steps: int = 3, rank: int = 0, **kw):
    model = _model()
    opt = DeMo(model.named_parameters(), **{**KW, **kw})
    for s in range(1, steps + 1):
        _step(model, opt, rank, s)
    return model, opt


def _snapshot(opt: DeMo):
    """Everything a load may change."""
    return (
        [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
        {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()},
        (opt._steps, opt.skipped_steps, opt.skipped_syncs),
        repr(opt.comm_stats.as_dict()),
        repr(opt.policy_log),
    )


def _same(a, b) -> bool:
    groups_a, state_a, *rest_a = a
    groups_b, state_b, *rest_b = b
    return (
        repr(groups_a) == repr(groups_b)
        and rest_a == rest_b
        and state_a.keys() == state_b.keys()
        and all(
            s.keys() == state_b[k].keys() and all(torch.equal(v, state_b[k][n]) for n, v in s.items())
            for k, s in state_a.items()
        )
    )


def _refused(opt: DeMo, sd, *needles: str, kind=ValueError) -> str:
    """Load ``sd``: it must raise ``kind`` naming every needle and leave ``opt`` unchanged."""
    before = _snapshot(opt)
    with pytest.raises(kind) as info:
        opt.load_state_dict(sd)
    message = str(info.value)
    for needle in needles:
        assert needle in message, message
    assert _same(before, _snapshot(opt)), "a refused load changed the optimizer"
    return message


# ----------------------------------------------------------------------------- format


def test_every_state_records_rank_world_settings_and_type():
    _, opt = _trained()
    fresh = DeMo(_model().named_parameters(), **KW)
    for sd in (opt.state_dict(), fresh.state_dict()):  # a fresh optimizer has zero buffers too
        assert [list(s) for s in sd["state"].values()] == [["delta_rank0"]] * 4
        rec = records(sd)
        common, mine = rec["common"], rec["ranks"][0]
        assert common["optimizer"] == "DeMo" and common["format"] == 2
        assert (common["world"], common["group_world"]) == (1, 1)
        assert common["settings"]["payload"] == "compact" and "groups" not in common["settings"]
        assert common["settings"]["value_dtype"] == "torch.bfloat16"
        assert (mine["rank"], mine["world"], mine["group_rank"], mine["group_world"]) == (0, 1, 0, 1)
    assert records(opt.state_dict())["common"]["steps"] == 3
    assert not fresh.state  # state_dict() does not create live buffers
    assert all(not torch.any(s["delta_rank0"]) for s in fresh.state_dict()["state"].values())


def test_a_plain_round_trip_resumes_bit_identically():
    model, opt = _trained(3)
    saved_model, saved = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    for s in range(4, 7):
        _step(model, opt, 0, s)
    resumed = _model()
    resumed.load_state_dict(saved_model)
    opt2 = DeMo(resumed.named_parameters(), **KW)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a matching load warns about nothing
        opt2.load_state_dict(saved)
    assert opt2._steps == 3 and records(opt2.state_dict())["common"] == records(saved)["common"]
    for s in range(4, 7):
        _step(resumed, opt2, 0, s)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed.parameters(), strict=True))
    assert opt2.comm_stats.steps == opt.comm_stats.steps == 6


def test_dcp_state_dict_functions_load_fqn_keyed_state():
    """``set_optimizer_state_dict`` gives the state keyed by parameter names (it used to raise
    ``TypeError: list indices must be integers or slices, not str``)."""
    model, opt = _trained(3)
    osd = get_optimizer_state_dict(model, opt)
    assert list(osd["state"]) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    model2 = copy.deepcopy(model)
    opt2 = DeMo(model2.named_parameters(), **KW)
    set_optimizer_state_dict(model2, opt2, copy.deepcopy(osd))
    assert opt2._steps == 3
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(opt.state[p]["delta"], opt2.state[q]["delta"])
    msd, osd2 = get_state_dict(model2, opt2)
    set_state_dict(model2, opt2, model_state_dict=msd, optim_state_dict=osd2)
    assert opt2._steps == 3


# ----------------------------------------------------------------------------- refusals


def test_another_optimizers_state_is_refused_before_anything_changes():
    model = _model()
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.nn.functional.mse_loss(model(torch.randn(4, 12)), torch.randn(4, 3)).backward()
    adamw.step()
    _, opt = _trained(2)
    message = _refused(opt, adamw.state_dict(), "not a DeMo state dict", "exp_avg", "AdamW", "betas")
    assert "load only the model" in message


def test_wrong_shapes_and_missing_parameters_are_refused_before_anything_changes():
    _, opt = _trained(2)
    saved = opt.state_dict()
    saved["param_groups"][0]["lr"] = 0.5  # would show if the groups were replaced before the check
    wide = DeMo(_model(hidden=21).named_parameters(), **KW)
    _refused(wide, saved, "has shape (20, 12)", "(21, 12)", "build the same model")
    few = torch.nn.Linear(12, 20)
    _refused(DeMo(few.named_parameters(), **KW), saved, "4 parameters in the checkpoint, 2 here")
    two_groups = DeMo([{"params": [p]} for p in _model().parameters()], **KW)
    _refused(two_groups, saved, "has 1 param groups, this optimizer has 4")
    renamed = copy.deepcopy(opt.state_dict())
    renamed["param_groups"][0]["param_names"][1] = "other.bias"
    _refused(opt, renamed, "'other.bias' in the checkpoint but '0.bias' here")


def test_a_refused_load_of_a_trained_optimizer_keeps_its_lr_and_buffers():
    _, opt = _trained(3)
    bad = opt.state_dict()
    bad = copy.deepcopy(bad)
    bad["param_groups"][0]["lr"] = 0.25
    bad["state"][2]["delta_rank0"] = torch.zeros(3, 19)
    _refused(opt, bad, "'2.weight' (3, 20)", "has shape (3, 19)")
    assert opt.param_groups[0]["lr"] == KW["lr"]


def test_non_finite_buffers_are_refused_or_zeroed_with_a_warning():
    _, opt = _trained(3)
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0]["delta_rank0"][0, 0] = float("nan")
    sd["state"][3]["delta_rank0"][1] = float("inf")
    fresh = DeMo(_model().named_parameters(), **KW)
    _refused(fresh, sd, "non-finite values", "'0.weight'", "'2.bias'", "never move again", "strict=False")
    with pytest.warns(UserWarning, match="strict=False: those buffers start from zero"):
        fresh.load_state_dict(sd, strict=False)
    params = list(fresh.param_groups[0]["params"])
    assert params[0] not in fresh.state and params[3] not in fresh.state
    assert torch.equal(fresh.state[params[1]]["delta"], sd["state"][1]["delta_rank0"])
    assert fresh._steps == 3


def test_other_settings_are_refused_or_kept_with_a_warning():
    _, opt = _trained(2)
    sd = opt.state_dict()
    sign = DeMo(_model().named_parameters(), payload="sign", **KW)
    _refused(sign, sd, "setting 'payload' was 'compact', is 'sign' now", "Nothing changed")
    with pytest.warns(UserWarning, match="kept this optimizer's settings"):
        sign.load_state_dict(sd, strict=False)
    assert sign.payload == "sign" and sign._steps == 2
    bandwidth = DeMo(_model().named_parameters(), policy="bandwidth", **KW)
    _refused(bandwidth, sd, "setting 'policy' was 'StaticPolicy()', is 'BandwidthTargetPolicy(")


def test_old_checkpoints_are_refused_unless_strict_is_false():
    _, opt = _trained(3)
    sd = opt.state_dict()
    old = {  # the layout before checkpoint format 2
        "state": {k: {"delta": v["delta_rank0"].clone()} for k, v in sd["state"].items()},
        "param_groups": [{k: v for k, v in sd["param_groups"][0].items() if not k.startswith("demo")}],
        "demo": {"steps": 3, "skipped_steps": 0, "skipped_syncs": 0, "comm_stats": {}, "policy": None},
    }
    fresh = DeMo(_model().named_parameters(), **KW)
    _refused(fresh, old, "old format", "strict=False")
    with pytest.warns(UserWarning, match="old-format checkpoint"):
        fresh.load_state_dict(old, strict=False)
    assert fresh._steps == 3
    for p, q in zip(opt.param_groups[0]["params"], fresh.param_groups[0]["params"], strict=True):
        assert torch.equal(opt.state[p]["delta"], fresh.state[q]["delta"])


def test_damaged_records_and_non_dicts_are_refused():
    _, opt = _trained(1)
    _refused(opt, [1, 2], "expected an optimizer state dict", kind=TypeError)
    sd = opt.state_dict()
    sd["param_groups"][0]["demo"] = "{not json"
    _refused(opt, sd, "do not parse")
    sd = opt.state_dict()
    del sd["param_groups"][0]["demo"]
    _refused(opt, sd, "no 'demo' record", "flatten_optimizer_state_dict")


def test_relaxed_loading_reaches_loads_made_by_dcp():
    model, opt = _trained(2)
    osd = copy.deepcopy(get_optimizer_state_dict(model, opt))
    osd["state"]["0.bias"]["delta_rank0"][0] = float("nan")
    fresh_model = copy.deepcopy(model)
    fresh = DeMo(fresh_model.named_parameters(), **KW)
    with pytest.raises(ValueError, match="non-finite"):
        set_optimizer_state_dict(fresh_model, fresh, copy.deepcopy(osd))
    with relaxed_loading(fresh), pytest.warns(UserWarning, match="start from zero"):
        set_optimizer_state_dict(fresh_model, fresh, osd)
    assert not fresh._relaxed_load
    assert fresh._steps == 2


# ----------------------------------------------------------------------------- ranks (gloo)


def _plain_ranks(rank: int, world: int, folder: str):
    os.environ["TRITON_INTERPRET"] = "0"  # a spawned rank: kernels take the torch path
    _, opt = _trained(3, rank)
    torch.save(opt.state_dict(), Path(folder) / f"rank{rank}.pt")
    dist.barrier()
    out: dict[str, Any] = {}
    for case, source in (("rank0 only", 0), ("swapped", (rank + 1) % world), ("own", rank)):
        fresh = DeMo(_model().named_parameters(), **KW)
        sd = torch.load(Path(folder) / f"rank{source}.pt", weights_only=True)
        try:
            fresh.load_state_dict(sd)
            out[case] = None
        except ValueError as exc:
            out[case] = (str(exc), not fresh.state and fresh._steps == 0)
    fresh = DeMo(_model().named_parameters(), **KW)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fresh.load_state_dict(torch.load(Path(folder) / f"rank{(rank + 1) % world}.pt"), strict=False)
    out["relaxed"] = ([str(w.message) for w in caught], len(fresh.state), fresh._steps)
    return out


def _other_world(rank: int, world: int, folder: str):
    """World 3 loads the files of world 2 (rank 2 takes rank 1's)."""
    os.environ["TRITON_INTERPRET"] = "0"
    sd = torch.load(Path(folder) / f"rank{min(rank, 1)}.pt", weights_only=True)
    fresh = DeMo(_model().named_parameters(), **KW)
    try:
        fresh.load_state_dict(sd)
        strict = None
    except ValueError as exc:
        strict = str(exc)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fresh.load_state_dict(sd, strict=False)
    return strict, [str(w.message) for w in caught], len(fresh.state), fresh._steps


@pytest.mark.distributed
@pytest.mark.slow
def test_plain_files_load_only_on_their_own_rank_and_world_size(worlds):
    r0, r1 = worlds[2]["plain"]
    assert r0["rank0 only"] is None and r0["own"] is None and r1["own"] is None
    message, unchanged = r1["rank0 only"]
    assert "records of rank(s) [0], this is rank 1" in message and "save on every rank" in message
    assert unchanged
    for out, other in ((r0, 1), (r1, 0)):
        message, unchanged = out["swapped"]
        assert f"rank(s) [{other}]" in message and unchanged
        warned, n_state, steps = out["relaxed"]
        assert any("dropped this rank's error buffers" in w for w in warned)
        assert n_state == 0 and steps == 3  # buffers dropped, counters kept

    for strict, warned, n_state, steps in worlds[3]["plain, world 2's files"]:
        assert strict is not None
        assert "saved at world size 2 (DeMo group size 2), this run has world size 3" in strict
        assert "strict=False" in strict
        assert any("dropped this rank's error buffers" in w for w in warned)
        assert n_state == 0 and steps == 3


# ----------------------------------------------------------------------------- DCP (gloo)

SAVE_AT, TOTAL = 3, 6


def _dcp_save(rank: int, world: int, folder: str):
    """Train TOTAL steps, saving with DCP after SAVE_AT; return what the resume must match."""
    os.environ["TRITON_INTERPRET"] = "0"  # a spawned rank: the torch path, like _dcp_resume
    model, opt = _trained(SAVE_AT, rank)
    dcp_save(model, opt, folder)
    saved = {
        "records": records(opt.state_dict()),
        "deltas": [opt.state[p]["delta"].clone() for p in model.parameters()],
        "groups": repr([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]),
    }
    for s in range(SAVE_AT + 1, TOTAL + 1):
        _step(model, opt, rank, s)
    return saved, [p.detach().clone() for p in model.parameters()]


def _dcp_resume(rank: int, world: int, folder: str):
    """New processes: load the DCP checkpoint and continue to TOTAL."""
    os.environ["TRITON_INTERPRET"] = "0"
    model = _model(seed=1)  # other initial values: the load must bring the saved ones
    opt = DeMo(model.named_parameters(), **KW)
    dcp_load(model, opt, folder)
    loaded = {
        "records": records(opt.state_dict()),
        "deltas": [opt.state[p]["delta"].clone() for p in model.parameters()],
        "groups": repr([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]),
    }
    for s in range(SAVE_AT + 1, TOTAL + 1):
        _step(model, opt, rank, s)
    return loaded, [p.detach().clone() for p in model.parameters()]


def _dcp_other_world(rank: int, world: int, folder: str):
    """Load a checkpoint of another world size: strictly (refused, into an optimizer that has
    trained a step: its buffers must not change), then partially and relaxed."""
    os.environ["TRITON_INTERPRET"] = "0"
    model = _model(seed=1)
    opt = DeMo(model.named_parameters(), **KW)
    _step(model, opt, rank, 0)
    before = [opt.state[p]["delta"].clone() for p in model.parameters()]
    msd, osd = get_state_dict(model, opt)
    state: dict[str, Any] = {"model": msd, "optim": osd}
    try:
        dcp.load(state, checkpoint_id=folder)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        failure = None
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        failure = (type(exc).__name__, str(exc))
    kept = all(torch.equal(a, opt.state[p]["delta"]) for a, p in zip(before, model.parameters(), strict=True))
    model = _model(seed=1)
    opt = DeMo(model.named_parameters(), **KW)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=folder, planner=DefaultLoadPlanner(allow_partial_load=True))
    with warnings.catch_warnings(record=True) as caught, relaxed_loading(opt):
        warnings.simplefilter("always")
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    relaxed = ([str(w.message) for w in caught], len(opt.state), opt._steps)
    return failure, relaxed, kept


def _totals(stats: dict) -> dict:
    """comm_stats without the last step's timing (not kept by CommStats.from_dict)."""
    return {k: v for k, v in stats.items() if not k.startswith("step_") and not k.endswith("_s")}


@pytest.fixture(scope="module")
def worlds(tmp_path_factory) -> dict[int, dict[str, Any]]:
    """Per world size (2, 3), each scenario's results by rank, and ``"folder"``: its DCP
    checkpoint. The uninterrupted runs save a DCP checkpoint after SAVE_AT steps; the
    resumes and the loads of the other world's DCP checkpoint run in fresh processes."""
    plain = str(tmp_path_factory.mktemp("plain"))
    dcp_at = {w: str(tmp_path_factory.mktemp(f"dcp{w}")) for w in (2, 3)}
    out: dict[int, dict[str, Any]] = {w: {"folder": dcp_at[w]} for w in (2, 3)}
    out[2].update(run_cases(2, [Case("plain", _plain_ranks, (plain,)), Case("dcp", _dcp_save, (dcp_at[2],))]))
    cases = [Case("plain, world 2's files", _other_world, (plain,)), Case("dcp", _dcp_save, (dcp_at[3],))]
    out[3].update(run_cases(3, [*cases, Case("dcp, other world", _dcp_other_world, (dcp_at[2],))]))
    for world, other in ((2, 3), (3, 2)):
        cases = [Case("resumed", _dcp_resume, (dcp_at[world],))]
        if world == 2:  # (world 3 loaded world 2's checkpoint above)
            cases.append(Case("dcp, other world", _dcp_other_world, (dcp_at[other],)))
        out[world].update(run_cases(world, cases))
    return out


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_dcp_resume_is_identical_to_an_uninterrupted_run(worlds, world):
    folder, uninterrupted = worlds[world]["folder"], worlds[world]["dcp"]
    keys = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    for fqn in ("0.weight", "0.bias", "2.weight", "2.bias"):  # each rank's buffer: its own entry
        assert all(f"optim.state.{fqn}.delta_rank{r}" in keys for r in range(world))
    assert all(f"optim.param_groups.0.demo_rank{r}" in keys for r in range(world))
    resumed = worlds[world]["resumed"]
    for (saved, final), (loaded, after) in zip(uninterrupted, resumed, strict=True):
        assert loaded["records"]["common"] == saved["records"]["common"]  # counters, policy, settings
        (rank,) = saved["records"]["ranks"]
        mine, theirs = loaded["records"]["ranks"][rank], saved["records"]["ranks"][rank]
        assert _totals(mine["comm_stats"]) == _totals(theirs["comm_stats"]) and mine["rank"] == rank
        assert loaded["groups"] == saved["groups"]
        assert all(torch.equal(a, b) for a, b in zip(loaded["deltas"], saved["deltas"], strict=True))
        assert all(torch.equal(a, b) for a, b in zip(after, final, strict=True))
    ranks = [u[0]["deltas"][0] for u in uninterrupted]
    assert not torch.equal(ranks[0], ranks[1])  # the buffers differ per rank: not deduplicated


@pytest.mark.distributed
@pytest.mark.slow
def test_dcp_checkpoints_refuse_another_world_size(worlds):
    smaller = worlds[2]["dcp, other world"]  # DeMo's own check
    larger = worlds[3]["dcp, other world"]  # DCP finds no entry for rank 2
    for _failure, _, kept in smaller + larger:
        assert kept, "a refused DCP load changed the live error buffers"
    for failure, _, _ in smaller:
        assert failure is not None and failure[0] == "ValueError", failure
        assert "saved at world size 3 (DeMo group size 3), this run has world size 2" in failure[1]
    for failure, _, _ in larger:
        assert failure is not None and failure[0] == "CheckpointException", failure
        assert "Missing key in checkpoint" in failure[1] and "rank2" in failure[1]
    for _, (warned, n_state, steps), _ in smaller + larger:  # partial + relaxed: settings, no buffers
        assert any("dropped this rank's error buffers" in w for w in warned), warned
        assert n_state == 0 and steps == SAVE_AT
