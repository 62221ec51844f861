"""DeMo checkpoints that cannot load wrongly: plain ``torch.save`` files and DCP.

``DeMo.state_dict()`` (format 2) is a torch.optim state dict laid out for both uses:

* ``state[i] = {"delta_rank<R>": fp32 buffer}`` for every parameter (zeros before its first
  gradient), ``R`` the global rank: each rank's error buffer differs, so it lives in an entry
  of its own (``torch.distributed.checkpoint`` writes equal keys of several ranks only once);
  the buffers that are identical on every rank (the adam rule's ``v`` and ``rule_step``, the
  fp32 ``master`` of ``precision="master"``) sit next to it under plain keys, stored once;
* ``param_groups[0]["demo"]``: a JSON record shared by the ranks: format, optimizer type, world
  sizes, the settings (``DeMo._settings()`` without the per-group ones, which are the param
  groups themselves), the step counters and the network policy's state;
* ``param_groups[0]["demo_rank<R>"]``: this rank's JSON record: its ranks, world sizes and
  ``comm_stats``.

Why there: DCP's ``get_optimizer_state_dict`` keeps only ``state`` (keyed by parameter) and
``param_groups``, and ``dcp.load`` fills only the keys the loading optimizer asks for; a JSON
string is one leaf, so a record always loads whole. :func:`check_load` validates a state
against an optimizer before anything changes; :meth:`DeMo.load_state_dict` applies the plan.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import warnings
from collections.abc import Iterator, Mapping
from itertools import chain
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from cokit.compress import rules
from cokit.compress.demo_settings import GROUP_SETTINGS, check_group, fingerprinted
from cokit.compress.dtensor import local
from cokit.compress.state_records import (
    check_counts,
    check_entries,
    check_format,
    check_groups,
    check_origin,
    check_policy_state,
    check_saved_groups,
    check_settings,
    check_tensor,
    damaged,
    load_comm_stats,
    origin_problem,
    setting_differences,
)
from cokit.compress.stats import CommStats

if TYPE_CHECKING:
    from cokit.compress.optimizer import DeMo

__all__ = [
    "FORMAT",
    "LoadPlan",
    "apply_load",
    "check_load",
    "pack",
    "records",
    "relaxed_loading",
    "replicated",
]

FORMAT = 2
COMMON_KEY = "demo"
_RANK_KEY = re.compile(r"^demo_rank(\d+)$")
_DELTA_KEY = re.compile(r"^delta_rank(\d+)$")
_WHERE = "DeMo.load_state_dict"
# per-parameter state identical on every rank (update rules, precision): plain keys
SHARED_KEYS = ("v", "rule_step", "master")


def rank_key(rank: int) -> str:
    """The param-group key of global rank ``rank``'s record."""
    return f"demo_rank{rank}"


def delta_key(rank: int) -> str:
    """The per-parameter state key of global rank ``rank``'s error buffer."""
    return f"delta_rank{rank}"


def identity(opt: DeMo) -> dict[str, int]:
    """This process's place: global rank and world, and its rank and size in DeMo's group."""
    on = dist.is_available() and dist.is_initialized()
    return {
        "rank": dist.get_rank() if on else 0,
        "world": dist.get_world_size() if on else 1,
        "group_rank": opt.comm.rank,
        "group_world": opt.comm.world_size,
    }


def _settings(opt: DeMo) -> dict[str, Any]:
    """The optimizer-wide settings as JSON values (the per-group ones travel as param groups)."""
    return json.loads(json.dumps({k: v for k, v in fingerprinted(opt).items() if k != "groups"}))


