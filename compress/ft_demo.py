"""DeMo on torchft: every step is a round; what a failed round leaves and how a joiner is healed.

:class:`DeMoReplica` is DeMo's adapter for :class:`~cokit.compress.ft.FaultTolerant`
(:mod:`cokit.compress.ft_replica`). The choices (docs/ft.md):

- **A failed round is undone and its gradient kept.** DeMo's encode adds the step's gradient to
  the error buffer and removes what it sends *before* the exchange, and a member may apply the
  mean before another one fails. So the step is undone from a snapshot taken before it
  (parameters, error buffers, the adam rule's ``v``/``rule_step``, fp32 masters, counters,
  policy), then the gradient enters the error buffer as in DeMo's skipped sync (``delta =
  decay*delta + lr*grad``); no parameter moves and **no counter moves**: DeMo's counters then
  count committed rounds only, so every replica at the same torchft step holds the same
  counters, even when two survivors dropped different numbers of rounds between two commits
  (one waited out its timeout while the others failed over twice). The survivors' gradients
  of that step go out with the next rounds; the departed replica's is gone with it.
- **Survivors keep their error buffers** (what each computed and has not sent; valid whoever the
  peers are) and compare parameters and shared state again at the first round of a new quorum.
- **A (re)joining replica is healed from a live peer**: the peer's parameters, shared DeMo state
  (``v``, ``rule_step``, ``master``), counters, settings and policy state, and **an error buffer
  of zero**: the peer still holds, and will send, its own residual, so a copy would count it
  twice (and a replica healed because it fell behind may hold a residual that its peers already
  applied). The parameters are copied bit for bit, so after the next round, which applies the
  same decoded mean everywhere, every replica's parameters are bit-identical.

Everything that can refuse a joiner (another model: parameter count, shapes, dtypes; other
settings; non-finite state) raises ``ValueError`` before anything changes.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import torch

from cokit.compress import checkpoint
from cokit.compress.demo_settings import GROUP_SETTINGS
from cokit.compress.ft_group import Quorum
from cokit.compress.optimizer import DeMo

__all__ = ["DeMoReplica", "Snapshot", "check_groups", "check_params", "for_joiner", "skip_failed_round"]

WHERE = "FaultTolerant"
PARAMS_KEY = "params"
OPTIMIZER_KEY = "optimizer"
#: param-group settings a schedule may drive: the live replicas' values are the run's, taken as they are
SCHEDULED = ("lr", "weight_decay", "compression_decay", "momentum")


@dataclasses.dataclass
class Snapshot:
    """A DeMo replica before a round: parameters, per-parameter state, counters, policy."""

    params: list[torch.Tensor]
    state: list[dict[str, Any]]
    counters: tuple[int, int, int]
    policy: dict[str, Any]
    checked: bool


def _params(opt: DeMo) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


def snapshot(opt: DeMo) -> Snapshot:
    """Copies of what a DeMo step changes (one copy of the parameters and of the state)."""
    params = _params(opt)
    return Snapshot(
        params=[p.detach().clone() for p in params],
        state=[
            {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opt.state[p].items()}
            for p in params
        ],
        counters=(opt._steps, opt.skipped_steps, opt.skipped_syncs),
        policy=copy.deepcopy(opt._driver.state_dict()),
        checked=opt._checked,
    )


def restore(opt: DeMo, snap: Snapshot) -> None:
    """Put ``opt`` back as it was at ``snap`` (the parameters in place: the model holds them)."""
    with torch.no_grad():
        for p, saved, state in zip(_params(opt), snap.params, snap.state, strict=True):
            p.copy_(saved)
            opt.state[p] = dict(state)  # the snapshot's copies become the state
    opt._steps, opt.skipped_steps, opt.skipped_syncs = snap.counters
    opt._driver.load_state_dict(snap.policy)
    opt._checked = snap.checked


def skip_failed_round(opt: DeMo, snap: Snapshot) -> None:
    """The round failed here: undo it from ``snap`` and keep its gradient in the error buffers,
    as a skipped sync does, with no counter moved (module docstring). A non-finite gradient is
    not kept (DeMo would have skipped that step)."""
    restore(opt, snap)
    with torch.no_grad():
        grads = [(g, p) for g in opt.param_groups for p in g["params"] if p.grad is not None]
        if not all(bool(torch.isfinite(p.grad).all()) for _, p in grads):
            return
        for group, p in grads:
            delta = opt.plan.error_buffer(p)
            delta.mul_(group["compression_decay"]).add_(p.grad.float(), alpha=group["lr"])


def check_params(theirs: object, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The live replicas' parameters, checked against this replica's ``params`` (count, shapes,
    dtypes, finite): raises ``ValueError`` naming the first difference ("another model")."""
    if not isinstance(theirs, list) or not all(isinstance(t, torch.Tensor) for t in theirs):
        raise ValueError(f"{WHERE}: the live replicas sent no DeMo parameters")
    if len(theirs) != len(params):
        raise ValueError(
            f"{WHERE}: the live replicas train a model of {len(theirs)} parameters, this replica's has "
            f"{len(params)}: another model"
        )
    for n, (t, p) in enumerate(zip(theirs, params, strict=True)):
        if t.shape != p.shape or t.dtype != p.dtype:
            raise ValueError(
                f"{WHERE}: parameter {n} is {tuple(t.shape)} {t.dtype} on the live replicas and "
                f"{tuple(p.shape)} {p.dtype} here: another model"
            )
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{WHERE}: parameter {n} of the live replicas holds non-finite values")
    return theirs


