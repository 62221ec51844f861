"""DeMo without silent surprises: gradient edits after an overlapped launch raise on every rank,
a DDP-wrapped model warns about the double sync, and momentum-cycling schedulers drive the
error-feedback decay through the ``momentum`` alias."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from distributed import run_gloo
from helpers import STATUS_ROW, SmallNet, regression_data

from cokit.compress import DeMo
from cokit.compress.guards import SYNCED_KEY, DoubleSyncWarning, GradMarks, find_ddp_wrappers
from cokit.compress.stats import ring_allgather_bytes


def _torch_path() -> None:
    os.environ["TRITON_INTERPRET"] = "0"  # kernels take the torch path in these workers


def _data(rank: int, n: int = 64):
    return regression_data(rank, n)


def _backward(model, x, y, scaler=None) -> None:
    loss = torch.nn.functional.mse_loss(model(x), y)
    (loss if scaler is None else scaler.scale(loss)).backward()


def _snapshot(model, opt):
    params = [p.detach().clone() for p in model.parameters()]
    deltas = [opt.state[p]["delta"].clone() if "delta" in opt.state[p] else None for p in model.parameters()]
    return params, deltas


def _same(a, b) -> bool:
    return all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in zip(a, b, strict=True)
    )


# ----------------------------------------------------------------------------- gradient edits

_EDITS = ("clip", "unscale", "mul", "assign", "data_mul", "none_grad")


def _edit(kind: str, model, opt, scaler) -> None:
    params = list(model.parameters())
    if kind == "clip":
        torch.nn.utils.clip_grad_norm_(params, 1e-3)
    elif kind == "unscale":
        scaler.unscale_(opt)
    elif kind == "mul":
        params[1].grad.mul_(0.5)
    elif kind == "assign":
        params[2].grad = params[2].grad * 3.0
    elif kind == "data_mul":  # skips the version counter: the bit checksum catches it
        params[0].grad.data.mul_(2.0)
    elif kind == "none_grad":
        params[3].grad = None


def _gradient_edits(rank: int, world: int):
    _torch_path()
    x, y = _data(rank)
    out = {}
    for kind in _EDITS:
        torch.manual_seed(0)
        model = SmallNet()
        opt = DeMo(model.parameters(), lr=3e-3, compression_topk=8, bucket_cap_mb=0.01, overlap_backward=True)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        for _ in range(2):  # clean steps first: nothing to report
            opt.zero_grad()
            _backward(model, x, y)
            opt.step()
        before = _snapshot(model, opt)
        opt.zero_grad()
        _backward(model, x, y, scaler if kind == "unscale" else None)
        if kind == "unscale" or rank == 1:  # one rank editing must make every rank raise
            _edit(kind, model, opt, scaler)
        try:
            opt.step()
            message = None
        except RuntimeError as exc:
            message = str(exc)
        unchanged = _same(before[0], _snapshot(model, opt)[0]) and _same(before[1], _snapshot(model, opt)[1])
        opt.zero_grad()  # the optimizer is usable again: a clean step goes through
        _backward(model, x, y)
        opt.step()
        moved = not _same(before[0], _snapshot(model, opt)[0])
        edit_bytes = [
            c["sent_bytes"] for c in opt.comm_stats.step_collectives if c["what"] == "status exchange"
        ]
        out[kind] = (message, unchanged, moved, edit_bytes)
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_gradient_edits_after_an_overlapped_launch_raise_on_every_rank_and_change_nothing():
    for rank, results in enumerate(run_gloo(2, _gradient_edits)):
        for kind, (message, unchanged, moved, edit_bytes) in results.items():
            assert message is not None, f"rank {rank}: {kind} after backward was silently ignored"
            assert "overlap_backward=False" in message and "no parameter and no buffer changed" in message
            editors = "[0, 1]" if kind == "unscale" else "[1]"
            assert f"rank{'s' if kind == 'unscale' else ''} {editors}" in message, message
            assert ("on this rank" in message) == (kind == "unscale" or rank == 1), message
            assert unchanged, f"rank {rank}: {kind}: a parameter or buffer changed before the error"
            assert moved, f"rank {rank}: {kind}: the step after the error did not update"
            # the step opens (first hook) and closes (step) with one status row each, counted
            assert edit_bytes == [ring_allgather_bytes(STATUS_ROW, 2)] * 2


def test_grad_marks_catch_each_kind_of_change_and_nothing_else():
    params = [torch.nn.Parameter(torch.randn(5, 6)) for _ in range(3)]
    for p in params:
        p.grad = torch.randn_like(p)
    marks = GradMarks(params)
    assert not marks.changed().any()
    params[0].grad.add_(0.0)  # an in-place op with no effect still moves the version counter
    assert marks.changed().tolist() == [True, False, False]
    marks = GradMarks(params)
    params[1].grad.data.mul_(-1.0)  # no version bump: the checksum changes
    params[2].grad.data = params[2].grad.clone()  # new storage, same tensor object
    assert marks.changed().tolist() == [False, True, True]
    for dtype in (torch.float16, torch.bfloat16):
        p = torch.nn.Parameter(torch.randn(4, 4, dtype=dtype))
        p.grad = torch.randn_like(p)
        half = GradMarks([p])
        assert not half.changed().any()
        p.grad.data.mul_(0.5)
        assert half.changed().all()


# ----------------------------------------------------------------------------- DDP double sync


def _ddp_double_sync(rank: int, world: int):
    _torch_path()
    from torch.nn.parallel import DistributedDataParallel as DDP

    x, y = _data(rank)
    counts = {}

    def train(model, forward, steps=3) -> int:
        opt = DeMo(model.parameters(), lr=1e-3, compression_topk=8)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(steps):
                opt.zero_grad()
                torch.nn.functional.mse_loss(forward(x), y).backward()
                opt.step()
        counts["seconds"] = max(counts.get("seconds", 0.0), opt._guards.ddp_seconds)
        return [w for w in caught if issubclass(w.category, DoubleSyncWarning)]

    torch.manual_seed(0)
    plain = SmallNet()
    counts["plain"] = len(train(plain, plain))
    other = DDP(SmallNet())  # a DDP of another model that ran: not DeMo's parameters
    other(x).sum().backward()
    counts["other_model"] = len(train(plain, plain))
    unwrapped = SmallNet()
    idle = DDP(unwrapped)  # wrapped, but trained through model.module: DDP never syncs
    counts["module"] = len(train(unwrapped, idle.module))
    wrapped = DDP(SmallNet())
    found = train(wrapped, wrapped)
    counts["ddp"] = len(found)
    counts["text"] = str(found[0].message) if found else ""
    counts["found"] = len(find_ddp_wrappers(wrapped.parameters()))
    del idle, other
    return counts


@pytest.mark.distributed
@pytest.mark.slow
def test_demo_on_a_ddp_model_warns_once_about_the_double_sync():
    for counts in run_gloo(2, _ddp_double_sync):
        assert counts["plain"] == 0 and counts["other_model"] == 0 and counts["module"] == 0, counts
        assert counts["ddp"] == 1, counts  # once, not every step
        assert counts["found"] == 1
        text = counts["text"]
        assert "twice" in text and "model.module" in text and "dct_topk_hook" in text
        assert counts["seconds"] < 30  # sanity only (a gc scan); the number is reported, not judged


def test_no_ddp_scan_without_a_process_group():
    p = torch.nn.Parameter(torch.randn(3))
    assert find_ddp_wrappers([p]) == []


# ----------------------------------------------------------------------------- momentum alias


def _grads_for(params, step: int):
    g = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


def _scheduled(make_sched, steps: int = 12, **demo):
    """Local DeMo steps under a scheduler; returns the (lr, decay) each step used and the run."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(32, 48), (17,), (8, 8)]]
    opt = DeMo(params, lr=1e-2, compression_topk=4, compression_chunk=16, **demo)
    sched = make_sched(opt)
    used = []
    for step in range(steps):
        _grads_for(params, step)
        used.append((opt.param_groups[0]["lr"], opt.param_groups[0]["momentum"]))
        opt.step()
        assert opt.param_groups[0]["compression_decay"] == used[-1][1]
        sched.step()
    return used, params, opt


