"""DeMo on DTensor parameters (FSDP2 ``fully_shard``, HSDP): local shards and agreement.

A DTensor parameter is updated through its local shard (``to_local()``, a view of FSDP's
sharded storage). FSDP has already reduce-scattered its gradient over the mesh, so DeMo
exchanges nothing there: the ranks of the mesh only agree each step on the settings and on
which gradients are finite, so that a skipped step is skipped everywhere. The compressed
exchange runs over ``process_group``: for HSDP, the replicate group of a 2-D mesh whose
shard dimension FSDP was given (``fully_shard(m, mesh=mesh["shard"])``). Parameters that
FSDP itself replicates (``Replicate()`` placements: ``fully_shard`` on the 2-D mesh) are
refused, since FSDP would all-reduce their gradients densely before DeMo sees them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["MeshPlan", "check_exchange_group", "check_same_mesh", "is_dtensor", "local", "mesh_plan"]


def is_dtensor(t: object) -> bool:
    """True for a ``torch.distributed.tensor.DTensor`` (False where DTensor is unavailable)."""
    if not dist.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (a view: writing it writes the parameter), else ``t``."""
    return t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined]


@dataclasses.dataclass(frozen=True)
class MeshPlan:
    """The device mesh of DeMo's DTensor parameters: ``agree`` holds one process group per
    mesh dimension (settings and finite-gradient agreement), ``layout`` a description."""

    agree: tuple[Any, ...]
    dims: tuple[str, ...]
    layout: str


def mesh_plan(params: list[torch.Tensor], owner: str = "DeMo") -> MeshPlan | None:
    """The plan for ``params``; None when none is a DTensor. Raises ``TypeError`` when DTensor
    and plain parameters are mixed and ``ValueError`` when they do not share one mesh or a
    placement is not ``Shard``."""
    dtensors: list[Any] = [p for p in params if is_dtensor(p)]
    if not dtensors:
        return None
    if len(dtensors) != len(params):
        raise TypeError(
            f"{owner}: {len(dtensors)} of {len(params)} parameters are DTensors: give DeMo either "
            "only DTensor parameters (shard every module with fully_shard) or only plain tensors"
        )
    mesh = dtensors[0].device_mesh
    names = tuple(mesh.mesh_dim_names or (f"dim{d}" for d in range(mesh.ndim)))
    for p in dtensors:
        if p.device_mesh != mesh:
            raise ValueError(
                f"{owner}: parameters live on different device meshes ({_mesh_text(mesh)} and "
                f"{_mesh_text(p.device_mesh)}): shard the whole model on one mesh"
            )
        for d, placement in enumerate(p.placements):
            if placement.is_replicate():
                raise ValueError(
                    f"{owner}: parameters are Replicate() on mesh dimension {names[d]!r} "
                    f"({_mesh_text(mesh)}): FSDP (HSDP) all-reduces their gradients densely over it "
                    "before DeMo sees them. Give fully_shard only the shard dimension and DeMo the "
                    'replicate group: fully_shard(m, mesh=mesh["shard"]) for every module, then '
                    'DeMo(model.named_parameters(), process_group=mesh.get_group("replicate"))'
                )
            if not placement.is_shard():
                raise ValueError(
                    f"{owner}: a parameter has placement {placement} on mesh dimension {names[d]!r}; "
                    "DeMo steps Shard() parameters (reduce partial values first)"
                )
    return MeshPlan(
        agree=tuple(mesh.get_group(d) for d in range(mesh.ndim)),
        dims=names,
        layout=_mesh_text(mesh),
    )


def check_exchange_group(plan: MeshPlan, process_group: Any, owner: str = "DeMo") -> None:
    """Raise unless ``process_group`` (the replicate group) meets every mesh group of this
    rank in this rank alone: a rank of the mesh holds a shard that no other rank of the
    exchange holds, and the exchange pairs ranks holding the same shard."""
    if process_group is None:
        return
    me = dist.get_rank()
    given = dist.get_process_group_ranks(process_group)
    for dim, group in zip(plan.dims, plan.agree, strict=True):
        ranks = dist.get_process_group_ranks(group)
        if set(given) & set(ranks) != {me}:
            raise ValueError(
                f"{owner}: process_group has ranks {given} but mesh dimension {dim!r} of the DTensor "
                f"parameters ({plan.layout}) has ranks {ranks} for rank {me}: the exchange group must "
                'hold one rank per shard position (the replicate group, e.g. mesh.get_group("replicate") '
                'with fully_shard(m, mesh=mesh["shard"]))'
            )


def _mesh_text(mesh: Any) -> str:
    shape = "x".join(str(s) for s in mesh.shape)
    names = f" {tuple(mesh.mesh_dim_names)}" if mesh.mesh_dim_names else ""
    return f"mesh {shape}{names} ranks {mesh.mesh.flatten().tolist()}"


def check_same_mesh(mesh: MeshPlan | None, existing: list[torch.Tensor], new: list, owner: str) -> None:
    """Raise unless the ``new`` parameters (tensors or ``(name, tensor)`` pairs) live on
    ``mesh``, the mesh of the ``existing`` ones (None: plain tensors)."""
    tensors = [p[1] if isinstance(p, tuple) else p for p in new]
    if mesh_plan(existing + tensors, owner=owner) != mesh:
        raise ValueError(
            f"{owner}: the new parameters are not on the optimizer's device mesh "
            f"({mesh.layout if mesh else 'plain tensors'})"
        )