def pack(opt: DeMo, sd: dict[str, Any]) -> dict[str, Any]:
    """``sd`` (torch's ``Optimizer.state_dict()`` of ``opt``) in DeMo's format 2."""
    who = identity(opt)
    params = [p for g in opt.param_groups for p in g["params"]]
    ids = [i for g in sd["param_groups"] for i in g["params"]]
    state: dict[Any, dict[str, torch.Tensor]] = {}
    for i, p in zip(ids, params, strict=True):
        delta = opt.state[p].get("delta") if p in opt.state else None
        if delta is None:  # no gradient yet: the buffer is zero (present, so DCP can load it)
            shard = local(p)
            delta = torch.zeros(shard.shape, dtype=torch.float32, device=shard.device)
        # a copy: DCP's load writes into the dict it is given, and nothing may change before
        # load_state_dict has checked the checkpoint
        state[i] = {delta_key(who["rank"]): delta.clone()}
        for key in SHARED_KEYS:
            if p in opt.state and key in opt.state[p]:
                state[i][key] = opt.state[p][key].clone()
    common = {
        "format": FORMAT,
        "optimizer": type(opt).__name__,
        "world": who["world"],
        "group_world": who["group_world"],
        "settings": _settings(opt),
        "steps": opt._steps,
        "skipped_steps": opt.skipped_steps,
        "skipped_syncs": opt.skipped_syncs,
        "policy": opt._driver.state_dict(),
    }
    mine = {"format": FORMAT, **who, "comm_stats": opt.comm_stats.as_dict()}
    groups = [dict(g) for g in sd["param_groups"]]
    groups[0][COMMON_KEY] = json.dumps(common, sort_keys=True)
    groups[0][rank_key(who["rank"])] = json.dumps(mine, sort_keys=True)
    return {**sd, "state": state, "param_groups": groups}


def records(sd: Mapping[str, Any]) -> dict[str, Any]:
    """The DeMo records of a format-2 state dict: ``{"common": {...}, "ranks": {rank: {...}}}``
    (what ``torch.load`` of a saved state can be inspected with)."""
    groups = sd.get("param_groups") or [{}]
    g0 = groups[0] if isinstance(groups[0], Mapping) else {}
    common = g0.get(COMMON_KEY)
    ranks = {int(m[1]): json.loads(v) for k, v in g0.items() if (m := _RANK_KEY.match(str(k)))}
    return {"common": json.loads(common) if isinstance(common, str) else None, "ranks": ranks}


@contextlib.contextmanager
def relaxed_loading(opt: DeMo) -> Iterator[None]:
    """Within the block, ``opt.load_state_dict(sd)`` behaves as ``load_state_dict(sd,
    strict=False)``: for loads that go through other code, such as DCP's
    ``set_optimizer_state_dict`` / ``set_state_dict``."""
    before = getattr(opt, "_relaxed_load", False)
    opt._relaxed_load = True
    try:
        yield
    finally:
        opt._relaxed_load = before


@dataclasses.dataclass
class LoadPlan:
    """What a validated load changes: param groups (for torch's loader), buffers, counters,
    the policy state and comm stats (None: keep the optimizer's), and the warnings to give."""

    groups: list[dict[str, Any]]
    deltas: list[tuple[torch.Tensor, torch.Tensor]]
    shared: list[tuple[torch.Tensor, dict[str, torch.Tensor]]]
    counters: dict[str, int]
    policy: dict[str, Any] | None
    comm_stats: CommStats | None
    warnings: list[str]


def check_load(opt: DeMo, sd: object, strict: bool) -> LoadPlan:
    """Validate ``sd`` against ``opt`` (nothing changes here) and return the load plan.

    Raises ``TypeError``/``ValueError`` naming what differs and what to do; with
    ``strict=False`` the relaxable differences become warnings in the plan: another rank or
    world size keeps settings, counters and policy and zeroes the error buffers; non-finite
    buffers start from zero; other settings keep the optimizer's; an old checkpoint without
    records loads unchecked. Buffers stay fp32 whatever the dtype.
    """
    if not (
        isinstance(sd, Mapping)
        and isinstance(sd.get("state"), Mapping)
        and isinstance(sd.get("param_groups"), list)
        and all(isinstance(g, Mapping) and "params" in g for g in sd["param_groups"])
    ):
        raise TypeError(
            f"{_WHERE}: expected an optimizer state dict ({{'state': ..., 'param_groups': [...]}}, "
            f"from DeMo.state_dict()), got {type(sd).__name__}"
            + (f" with keys {sorted(map(str, sd))}" if isinstance(sd, Mapping) else "")
        )
    saved_groups = sd["param_groups"]
    g0 = saved_groups[0] if saved_groups else {}
    warns: list[str] = []
    fmt = _format_of(opt, sd, g0)
    if fmt == 1 and strict:
        raise ValueError(
            f"{_WHERE}: this checkpoint has the old format (no rank, world size or settings "
            "records: saved by cokit before checkpoint format 2), so DeMo cannot check that it "
            "belongs to this rank. If every rank loads the file it saved itself, at the same world "
            "size and settings, load it with load_state_dict(sd, strict=False) (it warns); "
            "otherwise start DeMo afresh and save again"
        )
    groups = _check_groups(opt, saved_groups)
    id_map = dict(zip(chain.from_iterable(g["params"] for g in saved_groups), _params(opt), strict=True))
    who = identity(opt)
    keep_rank = True
    if fmt == 1:
        warns.append(
            f"{_WHERE}: loading an old-format checkpoint (no rank/world records): nothing checks "
            "that this rank saved it; save again to get a checked checkpoint"
        )
        extra = sd.get(COMMON_KEY, {})
        common = {k: extra.get(k, 0) for k in ("steps", "skipped_steps", "skipped_syncs")}
        common["policy"] = extra.get("policy")
        mine: dict[str, Any] | None = {"comm_stats": extra.get("comm_stats", {})}
        key = "delta"
    else:
        common, ranks = _parse_records(g0)
        mine = ranks.get(who["rank"])
        keep_rank = _check_world(common, ranks, who, strict, warns)
        _check_settings(opt, common, strict, warns)
        key = delta_key(who["rank"])
    deltas, shared = _check_deltas(opt, sd["state"], id_map, key, keep_rank, fmt, strict, warns)
    counters = {k: common.get(k, 0) for k in ("steps", "skipped_steps", "skipped_syncs")}
    check_counts(_WHERE, counters, counters)
    policy = _check_policy(opt, common.get("policy"), strict, warns)
    if keep_rank and mine is not None:
        stats = load_comm_stats(_WHERE, mine.get("comm_stats", {}))
    else:
        warns.append(f"{_WHERE}: comm_stats start again from zero (this rank's record was dropped)")
        stats = CommStats()
    return LoadPlan(groups, deltas, shared, counters, policy, stats, warns)