def _replayed(used, **demo):
    """A DeMo without scheduler whose lr and compression_decay are set by hand each step."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(32, 48), (17,), (8, 8)]]
    opt = DeMo(params, lr=1e-2, compression_topk=4, compression_chunk=16, **demo)
    for step, (lr, decay) in enumerate(used):
        _grads_for(params, step)
        opt.param_groups[0]["lr"] = lr
        opt.param_groups[0]["compression_decay"] = decay
        opt.step()
    return params, opt


_SCHEDULERS = {
    "OneCycleLR": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=12),
    "CyclicLR": lambda opt: torch.optim.lr_scheduler.CyclicLR(opt, base_lr=1e-3, max_lr=1e-2, step_size_up=3),
}


@pytest.mark.parametrize("name", list(_SCHEDULERS))
def test_momentum_cycling_schedulers_drive_the_decay(name):
    used, params, opt = _scheduled(_SCHEDULERS[name])
    decays = [d for _, d in used]
    assert len(set(decays)) > 3 and all(0.0 < d < 1.0 for d in decays)  # it really cycles
    ref_params, ref_opt = _replayed(used)
    for p, q in zip(params, ref_params, strict=True):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["delta"], ref_opt.state[q]["delta"])
    fixed_params, _ = _replayed([(lr, 0.999) for lr, _ in used])
    assert not all(torch.equal(p, q) for p, q in zip(params, fixed_params, strict=True))  # the decay mattered


def test_the_decay_follows_a_float64_simulation_of_the_buffer():
    """With alpha tiny, delta = decay * delta + lr * grad with the scheduler's decay (up to
    alpha * |delta|; OneCycleLR's decays differ by ~0.1 between steps)."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(6, 8))
    opt = DeMo([p], lr=0.1, compression_topk=4, compression_chunk=8, alpha=1e-6)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=6)
    delta = torch.zeros(6, 8, dtype=torch.float64)
    for step in range(5):
        _grads_for([p], step)
        lr, decay = opt.param_groups[0]["lr"], opt.param_groups[0]["momentum"]
        delta = decay * delta + lr * p.grad.double()
        opt.step()
        sched.step()
        torch.testing.assert_close(opt.state[p]["delta"].double(), delta, rtol=1e-5, atol=1e-5)


