"""``comm_priority=`` / ``comm_guard=`` on every compression front end (DeMo, SparseLoCo, the DDP
hook) and the one mechanism behind them, :mod:`cokit.compress.priority`.

On gloo a high priority is a no-op that says so: training is bit-identical to normal priority.
Ranks built with different priorities are refused at the first round on every rank. The NCCL
path (one new group over the exchange group's ranks, with high-priority streams) is checked
with ``dist.get_backend`` reporting ``nccl`` and ``dist.new_group`` recording its calls (a gloo
group over the same ranks stands in). The gloo scenarios share one spawned world per size
(tests/gloo_cases.py).
"""

from __future__ import annotations

import os

import pytest
import torch
from gloo_cases import Case, run_cases
from helpers import SmallNet, regression_data

from cokit.compress import DeMo, SparseLoCo
from cokit.compress import priority as prio
from cokit.compress.agreement import SettingsMismatch
from cokit.compress.hooks import DCTTopKState, dct_topk_hook
from cokit.overlap import guard as overlap_guard
from cokit.overlap import streams
from cokit.overlap.guard import GuardViolation, StarvationGuard

FRONTS = ("demo", "sparseloco", "hook")
BAD = ("urgent", True, 7, 1.5)
GLOO_NOTE = "gloo has no GPU streams: comm_priority has no effect"


# ----------------------------------------------------------------------------- the front ends
def _demo(priority, process_group=None):
    torch.manual_seed(0)
    net = SmallNet()
    opt = DeMo(
        net.parameters(),
        lr=1e-2,
        compression_topk=4,
        compression_chunk=16,
        process_group=process_group,
        comm_priority=priority,
    )
    return net, net, opt, opt


def _sparseloco(priority, process_group=None):
    torch.manual_seed(0)
    net = SmallNet()
    opt = SparseLoCo(
        net.parameters(),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2),
        sync_every=2,
        topk=4,
        chunk=16,
        process_group=process_group,
        comm_priority=priority,
    )
    return net, net, opt, opt


def _hook(priority, process_group=None):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    net = SmallNet()
    ddp = DDP(net)
    state = DCTTopKState(topk=4, chunk=16, process_group=process_group, comm_priority=priority)
    ddp.register_comm_hook(state.attach(ddp), dct_topk_hook)
    return net, ddp, torch.optim.SGD(net.parameters(), lr=1e-2), state


BUILD = {"demo": _demo, "sparseloco": _sparseloco, "hook": _hook}


def _train(front: str, priority, rank: int, steps: int = 4, process_group=None):
    """``steps`` steps of ``front`` on this rank's data: (model, forward, optimizer, holder of
    comm_priority_info)."""
    os.environ["TRITON_INTERPRET"] = "0"  # the torch path: fast, and the same on every rank
    net, forward, opt, holder = BUILD[front](priority, process_group)
    x, y = regression_data(rank, 64)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(forward(x), y).backward()
        opt.step()
    return net, forward, opt, holder


def _params(net) -> list[torch.Tensor]:
    return [p.detach().clone() for p in net.parameters()]


def _info(holder) -> tuple:
    i = holder.comm_priority_info
    return (i.backend, i.requested, i.high_priority, i.note, i.group is i.source)


def _same_training(rank: int, world: int, front: str):
    """Normal, then high priority (int -1 too): the same parameters, the info, the state."""
    net, _, _, normal = _train(front, "normal", rank)
    want = _params(net)
    out = {"normal": _info(normal)}
    for priority in ("high", -1):
        net, forward, opt, holder = _train(front, priority, rank)
        out[priority] = _info(holder)
        out[f"{priority} same"] = all(torch.equal(a, b) for a, b in zip(want, _params(net), strict=True))
    sd = holder.state_dict()  # a runtime setting: not saved, and a normal one loads the state
    out["in state_dict"] = "comm_priority" in repr(sd)
    if front == "hook":
        DCTTopKState(topk=4, chunk=16).attach(forward).load_state_dict(sd)
    else:
        type(opt)(net.parameters(), **_rebuild_kwargs(front)).load_state_dict(sd)
    return out


def _rebuild_kwargs(front: str) -> dict:
    if front == "demo":
        return {"lr": 1e-2, "compression_topk": 4, "compression_chunk": 16}
    return {"inner": lambda ps: torch.optim.AdamW(ps, lr=1e-2), "sync_every": 2, "topk": 4, "chunk": 16}


