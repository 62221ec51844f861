"""Every rank's optimizer state in one checkpoint file, for trainers that save on rank 0 only.

DeMo and SparseLoCo keep per-rank buffers (error feedback, inner-optimizer state) under state
keys that name the global rank (``delta_rank1``, ``error_rank1``, ``inner_rank1.exp_avg``) and
per-rank records in ``param_groups[0]`` (``demo_rank1``, ``sparseloco_rank1``), next to keys
shared by every rank. accelerate, the HF Trainer and Lightning write the optimizer's
``state_dict()`` from the main process only, so the other ranks' buffers are lost and their
load is refused. :func:`gather_state_dict` (collective) merges every rank's state into one
dict; :func:`own_state_dict` cuts a rank's own state out of it again, which the optimizer's
``load_state_dict`` checks as usual.
"""

from __future__ import annotations

import io
import re
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "GATHERED_KEY",
    "HookStates",
    "RankStates",
    "gather_state_dict",
    "is_cokit_optimizer",
    "merge_states",
    "own_state_dict",
    "sync_module_states",
]

#: top-level key of a gathered state: the world size it was gathered at
GATHERED_KEY = "cokit_gathered_world"
_RANK = re.compile(r"_rank(\d+)(?:$|\.)")


def is_cokit_optimizer(optimizer: object) -> bool:
    """True for DeMo and SparseLoCo (also behind an accelerate/Lightning optimizer wrapper)."""
    from cokit.compress import DeMo, SparseLoCo

    return isinstance(_unwrap(optimizer), (DeMo, SparseLoCo))


def sync_module_states(module: torch.nn.Module, src: int = 0) -> None:
    """Broadcast ``module``'s parameters and buffers from global rank ``src`` (collective), as
    DDP does when it wraps a model: DeMo and SparseLoCo need every rank to start from the same
    weights. Nothing happens without an initialized process group or at world 1."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"sync_module_states: expected a torch.nn.Module, got {type(module).__name__}")
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t.data, src=src)


def _unwrap(optimizer: object) -> object:
    """The optimizer inside accelerate's ``AcceleratedOptimizer`` / Lightning's ``LightningOptimizer``."""
    for _ in range(4):
        inner = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
        if inner is None:
            break
        optimizer = inner
    return optimizer


def _rank_of(key: object) -> int | None:
    """The global rank a state key belongs to, None for keys every rank shares."""
    m = _RANK.search(str(key))
    return int(m[1]) if m else None


def _to_cpu(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, dict):
        return {k: _to_cpu(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_to_cpu(v) for v in x]
    if isinstance(x, tuple):
        return tuple(_to_cpu(v) for v in x)
    return x


def _check_state(sd: object, where: str) -> Mapping[str, Any]:
    if not (
        isinstance(sd, Mapping)
        and isinstance(sd.get("state"), Mapping)
        and isinstance(sd.get("param_groups"), list)
        and sd["param_groups"]
        and all(isinstance(g, Mapping) for g in sd["param_groups"])
    ):
        raise TypeError(
            f"{where}: expected an optimizer state dict ({{'state': ..., 'param_groups': [...]}}), "
            f"got {type(sd).__name__}"
        )
    return sd


def merge_states(states: list[Mapping[str, Any]]) -> dict[str, Any]:
    """One state holding each rank's keys (``states[r]`` from global rank ``r``) and the shared
    keys of rank 0. Raises ``ValueError`` when the ranks' states do not have the same layout."""
    where = "cokit.integrations.merge_states"
    if not states:
        raise ValueError(f"{where}: no states to merge")
    first = _check_state(states[0], where)
    state = {k: dict(v) for k, v in first["state"].items()}
    groups = [dict(g) for g in first["param_groups"]]
    for r, sd in enumerate(states[1:], start=1):
        sd = _check_state(sd, where)
        if set(sd["state"]) != set(state) or len(sd["param_groups"]) != len(groups):
            raise ValueError(
                f"{where}: rank {r}'s optimizer state has other parameters or param groups than rank 0's "
                "(every rank must build the same model and optimizer)"
            )
        for k, entry in sd["state"].items():
            state[k].update({key: v for key, v in entry.items() if _rank_of(key) == r})
        groups[0].update({key: v for key, v in sd["param_groups"][0].items() if _rank_of(key) == r})
    return {
        **{k: v for k, v in first.items() if k not in ("state", "param_groups")},
        "state": state,
        "param_groups": groups,
        GATHERED_KEY: len(states),
    }


