"""The checkpoint records of every front end (DeMo, SparseLoCo, Dion, the DDP hook), and the
checks every load runs on them before anything changes, with one wording for each defect.

The optimizers save torch.optim's layout (``state`` and ``param_groups``, which DCP keeps) and
put two kinds of JSON string in group 0: ``<key>`` (shared: format, optimizer, world size,
settings, counters) and ``<key>_rank<R>`` (rank ``R``'s own: its comm stats); the hook saves a
plain dict with the same fields. A load checks, each raising ``ValueError`` naming what differs
and what to do:

* the format and the optimizer that saved it (:func:`check_format`);
* the rank and world size (:func:`origin_problem`, :func:`check_origin`): per-rank state loads
  only on its own rank at its own world size;
* the settings (:func:`setting_differences`, :func:`check_settings`);
* the param groups (:func:`check_groups`) and their hyper-parameters
  (:func:`check_saved_groups`, :func:`check_finite_hyper_parameters`);
* the state's entries (:func:`check_entries`, :func:`lacks`), tensors (:func:`check_tensor`,
  :func:`check_inner_state`), counters (:func:`check_counts`), comm stats
  (:func:`load_comm_stats`) and policy state (:func:`check_policy_state`).

:func:`read_records` runs the first two for the optimizers' JSON records, and
:class:`RecordSpec` writes and reads them for an optimizer front end.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from cokit.compress.stats import CommStats

__all__ = [
    "FrontEnd",
    "RecordSpec",
    "Records",
    "check_counts",
    "check_entries",
    "check_finite_hyper_parameters",
    "check_format",
    "check_groups",
    "check_inner_state",
    "check_origin",
    "check_policy_state",
    "check_saved_groups",
    "check_settings",
    "check_tensor",
    "damaged",
    "hyper_parameters",
    "lacks",
    "load_comm_stats",
    "origin_problem",
    "read_records",
    "setting_differences",
]

#: how every refusal ends: the load changed nothing
NOTHING_CHANGED = "Nothing changed"


@dataclass(frozen=True)
class Records:
    """What :func:`read_records` found: the saved state and groups, the shared record and this
    rank's, the groups' hyper-parameters (:func:`hyper_parameters`) and the state's keys of the
    parameters in order (indices, or names after DCP)."""

    state: Mapping[Any, Any]
    groups: list[Mapping[str, Any]]
    common: dict[str, Any]
    mine: dict[str, Any]
    hyper: list[dict[str, Any]]
    keys: list[Any]


def _rank_key(key: str) -> re.Pattern[str]:
    return re.compile(rf"^{re.escape(key)}_rank(\d+)$")


def damaged(where: str, what: str) -> ValueError:
    """The error of a state that no save writes: ``what`` it holds."""
    return ValueError(f"{where}: {what}; the file is damaged")


def check_format(where: str, record: object, *, optimizer: str, fmt: object) -> None:
    """Raise unless ``record`` (a dict with ``format`` and, for optimizers, ``optimizer``) is
    ``optimizer``'s format ``fmt``."""
    saved = record.get("format") if isinstance(record, Mapping) else None
    if saved != fmt:
        raise ValueError(
            f"{where}: the state has format {saved!r}, this cokit reads {optimizer} format {fmt!r}: "
            "it is another optimizer's state, or another cokit version saved it (load it with that one)"
        )
    assert isinstance(record, Mapping)
    if record.get("optimizer", optimizer) != optimizer:
        raise ValueError(
            f"{where}: the state was saved by optimizer {record.get('optimizer')!r}, not {optimizer}: "
            "load it into the optimizer that saved it"
        )


def origin_problem(
    *, saved_world: object, world: object, ranks: Mapping[int, object], who: Mapping[str, int], per_rank: str
) -> str | None:
    """Why this rank (``who``: its ``rank`` and whatever else its record keeps) cannot load the
    per-rank part of a state saved at ``saved_world`` with the records ``ranks`` (by rank); None
    when it can. ``per_rank`` says what is kept per rank."""
    mine = ranks.get(who["rank"])
    if saved_world != world:
        return (
            f"the state was saved at world size {saved_world}, this run has world size {world}: {per_rank} "
            "belong to the rank that saved them"
        )
    if not isinstance(mine, Mapping):
        return (
            f"the state holds the records of rank(s) {sorted(ranks)}, this is rank {who['rank']}: every "
            "rank must load the state it saved itself (saving on rank 0 only loses the other ranks' "
            f"{per_rank}: save on every rank, one file each, or use torch.distributed.checkpoint)"
        )
    differ = [k for k in who if mine.get(k) != who[k]]
    if differ:
        diff = ", ".join(f"{k} {mine.get(k)!r} (here {who[k]})" for k in differ)
        return f"this rank's record says {diff}: the state belongs to another rank or run"
    return None


