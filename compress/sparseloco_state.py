"""SparseLoCo's state dict in torch.optim's layout: plain ``torch.save`` files and DCP.

``torch.distributed.checkpoint`` (``get_optimizer_state_dict`` / ``set_optimizer_state_dict``)
keeps only ``state`` (keyed by parameter) and ``param_groups``, and writes keys that several
ranks share once. So (format 2):

* ``state[n]`` for the model's parameter ``n``: ``global`` (theta_global) and ``momentum`` (the
  outer Nesterov momentum), identical on every rank; ``error_rank<R>`` (the error buffer),
  ``master_rank<R>`` (the fp32 master of a low-precision parameter), ``local_rank<R>`` (the
  parameter itself: between syncs every rank's weights differ, and DCP keeps only one copy of
  the model's) and ``inner_rank<R>.<key>`` (the inner optimizer's state), which differ per
  rank, under keys naming the global rank ``R``;
* with ``sync="eager"`` also ``pending`` (the mean of the round in flight, waited for by
  ``state_dict()``: shared; zeros when none) and ``start_rank<R>`` (where this rank's period
  started); the error buffers are then the ones that round produced;
* ``param_groups``: the groups' hyper-parameters (shared); group 0 also holds two JSON records,
  ``sparseloco`` (shared: format, world size, settings, counters, policy) and
  ``sparseloco_rank<R>`` (this rank's comm stats). With ``adaptive_topk`` the shared record
  also holds ``topk_per_tensor``: ``[[parameter index, k], ...]``, the k's of the next sync;
  with ``sync="eager"``, ``in_flight``: every rank's status row of the round launched and not
  yet applied (a list of report fields), or None.

:func:`load` checks everything (format, rank, world size, settings, shapes, finiteness,
counters, the policy state) before anything changes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from cokit.compress import sparseloco_overlap as overlap
from cokit.compress.adaptive_topk import k_limits
from cokit.compress.frontend import plain
from cokit.compress.named_params import indexed_groups
from cokit.compress.payload import wire_sizes
from cokit.compress.sparseloco_local import hyper
from cokit.compress.state_records import (
    RecordSpec,
    check_counts,
    check_finite_hyper_parameters,
    check_inner_state,
    check_policy_state,
    check_tensor,
    lacks,
    load_comm_stats,
)

if TYPE_CHECKING:
    from cokit.compress.sparseloco import SparseLoCo

__all__ = ["FORMAT", "load", "pack", "records"]

FORMAT = 2
COMMON_KEY = "sparseloco"
_RANK_KEY = re.compile(r"^sparseloco_rank(\d+)$")
_WHERE = "SparseLoCo.load_state_dict"
_SHARED = ("global", "momentum")
_COUNTERS = ("steps", "since_sync", "syncs", "skipped_syncs", "skipped_steps", "inner_resets")
_LOOSE = ("validate_payload",)  # settings that do not change what is computed
#: settings recorded only when they are on (so a run without them keeps its fingerprint and saved
#: settings), and their values when off
_OPTIONAL: dict[str, Any] = {
    "sync": "blocking",
    "dense_warmup": 0,
    "dense_params": None,
    "adaptive_topk": False,
    "adaptive_range": None,
}
_RECORDS = RecordSpec(
    COMMON_KEY, "SparseLoCo", FORMAT, _WHERE, "error buffers and inner state", _LOOSE, _OPTIONAL
)


def pack(opt: SparseLoCo) -> dict[str, Any]:
    """``opt``'s state in format 2 (module docstring); a round in flight is waited for first."""
    eager = opt.sync == "eager"
    if eager:
        overlap.settle(opt)
    rank = opt.exchange.global_rank()
    pending_key, start_key = overlap.state_keys(rank)
    pending, next_errors = overlap.pending_means(opt), overlap.pending_errors(opt)
    inner = opt.inner.state_dict()
    # every buffer the optimizer will hold is present (zeros until first used), so that a load
    # through DCP, which fills only the keys the loading optimizer's state has, brings them all
    compressed = {i for b in opt.plan.buckets() if not b.dense for i in b.members}
    state: dict[int, dict[str, Any]] = {}
    for n, p in enumerate(opt._model_params):
        s = opt.state.get(p, {})
        zeros = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        entry: dict[str, Any] = {k: s[k].clone() for k in _SHARED if k in s}
        if opt.outer == "nesterov" and "momentum" not in entry and "global" in entry:
            entry["momentum"] = zeros
        if (error := next_errors[n]) is None:  # the round in flight commits its buffers when it lands
            error = s.get("error")
        if error is not None or n in compressed:
            entry[f"error_rank{rank}"] = error.clone() if error is not None else zeros.clone()
        if eager and "global" in entry:  # the round's mean (shared) and this rank's start point
            entry[pending_key] = pending[n].clone() if pending[n] is not None else zeros.clone()
            entry[start_key] = s.get("start", s["global"]).clone()
        if id(p) in opt._masters:  # the local weights: the master, or the parameter itself
            entry[f"master_rank{rank}"] = opt._masters[id(p)].detach().clone()
        else:
            entry[f"local_rank{rank}"] = p.detach().clone()
        for key, value in inner["state"].get(n, {}).items():
            entry[f"inner_rank{rank}.{key}"] = value.clone() if isinstance(value, torch.Tensor) else value
        state[n] = entry
    groups = indexed_groups(opt.param_groups)
    shared: dict[str, Any] = {
        "counters": _counters(opt),
        "interval": opt.current_interval,
        "policy": opt._driver.state_dict(),
    }
    if opt.adaptive_topk:
        shared["topk_per_tensor"] = [[i, k] for i, k in sorted(opt.plan.topks().items())]
    if eager:  # every rank's status row of the round in flight (None: nothing in flight)
        shared["in_flight"] = overlap.saved_status(opt)
    _RECORDS.write(groups, opt, _settings(opt), **shared)
    return {"state": state, "param_groups": groups}


