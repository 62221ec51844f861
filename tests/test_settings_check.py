"""DeMo: every rank must use the same settings (or payloads are decoded wrongly); empty parameters;
bad arguments."""

from __future__ import annotations

import os
import pickle
import zlib
from unittest import mock

import pytest
import torch
from distributed import run_gloo
from torch.distributed import distributed_c10d

from cokit.compress import DeMo
from cokit.compress.demo_settings import fingerprinted

SHAPES = [(32, 48), (48,), (24, 32), (7,), (16, 3, 3, 3), (3,)]  # >= 6 tensors: a full 32-bit fingerprint


def _params(shapes=SHAPES) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def _set_grads(params, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(100 * step + rank)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


def _snapshot(params, opt) -> list[torch.Tensor]:
    return [p.detach().clone() for p in params] + [s["delta"].clone() for s in opt.state.values()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# One value per rank for each setting: (keyword, rank 0, rank 1, text naming it in the error).
DIFFERENCES = [
    ("lr", 0.01, 0.02, "param group 0 setting 'lr' is 0.01 on rank [0], 0.02 on rank [1]"),
    ("weight_decay", 0.0, 0.1, "param group 0 setting 'weight_decay' is 0.0 on rank [0], 0.1 on rank [1]"),
    ("compression_decay", 0.9, 0.99, "setting 'compression_decay' is 0.9 on rank [0], 0.99 on rank [1]"),
    ("compression_topk", 4, 8, "setting 'compression_topk' is 4 on rank [0], 8 on rank [1]"),
    ("compression_chunk", 16, 8, "setting 'compression_chunk' is 16 on rank [0], 8 on rank [1]"),
    ("alpha", 1.0, 0.5, "setting 'alpha' is 1.0 on rank [0], 0.5 on rank [1]"),
    ("payload", "compact", "sign", "setting 'payload' is 'compact' on rank [0], 'sign' on rank [1]"),
    ("value_dtype", torch.bfloat16, torch.float16, "'value_dtype' is 'torch.bfloat16' on rank [0]"),
    ("dense_fallback", True, False, "setting 'dense_fallback' is True on rank [0], False on rank [1]"),
    ("bucket_cap_mb", 25.0, 0.001, "setting 'bucket_cap_mb' is 25.0 on rank [0], 0.001 on rank [1]"),
    ("full_sync_every", None, 2, "setting 'full_sync_every' is None on rank [0], 2 on rank [1]"),
    ("overlap_backward", False, True, "setting 'overlap_backward' is False on rank [0], True on rank [1]"),
    ("nonfinite", "error", "skip", "setting 'nonfinite' is 'error' on rank [0], 'skip' on rank [1]"),
    ("validate_payload", False, True, "setting 'validate_payload' is False on rank [0], True on rank [1]"),
]


def _first_step_differences(rank: int, world: int):
    os.environ["TRITON_INTERPRET"] = "0"
    out = {}
    for key, v0, v1, _ in DIFFERENCES:
        params = _params()
        opt = DeMo(
            params, **{"lr": 0.01, "compression_topk": 4, "compression_chunk": 16, key: (v0, v1)[rank]}
        )
        _set_grads(params, rank, 0)
        if key == "nonfinite" and rank == 1:
            params[0].grad[0, 0] = float("inf")  # "error" would raise, "skip" would skip
        before = _snapshot(params, opt)
        try:
            opt.step()
            out[key] = ("no error", True)
        except ValueError as exc:
            out[key] = (str(exc), _same(before, _snapshot(params, opt)) and not opt.state)
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_every_setting_that_differs_at_the_first_step_fails_on_every_rank_naming_it():
    results = run_gloo(2, _first_step_differences)
    for key, _, _, text in DIFFERENCES:
        messages = [r[key][0] for r in results]
        assert messages[0] == messages[1], key  # the same error on every rank
        assert text in messages[0] and "nothing changed" in messages[0], messages[0]
        assert all(r[key][1] for r in results), f"{key}: a parameter or buffer changed"


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.b = torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.b(torch.relu(self.norm(self.a(x))))


def _backward(model, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(10 * step + rank)
    x = torch.randn(8, 16, generator=g)
    model(x).square().mean().backward()


def _scheduler_on_one_rank(rank: int, world: int, overlap: bool):
    """Rank 1 steps an LR scheduler, rank 0 forgets: the second step must fail everywhere."""
    os.environ["TRITON_INTERPRET"] = "0"
    torch.manual_seed(0)
    model = _Net()
    opt = DeMo(model.parameters(), lr=0.01, compression_topk=4, compression_chunk=8, overlap_backward=overlap)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    opt.zero_grad()
    _backward(model, rank, 0)
    opt.step()
    if rank == 1:
        sched.step()
    params = list(model.parameters())
    before = _snapshot(params, opt)
    opt.zero_grad()
    try:
        _backward(model, rank, 1)
        opt.step()
        message = "no error"
    except ValueError as exc:
        message = str(exc)
    unchanged = _same(before, _snapshot(params, opt))
    opt.param_groups[0]["lr"] = 0.01  # the scheduler fixed: the next step goes through
    opt.zero_grad()
    _backward(model, rank, 2)
    opt.step()
    return message, unchanged, opt.comm_stats.steps


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True])
def test_a_learning_rate_that_diverges_at_a_later_step_fails_on_every_rank(overlap):
    for message, unchanged, steps in run_gloo(2, _scheduler_on_one_rank, overlap):
        assert "param group 0 setting 'lr' is 0.01 on rank [0], 0.005 on rank [1]" in message, message
        assert unchanged and steps == 2  # and after the error, the optimizer steps again


def _overlap_on_one_rank(rank: int, world: int):
    """overlap_backward on rank 1 only, with a real backward: rank 1 checks in its first hook,
    rank 0 in step(); the check is the first collective of both."""
    os.environ["TRITON_INTERPRET"] = "0"
    torch.manual_seed(0)
    model = _Net()
    opt = DeMo(model.parameters(), lr=0.01, overlap_backward=rank == 1)
    before = [p.detach().clone() for p in model.parameters()]
    try:
        _backward(model, rank, 0)
        opt.step()
        message = "no error"
    except (ValueError, RuntimeError) as exc:
        message = str(exc)
    return message, all(
        torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)
    ) and not opt.state