def _params(opt: DeMo) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


def _format_of(opt: DeMo, sd: Mapping[str, Any], g0: Mapping[str, Any]) -> int:
    """2 (records present) or 1 (DeMo before format 2); anything else raises, saying whose it is."""
    if COMMON_KEY in g0:
        return 2
    entries = [v for v in sd["state"].values() if isinstance(v, Mapping)]
    keys = sorted({str(k) for v in entries for k in v})
    if COMMON_KEY in sd and all(set(v) <= {"delta"} for v in entries):
        return 1
    if keys and all(_DELTA_KEY.match(k) or k in SHARED_KEYS for k in keys):
        raise ValueError(
            f"{_WHERE}: the state has DeMo's per-rank buffers but param group 0 has no 'demo' "
            "record: something dropped it (DCP with StateDictOptions(flatten_optimizer_state_dict="
            "True) does; use the default options), or the dict was edited"
        )
    group_keys = sorted(set(g0) - {"params", "param_names", "differentiable"} - set(opt.defaults))
    raise ValueError(
        f"{_WHERE}: this is not a DeMo state dict (it has no 'demo' record"
        + (f"; its state holds {keys}" if keys else "")
        + (f"; its param groups have {group_keys}" if group_keys else "")
        + "): it was saved by another optimizer (e.g. torch.optim.AdamW). Load it into the "
        "optimizer that saved it; to switch a run to DeMo, load only the model and start DeMo afresh"
    )