def records(sd: Mapping[str, Any]) -> dict[str, Any]:
    """The records of a format-2 state: ``{"common": {...}, "ranks": {rank: {...}}}``."""
    g0 = (sd.get("param_groups") or [{}])[0]
    common = g0.get(COMMON_KEY)
    ranks = {int(m[1]): json.loads(v) for k, v in g0.items() if (m := _RANK_KEY.match(str(k)))}
    return {"common": json.loads(common) if isinstance(common, str) else None, "ranks": ranks}


def _settings(opt: SparseLoCo) -> dict[str, Any]:
    return json.loads(json.dumps(settings(opt)))


def _counters(opt: SparseLoCo) -> dict[str, Any]:
    return {
        "steps": opt._steps,
        "since_sync": opt._since_sync,
        "syncs": opt.syncs,
        "skipped_syncs": opt.skipped_syncs,
        "skipped_steps": opt.skipped_steps,
        "inner_resets": opt.inner_resets,
        "checked": opt._checked,
    }


def load(opt: SparseLoCo, sd: object) -> None:
    """Check ``sd`` against ``opt``, then load it (see :meth:`SparseLoCo.load_state_dict`)."""
    if isinstance(sd, Mapping) and sd.get("type") == "SparseLoCo":
        raise ValueError(
            f"{_WHERE}: this state has format {sd.get('format')!r} (cokit before SparseLoCo's format "
            f"{FORMAT}); load it with the cokit version that saved it"
        )
    rank = opt.exchange.global_rank()
    rec = _RECORDS.read(sd, opt, _settings(opt))
    common = rec.common
    check_finite_hyper_parameters(_WHERE, rec.hyper)
    params = opt._model_params
    inner_state: dict[int, dict[str, Any]] = {}
    loaded: list[dict[str, torch.Tensor]] = []
    prefix = f"inner_rank{rank}."
    keys = {"global", "momentum", f"error_rank{rank}", f"master_rank{rank}", f"local_rank{rank}"}
    eager = opt.sync == "eager"
    if eager:
        keys.update(overlap.state_keys(rank))
    for n, (p, key_n) in enumerate(zip(params, rec.keys, strict=True)):
        entry = rec.state.get(key_n, {})
        if not isinstance(entry, Mapping):
            raise ValueError(f"{_WHERE}: the state of {opt._name(n)} is {type(entry).__name__}, not a dict")
        ours: dict[str, torch.Tensor] = {}
        for key, value in entry.items():
            key = str(key)
            if key.startswith(prefix):
                inner_state.setdefault(n, {})[key[len(prefix) :]] = value
            elif key in keys:
                check_tensor(_WHERE, f"{key} of {opt._name(n)}", value, tuple(p.shape))
                dtype = p.dtype if key.startswith("local") else torch.float32
                ours[key.split("_rank")[0]] = value.detach().to(p.device, dtype).clone()
            elif not (
                key.startswith(("error_rank", "master_rank", "local_rank", "inner_rank", "start_rank"))
            ):
                raise ValueError(f"{_WHERE}: unknown state {key!r} for {opt._name(n)}")
        loaded.append(ours)
    check_inner_state(_WHERE, inner_state, opt._name)
    counters = common.get("counters") or {}
    check_counts(_WHERE, counters, _COUNTERS)
    status = common.get("in_flight") if eager else None
    in_flight = status is not None
    _check_present(opt, loaded, counters, in_flight)
    interval = common.get("interval", opt.sync_every)
    if not (isinstance(interval, int) and interval >= 1):
        raise ValueError(f"{_WHERE}: saved interval {interval!r} is not a positive integer")
    policy = common.get("policy")
    if policy is not None:
        check_policy_state(_WHERE, opt._driver, policy, "SparseLoCo")
    topks = _saved_topks(opt, common) if opt.adaptive_topk else None
    stats = load_comm_stats(_WHERE, rec.mine.get("comm_stats", {}))
    # everything checked: the inner optimizer first (it validates its own state), then ours
    hyper = rec.hyper
    inner_groups = opt.inner.state_dict()["param_groups"]
    opt.inner.load_state_dict(
        {
            "state": inner_state,
            "param_groups": [
                {**h, "params": ig["params"]} for h, ig in zip(hyper, inner_groups, strict=True)
            ],
        }
    )
    for g, h in zip(opt.param_groups, hyper, strict=True):
        g.update(h)
    means = [ours.pop("pending", None) for ours in loaded]
    flight = overlap.loaded_flight(means, status, opt.comm.world_size, _WHERE) if in_flight else None
    for n, p in enumerate(params):
        ours = loaded[n]
        master, local = ours.pop("master", None), ours.pop("local", None)
        with torch.no_grad():
            if master is not None and id(p) in opt._masters:
                opt._masters[id(p)].copy_(master)
                p.copy_(master)
            elif local is not None:
                p.copy_(local)
        opt.state[p] = ours
    opt._steps, opt._since_sync = counters.get("steps", 0), counters.get("since_sync", 0)
    opt.syncs, opt.skipped_syncs = counters.get("syncs", 0), counters.get("skipped_syncs", 0)
    opt.skipped_steps, opt.inner_resets = counters.get("skipped_steps", 0), counters.get("inner_resets", 0)
    opt._checked = False  # the first step after a load compares the replicas again
    opt._flight = flight
    opt.current_interval = interval
    if topks is not None:
        opt.plan.set_topks(topks)
    if policy is not None:
        opt._driver.load_state_dict(policy, owner="SparseLoCo")
    opt.comm_stats = stats