def _gather(obj: Any, everywhere: bool, where: str) -> list[Any] | None:
    """Every rank's ``obj`` (CPU tensors and plain containers) in rank order, on rank 0 (every
    rank with ``everywhere``), else None; ``[obj]`` without a process group. Sent as bytes over
    the exchange core's communicator (its timeout applies) and read back with
    ``torch.load(weights_only=True)``: tensors and plain data only, never arbitrary objects
    from a peer. Every rank receives every rank's bytes (one all-gather: the collective the
    exchange core guards); only the ranks that return them read them."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    from cokit.compress.comm import Communicator

    buf = io.BytesIO()
    torch.save(obj, buf)
    data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )
    comm = Communicator(owner=where)
    sizes = comm.all_gather(
        torch.tensor([data.numel()], dtype=torch.int64, device=device), "state sizes"
    ).wait()
    sizes_list = [int(n) for n in sizes.flatten().tolist()]
    padded = torch.zeros(max(sizes_list), dtype=torch.uint8)
    padded[: data.numel()] = data
    rows = comm.all_gather(padded.to(device), "per-rank state").wait().cpu()
    if not everywhere and dist.get_rank() != 0:
        return None
    out = []
    for r, n in enumerate(sizes_list):
        try:
            out.append(torch.load(io.BytesIO(rows[r, :n].numpy().tobytes()), weights_only=True))
        except Exception as exc:
            raise ValueError(
                f"{where}: rank {r}'s state could not be read as tensors and plain data: {exc}"
            ) from None
    return out


def gather_state_dict(optimizer: torch.optim.Optimizer, *, everywhere: bool = False) -> dict[str, Any] | None:
    """Every rank's ``optimizer.state_dict()`` merged into one dict (on CPU).

    Collective: every rank of the default process group must call it. Returns the merged dict
    on rank 0 (on every rank with ``everywhere=True``, e.g. when each node's first rank saves)
    and None on the others. Without an initialized process group, the optimizer's own state
    marked as gathered at world 1."""
    where = "cokit.integrations.gather_state_dict"
    sd = _to_cpu(_check_state(optimizer.state_dict(), where))
    gathered = _gather(sd, everywhere, where)
    return merge_states(gathered) if gathered is not None else None


def own_state_dict(sd: Mapping[str, Any], rank: int | None = None) -> dict[str, Any]:
    """Global rank ``rank``'s state (default: this process's) cut out of a gathered state: the
    shared keys and that rank's own, for the optimizer's ``load_state_dict`` (which checks the
    rank, world size and settings). A state that was not gathered passes through unchanged."""
    where = "cokit.integrations.own_state_dict"
    _check_state(sd, where)
    if rank is None:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise ValueError(f"{where}: rank must be an integer >= 0, got {rank!r}")
    if GATHERED_KEY not in sd:
        return dict(sd)
    world = sd[GATHERED_KEY]
    if not isinstance(world, int) or rank >= world:
        raise ValueError(
            f"{where}: this state was gathered from a world of {world} ranks, this is rank {rank}: "
            "per-rank optimizer state loads only at the world size it was saved at"
        )

    def keep(key: object) -> bool:
        owner = _rank_of(key)
        return owner is None or owner == rank

    state = {k: {key: v for key, v in entry.items() if keep(key)} for k, entry in sd["state"].items()}
    groups = [dict(g) for g in sd["param_groups"]]
    groups[0] = {k: v for k, v in groups[0].items() if keep(k)}
    rest = {k: v for k, v in sd.items() if k not in ("state", "param_groups", GATHERED_KEY)}
    return {**rest, "state": state, "param_groups": groups}


class RankStates:
    """A checkpointable object (``state_dict`` / ``load_state_dict``) whose state is every rank's
    optimizer state: for trainers that save registered objects from the main process only,
    such as ``accelerator.register_for_checkpointing``. ``state_dict()`` is collective."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, everywhere: bool = False):
        if not isinstance(_unwrap(optimizer), torch.optim.Optimizer):
            raise TypeError(f"RankStates: expected a torch optimizer, got {type(optimizer).__name__}")
        self.optimizer = optimizer
        self.everywhere = everywhere

    def state_dict(self) -> dict[str, Any]:
        """Every rank's state on the saving rank (an empty dict on the others, never written)."""
        return gather_state_dict(self.optimizer, everywhere=self.everywhere) or {}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load this rank's part of a gathered state into the optimizer."""
        self.optimizer.load_state_dict(own_state_dict(state_dict))


class HookStates:
    """A checkpointable object holding every rank's DDP comm hook state (``DCTTopKState``: its
    per-rank error buffers), for trainers that save registered objects from the main process
    only. ``state_dict()`` is collective; ``load_state_dict`` gives each rank its own, which the
    hook state checks (rank, world size, settings) as usual."""

    def __init__(self, hook_state: Any, *, everywhere: bool = False):
        missing = [n for n in ("state_dict", "load_state_dict") if not callable(getattr(hook_state, n, None))]
        if missing:
            raise TypeError(
                f"HookStates: {type(hook_state).__name__} has no {' / '.join(missing)} (expected a "
                "cokit.compress.hooks.DCTTopKState)"
            )
        self.hook_state = hook_state
        self.everywhere = everywhere

    def state_dict(self) -> dict[str, Any]:
        """``{"ranks": [state of rank 0, rank 1, ...]}`` on the saving rank ({} on the others)."""
        gathered = _gather(
            _to_cpu(self.hook_state.state_dict()), self.everywhere, "cokit.integrations.HookStates"
        )
        return {"ranks": gathered} if gathered is not None else {}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load this rank's hook state (the world size must be the one it was saved at)."""
        ranks = state_dict.get("ranks") if isinstance(state_dict, Mapping) else None
        if not isinstance(ranks, list):
            raise TypeError(
                f"HookStates.load_state_dict: expected {{'ranks': [...]}} from HookStates.state_dict(), "
                f"got {type(state_dict).__name__}"
            )
        on = dist.is_available() and dist.is_initialized()
        rank, world = (dist.get_rank(), dist.get_world_size()) if on else (0, 1)
        if len(ranks) != world:
            raise ValueError(
                f"HookStates.load_state_dict: saved by {len(ranks)} ranks, this run has {world}: the hook's "
                "error buffers are per rank; resume at the world size it was saved at"
            )
        self.hook_state.load_state_dict(ranks[rank])
