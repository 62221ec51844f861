"""cokit.overlap.training.apply_overlap: layers replaced in place (state dict unchanged, undo, compile), the
class-by-class tuner on an injected clock, telemetry, bad input, and decisions agreed on gloo."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from gloo_cases import Case, run_cases
from torch import nn

from cokit.compress.agreement import SettingsMismatch
from cokit.overlap.guard import GuardViolation, StarvationGuard
from cokit.overlap.layers import Linear
from cokit.overlap.training import apply_overlap
from cokit.telemetry import Monitor
from cokit.triton_kernels.gemm_config import GemmConfig

#: two small configs: the interpreter runs whatever the tuner picks
SMALL = [
    GemmConfig(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_warps=4, num_stages=1),
    GemmConfig(BLOCK_M=32, BLOCK_N=16, BLOCK_K=16, num_warps=4, num_stages=1),
    GemmConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, num_warps=2, num_stages=1),
]


class Mlp(nn.Module):
    """Two shape classes: fc1/fc3 (12 -> 20, bias) share one, fc2 (20 -> 12, no bias) another."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(12, 20)
        self.inner = nn.Sequential(nn.GELU(), nn.Linear(20, 12, bias=False))
        self.fc3 = nn.Linear(12, 20)
        self.norm = nn.LayerNorm(20)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc3(self.inner(self.fc1(x))))