def test_onecycle_momenta_suited_to_demo_stay_in_their_range():
    used, _, _ = _scheduled(
        lambda opt: torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=1e-2, total_steps=12, base_momentum=0.99, max_momentum=0.999
        )
    )
    assert min(d for _, d in used) >= 0.99 - 1e-12 and max(d for _, d in used) == 0.999


def test_momentum_and_compression_decay_stay_one_setting():
    p = torch.nn.Parameter(torch.randn(8, 8))
    opt = DeMo([p], lr=1e-2, compression_decay=0.9)
    group = opt.param_groups[0]
    assert opt.defaults["momentum"] == 0.9 and group["momentum"] == 0.9
    p.grad = torch.randn_like(p)
    group["compression_decay"] = 0.8  # the user writes the canonical name
    opt.step()
    assert group["momentum"] == 0.8 == group["compression_decay"]
    group["momentum"] = 0.7  # a scheduler writes the alias
    opt.step()
    assert group["compression_decay"] == 0.7
    before = p.detach().clone(), opt.state[p]["delta"].clone()
    group["momentum"], group["compression_decay"] = 0.6, 0.5  # both, differently: ambiguous
    with pytest.raises(ValueError, match="one setting"):
        opt.step()
    assert torch.equal(p, before[0]) and torch.equal(opt.state[p]["delta"], before[1])
    group["momentum"] = 0.5
    opt.step()  # agreeing values go through
    group["momentum"] = 1.5
    with pytest.raises(ValueError, match=r"momentum .* must be a finite number in \[0, 1\], got 1.5"):
        opt.step()
    assert group["compression_decay"] == 0.5  # nothing changed