def _check_groups(opt: DeMo, saved: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The saved param groups without DeMo's records, checked against ``opt``'s."""
    check_groups(_WHERE, saved, opt.param_groups)
    # saved before the update rules existed: those ran DeMo's sign rule
    out = [{**rules.RULE_DEFAULTS, **s} if "update_rule" not in s else dict(s) for s in saved]
    out = [{k: v for k, v in s.items() if not (k == COMMON_KEY or _RANK_KEY.match(str(k)))} for s in out]
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in out]
    check_saved_groups(_WHERE, hyper, GROUP_SETTINGS, lambda g, gi: check_group({**g, "params": []}, gi))
    return out


def _parse_records(g0: Mapping[str, Any]) -> tuple[dict[str, Any], dict[int, Any]]:
    """The shared record and every rank's."""
    try:
        common = json.loads(g0[COMMON_KEY])
        ranks = {int(m[1]): json.loads(v) for k, v in g0.items() if (m := _RANK_KEY.match(str(k)))}
    except (TypeError, ValueError) as exc:
        raise damaged(_WHERE, f"the DeMo records do not parse ({exc})") from None
    check_format(_WHERE, common, optimizer="DeMo", fmt=FORMAT)
    return common, ranks


def _check_world(
    common: dict[str, Any], ranks: dict[int, Any], who: dict[str, int], strict: bool, warns: list[str]
) -> bool:
    """True when this rank's buffers can load: same world sizes, and the record is this rank's."""
    problem = origin_problem(
        saved_world=f"{common.get('world')} (DeMo group size {common.get('group_world')})",
        world=f"{who['world']} (DeMo group size {who['group_world']})",
        ranks=ranks,
        who=who,
        per_rank="error buffers",
    )
    if problem is None:
        return True
    if strict:
        check_origin(
            _WHERE,
            problem,
            ", or pass strict=False (DCP: with cokit.compress.checkpoint.relaxed_loading(opt)) to keep "
            "the settings, counters and policy and start the error buffers from zero",
        )
    warns.append(
        f"{_WHERE}: {problem}; strict=False: dropped this rank's error buffers (zero) and comm_stats"
    )
    return False


# settings that change nothing a checkpoint holds (checking peers' bytes): not compared on load
_LOOSE = ("validate_payload",)
_RELAX_SETTINGS = ", or pass strict=False to load the buffers under this optimizer's settings"


def _check_settings(opt: DeMo, common: dict[str, Any], strict: bool, warns: list[str]) -> None:
    saved, here = common.get("settings") or {}, _settings(opt)
    if strict:
        check_settings(_WHERE, here, saved, _LOOSE, relax=_RELAX_SETTINGS)
    differ = setting_differences(here, saved, _LOOSE)
    if differ:
        warns.append(f"{_WHERE}: {'; '.join(differ)}; strict=False: kept this optimizer's settings")


def _check_deltas(
    opt: DeMo,
    state: Mapping[Any, Any],
    id_map: dict[Any, torch.Tensor],
    key: str,
    keep: bool,
    fmt: int,
    strict: bool,
    warns: list[str],
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[tuple[torch.Tensor, dict[str, torch.Tensor]]]]:
    """``(param, fp32 buffer copy)`` for every error buffer that loads, and ``(param, {key:
    copy})`` of the shared buffers (:data:`SHARED_KEYS`)."""
    names = {
        id(p): opt.plan.name(gi, i, p)
        for gi, g in enumerate(opt.param_groups)
        for i, p in enumerate(g["params"])
    }
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    shared: list[tuple[torch.Tensor, dict[str, torch.Tensor]]] = []
    found: set[int] = set()
    bad: list[str] = []
    check_entries(_WHERE, state, id_map)
    for k, entry in state.items():
        p = id_map[k]
        if not isinstance(entry, Mapping) or (keep and set(map(str, entry)) - {key, *SHARED_KEYS}):
            others = sorted(map(str, entry)) if isinstance(entry, Mapping) else type(entry).__name__
            raise ValueError(
                f"{_WHERE}: the state of {names[id(p)]} holds {others}, expected {[key]} (and "
                f"optionally {list(SHARED_KEYS)}): it was saved by another rank or optimizer"
            )
        if not keep:
            continue
        extra = _check_shared(entry, local(p), names[id(p)])
        if extra is None:
            bad.append(names[id(p)])
            continue
        if extra:
            shared.append((p, extra))
        delta = entry.get(key)
        if delta is None:
            continue
        check_tensor(
            _WHERE, f"the error buffer of {names[id(p)]}", delta, tuple(local(p).shape), finite=False
        )
        if not bool(torch.isfinite(delta).all()):
            bad.append(names[id(p)])
            continue
        found.add(id(p))
        out.append((p, delta))
    if bad:
        what = f"non-finite values in the error buffers of {_listing(bad)}"
        if strict:
            raise ValueError(
                f"{_WHERE}: {what}: the checkpoint was saved after a NaN/inf reached them and those "
                "parameters would never move again. Nothing changed. Resume from an earlier "
                "checkpoint, or pass strict=False to start those buffers from zero"
            )
        warns.append(f"{_WHERE}: {what}; strict=False: those buffers start from zero")
    if keep and fmt == 2:
        missing = [names[id(p)] for p in _params(opt) if p.requires_grad and id(p) not in found]
        missing = [n for n in missing if n not in bad]
        if missing:
            text = f"no error buffer for {_listing(missing)}"
            if strict:
                raise ValueError(
                    f"{_WHERE}: {text}; DeMo.state_dict() saves one for every parameter. Build the same "
                    "model as when saving, or pass strict=False to start them from zero"
                )
            warns.append(f"{_WHERE}: {text}; strict=False: they start from zero")
    deltas = [
        (p, d.detach().to(device=local(p).device, dtype=torch.float32, copy=True).contiguous())
        for p, d in out
    ]
    return deltas, shared


def _check_shared(entry: Mapping[Any, Any], shard: torch.Tensor, name: str) -> dict[str, torch.Tensor] | None:
    """Copies of the shared buffers of one parameter's entry (checked: fp32 tensors of the
    parameter's shape, a step count); None when one holds non-finite values."""
    out: dict[str, torch.Tensor] = {}
    for key in SHARED_KEYS:
        value = entry.get(key)
        if value is None:
            continue
        want: tuple[int, ...] = () if key == "rule_step" else tuple(shard.shape)
        check_tensor(_WHERE, f"the {key!r} of {name}", value, want, finite=False)
        if not bool(torch.isfinite(value).all()):
            return None
        device = value.device if key == "rule_step" else shard.device  # the step count stays on CPU
        out[key] = value.detach().to(device=device, dtype=torch.float32, copy=True).contiguous()
    if ("v" in out) != ("rule_step" in out):
        raise ValueError(f"{_WHERE}: the adam rule state of {name} has only one of 'v' and 'rule_step'")
    if "rule_step" in out and not (out["rule_step"] >= 1 and out["rule_step"] == out["rule_step"].round()):
        raise ValueError(
            f"{_WHERE}: the 'rule_step' of {name} is {out['rule_step'].item()}, not a count >= 1"
        )
    return out


def _check_policy(opt: DeMo, saved: object, strict: bool, warns: list[str]) -> dict[str, Any] | None:
    """The policy state to load (validated on a copy of the policy), or None to keep it."""
    if saved is None:
        return None
    if not isinstance(saved, dict):
        raise damaged(_WHERE, f"the saved policy record is {type(saved).__name__}")
    differ = setting_differences({"policy": opt.policy.describe()}, {"policy": saved.get("policy")})
    if differ:  # unless the settings record was edited, _check_settings found it already
        if strict:
            check_settings(_WHERE, {"policy": opt.policy.describe()}, {"policy": saved.get("policy")})
        warns.append(f"{_WHERE}: {differ[0]}; strict=False: the policy starts afresh")
        return None
    check_policy_state(_WHERE, opt._driver, saved, "DeMo")
    return saved


def _listing(names: list[str], shown: int = 4) -> str:
    """``a, b, c, d (and 3 more)``."""
    more = f" (and {len(names) - shown} more)" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def apply_load(opt: DeMo, plan: LoadPlan) -> None:
    """Put a checked :class:`LoadPlan` into ``opt`` (its param groups already loaded): the error
    buffers, the shared rule state, counters, policy and comm stats; warn about what it drops."""
    for message in plan.warnings:
        warnings.warn(message, stacklevel=3)
    for p, delta in plan.deltas:
        opt.state[p]["delta"] = delta
    for p, shared in plan.shared:
        opt.state[p].update(shared)
    opt._steps = plan.counters["steps"]
    opt.skipped_steps = plan.counters["skipped_steps"]
    opt.skipped_syncs = plan.counters["skipped_syncs"]
    if plan.policy is not None:
        opt._driver.load_state_dict(plan.policy)
    if plan.comm_stats is not None:
        opt.comm_stats = plan.comm_stats
    opt._checked = False  # the first round after a load compares the replicated state


def replicated(opt: DeMo, entries: list[tuple[int, int, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """What must be alike on every rank of DeMo's group, named: every parameter (its local
    shard) and its shared state (:data:`SHARED_KEYS`: the adam rule's ``v`` and ``rule_step``,
    the fp32 ``master``), not the per-rank error buffers. As many tensors on every rank: each
    key the agreed settings may create is there, empty where the state lacks it."""
    out = []
    for gi, i, p in entries:
        group, shard, name = opt.param_groups[gi], local(p), opt.plan.name(gi, i, p)
        keys = []
        if rules.effective_rule(group["update_rule"], group["rule_fallback"], shard.shape) == "adam":
            keys += ["v", "rule_step"]
        if opt.precision == "master" and p.dtype != torch.float32:
            keys.append("master")
        state = opt.state.get(p, {})
        out.append((f"parameter {name}", shard))
        out += [(f"the {k!r} of {name}", state.get(k, torch.zeros(0, device=shard.device))) for k in keys]
    return out