class Clock:
    """Milliseconds that advance by what the test says each step costs."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 12, generator=g)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _step_with_cost(tuning, clock: Clock, cost) -> None:
    """One step whose time is ``cost(configs in use)``: the clock moves, then the tuner reads it."""
    clock.now += cost(tuning.configs())
    tuning.step()


def test_replaces_in_place_keeps_the_state_dict_and_undoes():
    torch.manual_seed(0)
    model = Mlp()
    before = model.state_dict()
    originals = {name: m for name, m in model.named_modules() if type(m) is nn.Linear}
    x = torch.randn(3, 5, 12)
    want = model(x).detach()
    tuning = apply_overlap(model, candidates=SMALL)
    after = model.state_dict()
    assert list(after) == list(before)  # same keys, same order
    assert all(after[k] is before[k] or after[k].data_ptr() == before[k].data_ptr() for k in before)
    replaced = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    assert set(replaced) == set(originals)
    for name, m in replaced.items():
        assert m.weight is originals[name].weight and m.bias is originals[name].bias
    assert [c.key for c in tuning.classes] == ["K12xN20 fp32 +bias", "K20xN12 fp32"]
    assert tuning.classes[0].names == ["fc1", "fc3"] and tuning.classes[1].names == ["inner.1"]
    # fp32 GEMMs of K <= 20: the kernel and torch agree to a few ulps of the output's scale
    torch.testing.assert_close(model(x), want, rtol=0, atol=1e-5)
    tuning.undo()
    tuning.undo()  # idempotent
    assert {name: m for name, m in model.named_modules() if type(m) is nn.Linear} == originals
    with pytest.raises(RuntimeError, match="undone"):
        tuning.step(1.0)


def test_compiled_model_equals_eager():
    torch.manual_seed(1)
    model = Mlp()
    apply_overlap(model, candidates=SMALL[:1])
    x = torch.randn(4, 12)
    compiled = torch.compile(model, backend="aot_eager")
    torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=1e-6)


def test_tunes_one_class_at_a_time_locks_the_cheapest_and_reexplores_on_drift():
    model = Mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    clock = Clock()
    tuning = apply_overlap(model, opt, candidates=SMALL, clock=clock, trials=1, window=3, cooldown=3)
    first, second = tuning.classes
    cost = {c.spec(): t for c, t in zip(SMALL, (5.0, 2.0, 3.0), strict=True)}
    slow = {"penalty": 0.0}

    def step_cost(configs):  # the step time: both classes' GEMM costs (class 2 weighs less)
        a, b = (configs[c.key] for c in tuning.classes)
        return cost[a.spec()] + 0.5 * cost[b.spec()] + slow["penalty"]

    def one_step(seed):
        clock.now += step_cost(tuning.configs())
        _train_step(model, opt, seed)  # the optimizer's post-hook calls tuning.step()

    one_step(0)  # the first step only starts the clock
    assert tuning.steps == 0
    seen = []
    for s in range(1, 7):
        seen.append((tuning.configs()[first.key], tuning.configs()[second.key]))
        one_step(s)
    # class 1 explores while class 2 holds its first candidate; then class 2 explores
    assert [a for a, _ in seen[:3]] == SMALL and all(b == SMALL[0] for _, b in seen[:3])
    assert first.tuner.locked == SMALL[1] and [b for _, b in seen[3:]] == SMALL
    assert second.tuner.locked == SMALL[1] and tuning.active == 1
    assert tuning.configs() == {first.key: SMALL[1], second.key: SMALL[1]}
    for s in range(7, 13):  # locked: the times are agreed every window (3) steps
        one_step(s)
    assert tuning.configs() == {first.key: SMALL[1], second.key: SMALL[1]}
    slow["penalty"] = 10.0  # the machine changes: every step is slower
    for s in range(13, 16):
        one_step(s)
    events = [d["event"] for d in tuning.decisions]
    assert events.count("drift") == 1 and events.count("explore") == 4  # 2 initial + both again
    assert tuning.active == 0 and first.tuner.state == "exploring"
    assert tuning.configs()[second.key] == SMALL[1]  # held while class 1 explores again
    assert tuning.configs()[first.key] == SMALL[0]  # the new exploration's first candidate


def test_telemetry_records_every_config_and_decision(tmp_path):
    model = Mlp()
    clock = Clock()
    monitor = Monitor(tmp_path, "overlap", clock=lambda: clock.now / 1e3)
    tuning = apply_overlap(model, candidates=SMALL[:2], clock=clock, trials=1, monitor=monitor)
    for step in range(1, 7):
        clock.now += 4.0
        monitor.step(step, loss=1.0 / step)
        tuning.step()
    monitor.close()
    tuning.undo()
    records = [
        json.loads(line)
        for line in (tmp_path / "telemetry" / "overlap" / "rank0.jsonl").read_text().splitlines()
    ]
    steps = [r for r in records if r["kind"] == "step"]
    assert len(steps) == 6
    for r in steps:
        assert sorted(k["name"] for k in r["kernels"]) == [f"linear {c.key}" for c in tuning.classes]
        assert all(k["blocks_per_sm"] >= 1 and k["target"] == "sm_90" for k in r["kernels"])
    events = [d["event"] for r in steps for d in r["tuner"]]
    assert events.count("explore") == 2 and events.count("lock") == 2 and "trial" in events
    # the config recorded at a step is the one that step ran
    first = tuning.classes[0].key
    assert [
        next(k for k in r["kernels"] if k["name"] == f"linear {first}")["config"]["BLOCK_M"]
        for r in steps[:3]
    ] == [
        16,
        16,
        32,
    ]


def test_bad_input_is_refused_before_anything_changes():
    with pytest.raises(ValueError, match=r"has no torch\.nn\.Linear layer"):
        apply_overlap(nn.Sequential(nn.ReLU(), nn.LayerNorm(4)))
    model = Mlp()
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    tight = StarvationGuard(max_reserved_fraction=0.0, max_footprint_inflation=1.0)
    shaped = [
        dataclasses.replace(SMALL[0], persistent=True, num_sms=100),
        dataclasses.replace(SMALL[0], smem_bytes=2**17),
    ]
    with pytest.raises(
        GuardViolation, match=r"rejects every candidate of shape class K12xN20.*max_reserved_fraction"
    ):
        apply_overlap(model, guard=tight, candidates=shaped)
    with pytest.raises(TypeError, match=r"torch\.optim\.Optimizer"):
        apply_overlap(model, optimizer=object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-empty sequence of GemmConfig"):
        apply_overlap(model, candidates=[])
    assert [m for m in model.modules() if type(m) is nn.Linear] == linears  # nothing replaced
    tuning = apply_overlap(model, candidates=SMALL, clock=Clock())
    for bad in (float("nan"), -1.0, True, "3"):
        with pytest.raises(ValueError, match="elapsed_ms"):
            tuning.step(bad)
    assert tuning.steps == 0


def test_shaped_candidates_pass_the_guard_and_leave_sms_to_communication():
    model = Mlp()
    guard = StarvationGuard(max_reserved_fraction=0.2)
    tuning = apply_overlap(model, guard=guard, target="sm_90")
    for c in tuning.classes:
        configs = c.tuner.candidates
        assert 2 <= len(configs) <= 6 and configs[0].smem_bytes is None and not configs[0].persistent
        assert any(cfg.smem_bytes for cfg in configs)  # an occupancy-shaped footprint
        persistent = [cfg for cfg in configs if cfg.persistent]
        assert persistent and all(132 - cfg.num_sms <= 0.2 * 132 for cfg in persistent)
        rejected = [e for e in c.tuner.log if e["event"] == "reject"]
        assert rejected == []  # the guard pruned before the tuner saw them


# ---------------------------------------------------------------------------------- gloo
def _agreed(rank: int, world: int) -> dict:
    """Each rank's clock says something else; the decisions must still be the same."""
    torch.manual_seed(0)
    model = Mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    clock = Clock()
    tuning = apply_overlap(model, opt, candidates=SMALL, clock=clock, trials=1)
    cost = {c.spec(): t for c, t in zip(SMALL, (3.0, 1.0, 2.0), strict=True)}
    history = []
    for s in range(12):
        configs = tuning.configs()
        history.append([configs[c.key].spec() for c in tuning.classes])
        # rank-dependent noise larger than the differences between candidates
        clock.now += sum(cost[c.spec()] for c in configs.values()) + (5.0 if (s + rank) % 2 else 0.0)
        _train_step(model, opt, s)
    times = [[e["elapsed_ms"] for e in c.tuner.log if e["event"] == "trial"] for c in tuning.classes]
    return {"history": history, "times": times, "locked": [str(c.tuner.locked) for c in tuning.classes]}


