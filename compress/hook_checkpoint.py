"""Saving and restoring a :class:`~cokit.compress.hooks.DCTTopKState`: pickling and state dicts.

The hook keys its error buffers by parameter (object identity, valid in this process only). On
the way out they are named after the parameters of the model the state is attached to
(``state.attach(ddp_model)``: ``named_parameters()`` of ``ddp_model.module``), and on the way
in those names find the new model's parameters, whatever DDP buckets they land in. A state
dict holds only tensors, numbers and strings (``torch.load(weights_only=True)`` reads it) and
records the rank and world size it belongs to: error buffers differ per rank.

Every load is checked in full before anything changes: the rank and world size, the settings
that change what is computed (``MATCHING``), the counters, the buffers' names, shapes, dtype
and finiteness, and that the buffers cover every compressed parameter or none.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import weakref
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from cokit.compress import state_records
from cokit.compress.buckets import sends_dense
from cokit.compress.payload import get_codec
from cokit.compress.state_records import (
    check_counts,
    check_format,
    check_settings,
    check_tensor,
    damaged,
    load_comm_stats,
    origin_problem,
)
from cokit.compress.stats import CommStats

if TYPE_CHECKING:
    from cokit.compress.hooks import DCTTopKState

__all__ = ["FORMAT", "MATCHING", "Restored"]

logger = logging.getLogger("cokit.compress.hooks")

FORMAT = "cokit.DCTTopKState/1"
# Settings that change what the hook computes: a checkpoint loads only into a state with the same.
MATCHING = ("topk", "chunk", "payload", "value_dtype", "decay", "warmup_steps")
SETTINGS = (*MATCHING, "nonfinite", "timeout", "validate_payload")
_KEYS = {
    "format",
    "rank",
    "world_size",
    "settings",
    "iteration",
    "skipped_steps",
    "comm_stats",
    "error_buffers",
}


@dataclasses.dataclass
class Restored:
    """What an unpickled state brought along until :meth:`DCTTopKState.attach` places it: the
    ``(rank, world_size)`` it was saved on (None: torch.distributed was not up) and its error
    buffers by parameter name."""

    origin: tuple[int, int] | None
    buffers: dict[str, torch.Tensor]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def settings(state: DCTTopKState) -> dict[str, Any]:
    """The state's settings as plain values (``value_dtype`` by name)."""
    out = {name: getattr(state, name) for name in SETTINGS}
    out["value_dtype"] = _dtype_name(state.value_dtype)
    return out