def _check_present(
    opt: SparseLoCo, loaded: list[dict[str, torch.Tensor]], counters: Mapping[str, Any], in_flight: bool
) -> None:
    """Raise unless the state holds what its counters say must exist: ``theta_global`` of every
    parameter once a step ran, the error buffer of every compressed tensor once a sync ran (or
    one is in flight), and with a round in flight its mean (``pending``) of every parameter."""
    steps, syncs = counters.get("steps", 0), counters.get("syncs", 0)
    compressed = {i for b in opt.plan.static() if not b.dense for i in b.members}
    for n, ours in enumerate(loaded):
        if steps and "global" not in ours:
            raise lacks(_WHERE, f"theta_global of {opt._name(n)}")
        if (syncs or in_flight) and n in compressed and "error" not in ours:
            raise lacks(_WHERE, f"this rank's error buffer of {opt._name(n)}")
        if in_flight and "pending" not in ours:
            raise lacks(_WHERE, f"the mean of the round in flight of {opt._name(n)}")


def _saved_topks(opt: SparseLoCo, common: Mapping[str, Any]) -> dict[int, int]:
    """The saved k's of ``adaptive_topk``: one per tensor the static plan compresses, each within
    its limits, the total within the static budget; else the file is damaged."""
    saved = common.get("topk_per_tensor")
    tilings = opt.plan.tilings()
    topk, k_range = opt.topk, opt.adaptive_range
    assert topk is not None and k_range is not None
    entries: list[Any] = saved if isinstance(saved, list) else []
    ok = isinstance(saved, list) and all(
        isinstance(e, list) and len(e) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in e)
        for e in entries
    )
    topks = {e[0]: e[1] for e in entries} if ok else {}
    ok = ok and len(topks) == len(entries) and sorted(topks) == sorted(tilings)
    ok = ok and all(
        k_limits(topk, t.tile_numel, k_range)[0] <= topks[i] <= k_limits(topk, t.tile_numel, k_range)[1]
        for i, t in tilings.items()
    )
    budget = sum(t.n_tiles * t.k_eff(topk) for t in tilings.values())
    if not ok or sum(tilings[i].n_tiles * k for i, k in topks.items()) > budget:
        raise ValueError(
            f"{_WHERE}: the saved topk_per_tensor {saved!r} do not fit this model's compressed "
            f"tensors {sorted(tilings)} (each within adaptive_range, the total within {budget} values); "
            "the file is damaged"
        )
    return topks