def check_groups(theirs: object, groups: list[dict[str, Any]]) -> None:
    """The live replicas' param groups against this replica's: as many, and the same settings
    in each (but :data:`SCHEDULED`, which the joiner takes from them). A joiner built with
    another ``compression_topk`` would otherwise silently take the peers' (torch's
    ``load_state_dict`` loads the groups' settings); raises ``ValueError`` naming the first
    difference."""
    if not isinstance(theirs, list) or len(theirs) != len(groups):
        n = len(theirs) if isinstance(theirs, list) else 0
        raise ValueError(f"{WHERE}: the live replicas have {n} param groups, this replica has {len(groups)}")
    for gi, (saved, mine) in enumerate(zip(theirs, groups, strict=True)):
        for key in GROUP_SETTINGS:
            if key in SCHEDULED or key not in mine or key not in saved or saved[key] == mine[key]:
                continue
            raise ValueError(
                f"{WHERE}: setting {key!r} of param group {gi} is {saved[key]!r} on the live replicas "
                f"and {mine[key]!r} here: build this replica with the run's settings"
            )


def for_joiner(opt: DeMo, sd: Mapping[str, Any], quorum: Quorum) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """The state of ``opt`` joining at ``quorum``, from what a live replica sent (its
    ``DeMo.state_dict()`` and parameters): shared state as is, this replica's error buffers
    zero, its records for its place in the quorum; and the peer's parameters, checked."""
    if not isinstance(sd, Mapping) or not {PARAMS_KEY, OPTIMIZER_KEY} <= set(sd):
        raise ValueError(f"{WHERE}: the live replicas sent no DeMo state (another front end?)")
    params = check_params(sd[PARAMS_KEY], _params(opt))
    peer_sd = sd[OPTIMIZER_KEY]
    if not isinstance(peer_sd, Mapping) or not isinstance(peer_sd.get("state"), Mapping):
        raise ValueError(f"{WHERE}: the live replicas sent no DeMo optimizer state")
    check_groups(peer_sd.get("param_groups"), opt.param_groups)
    rec = checkpoint.records(peer_sd)
    if rec["common"] is None or len(rec["ranks"]) != 1:
        raise ValueError(
            "the live replica's state is not one replica's DeMo state "
            f"(records of ranks {sorted(rec['ranks'])})"
        )
    (peer,) = rec["ranks"]
    who = {**checkpoint.identity(opt), "group_rank": quorum.rank, "group_world": quorum.world_size}
    mine = checkpoint.delta_key(who["rank"])
    state: dict[Any, dict[str, Any]] = {}
    for key, entry in peer_sd["state"].items():
        out = {k: v for k, v in entry.items() if k in checkpoint.SHARED_KEYS}
        theirs = entry.get(checkpoint.delta_key(peer))
        if theirs is not None:
            out[mine] = torch.zeros_like(theirs)
        state[key] = out
    groups = copy.deepcopy(list(peer_sd["param_groups"]))
    g0 = groups[0]
    common = dict(rec["common"], world=who["world"], group_world=who["group_world"])
    g0[checkpoint.COMMON_KEY] = json.dumps(common, sort_keys=True)
    del g0[checkpoint.rank_key(peer)]
    own = {"format": checkpoint.FORMAT, **who, "comm_stats": opt.comm_stats.as_dict()}
    g0[checkpoint.rank_key(who["rank"])] = json.dumps(own, sort_keys=True)
    return {"state": state, "param_groups": groups}, params


class DeMoReplica:
    """DeMo: every step is a round; a failed round is undone, its gradient kept (module docstring)."""

    def __init__(self, optimizer: DeMo) -> None:
        if optimizer.comm.world_size != 1:
            raise ValueError(
                f"{WHERE}: build the DeMo with process_group=None and one process per replica group "
                f"(its group has {optimizer.comm.world_size} ranks); the quorum is its group"
            )
        if optimizer.strategy.name != "flat":
            raise ValueError(
                f"{WHERE}: DeMo's {optimizer.strategy.name} exchange is not supported on torchft "
                "(overlap_backward launches collectives during backward, hierarchy= and DTensor "
                "parameters span several processes); use plain data parallel"
            )
        self.optimizer = optimizer

    def interval(self) -> int:
        return 1

    def snapshot(self) -> Snapshot:
        return snapshot(self.optimizer)

    def failed(self, before: Snapshot) -> None:
        skip_failed_round(self.optimizer, before)

    def recheck(self) -> None:
        self.optimizer._checked = False  # the next round's status row is followed by check_replicas

    def peer_state(self) -> dict[str, Any]:
        params = [p.detach().clone() for p in _params(self.optimizer)]
        return {OPTIMIZER_KEY: self.optimizer.state_dict(), PARAMS_KEY: params}

    def for_joiner(self, sd: Mapping[str, Any], quorum: Quorum) -> tuple[dict[str, Any], list[torch.Tensor]]:
        return for_joiner(self.optimizer, sd, quorum)

    def load(self, joined: tuple[dict[str, Any], list[torch.Tensor]]) -> int:
        state, params = joined
        self.optimizer.load_state_dict(state)  # settings, shapes, finiteness: checked first
        with torch.no_grad():
            for p, theirs in zip(_params(self.optimizer), params, strict=True):
                p.copy_(theirs)
        return 0
