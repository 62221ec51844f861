"""A live replica's SparseLoCo state, made into the state of a replica that (re)joins.

SparseLoCo's state dict (:mod:`cokit.compress.sparseloco_state`) keeps what every replica
shares (``theta_global``, the outer momentum, the counters, settings and policy) under plain
keys and what is one replica's own under keys naming its rank. A joining replica takes the
shared state as it is and, of the per-rank state:

- its **error buffers start at zero**: an error buffer holds what its replica computed and has
  not sent yet; the peer still holds (and will send) its own, so a copy would count it twice;
- its **local weights are ``theta_global``** (the weights of the last sync, identical on every
  replica), not the peer's local weights, which carry the peer's steps since that sync: the
  joiner's next pseudo-gradient is then its own;
- its **inner optimizer state is the peer's** (moments and step counts of the same model), a
  warm start instead of a fresh optimizer whose first steps would be the largest.

The result is keyed for the joiner's rank in the new quorum, so ``load_state_dict`` checks
settings, shapes and finiteness as for any load, before anything changes.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from cokit.compress.sparseloco_state import COMMON_KEY, records

__all__ = ["check_layout", "for_joiner"]

#: the entries shaped like their parameter (inner optimizer state may hold scalars)
_SHAPED = ("global", "momentum", "error", "master", "local")


def check_layout(sd: Mapping[str, Any], params: Sequence[torch.Tensor], where: str) -> None:
    """Raise unless the peer's state ``sd`` is of a model with ``params``' shapes, in order."""
    state = sd.get("state")
    groups = sd.get("param_groups")
    if not isinstance(state, Mapping) or not isinstance(groups, list):
        raise ValueError(f"{where}: the live replicas sent no SparseLoCo state")
    keys = [k for g in groups for k in g.get("params", [])]
    if len(keys) != len(params):
        raise ValueError(
            f"{where}: the live replicas train a model of {len(keys)} parameters, this replica's has "
            f"{len(params)}: another model"
        )
    for n, (key, p) in enumerate(zip(keys, params, strict=True)):
        entry = state.get(key) or {}
        shapes = {
            tuple(v.shape)
            for k, v in entry.items()
            if isinstance(v, torch.Tensor) and str(k).split("_rank")[0] in _SHAPED
        }
        if shapes and shapes != {tuple(p.shape)}:
            raise ValueError(
                f"{where}: parameter {n} is {sorted(shapes)[0]} on the live replicas and "
                f"{tuple(p.shape)} here: another model"
            )


def for_joiner(sd: Mapping[str, Any], rank: int, world: int) -> dict[str, Any]:
    """The state for a replica joining at ``rank`` of a quorum of ``world``, from the state ``sd``
    that one live replica packed (module docstring)."""
    rec = records(sd)
    if rec["common"] is None or len(rec["ranks"]) != 1:
        raise ValueError(
            "the live replica's state is not one replica's SparseLoCo state "
            f"(records of ranks {sorted(rec['ranks'])})"
        )
    (peer,) = rec["ranks"]
    state: dict[Any, dict[str, Any]] = {}
    for key, entry in sd["state"].items():
        shared = entry.get("global")
        out: dict[str, Any] = {k: entry[k] for k in ("global", "momentum") if k in entry}
        for name, value in entry.items():
            if name.startswith(f"inner_rank{peer}."):
                out[f"inner_rank{rank}." + name.split(".", 1)[1]] = value
            elif name == f"error_rank{peer}":
                out[f"error_rank{rank}"] = torch.zeros_like(value)
            elif name in (f"master_rank{peer}", f"local_rank{peer}"):
                base = name.split("_rank")[0]
                own = value if shared is None else shared.to(value.dtype)
                out[f"{base}_rank{rank}"] = own.clone()
        state[key] = out
    groups = copy.deepcopy(list(sd["param_groups"]))
    g0 = groups[0]
    common = dict(rec["common"], world=world)
    g0[COMMON_KEY] = json.dumps(common, sort_keys=True)
    del g0[f"{COMMON_KEY}_rank{peer}"]
    g0[f"{COMMON_KEY}_rank{rank}"] = json.dumps({"format": common["format"], "rank": rank}, sort_keys=True)
    return {"state": state, "param_groups": groups}