def _diverged_at_start(rank: int, world: int) -> dict:
    """Rank 1 would tune over other candidates: every rank is refused before a layer changes."""
    model = Mlp()
    try:
        apply_overlap(model, candidates=SMALL if rank != 1 else SMALL[::-1], clock=Clock(), timeout=60)
    except SettingsMismatch as exc:
        untouched = not any(isinstance(m, Linear) for m in model.modules())
        return {"error": str(exc), "unchanged": untouched}
    return {"error": None}


def _diverged_later(rank: int, world: int) -> dict:
    """Rank 1's tuner state changes behind the others' back: the next agreement refuses it on
    every rank, before the decision it would take is applied."""
    model = Mlp()
    clock = Clock()
    tuning = apply_overlap(model, candidates=SMALL, clock=clock, trials=1, timeout=60)
    tuning.step()  # starts the clock
    for _ in range(2):
        clock.now += 2.0
        tuning.step()
    if rank == 1:
        tuning.classes[0].tuner.reexplore("changed on rank 1 only")
    before = tuning.configs()
    clock.now += 2.0
    try:
        tuning.step()  # the batch of 3 is complete: the agreement
    except SettingsMismatch as exc:
        return {"error": str(exc), "unchanged": tuning.configs() == before}
    return {"error": None}


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_takes_the_same_decision_on_gloo(world):
    cases = [Case("agreed", _agreed), Case("start", _diverged_at_start), Case("later", _diverged_later)]
    results = run_cases(world, cases)
    agreed = results["agreed"]
    assert all(r == agreed[0] for r in agreed), agreed
    # the agreed time is the slowest rank's: every trial carries the +5 ms of some rank
    assert all(t >= 5.0 for times in agreed[0]["times"] for t in times)
    for r in results["start"] + results["later"]:
        assert r["error"] is not None and "apply_overlap" in r["error"], r
        assert r["unchanged"], r