def settings(opt: SparseLoCo) -> dict[str, Any]:
    """Everything every rank must agree on (compared at every sync, kept in the records)."""
    out: dict[str, Any] = {
        "sync_every": opt.sync_every,
        "topk": opt.topk,
        "chunk": opt.chunk,
        "dct": opt.dct,
        "payload": opt.payload,
        "value_dtype": str(opt.value_dtype),
        "error_decay": opt.error_decay,
        "outer": opt.outer,
        "outer_lr": opt.outer_lr,
        "outer_momentum": opt.outer_momentum,
        "nonfinite": opt.nonfinite,
        "precision": opt.precision,
        "seed": opt.seed,
        "bucket_cap_mb": opt.bucket_cap_mb,
        "policy": opt.policy.describe(),
        "inner": type(opt.inner).__name__,
        "validate_payload": opt.exchange.validate,
    }
    # the later options only when on: the fingerprint and saved settings of a run without
    # them are what they were
    if opt.sync != "blocking":
        out["sync"] = opt.sync
    if opt.dense_warmup:
        out["dense_warmup"] = opt.dense_warmup
    if opt.dense_params is not None:
        out["dense_params"] = list(opt.dense_params)
    if opt.adaptive_topk:
        assert opt.adaptive_range is not None
        out["adaptive_topk"] = True
        out["adaptive_range"] = list(opt.adaptive_range)
    return out


def describe(opt: SparseLoCo) -> dict[str, Any]:
    """What every sync's fingerprint covers, as JSON (the mismatch report)."""
    out = settings(opt)
    if opt.adaptive_topk:
        # the k's of the next sync (state, not a setting: a load does not compare them), named
        # first when a rank's diverged
        out["topk_per_tensor"] = [[i, k] for i, k in sorted(opt.plan.topks().items())]
    return {
        "settings": out,
        "groups": [{k: plain(v) for k, v in hyper(g).items() if _comparable(v)} for g in opt.param_groups],
        "layout": [[opt._name(n), f"{tuple(p.shape)} {p.dtype}"] for n, p in enumerate(opt._model_params)],
        "derived": {"payload wire sizes": wire_sizes(b.codec for b in opt.plan.buckets())},
        "counters": {"steps": opt._steps, "syncs": opt.syncs, "skipped_syncs": opt.skipped_syncs},
    }


def _comparable(v: object) -> bool:
    return isinstance(v, (int, float, bool, str, tuple, torch.Tensor)) or v is None