@pytest.mark.distributed
@pytest.mark.slow
def test_overlap_backward_on_one_rank_only_fails_on_every_rank_without_a_hang():
    for message, unchanged in run_gloo(2, _overlap_on_one_rank):
        assert "setting 'overlap_backward' is False on rank [0], True on rank [1]" in message, message
        assert unchanged


def _added_groups(rank: int, world: int, overlap: bool):
    os.environ["TRITON_INTERPRET"] = "0"
    torch.manual_seed(0)
    model, extra = _Net(), torch.nn.Linear(16, 32)
    opt = DeMo(model.parameters(), lr=0.01, compression_topk=4, compression_chunk=8, overlap_backward=overlap)
    _backward(model, rank, 0)
    opt.step()
    opt.zero_grad()
    opt.add_param_group({"params": extra.parameters(), "lr": 0.02})  # the same on every rank: fine
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
    ((model(x).sum() + extra(x).sum()) / 100).backward()
    opt.step()
    trained = [p.detach().clone() for p in extra.parameters()]
    opt.zero_grad()
    late = torch.nn.Linear(4, 4)
    opt.add_param_group({"params": late.parameters(), "lr": 0.03 if rank == 0 else 0.04})
    before = _snapshot([p for g in opt.param_groups for p in g["params"]], opt)
    try:  # overlap_backward: the check runs in the first hook, during backward
        ((model(x).sum() + extra(x).sum() + late(torch.ones(2, 4)).sum()) / 100).backward()
        opt.step()
        message = "no error"
    except ValueError as exc:
        message = str(exc)
    unchanged = _same(before, _snapshot([p for g in opt.param_groups for p in g["params"]], opt))
    return trained, message, unchanged


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True])
def test_settings_are_checked_again_after_add_param_group(overlap):
    results = run_gloo(2, _added_groups, overlap)
    for trained, message, unchanged in results:
        assert all(torch.equal(a, b) for a, b in zip(trained, results[0][0], strict=True))  # ranks agree
        assert "param group 2 setting 'lr' is 0.03 on rank [0], 0.04 on rank [1]" in message, message
        assert unchanged
    assert not torch.equal(results[0][0][0], torch.nn.Linear(16, 32).weight)  # the new group stepped


# ----------------------------------------------------------------------------- empty parameters


def _with_an_empty_param(rank: int, world: int, payload: str, overlap: bool):
    os.environ["TRITON_INTERPRET"] = "0"
    runs = {}
    for with_empty in (False, True):
        params = _params(SHAPES[:3])
        empty = torch.nn.Parameter(torch.zeros(0, 5))
        opt = DeMo(
            [*params, empty] if with_empty else params,
            lr=0.01,
            compression_topk=4,
            compression_chunk=16,
            payload=payload,
            overlap_backward=overlap,
        )
        for step in range(2):
            _set_grads(params, rank, step)
            empty.grad = torch.zeros(0, 5)
            opt.step()
        runs[with_empty] = (
            [p.detach().clone() for p in params],
            opt.comm_stats.step_sent_bytes,
            empty in opt.state,
            tuple(empty.shape),
        )
    return runs


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(
    "payload, overlap", [("compact", False), ("sign", False), ("reference", False), ("compact", True)]
)
def test_an_empty_parameter_sends_nothing_and_changes_nothing(payload, overlap):
    world = 2
    results = run_gloo(world, _with_an_empty_param, payload, overlap)
    for runs in results:
        plain, with_empty = runs[False], runs[True]
        assert all(torch.equal(a, b) for a, b in zip(plain[0], with_empty[0], strict=True))  # same steps
        assert all(torch.equal(a, b) for a, b in zip(with_empty[0], results[0][True][0], strict=True))
        # it adds no byte: the status row has one size whatever the parameters
        assert with_empty[1] == plain[1]
        assert not with_empty[2] and with_empty[3] == (0, 5)