def rank_world(state: DCTTopKState, owner: str) -> tuple[int, int]:
    """This process's rank in the state's group and the group's size."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{owner} needs torch.distributed initialized (the error buffers belong to one rank "
            "of one world size): call it after dist.init_process_group()"
        )
    return dist.get_rank(state.process_group), dist.get_world_size(state.process_group)


def trainable(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The parameters DDP buckets (those that require grad), by name; a DDP model's by its
    module's names (no ``module.`` prefix), so that a checkpoint fits the model either way."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"DCTTopKState.attach: model must be the DDP model (or its module), got {type(model).__name__}"
        )
    module = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    params = {name: p for name, p in module.named_parameters() if p.requires_grad}
    if not params:
        raise ValueError("DCTTopKState.attach: the model has no parameter that requires grad")
    return params


def in_flight(state: DCTTopKState) -> bool:
    """True between an iteration's first bucket and its last bucket's assembly."""
    rnd = state._round
    return rnd is not None and not (rnd.closed and len(rnd.done) == rnd.launched)


def _live_buffers(state: DCTTopKState) -> dict[int, torch.Tensor]:
    """The error buffers whose parameter is still alive, by ``id(parameter)``; dead ones go."""
    dead = [key for key, ref in state._params.items() if ref() is None]
    for key in dead:
        state._errors.pop(key, None)
        del state._params[key]
    return dict(state._errors)


def buffers_by_name(state: DCTTopKState, owner: str) -> dict[str, torch.Tensor]:
    """The error buffers by parameter name (needs :meth:`attach` once there are any)."""
    if state._restored is not None:  # unpickled and not attached yet: still by name
        return dict(state._restored.buffers)
    live = _live_buffers(state)
    if not live:
        return {}
    if state._attached is None:
        raise RuntimeError(
            f"{owner}: the state holds error buffers of {len(live)} parameters but does not know "
            "their names: call state.attach(ddp_model) (the model the hook is registered on) first"
        )
    out = {}
    for key, buf in live.items():
        name, ref = state._attached.get(key, (None, None))
        if name is None or ref is None or ref() is not state._params[key]():
            raise RuntimeError(
                f"{owner}: the state holds an error buffer of a {tuple(buf.shape)} parameter that is "
                "not in the attached model: attach the DDP model this hook is registered on"
            )
        out[name] = buf
    return out


def check_origin(owner: str, origin: tuple[int, int], here: tuple[int, int]) -> None:
    """Raise unless the state was saved on this rank of a world of this size."""
    (rank, world), (my_rank, my_world) = origin, here
    problem = origin_problem(
        saved_world=world,
        world=my_world,
        ranks={rank: {"rank": rank}},
        who={"rank": my_rank},
        per_rank="error buffers",
    )
    state_records.check_origin(
        owner, problem, " (one file per rank, e.g. hook_state.rank{rank}.pt), or start a fresh DCTTopKState"
    )


def check_buffers(
    owner: str,
    state: DCTTopKState,
    buffers: object,
    params: dict[str, torch.nn.Parameter],
    world: int,
) -> None:
    """Raise unless ``buffers`` are finite fp32 error buffers for exactly the compressed ones
    of ``params`` (or empty)."""
    if not isinstance(buffers, dict):
        raise TypeError(f"{owner}: error_buffers must be a dict name -> tensor, got {type(buffers).__name__}")
    codec_cls = get_codec(state.payload, owner="DCTTopKState")
    compressed = {
        name
        for name, p in params.items()
        if math.prod(p.shape) > 0
        and not sends_dense(tuple(p.shape), state.chunk, state.topk, codec_cls, state.value_dtype, world)
    }
    for name, buf in buffers.items():
        if name not in params:
            known = ", ".join(list(params)[:8]) + (", ..." if len(params) > 8 else "")
            raise ValueError(
                f"{owner}: error buffer for {name!r}, but the model has no trainable parameter of "
                f"that name ({known}): load it into the model it was saved from"
            )
        check_tensor(
            owner, f"error buffer {name!r}", buf, tuple(params[name].shape), dtype=torch.float32, finite=False
        )
        if name not in compressed:
            raise ValueError(
                f"{owner}: error buffer for {name!r}, which these settings all-reduce dense "
                f"(world size {world}): the checkpoint is from other settings or another world size"
            )
        check_tensor(owner, f"error buffer {name!r}", buf, tuple(buf.shape))
    missing = sorted(compressed - set(buffers))
    if buffers and missing:
        raise ValueError(
            f"{owner}: no error buffer for the compressed parameters {missing}: the checkpoint is "
            "from another model; buffers must cover every compressed parameter or none"
        )


def _place(
    state: DCTTopKState, buffers: dict[str, torch.Tensor], params: dict[str, torch.nn.Parameter]
) -> None:
    """Make ``buffers`` (checked) the state's error buffers, keyed by this process's parameters."""
    state._errors.clear()
    state._params.clear()
    state._layouts.clear()  # rebuilt on the next iteration, on the new keys
    for name, buf in buffers.items():
        p = params[name]
        state._errors[id(p)] = buf.detach().to(device=p.device, dtype=torch.float32, copy=True)
        state._params[id(p)] = weakref.ref(p)


def attach(state: DCTTopKState, model: torch.nn.Module) -> None:
    """Name the state's error buffers after ``model``'s parameters (see :meth:`DCTTopKState.attach`)."""
    owner = "DCTTopKState.attach"
    params = trainable(model)
    restored = state._restored
    if restored is not None and restored.origin is not None:
        check_origin(owner, restored.origin, rank_world(state, owner))
    if restored is not None:
        buffers = restored.buffers
    else:
        live = _live_buffers(state)
        if state._attached is not None:
            buffers = buffers_by_name(state, owner)
        else:  # buffers the hook made before attach: they must be this model's
            by_id = {id(p): name for name, p in params.items()}
            stray = [
                key for key in live if key not in by_id or state._params[key]() is not params[by_id[key]]
            ]
            if stray:
                raise RuntimeError(
                    f"{owner}: the state holds error buffers of {len(stray)} parameters that are not "
                    "in this model: attach the DDP model the hook is registered on"
                )
            buffers = {by_id[key]: buf for key, buf in live.items()}
    if buffers:
        check_buffers(owner, state, buffers, params, rank_world(state, owner)[1])
    _place(state, buffers, params)
    state._attached = {id(p): (name, weakref.ref(p)) for name, p in params.items()}
    state._restored = None


def state_dict(state: DCTTopKState) -> dict[str, Any]:
    """See :meth:`DCTTopKState.state_dict`."""
    owner = "DCTTopKState.state_dict"
    if in_flight(state):
        raise RuntimeError(f"{owner}: called during backward(); call it between iterations")
    rank, world = rank_world(state, owner)
    if state._restored is not None and state._restored.origin is not None:
        check_origin(owner, state._restored.origin, (rank, world))
    return {
        "format": FORMAT,
        "rank": rank,
        "world_size": world,
        "settings": settings(state),
        "iteration": state.iteration,
        "skipped_steps": state.skipped_steps,
        "comm_stats": _stats_dict(state.comm_stats),
        "error_buffers": buffers_by_name(state, owner),
    }


def _stats_dict(stats: CommStats) -> dict[str, Any]:
    """The totals of ``stats`` (what :meth:`CommStats.from_dict` reads back)."""
    names = {f.name for f in dataclasses.fields(CommStats) if not f.name.startswith("_")}
    return {k: v for k, v in stats.as_dict().items() if k in names}


def load_state_dict(state: DCTTopKState, sd: object) -> None:
    """See :meth:`DCTTopKState.load_state_dict`."""
    owner = "DCTTopKState.load_state_dict"
    if not isinstance(sd, dict):
        raise TypeError(f"{owner}: expected the dict from DCTTopKState.state_dict(), got {type(sd).__name__}")
    check_format(owner, sd, optimizer="DCTTopKState", fmt=FORMAT)
    if set(sd) != _KEYS:
        raise damaged(
            owner, f"the state has the keys {sorted(sd)}, DCTTopKState.state_dict() saves {sorted(_KEYS)}"
        )
    if in_flight(state):
        raise RuntimeError(f"{owner}: called during backward(); call it between iterations")
    here = rank_world(state, owner)
    check_origin(owner, (sd["rank"], sd["world_size"]), here)
    saved, mine = sd["settings"], settings(state)
    if not isinstance(saved, dict):
        raise TypeError(f"{owner}: settings must be a dict, got {type(saved).__name__}")
    check_settings(owner, {k: mine[k] for k in MATCHING}, {k: saved.get(k) for k in MATCHING})
    check_counts(owner, sd, ("iteration", "skipped_steps"))
    iteration, skipped = sd["iteration"], sd["skipped_steps"]
    stats = load_comm_stats(owner, sd["comm_stats"])
    buffers = sd["error_buffers"]
    if not isinstance(buffers, dict):
        raise TypeError(f"{owner}: error_buffers must be a dict name -> tensor, got {type(buffers).__name__}")
    if buffers and state._attached is None:
        raise RuntimeError(
            f"{owner}: the checkpoint holds error buffers by parameter name: call "
            "state.attach(ddp_model) before load_state_dict() so that they find their parameters"
        )
    params: dict[str, torch.nn.Parameter] = {}
    if state._attached is not None:
        params = {name: p for name, ref in state._attached.values() if (p := ref()) is not None}
    check_buffers(owner, state, buffers, params, here[1])
    # everything checked: now change the state
    _place(state, buffers, params)
    state.iteration, state.skipped_steps, state.comm_stats = iteration, skipped, stats
    state._restored = None


def getstate(state: DCTTopKState) -> dict[str, Any]:
    """What pickling keeps: settings, counters, comm stats and the buffers by name; not the
    process group, the lock, the timer or an iteration in flight."""
    owner = "DCTTopKState pickling"
    buffers = buffers_by_name(state, owner)
    origin = state._restored.origin if state._restored is not None else None
    if dist.is_available() and dist.is_initialized():
        origin = rank_world(state, owner)
    if state.process_group is not None:
        logger.warning(
            "NOTE: DCTTopKState's process group is not picklable and is left out; the loaded state "
            "uses the default group: set state.process_group = <your group> after loading"
        )
    else:
        logger.info("NOTE: DCTTopKState's process group (the default one) is left out of the pickle")
    if in_flight(state):
        logger.warning("NOTE: DCTTopKState pickled during backward(): the iteration in flight is left out")
    out = {name: getattr(state, name) for name in SETTINGS}
    out.update(
        iteration=state.iteration,
        skipped_steps=state.skipped_steps,
        comm_stats=_stats_dict(state.comm_stats),
        restored=Restored(origin, buffers),
        had_group=state.process_group is not None,
    )
    return out


def setstate(state: DCTTopKState, saved: dict[str, Any]) -> None:
    """Rebuild a pickled state on the default process group; its buffers wait for :meth:`attach`."""
    defaults = {f.name: f.default for f in dataclasses.fields(state)}
    for name in SETTINGS:  # a pickle of an older cokit lacks the newer settings: their defaults
        setattr(state, name, saved.get(name, defaults[name]))
    state.process_group = None
    state.iteration, state.skipped_steps = saved["iteration"], saved["skipped_steps"]
    state.comm_stats = CommStats.from_dict(saved["comm_stats"])
    state._layouts, state._errors, state._params, state._attached = {}, {}, {}, None
    state._exchange, state._round, state._lock, state._device = None, None, threading.Lock(), None
    restored = saved["restored"]
    state._restored = restored if restored.origin is not None or restored.buffers else None
    state.__post_init__()  # the settings are checked as on construction
    log = logger.warning if saved["had_group"] else logger.info
    log(
        "NOTE: DCTTopKState loaded on the default process group; if it ran on another group, "
        "set state.process_group = <your group> before training"
    )
