"""A live replica's SparseLoCo state made into a joiner's (cokit.compress.ft_heal), in one process:
shared state as is, local weights = theta_global, error buffers zero, inner state the peer's,
keyed for the joiner's rank; another model or other settings are refused before anything changes."""

from __future__ import annotations

import pytest
import torch

from cokit.compress import SparseLoCo
from cokit.compress.ft_heal import check_layout, for_joiner
from cokit.compress.sparseloco_state import records


def _run(seed: int, hidden: int = 8, topk: int = 4, steps: int = 7) -> tuple[torch.nn.Module, SparseLoCo]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 2))
    opt = SparseLoCo(model.named_parameters(), sync_every=3, topk=topk, chunk=4)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        x = torch.randn(5, 6, generator=g)
        model(x).square().mean().backward()
        opt.step()
    return model, opt


def test_joiner_takes_shared_and_inner_state_with_zero_error_and_global_weights() -> None:
    _, peer = _run(0)  # 7 steps: 2 syncs and one local step since
    sd = peer.state_dict()
    peer_state = [peer.state[p] for g in peer.param_groups for p in g["params"]]
    assert any(float(s["error"].abs().sum()) > 0 for s in peer_state if "error" in s)
    _, joiner = _run(1, steps=0)
    joined = for_joiner(sd, rank=0, world=1)
    joiner.load_state_dict(joined)
    params = [p for g in joiner.param_groups for p in g["params"]]
    for p, theirs in zip(params, peer_state, strict=True):
        mine = joiner.state[p]
        assert torch.equal(mine["global"], theirs["global"])
        assert torch.equal(p.detach(), theirs["global"])  # local weights: the last sync's
        if "error" in theirs:
            assert not mine["error"].any()  # the peer still holds its own residual
    assert joiner.syncs == peer.syncs == 2
    assert records(joined)["common"]["counters"]["since_sync"] == 1
    inner_peer, inner_mine = peer.inner.state_dict()["state"], joiner.inner.state_dict()["state"]
    for n, s in inner_peer.items():
        for k, v in s.items():
            assert torch.equal(torch.as_tensor(inner_mine[n][k]), torch.as_tensor(v)), (n, k)


def test_rank_keys_are_renamed_for_the_joiner() -> None:
    _, peer = _run(0)
    joined = for_joiner(peer.state_dict(), rank=2, world=3)
    keys = {k for entry in joined["state"].values() for k in entry}
    assert any(k.startswith("inner_rank2.") for k in keys) and "local_rank2" in keys
    assert not any("rank0" in k for k in keys)
    rec = records(joined)
    assert rec["common"]["world"] == 3 and list(rec["ranks"]) == [2]


def test_another_model_or_other_settings_are_refused_before_anything_changes() -> None:
    _, peer = _run(0)
    sd = peer.state_dict()
    _, opt = _run(1, hidden=5, steps=0)
    with pytest.raises(ValueError, match=r"parameter 0 is \(8, 6\) on the live replicas and \(5, 6\) here"):
        check_layout(sd, [p for g in opt.param_groups for p in g["params"]], "FaultTolerant")
    deeper = torch.nn.Linear(6, 2)
    with pytest.raises(ValueError, match="a model of 4 parameters, this replica's has 2"):
        check_layout(sd, list(deeper.parameters()), "FaultTolerant")
    model, opt = _run(1, topk=2, steps=0)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="setting 'topk' was 4, is 2 now"):
        opt.load_state_dict(for_joiner(sd, rank=0, world=1))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize(
    "options, message",
    [
        ({"sync": "eager"}, "sync='eager' is not supported"),
        ({"dense_warmup": 2}, "dense_warmup=2 is not supported"),
    ],
)
def test_sparseloco_settings_torchft_cannot_run_are_refused_at_construction(
    options: dict, message: str
) -> None:
    pytest.importorskip("torchft", reason="torchft is not installed (pip install 'cokit[ft]')")
    import datetime
    from types import SimpleNamespace

    from cokit.compress.ft import FaultTolerant
    from cokit.compress.ft_group import QuorumGloo

    group = QuorumGloo(timeout=datetime.timedelta(seconds=5))
    manager = SimpleNamespace(_pg=group, _use_async_quorum=False)  # refused before the manager is used
    model = torch.nn.Linear(4, 2)
    with pytest.raises(ValueError, match=message):
        FaultTolerant(
            manager, SparseLoCo(model.parameters(), sync_every=2, topk=2, chunk=2, **options), group
        )
