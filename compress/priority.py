"""Communication priority: the one mechanism behind ``comm_priority=`` and overlap's streams.

On a GPU a collective's priority is its process group's: NCCL (RCCL on ROCm keeps the name)
launches a group's kernels on streams it owns, high-priority ones when the group was made with
``ProcessGroupNCCL.Options(is_high_priority_stream=True)``, whatever stream the caller is on
(docs/design.md §1.2). So asking for high priority means using another group over the same
ranks, made once at construction. gloo has no GPU streams: there the request changes nothing,
and says so.

* :func:`resolve_priority` / :func:`check_comm_priority` -- what a priority may be:
  ``'normal'`` (default), ``'high'`` or an integer stream priority (lower = higher);
* :func:`priority_group` -- the group a front end (DeMo, SparseLoCo, the DDP hook) exchanges
  over for a priority, as a :class:`PriorityGroup` that says what it got and why;
* :func:`high_priority_group` / :func:`group_is_high_priority` -- a new high-priority group,
  and whether a group is one (re-exported by :mod:`cokit.overlap.streams`);
* :class:`GuardViolation` -- a setting breaks a guard (``comm_guard``: any object with
  ``violations(config=None, *, priority=...) -> list[str]``, e.g. overlap's
  ``StarvationGuard``, which raises this class too).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, cast

import torch
import torch.distributed as dist

__all__ = [
    "CPU_PRIORITY_RANGE",
    "CommGroup",
    "GuardViolation",
    "PriorityGroup",
    "check_comm_priority",
    "check_guard",
    "group_is_high_priority",
    "high_priority_group",
    "is_high",
    "priority_group",
    "priority_range",
    "resolve_priority",
]

#: (lowest, highest) stream priority accepted on CPU, where priorities are recorded but have
#: no effect. It mirrors what torch exposes on CUDA (0 = default, lower = higher priority,
#: at most 4 levels); on a GPU the live range from the driver is used instead.
CPU_PRIORITY_RANGE = (0, -3)


class GuardViolation(ValueError):
    """A setting breaks a guard (the starvation guard's limits); the message lists every broken
    bound. ``cokit.overlap.guard.GuardViolation`` is this class."""


def _current_device(device: torch.device | None) -> torch.device:
    if device is not None:
        return device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def priority_range(device: torch.device | None = None) -> tuple[int, int]:
    """``(lowest, highest)`` stream priority on ``device`` (default: the current GPU, else the
    CPU); lower number = higher priority."""
    dev = _current_device(device)
    if dev.type == "cuda":
        # a staticmethod (torch's stub types it as an instance method)
        least, greatest = cast(Any, torch.cuda.Stream).priority_range()
        return int(least), int(greatest)
    return CPU_PRIORITY_RANGE


def resolve_priority(
    priority: str | int, device: torch.device | None = None, *, name: str = "priority", where: str = ""
) -> int:
    """The integer stream priority for ``'high'`` (the device's highest), ``'normal'`` (0, the
    default stream's) or an integer inside :func:`priority_range`; anything else (bools,
    floats, other strings) raises ``ValueError`` listing what is allowed."""
    least, greatest = priority_range(device)
    if priority == "high":
        return greatest
    if priority == "normal":
        return least
    if isinstance(priority, bool) or not isinstance(priority, int) or not greatest <= priority <= least:
        prefix = f"{where}: " if where else ""
        raise ValueError(
            f"{prefix}{name}={priority!r} is invalid; allowed: 'high', 'normal' or an integer from "
            f"{greatest} (highest) to {least} (lowest) on {_current_device(device)}"
        )
    return priority


def is_high(priority: Any) -> bool:
    """Whether ``priority`` asks for more than the default: ``'high'`` or a negative integer."""
    if priority is None or priority == "normal":
        return False
    if priority == "high":
        return True
    return isinstance(priority, int) and not isinstance(priority, bool) and priority < 0


def check_guard(guard: Any, priority: str | int, *, where: str) -> None:
    """Raise :class:`GuardViolation` (naming the broken limits) when ``guard`` refuses
    ``priority``; ``guard`` None allows anything. A guard is any object with
    ``violations(config=None, *, priority=...) -> list[str]``."""
    if guard is None:
        return
    violations = getattr(guard, "violations", None)
    if not callable(violations):
        raise TypeError(
            f"{where}: comm_guard must be None or have violations(config=None, *, priority=...) "
            f"(e.g. cokit.overlap.guard.StarvationGuard), got {type(guard).__name__}"
        )
    broken = list(violations(None, priority=priority))
    if broken:
        raise GuardViolation(
            f"{where}: comm_priority={priority!r} breaks comm_guard: {'; '.join(map(str, broken))}; "
            "nothing was built"
        )


def check_comm_priority(where: str, priority: Any, guard: Any = None) -> str | int:
    """A front end's ``comm_priority`` and ``comm_guard``, checked before anything is built:
    ``priority`` as given when valid (:func:`resolve_priority` on the current device) and
    allowed by ``guard`` (:func:`check_guard`)."""
    resolve_priority(priority, name="comm_priority", where=where)
    check_guard(guard, priority, where=where)
    return cast("str | int", priority)


@dataclasses.dataclass(frozen=True)
class PriorityGroup:
    """A process group to issue collectives on, and what priority they get.

    ``group``: the group to use (None: the default group); ``backend``: its backend (``""``
    when torch.distributed is not initialized); ``high_priority``: whether its collectives
    really run on high-priority streams (the effective priority); ``note``: why (not);
    ``requested``: the priority asked for; ``source``: the group it stands for (None: the
    default group).
    """

    group: Any
    backend: str
    high_priority: bool
    note: str
    requested: str | int = "high"
    source: Any = None


#: overlap's name for a :class:`PriorityGroup` (:mod:`cokit.overlap.streams`)
CommGroup = PriorityGroup


def _nccl_options() -> Any:
    """``ProcessGroupNCCL.Options`` asking for high-priority streams."""
    try:
        from torch.distributed import ProcessGroupNCCL
    except ImportError:
        raise RuntimeError("backend 'nccl' requested but this torch build has no NCCL/RCCL") from None
    return ProcessGroupNCCL.Options(is_high_priority_stream=True)


def _group_ranks(group: Any) -> list[int]:
    """The global ranks of ``group`` (None: the default group), in group-rank order."""
    if group is None:
        return list(range(dist.get_world_size()))
    return [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))]


def _every_ranks_group(ranks: list[int]) -> list[list[int]]:
    """The distinct rank lists of every rank's group, in rank order (one all-gather of
    ``world``-long int64 rows over the default group, padded with -1: no pickled peer data)."""
    world = dist.get_world_size()
    on_gpu = str(dist.get_backend()) == "nccl" and torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    row = torch.full((world,), -1, dtype=torch.int64)
    row[: len(ranks)] = torch.tensor(ranks, dtype=torch.int64)
    rows = [torch.empty(world, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(rows, row.to(device))
    lists = [[r for r in t.tolist() if r >= 0] for t in rows]
    if any(not rs or max(rs) >= world or len(set(rs)) != len(rs) for rs in lists):
        raise ValueError(f"comm_priority: the ranks sent malformed process-group rank lists: {lists}")
    return [list(r) for r in dict.fromkeys(tuple(rs) for rs in lists)]


def _high_priority_copy(group: Any) -> tuple[Any, list[int]]:
    """A new NCCL group with high-priority streams over ``group``'s ranks (same order).

    ``dist.new_group`` is collective over the default group: every rank must create every
    group, in the same order. When ``group`` is a subgroup, ranks may hold different ones (HSDP
    replicate groups, a hierarchy's inter-node groups), so their rank lists are gathered first
    and every rank creates each distinct one, keeping its own.
    """
    options = _nccl_options()
    ranks = _group_ranks(group)
    every = [ranks] if len(ranks) == dist.get_world_size() else _every_ranks_group(ranks)
    mine = None
    for members in every:
        made = dist.new_group(members, backend="nccl", pg_options=options, sort_ranks=False)
        if members == ranks:
            mine = made
    return mine, ranks


def priority_group(
    process_group: Any = None,
    priority: str | int = "normal",
    *,
    local: bool = False,
    create: bool = True,
    where: str = "comm_priority",
) -> PriorityGroup:
    """The group collectives of ``process_group`` (None: the default group) should use for
    ``priority``, and what it achieves.

    ``'normal'`` (or 0) keeps ``process_group``. A high priority on NCCL/RCCL makes ONE new
    group over the same ranks with ``ProcessGroupNCCL.Options(is_high_priority_stream=True)``
    (collective over the default group: every rank must call it, at construction, with the
    same priority); a group that already runs on high-priority streams (e.g. under
    ``TORCH_NCCL_HIGH_PRIORITY=1``) is kept. gloo, other backends, an uninitialized
    torch.distributed and ``local`` (the exchange group is this rank alone) keep
    ``process_group`` with ``high_priority=False`` and a note saying why. ``create=False``
    raises ``RuntimeError`` instead of making a group (a state whose group changed after
    construction).
    """
    resolve_priority(priority, name="comm_priority", where=where)
    backend = str(dist.get_backend(process_group)) if dist.is_available() and dist.is_initialized() else ""

    def keep(high: bool, note: str) -> PriorityGroup:
        return PriorityGroup(process_group, backend, high, note, priority, process_group)

    if not is_high(priority):
        return keep(False, "normal priority: the process group as given")
    if local:
        return keep(
            False, "the exchange group is this rank alone: nothing is sent, comm_priority has no effect"
        )
    if not backend:
        return keep(
            False, "torch.distributed is not initialized: no collectives, comm_priority has no effect"
        )
    if backend != "nccl":
        hint = "; set TORCH_NCCL_HIGH_PRIORITY=1 for its NCCL part" if "nccl" in backend else ""
        return keep(False, f"{backend} has no GPU streams: comm_priority has no effect{hint}")
    if group_is_high_priority(process_group):
        return keep(True, "the process group already runs on high-priority NCCL/RCCL streams")
    if not create:
        raise RuntimeError(
            f"{where}: comm_priority={priority!r} needs a high-priority NCCL group made at construction, "
            "but process_group changed since; build a new one with the new process_group"
        )
    group, ranks = _high_priority_copy(process_group)
    note = f"NCCL/RCCL collectives run on high-priority streams (a new group over ranks {ranks})"
    return PriorityGroup(group, "nccl", True, note, priority, process_group)


def high_priority_group(ranks: Iterable[int] | None = None, *, backend: str | None = None) -> PriorityGroup:
    """A new process group whose NCCL/RCCL work runs on high-priority streams.

    Collective: every rank of the default group must call it, with the same ``ranks``.
    ``backend`` defaults to the default group's. For ``nccl`` (RCCL on ROCm keeps that name)
    the group is created with ``ProcessGroupNCCL.Options(is_high_priority_stream=True)``;
    other backends (gloo) have no streams, so the group is ordinary and says so.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "high_priority_group needs torch.distributed initialized (dist.init_process_group)"
        )
    backend = str(backend or dist.get_backend()).lower()
    members = sorted(ranks) if ranks is not None else None
    if backend == "nccl":
        group = dist.new_group(members, backend="nccl", pg_options=_nccl_options())
        return PriorityGroup(group, "nccl", True, "NCCL/RCCL collectives run on high-priority streams")
    group = dist.new_group(members, backend=backend)
    return PriorityGroup(
        group, backend, False, f"{backend} has no GPU streams: stream priority does not apply"
    )


def group_is_high_priority(group: Any = None) -> bool | None:
    """Whether ``group``'s (default: the default group's) NCCL work runs on high-priority
    streams; False for backends without streams; None when it cannot be told."""
    if isinstance(group, PriorityGroup):
        return group.high_priority
    if not dist.is_initialized():
        return None
    try:
        backend = dist.get_backend(group)
    except Exception:  # not a group of this process
        return None
    if backend != "nccl":
        return False
    pg: Any = group if group is not None else dist.group.WORLD  # private API below: untyped
    try:
        return bool(pg._get_backend(torch.device("cuda")).options.is_high_priority_stream)
    except Exception:  # private API moved: unknown
        return None