# ----------------------------------------------------------------------------- bad arguments


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (
            {"process_group": "x"},
            TypeError,
            "process_group must be None .* or a torch.distributed ProcessGroup",
        ),
        ({"bucket_cap_mb": True}, ValueError, "bucket_cap_mb must be a finite number > 0"),
        ({"overlap_backward": "yes"}, TypeError, "overlap_backward must be True or False"),
        ({"validate_payload": 1}, TypeError, "validate_payload must be True or False"),
        ({"dense_fallback": "auto"}, TypeError, "dense_fallback must be True or False"),
        ({"lr": True}, ValueError, "lr must be a finite number"),
    ],
)
def test_bad_arguments_are_rejected(kwargs, error, match):
    with pytest.raises(error, match=match):
        DeMo(_params(SHAPES[:1]), **kwargs)


def test_a_bad_param_group_is_not_added():
    opt = DeMo(_params(SHAPES[:1]), lr=0.01)
    extra = torch.nn.Parameter(torch.zeros(4))
    for group, match in (
        ({"params": [extra], "lr": -1.0}, "param group 1: lr must be a finite number >= 0.0"),
        ({"params": [extra], "compression_topk": 0}, "compression_topk must be an integer >= 1"),
        ({"params": (p for p in [torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))])}, "float32"),
    ):
        with pytest.raises((ValueError, TypeError), match=match):
            opt.add_param_group(group)
        assert len(opt.param_groups) == 1
    opt.add_param_group({"params": (p for p in [extra]), "lr": 0.5})  # a generator is read once
    assert opt.param_groups[1]["params"] == [extra] and opt.param_groups[1]["lr"] == 0.5


# ----------------------------------------------------------------------------- a 64-bit fingerprint


def _old_six_bits(lr: float) -> int:
    """The fingerprint one parameter carried before: 6 bits of a crc32 of the settings."""
    opt = DeMo([torch.nn.Parameter(torch.zeros(32, 48))], lr=lr, compression_topk=4, compression_chunk=16)
    return zlib.crc32(repr(fingerprinted(opt)).encode()) & 63


def _colliding_lr() -> float:
    """An lr near 0.01 that the old 6-bit fingerprint could not tell from 0.01."""
    base = _old_six_bits(0.01)
    return next(x for i in range(1, 10000) if _old_six_bits(x := round(0.01 * (1 + i * 1e-4), 8)) == base)


def _slightly_other_lr(rank: int, world: int, lr: float):
    os.environ["TRITON_INTERPRET"] = "0"
    params = [torch.nn.Parameter(torch.randn(32, 48, generator=torch.Generator().manual_seed(0)))]
    opt = DeMo(params, lr=0.01 if rank == 0 else lr, compression_topk=4, compression_chunk=16)
    _set_grads(params, rank, 0)
    before = [p.detach().clone() for p in params]

    def refuse(*args, **kwargs):  # the mismatch report must not unpickle what a peer sent
        raise AssertionError("the exchange unpickled peer data")

    class Refusing(pickle.Unpickler):  # what torch's object collectives unpickle with
        def load(self):
            refuse()

    with (
        mock.patch.object(pickle, "loads", refuse),
        mock.patch.object(distributed_c10d, "_unpickler", Refusing),
    ):
        try:
            opt.step()
            message = "no error"
        except ValueError as exc:
            message = str(exc)
    return message, all(torch.equal(a, b) for a, b in zip(before, params, strict=True))


@pytest.mark.distributed
def test_a_slightly_different_lr_on_one_parameter_is_caught_without_unpickling():
    """One parameter carried 6 bits of the settings crc: 1 lr in 64 trained on with diverging
    replicas. The 64-bit fingerprint catches it, and the report travels as JSON."""
    lr = _colliding_lr()
    for message, unchanged in run_gloo(2, _slightly_other_lr, lr):
        assert f"param group 0 setting 'lr' is 0.01 on rank [0], {lr} on rank [1]" in message, message
        assert unchanged


def test_fingerprints_of_near_settings_never_collide():
    from cokit.compress.agreement import canonical, fingerprint

    seen = {fingerprint(canonical({"lr": 0.01 * (1 + i * 1e-9), "k": i % 7})) for i in range(50_000)}
    assert len(seen) == 50_000