def _mismatch(rank: int, world: int, front: str):
    """The last rank asks for high priority, the others for normal: the first round refuses it
    on every rank, before anything changed."""
    os.environ["TRITON_INTERPRET"] = "0"
    net, forward, opt, _ = BUILD[front]("high" if rank == world - 1 else "normal")
    before = _params(net)
    x, y = regression_data(rank, 64)
    try:
        opt.zero_grad()
        torch.nn.functional.mse_loss(forward(x), y).backward()
        opt.step()
    except Exception as exc:  # the hook's error reaches backward() as DDP's RuntimeError
        unchanged = all(torch.equal(a, b) for a, b in zip(before, _params(net), strict=True))
        return type(exc).__name__, isinstance(exc, SettingsMismatch), str(exc), unchanged
    return "no error", False, "", False


# ----------------------------------------------------------------------------- the NCCL path
class _FakeOptions:
    """``ProcessGroupNCCL.Options`` of a torch build without NCCL."""

    def __init__(self, is_high_priority_stream: bool = False):
        self.is_high_priority_stream = is_high_priority_stream


class _FakeNCCL:
    Options = _FakeOptions


def _nccl_path(rank: int, world: int):
    """With ``dist.get_backend`` saying nccl and ``dist.new_group`` recording (and making a gloo
    group over the same ranks): what priority_group and the front ends create."""
    import torch.distributed as dist

    os.environ["TRITON_INTERPRET"] = "0"
    subgroups = [dist.new_group([r]) for r in range(world)]  # every rank makes every group
    real_new_group, real_get_backend = dist.new_group, dist.get_backend
    had_nccl = hasattr(dist, "ProcessGroupNCCL")
    calls: list[tuple] = []

    def recorder(ranks=None, **kwargs):
        options = kwargs.get("pg_options")
        calls.append((list(ranks), kwargs.get("backend"), getattr(options, "is_high_priority_stream", None)))
        return real_new_group(ranks)

    def taken() -> list[tuple]:
        out = list(calls)
        calls.clear()
        return out

    out = {}
    dist.new_group, dist.get_backend = recorder, lambda group=None: "nccl"
    if not had_nccl:
        dist.ProcessGroupNCCL = _FakeNCCL
    try:
        info = prio.priority_group(None, "high")
        out["world"] = (
            taken(),
            info.backend,
            info.high_priority,
            info.note,
            dist.get_process_group_ranks(info.group),
        )
        sub = prio.priority_group(subgroups[rank], "high")  # ranks hold different subgroups
        out["subgroup"] = (
            taken(),
            sub.high_priority,
            dist.get_process_group_ranks(sub.group),
            sub.source is subgroups[rank],
        )
        normal = prio.priority_group(None, "normal")
        out["normal"] = (taken(), normal.high_priority, normal.group is None)
        for front in FRONTS:
            i = _train(front, "high", rank, steps=2)[3].comm_priority_info
            out[front] = (taken(), i.high_priority, i.requested, i.group is not None and i.source is None)
        state = DCTTopKState(comm_priority="high")
        taken()
        state.process_group = subgroups[rank]  # a group set after construction: no new group then
        try:
            out["late group"] = f"no error: {state.exchange}"
        except RuntimeError as exc:
            out["late group"] = str(exc)
        out["late group calls"] = taken()
    finally:
        dist.new_group, dist.get_backend = real_new_group, real_get_backend
        if not had_nccl:
            del dist.ProcessGroupNCCL
    return out


@pytest.fixture(scope="module")
def world2():
    cases = [Case(f"same {f}", _same_training, (f,)) for f in FRONTS]
    cases.append(Case("nccl", _nccl_path))
    cases += [Case(f"mismatch {f}", _mismatch, (f,)) for f in FRONTS]
    return run_cases(2, cases)


@pytest.fixture(scope="module")
def world3():
    return run_cases(
        3, [Case("same demo", _same_training, ("demo",)), Case("mismatch demo", _mismatch, ("demo",))]
    )


# ----------------------------------------------------------------------------- gloo worlds
@pytest.mark.parametrize("front", FRONTS)
def test_high_priority_on_gloo_trains_bit_identical_and_says_why(world2, front):
    for out in world2[f"same {front}"]:
        assert out["normal"] == ("gloo", "normal", False, "normal priority: the process group as given", True)
        for priority in ("high", -1):
            assert out[priority] == ("gloo", priority, False, GLOO_NOTE, True)
            assert out[f"{priority} same"]
        assert not out["in state_dict"]


def test_world3_demo_high_priority_trains_bit_identical(world3):
    for out in world3["same demo"]:
        assert out["high"] == ("gloo", "high", False, GLOO_NOTE, True) and out["high same"] and out["-1 same"]


@pytest.mark.parametrize("front", FRONTS)
def test_different_priorities_are_refused_on_every_rank(world2, front):
    for kind, is_mismatch, message, unchanged in world2[f"mismatch {front}"]:
        assert "setting 'comm_priority' is 'normal' on rank [0], 'high' on rank [1]" in message, message
        assert unchanged
        assert is_mismatch or (front == "hook" and kind == "RuntimeError")