def check_origin(where: str, problem: str | None, relax: str = "") -> None:
    """Raise with :func:`origin_problem`'s ``problem`` (nothing when None); ``relax`` says how
    to load anyway."""
    if problem is not None:
        raise ValueError(
            f"{where}: {problem}. {NOTHING_CHANGED}. Load each rank's own state at the world size it "
            f"was saved at{relax}"
        )


def read_records(
    sd: object,
    *,
    key: str,
    optimizer: str,
    fmt: int,
    rank: int,
    world: int,
    where: str,
    per_rank: str,
    settings: Mapping[str, Any],
    live_groups: list[dict[str, Any]],
    loose: Iterable[str] = (),
    optional: Mapping[str, Any] | None = None,
) -> Records:
    """Check that ``sd`` is an ``optimizer`` state dict of format ``fmt`` saved by rank
    ``rank`` of a world of ``world`` (``per_rank`` says what is kept per rank), with the
    ``settings`` (:func:`check_settings`), param groups like ``live_groups`` and no entry that
    no group lists, and return its records."""
    if not (
        isinstance(sd, Mapping)
        and isinstance(sd.get("state"), Mapping)
        and isinstance(sd.get("param_groups"), list)
        and sd["param_groups"]
        and all(isinstance(g, Mapping) and "params" in g for g in sd["param_groups"])
    ):
        raise ValueError(
            f"{where}: this is not a {optimizer} state_dict ({{'state': ..., 'param_groups': [...]}})"
        )
    groups, g0 = sd["param_groups"], sd["param_groups"][0]
    pattern = _rank_key(key)
    try:
        common = json.loads(g0[key])
        ranks = {int(m[1]): json.loads(v) for k, v in g0.items() if (m := pattern.match(str(k)))}
    except (KeyError, TypeError, ValueError):
        raise ValueError(
            f"{where}: param group 0 has no readable {key!r} record: this is not a {optimizer} state (or "
            "something dropped the record, e.g. DCP with flatten_optimizer_state_dict=True)"
        ) from None
    check_format(where, common, optimizer=optimizer, fmt=fmt)
    problem = origin_problem(
        saved_world=common.get("world"), world=world, ranks=ranks, who={"rank": rank}, per_rank=per_rank
    )
    check_origin(where, problem)
    check_settings(where, settings, common.get("settings") or {}, loose, optional)
    check_groups(where, groups, live_groups)
    keys = [k for g in groups for k in g["params"]]
    check_entries(where, sd["state"], keys)
    return Records(sd["state"], groups, common, ranks[rank], hyper_parameters(groups, key), keys)


class FrontEnd(Protocol):
    """What :class:`RecordSpec` reads of an optimizer front end (:mod:`cokit.compress.frontend`)."""

    exchange: Any  # global_rank(): this rank in the default group
    comm: Any  # world_size: the exchange group's
    comm_stats: CommStats
    param_groups: list[dict[str, Any]]


@dataclass(frozen=True)
class RecordSpec:
    """One optimizer front end's JSON records (module docstring): the group-0 ``key`` of the
    shared record (``<key>_rank<R>``: rank ``R``'s), the ``optimizer`` and format ``fmt`` they
    name, the loader's name in messages (``where``), what it keeps per rank (``per_rank``) and
    the settings a load compares loosely or only when on (``loose``, ``optional``: see
    :func:`check_settings`)."""

    key: str
    optimizer: str
    fmt: int
    where: str
    per_rank: str
    loose: tuple[str, ...] = ()
    optional: Mapping[str, Any] | None = None

    def write(self, groups: list[dict[str, Any]], opt: FrontEnd, settings: Any, **shared: Any) -> None:
        """Put the shared record (format, optimizer, world size, ``settings`` and ``shared``) and
        this rank's (format, rank, comm stats) in param group 0 of ``groups``."""
        rank = opt.exchange.global_rank()
        common = {"format": self.fmt, "optimizer": self.optimizer, "world": opt.comm.world_size}
        common.update(settings=settings, **shared)
        mine = {"format": self.fmt, "rank": rank, "comm_stats": opt.comm_stats.as_dict()}
        groups[0][self.key] = json.dumps(common, sort_keys=True)
        groups[0][f"{self.key}_rank{rank}"] = json.dumps(mine, sort_keys=True)

    def read(self, sd: object, opt: FrontEnd, settings: Mapping[str, Any]) -> Records:
        """:func:`read_records` of ``sd`` for ``opt`` (this rank, its world size and param groups)
        with ``opt``'s ``settings``."""
        spec = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return read_records(
            sd,
            **spec,
            rank=opt.exchange.global_rank(),
            world=opt.comm.world_size,
            settings=settings,
            live_groups=opt.param_groups,
        )