def test_param_groups_may_set_either_name():
    a, b, c = (torch.nn.Parameter(torch.randn(4, 4)) for _ in range(3))
    opt = DeMo([{"params": [a], "momentum": 0.5}, {"params": [b], "compression_decay": 0.6}, {"params": [c]}])
    assert [(g["compression_decay"], g["momentum"]) for g in opt.param_groups] == [
        (0.5, 0.5),
        (0.6, 0.6),
        (0.999, 0.999),
    ]
    with pytest.raises(ValueError, match="one setting"):
        DeMo([{"params": [a], "momentum": 0.5, "compression_decay": 0.6}])
    with pytest.raises(ValueError, match=r"momentum must be a finite number in \[0.0, 1.0\]"):
        DeMo([{"params": [a], "momentum": -0.1}])
    d = torch.nn.Parameter(torch.randn(4))
    opt.add_param_group({"params": [d], "compression_decay": 0.3})
    for p in (a, b, c, d):
        p.grad = torch.randn_like(p)
    opt.step()
    assert opt.param_groups[3]["momentum"] == 0.3


def test_a_resume_between_scheduler_and_step_keeps_the_scheduler_value():
    p = torch.nn.Parameter(torch.randn(8, 8))
    opt = DeMo([p], lr=1e-2)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=10)
    for step in range(3):
        _grads_for([p], step)
        opt.step()
        sched.step()
    written = opt.param_groups[0]["momentum"]
    saved = opt.state_dict()  # momentum written by the scheduler, compression_decay not yet synced
    assert saved["param_groups"][0]["compression_decay"] != written
    q = torch.nn.Parameter(p.detach().clone())
    resumed = DeMo([q], lr=1e-2)
    resumed.load_state_dict(saved)
    q.grad = torch.randn_like(q)
    resumed.step()
    assert resumed.param_groups[0]["compression_decay"] == written == resumed.param_groups[0][SYNCED_KEY]


# ----------------------------------------------------------------------------- overlap + scheduler


def _overlap_with_scheduler(rank: int, world: int):
    _torch_path()
    x, y = _data(rank)
    runs = []
    for overlap in (False, True):
        torch.manual_seed(0)
        model = SmallNet()
        opt = DeMo(
            model.parameters(), lr=3e-3, compression_topk=8, bucket_cap_mb=0.01, overlap_backward=overlap
        )
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=6)
        decays = []
        for _ in range(5):
            opt.zero_grad()
            _backward(model, x, y)
            opt.step()
            decays.append(opt.param_groups[0]["compression_decay"])
            sched.step()
        runs.append(([p.detach().clone() for p in model.parameters()], decays))
    return runs


@pytest.mark.distributed
@pytest.mark.slow
def test_overlapped_buckets_use_the_scheduler_decay():
    for (sync_params, sync_decays), (ovl_params, ovl_decays) in run_gloo(2, _overlap_with_scheduler):
        assert sync_decays == ovl_decays and len(set(sync_decays)) > 2
        assert all(torch.equal(a, b) for a, b in zip(sync_params, ovl_params, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_all_finite_matches_isfinite(dtype):
    from cokit.compress.guards import all_finite

    x = torch.randn(1000).to(dtype)
    assert bool(all_finite(x)) and bool(all_finite(x[:0]))
    for bad in (float("nan"), float("inf"), -float("inf")):
        y = x.clone()
        y[517] = bad
        assert not bool(all_finite(y)) and not bool(all_finite(y.view(10, 100)[5:]))
    assert all_finite(x).shape == () and all_finite(x).dtype == torch.bool