@pytest.mark.parametrize("old", ["cokit.nn", "cokit.overlap_training"])
def test_old_paths_warn_and_give_the_library_objects(old):
    """``cokit.nn`` and ``cokit.overlap_training`` are the old paths of the layers and the
    tuning: every name they had still resolves, to the library's object, with a
    DeprecationWarning that names its new home and points at the caller's line."""
    import importlib

    shim = importlib.import_module(old)
    for name, home in shim.NAMES.items():
        with pytest.warns(DeprecationWarning, match=rf"{old}\.{name} moved to {home}\.{name}") as w:
            got = getattr(shim, name)
        assert got is getattr(importlib.import_module(home), name)
        assert w[0].filename == __file__
    assert {"Linear", "apply_overlap", "OverlapTuning"} <= set(importlib.import_module("cokit.nn").NAMES)
    with pytest.raises(AttributeError):
        shim.nothing  # noqa: B018


class Block(nn.Module):
    """An attention block: MultiheadAttention (its out_proj is an nn.Linear subclass) and an MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.attn(x, x, x, need_weights=False)[0])


def test_multihead_attention_out_proj_is_left_as_it_never_runs(monkeypatch):
    """Only exact nn.Linear layers are replaced: MultiheadAttention's out_proj (a
    NonDynamicallyQuantizableLinear) stays, because the attention reads out_proj.weight/bias in
    F.multi_head_attention_forward and never calls out_proj: a replaced layer would not run."""
    torch.manual_seed(2)
    block = Block()
    x = torch.randn(2, 5, 16)
    want = block(x).detach()
    calls = []
    real = type(block.attn.out_proj).forward
    monkeypatch.setattr(
        type(block.attn.out_proj), "forward", lambda self, t: calls.append(1) or real(self, t)
    )
    block(x)
    assert calls == []  # never called: swapping it could change nothing
    tuning = apply_overlap(block, candidates=SMALL[:1])
    assert [c.names for c in tuning.classes] == [["fc"]]
    assert type(block.attn.out_proj) is nn.modules.linear.NonDynamicallyQuantizableLinear
    assert isinstance(block.fc, Linear)
    torch.testing.assert_close(block(x), want, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match=r"NonDynamicallyQuantizableLinear layers are nn\.Linear subclasses"):
        apply_overlap(nn.MultiheadAttention(16, 2))


def test_on_the_torch_path_the_swapped_model_is_the_original_and_says_why(monkeypatch, caplog):
    """CPU without TRITON_INTERPRET: the replaced layers call F.linear (the op never runs), so
    the model computes bitwise what it did; the handle and the log say the configs change no
    timing there, and the tuner still steps."""
    import logging

    import cokit.triton_kernels.linear as L

    monkeypatch.setenv("TRITON_INTERPRET", "0")

    def no_op(*args, **kwargs):
        raise AssertionError("cokit::linear ran on the torch path")

    monkeypatch.setattr(L, "_linear_op", no_op)
    torch.manual_seed(3)
    model = Mlp()
    x = torch.randn(4, 12)
    want = model(x).detach()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with caplog.at_level(logging.INFO, logger="cokit.overlap.training"):
        tuning = apply_overlap(model, opt, candidates=SMALL, clock=Clock())
    assert tuning.kernel_path == "torch" and "change no timing" in tuning.note
    assert any("F.linear" in r.getMessage() for r in caplog.records)
    assert "torch path: configs change no timing" in repr(tuning)
    assert torch.equal(model(x), want)
    for s in range(3):
        _train_step(model, opt, s)
    assert tuning.steps == 2  # the first step only starts the clock
    assert tuning.configs()[tuning.classes[0].key] == SMALL[2]  # the plan goes on: records, not speed
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert apply_overlap(Mlp(), candidates=SMALL).note.startswith("the GEMM runs in the Triton interpreter")