def setting_differences(
    here: Mapping[str, Any],
    saved: Mapping[str, Any],
    loose: Iterable[str] = (),
    optional: Mapping[str, Any] | None = None,
) -> list[str]:
    """Every setting that differs between ``here`` and ``saved``, said the same way for every
    front end. ``loose`` settings do not change what is computed and may differ; ``optional``
    ones are recorded only when on and compare as their value when off (``{name: off value}``)
    when either side lacks them."""
    optional = optional or {}
    out = []
    for name in sorted((set(here) | set(saved) | set(optional)) - set(loose)):
        now, then = here.get(name, optional.get(name)), saved.get(name, optional.get(name))
        if now != then:
            out.append(f"setting {name!r} was {then!r}, is {now!r} now")
    return out


def check_settings(
    where: str,
    here: Mapping[str, Any],
    saved: Mapping[str, Any],
    loose: Iterable[str] = (),
    optional: Mapping[str, Any] | None = None,
    relax: str = "",
) -> None:
    """Raise naming every setting that differs (:func:`setting_differences`); ``relax`` says
    how to load anyway."""
    differ = setting_differences(here, saved, loose, optional)
    if differ:
        raise ValueError(
            f"{where}: {'; '.join(differ)}. {NOTHING_CHANGED}. Build it with the settings it was saved "
            f"with{relax}"
        )


def check_groups(where: str, saved: list[Mapping[str, Any]], live: list[dict[str, Any]]) -> None:
    """Raise unless the saved groups hold as many parameters, group by group, as ``live``, under
    the same names where both name them."""
    if len(saved) != len(live):
        raise ValueError(
            f"{where}: the checkpoint has {len(saved)} param groups, this optimizer has {len(live)}; "
            "build the optimizer with the param groups it was saved with"
        )
    for gi, (s, g) in enumerate(zip(saved, live, strict=True)):
        if len(s["params"]) != len(g["params"]):
            raise ValueError(
                f"{where}: param group {gi} has {len(s['params'])} parameters in the checkpoint, "
                f"{len(g['params'])} here; build the same model (and groups) as when saving"
            )
        names, saved_names = g.get("param_names"), s.get("param_names")
        if names is not None and saved_names is not None and list(names) != list(saved_names):
            n = next(i for i, (a, b) in enumerate(zip(names, saved_names, strict=True)) if a != b)
            raise ValueError(
                f"{where}: param group {gi} parameter {n} is {saved_names[n]!r} in the checkpoint but "
                f"{names[n]!r} here; build the same model, with its parameters in the same order"
            )


def hyper_parameters(groups: list[Mapping[str, Any]], key: str) -> list[dict[str, Any]]:
    """The saved groups without their records (and without ``params``)."""
    pattern = _rank_key(key)
    return [
        {k: v for k, v in g.items() if not (k == "params" or k == key or pattern.match(str(k)))}
        for g in groups
    ]


def _number(value: object) -> object:
    return value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value


def check_finite_hyper_parameters(where: str, groups: Sequence[Mapping[str, Any]]) -> None:
    """Raise unless every number among the saved groups' hyper-parameters (``lr``, betas, ...)
    is finite and every ``lr`` is >= 0: a NaN lr would turn the weights NaN at the next step."""
    for gi, group in enumerate(groups):
        for name, value in group.items():
            for v in value if isinstance(value, (tuple, list)) else [value]:
                v = _number(v)
                if isinstance(v, float) and not math.isfinite(v):
                    raise damaged(where, f"saved param group {gi} has {name}={value!r}")
        lr = _number(group.get("lr"))
        if isinstance(lr, (int, float)) and not isinstance(lr, bool) and lr < 0:
            raise damaged(where, f"saved param group {gi} has lr={lr!r} < 0")


