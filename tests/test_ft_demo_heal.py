"""DeMo's torchft adapter (cokit.compress.ft_demo) in one process: a failed round undone with
its gradient kept in the error buffers and no counter moved; a live replica's state made a joiner's (its parameters and shared
state, error buffers zero); another model or other settings refused before anything changes."""

from __future__ import annotations

import pytest
import torch

from cokit.compress import DeMo
from cokit.compress.ft_demo import DeMoReplica
from cokit.compress.ft_group import Quorum

pytest.importorskip("torchft", reason="torchft is not installed (pip install 'cokit[ft]')")


def _model(seed: int, hidden: int = 8) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 2))


def _demo(model: torch.nn.Module, topk: int = 4, **kw: object) -> DeMo:
    return DeMo(
        model.named_parameters(),
        lr=1e-2,
        compression_decay=0.9,
        compression_topk=topk,
        compression_chunk=4,
        update_rule="adam",
        **kw,
    )


def _backward(model: torch.nn.Module, g: torch.Generator) -> None:
    x = torch.randn(5, 6, generator=g)
    model(x).square().mean().backward()


def _run(seed: int, steps: int, **kw: object) -> tuple[torch.nn.Module, DeMo]:
    model = _model(seed, **kw)  # type: ignore[arg-type]
    opt = _demo(model)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        _backward(model, g)
        opt.step()
    return model, opt


def test_a_failed_round_is_undone_and_its_gradient_kept() -> None:
    model, opt = _run(0, steps=3)
    replica = DeMoReplica(opt)
    g = torch.Generator().manual_seed(7)
    opt.zero_grad()
    _backward(model, g)
    params = [p.detach().clone() for p in model.parameters()]
    deltas = [opt.state[p]["delta"].clone() for p in model.parameters()]
    v = [opt.state[p]["v"].clone() for p in model.parameters()]
    counters = (opt._steps, opt.skipped_steps, opt.skipped_syncs)
    before = replica.snapshot()
    opt.step()  # applied here, but (say) not committed: a peer failed
    assert not all(torch.equal(a, p) for a, p in zip(params, model.parameters(), strict=True))
    replica.failed(before)
    for p, p0, d0, v0 in zip(model.parameters(), params, deltas, v, strict=True):
        assert torch.equal(p.detach(), p0)  # no parameter moved
        assert torch.equal(opt.state[p]["v"], v0)  # nor the rule state
        want = d0.mul(0.9).add(p.grad.float(), alpha=1e-2)  # the gradient in full
        assert torch.equal(opt.state[p]["delta"], want)
    # counters count committed rounds only: alike on every replica at the same torchft step
    assert (opt._steps, opt.skipped_steps, opt.skipped_syncs) == counters
    opt.zero_grad()
    _backward(model, g)
    opt.step()  # and training goes on
    assert opt._steps == counters[0] + 1


def test_a_failed_round_with_a_nonfinite_gradient_keeps_nothing() -> None:
    model, opt = _run(0, steps=2)
    replica = DeMoReplica(opt)
    deltas = [opt.state[p]["delta"].clone() for p in model.parameters()]
    opt.zero_grad()
    _backward(model, torch.Generator().manual_seed(3))
    next(model.parameters()).grad[0, 0] = float("nan")
    before = replica.snapshot()
    replica.failed(before)
    assert all(torch.equal(opt.state[p]["delta"], d) for p, d in zip(model.parameters(), deltas, strict=True))
    assert opt.skipped_steps == 0 and opt.skipped_syncs == 0 and opt._steps == 2


def test_joiner_takes_parameters_and_shared_state_with_zero_error() -> None:
    peer_model, peer = _run(0, steps=4)
    assert any(bool(peer.state[p]["delta"].any()) for p in peer_model.parameters())
    sent = DeMoReplica(peer).peer_state()
    model, opt = _run(1, steps=0)
    joiner = DeMoReplica(opt)
    assert joiner.load(joiner.for_joiner(sent, Quorum(quorum_id=3, rank=0, world_size=1))) == 0
    for p, theirs in zip(model.parameters(), peer_model.parameters(), strict=True):
        assert torch.equal(p.detach(), theirs.detach())
        assert torch.equal(opt.state[p]["v"], peer.state[theirs]["v"])
        assert torch.equal(opt.state[p]["rule_step"], peer.state[theirs]["rule_step"])
        assert not opt.state[p]["delta"].any()  # the peer still holds its own residual
    assert (opt._steps, opt.skipped_steps, opt.skipped_syncs) == (peer._steps, 0, 0)
    opt.zero_grad()
    _backward(model, torch.Generator().manual_seed(5))
    opt.step()  # its first round compares replicas (_checked False after the load)
    assert opt._steps == peer._steps + 1


def test_another_model_or_other_settings_are_refused_before_anything_changes() -> None:
    _, peer = _run(0, steps=2)
    sent = DeMoReplica(peer).peer_state()
    q = Quorum(quorum_id=1, rank=0, world_size=1)
    other = DeMoReplica(_run(1, steps=0, hidden=5)[1])
    with pytest.raises(
        ValueError, match=r"parameter 0 is \(8, 6\) torch.float32 on the live replicas and \(5, 6\)"
    ):
        other.for_joiner(sent, q)
    shallow = DeMoReplica(_demo(torch.nn.Linear(6, 2)))
    with pytest.raises(ValueError, match="a model of 4 parameters, this replica's has 2: another model"):
        shallow.for_joiner(sent, q)
    with pytest.raises(ValueError, match="sent no DeMo state"):
        shallow.for_joiner({"state": {}, "param_groups": []}, q)
    model = _model(1)
    opt = _demo(model, topk=2)
    before = [p.detach().clone() for p in model.parameters()]
    replica = DeMoReplica(opt)
    with pytest.raises(
        ValueError, match="'compression_topk' of param group 0 is 4 on the live replicas and 2 here"
    ):
        replica.for_joiner(sent, q)
    global_opt = _demo(model, payload="sign")  # an optimizer-wide setting: the load's own check
    with pytest.raises(ValueError, match="payload"):
        DeMoReplica(global_opt).load(DeMoReplica(global_opt).for_joiner(sent, q))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert not opt.state


def test_unsupported_demo_layouts_are_refused() -> None:
    with pytest.raises(ValueError, match="overlapped exchange is not supported on torchft"):
        DeMoReplica(_demo(_model(0), overlap_backward=True))
