"""The JSON records that SparseLoCo's and Dion's state dicts keep in param group 0, and the
checks every load runs on them before anything changes.

Both optimizers save torch.optim's layout (``state`` and ``param_groups``, which DCP keeps) and
put two kinds of JSON string in group 0: ``<key>`` (shared: format, optimizer, world size,
settings, counters) and ``<key>_rank<R>`` (rank ``R``'s own: its comm stats). A load reads
them with :func:`read_records`, compares the settings with :func:`check_settings` and the
groups with :func:`check_groups`; each raises ``ValueError`` naming what differs.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "Records",
    "check_finite_hyper_parameters",
    "check_groups",
    "check_inner_state",
    "check_settings",
    "hyper_parameters",
    "read_records",
]


@dataclass(frozen=True)
class Records:
    """What :func:`read_records` found: the saved state and groups, the shared record and this
    rank's."""

    state: Mapping[Any, Any]
    groups: list[Mapping[str, Any]]
    common: dict[str, Any]
    mine: dict[str, Any]


def _rank_key(key: str) -> re.Pattern[str]:
    return re.compile(rf"^{re.escape(key)}_rank(\d+)$")


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
) -> Records:
    """Check that ``sd`` is an ``optimizer`` state dict of format ``fmt`` saved by rank
    ``rank`` of a world of ``world``, and return its records. ``per_rank`` says what is kept
    per rank (the reason a state loads only on its own rank at its own world size)."""
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
    if not isinstance(common, dict) or common.get("format") != fmt or common.get("optimizer") != optimizer:
        raise ValueError(f"{where}: the record says {common!r}; expected {optimizer} format {fmt}")
    mine = ranks.get(rank)
    if common.get("world") != world or not isinstance(mine, dict):
        raise ValueError(
            f"{where}: saved by rank(s) {sorted(ranks)} of a world of {common.get('world')}, loading on rank "
            f"{rank} of {world}: {per_rank} are per rank; load each rank's own state at the world size it "
            "was saved at (DCP keeps every rank's)"
        )
    return Records(sd["state"], groups, common, mine)


def check_settings(
    here: Mapping[str, Any],
    saved: Mapping[str, Any],
    where: str,
    loose: tuple[str, ...] = (),
    optional: Mapping[str, Any] | None = None,
) -> None:
    """Raise unless every setting in ``here`` equals the saved one. ``loose`` settings do not
    change what is computed and may differ; ``optional`` ones are recorded only when on and
    compare as their value when off (``{name: off value}``) when either side lacks them."""
    optional = optional or {}
    for name in [*here, *(k for k in optional if k not in here)]:
        now, then = here.get(name, optional.get(name)), saved.get(name, optional.get(name))
        if name not in loose and now != then:
            raise ValueError(f"{where}: setting {name!r} was {then!r}, is {now!r} now")


def check_groups(saved: list[Mapping[str, Any]], param_groups: list[dict[str, Any]], where: str) -> None:
    """Raise unless the saved groups hold as many parameters, group by group, as ours."""
    if len(saved) != len(param_groups) or any(
        len(s["params"]) != len(g["params"]) for s, g in zip(saved, param_groups, strict=True)
    ):
        raise ValueError(
            f"{where}: the saved param groups do not match this optimizer's (build the same model)"
        )


def hyper_parameters(groups: list[Mapping[str, Any]], key: str) -> list[dict[str, Any]]:
    """The saved groups without their records (and without ``params``)."""
    pattern = _rank_key(key)
    return [
        {k: v for k, v in g.items() if not (k == "params" or k == key or pattern.match(str(k)))}
        for g in groups
    ]


def check_finite_hyper_parameters(groups: list[Mapping[str, Any]], where: str) -> None:
    """Raise unless every number among the saved groups' hyper-parameters (``lr``, betas, ...)
    is finite and every ``lr`` is >= 0: a NaN lr would turn the weights NaN at the next step."""
    for gi, group in enumerate(groups):
        for name, value in group.items():
            values = value if isinstance(value, (tuple, list)) else [value]
            for v in values:
                if isinstance(v, torch.Tensor) and v.numel() == 1:
                    v = v.item()
                if isinstance(v, float) and not math.isfinite(v):
                    raise ValueError(
                        f"{where}: saved param group {gi} has {name}={value!r}; the file is damaged"
                    )
        lr = group.get("lr")
        lr = lr.item() if isinstance(lr, torch.Tensor) and lr.numel() == 1 else lr
        if isinstance(lr, (int, float)) and not isinstance(lr, bool) and lr < 0:
            raise ValueError(f"{where}: saved param group {gi} has lr={lr!r} < 0; the file is damaged")


def check_inner_state(state: Mapping[int, Mapping[str, Any]], name: Callable[[int], str], where: str) -> None:
    """Raise unless every tensor of a saved inner-optimizer state is finite and every second
    moment (``exp_avg_sq``, ``max_exp_avg_sq``) is >= 0: a negative one turns every later
    step's update NaN."""
    for n, entry in state.items():
        for key, value in entry.items():
            if not isinstance(value, torch.Tensor) or not value.is_floating_point():
                continue
            if not bool(torch.isfinite(value).all()):
                raise ValueError(
                    f"{where}: the inner optimizer's {key} of {name(n)} is not finite; the file is damaged"
                )
            if key.endswith("exp_avg_sq") and bool((value < 0).any()):
                raise ValueError(
                    f"{where}: the inner optimizer's {key} of {name(n)} is negative; the file is damaged"
                )