def check_saved_groups(
    where: str,
    hyper: list[dict[str, Any]],
    keys: Iterable[str],
    check: Callable[[dict[str, Any], int], None],
) -> None:
    """Raise unless every saved group's hyper-parameters (:func:`hyper_parameters`) are finite
    (:func:`check_finite_hyper_parameters`), hold ``keys`` and pass the front end's own
    ``check(group, index)``, whose error is told as the saved group's."""
    check_finite_hyper_parameters(where, hyper)
    for gi, h in enumerate(hyper):
        missing = sorted(set(keys) - set(h))
        if missing:
            raise damaged(where, f"saved param group {gi} lacks {missing}")
        try:
            check(h, gi)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: saved {exc}") from None


def check_entries(where: str, state: Mapping[Any, Any], listed: Iterable[Any]) -> None:
    """Raise unless every entry of ``state`` belongs to a parameter some saved group lists."""
    extra = sorted(map(str, set(state) - set(listed)))
    if extra:
        raise damaged(where, f"the state has entries {extra} that no saved param group lists")


def lacks(where: str, what: str) -> ValueError:
    """The error of a state that lacks ``what`` a save always writes."""
    return damaged(where, f"the state lacks {what}")


def check_tensor(
    where: str,
    what: str,
    value: object,
    shape: tuple[int, ...],
    *,
    dtype: torch.dtype | None = None,
    finite: bool = True,
) -> torch.Tensor:
    """``value``, checked: a float tensor (of ``dtype`` when given) of ``shape``, and finite
    unless ``finite=False`` (the caller decides)."""
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        got = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"{where}: {what} is {got}, not a float tensor")
    if dtype is not None and value.dtype != dtype:
        raise TypeError(f"{where}: {what} must be a {dtype} tensor, got {value.dtype}")
    if tuple(value.shape) != tuple(shape):
        raise ValueError(
            f"{where}: {what} has shape {tuple(value.shape)}, expected {tuple(shape)}: build the same "
            "model (and sharding) as when saving"
        )
    if finite and not bool(torch.isfinite(value).all()):
        raise damaged(where, f"{what} is not finite")
    return value


def check_inner_state(where: str, state: Mapping[int, Mapping[str, Any]], name: Callable[[int], str]) -> None:
    """Raise unless every tensor of a saved inner-optimizer state is finite and every second
    moment (``exp_avg_sq``, ``max_exp_avg_sq``) is >= 0: a negative one turns every later
    step's update NaN."""
    for n, entry in state.items():
        for key, value in entry.items():
            if not isinstance(value, torch.Tensor) or not value.is_floating_point():
                continue
            if not bool(torch.isfinite(value).all()):
                raise damaged(where, f"the inner optimizer's {key} of {name(n)} is not finite")
            if key.endswith("exp_avg_sq") and bool((value < 0).any()):
                raise damaged(where, f"the inner optimizer's {key} of {name(n)} is negative")


def check_counts(where: str, counters: Mapping[str, Any], names: Iterable[str], default: object = 0) -> None:
    """Raise unless each of ``names`` in ``counters`` (``default`` where absent) is an int >= 0."""
    for name in names:
        value = counters.get(name, default)
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
            raise damaged(where, f"the saved {name} is {value!r}, not a count")


_STATS = {f.name for f in dataclasses.fields(CommStats) if not f.name.startswith("_")}


def load_comm_stats(where: str, saved: object) -> CommStats:
    """The saved comm stats (:meth:`CommStats.as_dict` output), each total a number >= 0."""
    problem = None
    if not isinstance(saved, Mapping):
        problem = f"a {type(saved).__name__}, not CommStats.as_dict() output"
    else:
        for key in sorted(_STATS & set(saved)):
            value = saved[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                problem = f"{key} is {value!r}, not a number >= 0"
                break
            if not math.isfinite(value):
                problem = f"{key} is {value!r}, not a number >= 0"
                break
    if problem is None:
        assert isinstance(saved, Mapping)
        try:
            return CommStats.from_dict(copy.deepcopy(dict(saved)))
        except (TypeError, ValueError) as exc:
            problem = str(exc)
    raise damaged(where, f"the saved comm_stats do not load ({problem})")


def check_policy_state(where: str, driver: Any, saved: object, owner: str) -> None:
    """Raise unless ``saved`` loads into a copy of the policy ``driver``."""
    if not isinstance(saved, dict):
        raise damaged(where, f"the saved policy record is {type(saved).__name__}")
    try:
        copy.deepcopy(driver).load_state_dict(saved, owner=owner)
    except (TypeError, ValueError, KeyError) as exc:
        raise ValueError(f"{where}: the saved policy state does not load: {exc}") from None
