"""SparseLoCo.snapshot(): undoing a step (a round torchft did not commit) puts back every bit of
the state, so that running the step again is the step of a twin that never ran it."""

from __future__ import annotations

import json

import pytest
import torch

from cokit.compress import SparseLoCo

SYNC_EVERY = 3


def _build(dtype: torch.dtype, **kwargs) -> tuple[torch.nn.Module, SparseLoCo]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).to(dtype)
    opt = SparseLoCo(model.named_parameters(), sync_every=SYNC_EVERY, topk=4, chunk=4, **kwargs)
    return model, opt


def _grads(model: torch.nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def _packed(model: torch.nn.Module, opt: SparseLoCo) -> tuple[list[torch.Tensor], dict, dict]:
    """The weights, every tensor of the state dict, and its shared record (the comm stats,
    which count what was sent, left out)."""
    sd = opt.state_dict()
    tensors = {
        f"{n}.{k}": torch.as_tensor(v).clone() for n, entry in sd["state"].items() for k, v in entry.items()
    }
    return (
        [p.detach().clone() for p in model.parameters()],
        tensors,
        json.loads(sd["param_groups"][0]["sparseloco"]),
    )


def _same(a: tuple, b: tuple) -> bool:
    (wa, ta, ra), (wb, tb, rb) = a, b
    return (
        all(torch.equal(x, y) for x, y in zip(wa, wb, strict=True))
        and ta.keys() == tb.keys()
        and all(torch.equal(ta[k], tb[k]) for k in ta)
        and ra == rb
    )


@pytest.mark.parametrize(
    ("dtype", "kwargs"),
    [
        (torch.float32, {}),
        (torch.bfloat16, {"outer": "nesterov", "adaptive_topk": True, "precision": "master"}),
    ],
    ids=["average", "nesterov-adaptive-bf16-master"],
)
def test_undo_puts_back_every_bit_and_the_step_runs_again_as_in_a_twin(dtype, kwargs) -> None:
    model, opt = _build(dtype, **kwargs)
    twin_model, twin = _build(dtype, **kwargs)
    undone = 0
    for step in range(3 * SYNC_EVERY):
        _grads(model, step)
        _grads(twin_model, step)
        if step in (0, SYNC_EVERY - 1, 2 * SYNC_EVERY - 1, 2 * SYNC_EVERY):  # first, syncs, local
            before = _packed(model, opt)
            undo = opt.snapshot()
            opt.step()
            assert not _same(before, _packed(model, opt)), step
            undo()
            assert _same(before, _packed(model, opt)), f"step {step} was not undone bit for bit"
            undone += 1
        opt.step()
        twin.step()
        assert _same(_packed(model, opt), _packed(twin_model, twin)), f"step {step} differs from the twin"
    assert undone == 4 and opt.syncs == twin.syncs == 3


def test_recheck_compares_the_replicas_at_the_next_step_only() -> None:
    model, opt = _build(torch.float32)
    for step in range(SYNC_EVERY):
        _grads(model, step)
        opt.step()
    calls = []
    opt.check_replicas = lambda named: calls.append(len(named))  # type: ignore[method-assign]
    _grads(model, SYNC_EVERY)
    opt.step()
    assert not calls  # checked once, at the first step
    opt.recheck()
    opt.step()
    opt.step()
    assert calls == [4]  # theta_global of each of the 4 tensors, at the step after recheck()
