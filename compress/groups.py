"""Process groups: checking a ``process_group=`` argument, and node-level (two-level) groups."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch.distributed as dist

__all__ = ["NodeGroups", "check_process_group", "node_groups"]


def check_process_group(owner: str, group: object) -> None:
    """Raise unless ``group`` is None (the default group) or a torch.distributed ProcessGroup."""
    if group is None or (dist.is_available() and isinstance(group, dist.ProcessGroup)):
        return
    raise TypeError(
        f"{owner}: process_group must be None (the default group) or a torch.distributed "
        f"ProcessGroup (e.g. from dist.new_group()), got {type(group).__name__} {group!r}"
    )


@dataclasses.dataclass(frozen=True)
class NodeGroups:
    """The two levels of a hierarchical exchange, as seen from this rank.

    ``intra``: the ranks of this rank's node (fast links: a dense average); ``inter``: the ranks
    that hold this rank's local rank on every node (slow links: the compressed exchange).
    Together the groups must tile the world: every intra group meets every inter group in
    exactly one rank. :func:`node_groups` builds them from ``LOCAL_WORLD_SIZE``; explicit
    groups are checked by :meth:`check_tiling` (a collective) at the optimizer's first step.
    """

    intra: Any
    inter: Any

    def __post_init__(self) -> None:
        for name in ("intra", "inter"):
            check_process_group(f"NodeGroups.{name}", getattr(self, name))
            if getattr(self, name) is None:
                raise TypeError(f"NodeGroups: {name} must be a ProcessGroup, not None")
        me = dist.get_rank()
        intra, inter = self.intra_ranks, self.inter_ranks
        if me not in intra or me not in inter:
            raise ValueError(
                f"NodeGroups: rank {me} must belong to both groups, got intra {intra} and inter {inter}"
            )
        if set(intra) & set(inter) != {me}:
            raise ValueError(
                f"NodeGroups: the intra group {intra} and the inter group {inter} may share only "
                f"this rank ({me})"
            )

    @property
    def intra_ranks(self) -> list[int]:
        return dist.get_process_group_ranks(self.intra)

    @property
    def inter_ranks(self) -> list[int]:
        return dist.get_process_group_ranks(self.inter)

    def check_tiling(self, owner: str = "NodeGroups", timeout: Any = None) -> None:
        """Collective over the world: raise on every rank unless the ranks' groups tile it.
        Each rank's groups travel as JSON (never pickled), with ``timeout`` (seconds)."""
        from cokit.compress.agreement import gather_json
        from cokit.compress.comm import Communicator

        comm = Communicator(None, owner, timeout)
        everyone = gather_json(
            comm,
            [sorted(self.intra_ranks), sorted(self.inter_ranks)],
            "node groups report",
            lambda p: p.wait(),
        )
        problem = _tiling_problem([e[0] for e in everyone], [e[1] for e in everyone])
        if problem:
            raise ValueError(
                f"{owner}: the node groups do not tile the world of {comm.world_size} ranks: {problem}"
            )


def _tiling_problem(intras: list[list[int]], inters: list[list[int]]) -> str | None:
    """What is wrong with rank r's groups ``intras[r]`` / ``inters[r]`` (None: they tile)."""
    world = len(intras)
    for kind, groups in (("intra", intras), ("inter", inters)):
        for r, ranks in enumerate(groups):
            for other in ranks:
                if groups[other] != ranks:
                    return f"rank {r}'s {kind} group is {ranks} but rank {other}'s is {groups[other]}"
    sizes = {len(g) for g in intras}, {len(g) for g in inters}
    if len(sizes[0]) > 1 or len(sizes[1]) > 1:
        return f"groups have different sizes (intra {sorted(sizes[0])}, inter {sorted(sizes[1])})"
    if len(intras[0]) * len(inters[0]) != world:
        return f"{len(intras[0])} ranks per node x {len(inters[0])} nodes != {world} ranks"
    return None


def node_groups(local_world_size: int | None = None) -> NodeGroups:
    """Node groups for ranks numbered node by node (torchrun's numbering).

    ``local_world_size``: ranks per node (default: the ``LOCAL_WORLD_SIZE`` environment
    variable that torchrun sets). A collective: every rank must call it, in the same order
    as its other group creations.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("node_groups: call dist.init_process_group() first")
    if local_world_size is None:
        env = os.environ.get("LOCAL_WORLD_SIZE")
        if env is None:
            raise ValueError(
                "node_groups: LOCAL_WORLD_SIZE is not set (torchrun sets it); pass local_world_size="
            )
        try:
            local_world_size = int(env)
        except ValueError:
            raise ValueError(f"node_groups: LOCAL_WORLD_SIZE must be an integer, got {env!r}") from None
    world = dist.get_world_size()
    if (
        not isinstance(local_world_size, int)
        or isinstance(local_world_size, bool)
        or local_world_size < 1
        or world % local_world_size
    ):
        raise ValueError(
            f"node_groups: {local_world_size!r} ranks per node does not tile the world of {world} "
            "ranks: it must be a positive divisor of the world size"
        )
    per_node, nodes = local_world_size, world // local_world_size
    intra, _ = dist.new_subgroups_by_enumeration(
        [list(range(n * per_node, (n + 1) * per_node)) for n in range(nodes)]
    )
    inter, _ = dist.new_subgroups_by_enumeration([list(range(r, world, per_node)) for r in range(per_node)])
    return NodeGroups(intra, inter)