def test_world3_different_priorities_are_refused_on_every_rank(world3):
    for kind, is_mismatch, message, unchanged in world3["mismatch demo"]:
        assert is_mismatch and unchanged, (kind, message)
        assert "'normal' on ranks [0, 1], 'high' on rank [2]" in message


def test_nccl_path_makes_one_high_priority_group(world2):
    for rank, out in enumerate(world2["nccl"]):
        calls, backend, high, note, ranks = out["world"]
        assert calls == [([0, 1], "nccl", True)] and (backend, high, ranks) == ("nccl", True, [0, 1])
        assert "high-priority streams" in note and "[0, 1]" in note
        calls, high, ranks, source_kept = out["subgroup"]
        assert calls == [([0], "nccl", True), ([1], "nccl", True)], calls  # every rank, the same order
        assert high and ranks == [rank] and source_kept
        assert out["normal"] == ([], False, True)
        for front in FRONTS:
            assert out[front] == ([([0, 1], "nccl", True)], True, "high", True), (front, out[front])
        assert "process_group changed" in out["late group"] and out["late group calls"] == []


# ----------------------------------------------------------------------------- one process
def _construct(front: str, **kwargs):
    net = SmallNet()
    if front == "demo":
        return DeMo(net.parameters(), **kwargs)
    if front == "sparseloco":
        return SparseLoCo(net.parameters(), **kwargs)
    return DCTTopKState(**kwargs)


@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.parametrize("bad", BAD)
def test_bad_priorities_raise_before_anything_is_built(front, bad):
    with pytest.raises(
        ValueError, match=r"comm_priority=.* is invalid; allowed: 'high', 'normal' or an integer"
    ):
        _construct(front, comm_priority=bad, comm_guard=StarvationGuard(allow_high_priority=False))


def test_a_bad_priority_leaves_the_parameters_and_inner_optimizer_untouched():
    net = SmallNet()
    params = list(net.parameters())
    with pytest.raises(ValueError, match="comm_priority"):
        DeMo(params, overlap_backward=True, comm_priority="urgent")
    assert not any(getattr(p, "_post_accumulate_grad_hooks", None) for p in params)  # no hook installed
    half = SmallNet().to(torch.bfloat16)
    inner = torch.optim.AdamW(half.parameters())
    with pytest.raises(ValueError, match="comm_priority"):
        SparseLoCo(half.parameters(), inner, precision="master", comm_priority=True)
    assert all(
        a is b for a, b in zip(inner.param_groups[0]["params"], half.parameters(), strict=True)
    )  # no masters swapped in


@pytest.mark.parametrize("front", FRONTS)
def test_a_guard_refuses_high_priority_naming_the_limit(front):
    guard = StarvationGuard(allow_high_priority=False)
    for priority in ("high", -2):
        with pytest.raises(GuardViolation, match=r"comm_guard: .*\(allow_high_priority=False\)") as err:
            _construct(front, comm_priority=priority, comm_guard=guard)
        assert isinstance(err.value, prio.GuardViolation) and isinstance(err.value, ValueError)
    built = _construct(front, comm_priority="normal", comm_guard=guard)
    assert built.comm_priority_info.requested == "normal"
    assert (
        _construct(front, comm_priority="high", comm_guard=StarvationGuard()).comm_priority_info.requested
        == "high"
    )
    with pytest.raises(TypeError, match="comm_guard must be None or have violations"):
        _construct(front, comm_priority="high", comm_guard=object())


def test_without_distributed_high_priority_is_a_noop_that_says_so():
    opt = DeMo(SmallNet().parameters(), comm_priority="high")
    info = opt.comm_priority_info
    assert (info.group, info.high_priority, info.requested) == (None, False, "high")
    assert "not initialized" in info.note
    local = prio.priority_group(None, "high", local=True)
    assert not local.high_priority and "this rank alone" in local.note


def test_one_mechanism_shared_with_overlap():
    assert streams.CommGroup is prio.PriorityGroup and streams.high_priority_group is prio.high_priority_group
    assert streams.group_is_high_priority is prio.group_is_high_priority
    assert overlap_guard.GuardViolation is prio.GuardViolation
    assert streams.CPU_PRIORITY_RANGE == prio.CPU_PRIORITY_RANGE
    assert prio.resolve_priority("high") == streams.resolve_priority("high", "cpu") == -3
    assert [prio.is_high(p) for p in ("high", -1, 0, "normal", None, True)] == [
        True,
        True,
        False,
        False,
        False,
        False,
    ]
    with pytest.raises(ValueError, match=r"^X: comm_priority=None is invalid"):
        prio.check_comm_priority("X", None)
