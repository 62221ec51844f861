"""gloo workers for tests/test_fsdp.py: DeMo on FSDP2 / HSDP models against a plain reference.

Each rank trains a small model sharded with ``fully_shard`` and, beside it, a reference: the
same model unsharded, its gradients computed batch by batch (the same shapes as the ranks'
backward, so CPU BLAS gives the same bits), averaged over the shard group's batches like
FSDP's reduce-scatter, and stepped by a plain DeMo over the shard slices that FSDP holds
(``torch.chunk`` along dim 0), exchanging over the same replicate group.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
import torch.distributed as dist

from cokit.compress.optimizer import DeMo
from tests.helpers import dcp_load, dcp_save

IN, HIDDEN, OUT, BATCH = 12, 7, 5, 6
SETTINGS: dict[str, Any] = dict(
    lr=1e-2, compression_topk=4, compression_chunk=4, compression_decay=0.9, bucket_cap_mb=1e-6
)


def build_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT))


def batch(global_rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + global_rank)
    x = torch.randn(BATCH, IN, generator=g)
    teacher = torch.Generator().manual_seed(7)
    w = torch.randn(OUT, IN, generator=teacher)
    return x, torch.tanh(x @ w.T)


def shard_model(model: torch.nn.Module, mesh) -> None:
    from torch.distributed.fsdp import fully_shard

    for module in model:
        if isinstance(module, torch.nn.Linear):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)


def make_mesh(replicas: int, shards: int):
    from torch.distributed.device_mesh import init_device_mesh

    if replicas == 1:
        return init_device_mesh("cpu", (shards,), mesh_dim_names=("shard",))
    return init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("replicate", "shard"))


def _slices(t: torch.Tensor, shards: int) -> list[torch.Tensor]:
    parts = list(torch.chunk(t, shards, dim=0))
    empty = t.new_empty((0, *t.shape[1:]))
    return parts + [empty] * (shards - len(parts))


def train_and_reference(rank: int, world: int, replicas: int, steps: int) -> dict[str, Any]:
    """Train FSDP2 (replicas=1) or HSDP (replicas x shards) DeMo and the plain reference."""
    os.environ["TRITON_INTERPRET"] = "0"  # the torch path: these tests check the distributed logic
    shards = world // replicas
    mesh = make_mesh(replicas, shards)
    r, s = divmod(rank, shards)  # mesh [[0, 1], [2, 3]]: replica r, shard s
    model = build_model()
    ref = copy.deepcopy(model)
    shard_model(model, mesh if replicas == 1 else mesh["shard"])
    replicate = None if replicas == 1 else mesh.get_group("replicate")
    opt = DeMo(model.named_parameters(), process_group=replicate, **SETTINGS)
    # the reference: plain tensors, one per (parameter, shard slice), exchanged over the
    # replicate group (none: a group of this rank alone)
    if replicate is None:
        exchange, _ = dist.new_subgroups_by_enumeration([[q] for q in range(world)])
    else:
        exchange = replicate
    ref_params = [
        part.clone().requires_grad_(True) for p in ref.parameters() for part in _slices(p.detach(), shards)
    ]
    ref_opt = DeMo(ref_params, process_group=exchange, **SETTINGS)
    losses = []
    for step in range(steps):
        x, y = batch(rank, step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        # reference gradient: the mean of this replica's shard-group batches
        grads = None
        for q in range(shards):
            ref.zero_grad()
            xq, yq = batch(r * shards + q, step)
            torch.nn.functional.mse_loss(ref(xq), yq).backward()
            g = [p.grad.clone() for p in ref.parameters()]
            grads = g if grads is None else [a + b for a, b in zip(grads, g, strict=True)]
        assert grads is not None
        parts = [part for g in grads for part in _slices(g / shards, shards)]
        for p, g in zip(ref_params, parts, strict=True):
            p.grad = g.clone()
        ref_opt.step()
        with torch.no_grad():  # the reference model's full weights from its shard slices
            for i, p in enumerate(ref.parameters()):
                p.copy_(torch.cat(ref_params[i * shards : (i + 1) * shards]))
    mine = [p.to_local().detach().clone() for p in model.parameters()]
    expected = [ref_params[i * shards + s].detach().clone() for i in range(len(mine))]
    return {
        "rank": rank,
        "replica": r,
        "shard": s,
        "local": mine,
        "expected": expected,
        "losses": losses,
        "stats": opt.comm_stats.as_dict(),
    }


def nonfinite_shard(rank: int, world: int, mode: str) -> dict[str, Any]:
    """Rank 1 alone finds a NaN in its local gradient shard: every rank must act the same."""
    os.environ["TRITON_INTERPRET"] = "0"  # the torch path: these tests check the distributed logic
    mesh = make_mesh(1, world)
    model = build_model()
    shard_model(model, mesh)
    opt = DeMo(model.parameters(), nonfinite=mode, **SETTINGS)
    x, y = batch(rank, 0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    if rank == 1:
        next(model.parameters()).grad.to_local()[0, 0] = float("nan")
    before = [p.to_local().clone() for p in model.parameters()]
    try:
        opt.step()
        error = None
    except FloatingPointError as exc:
        error = str(exc)
    unchanged = all(torch.equal(a, p.to_local()) for a, p in zip(before, model.parameters(), strict=True))
    return {"error": error, "unchanged": unchanged, "skipped": opt.skipped_steps, "state": len(opt.state)}


def bad_setup(rank: int, world: int, case: str) -> str:
    """Build a bad FSDP/DeMo combination on every rank; return the error text."""
    os.environ["TRITON_INTERPRET"] = "0"  # the torch path: these tests check the distributed logic
    from cokit.compress.groups import node_groups

    replicas, shards = (2, 2) if world == 4 else (1, world)
    mesh = make_mesh(replicas, shards)
    model = build_model()
    kwargs: dict[str, Any] = {}
    if case == "replicate placement":  # fully_shard on the 2-D mesh: FSDP all-reduces replicas
        shard_model(model, mesh)
    elif case == "group overlaps mesh":  # the exchange group shares ranks with the shard group
        shard_model(model, mesh["shard"])
        kwargs["process_group"] = dist.new_group(list(range(world)))
    elif case == "mixed":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model[0], mesh=mesh)  # the last layer stays plain
    elif case == "overlap_backward":
        shard_model(model, mesh)
        kwargs["overlap_backward"] = True
    elif case == "hierarchy":
        groups = node_groups(local_world_size=2)
        shard_model(model, mesh)
        kwargs["hierarchy"] = groups
    try:
        DeMo(model.parameters(), **kwargs)
    except (TypeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def bad_setups(rank: int, world: int, cases: list[str]) -> dict[str, str]:
    """:func:`bad_setup` for each case, in one process group."""
    return {case: bad_setup(rank, world, case) for case in cases}


def dcp_run(rank: int, world: int, replicas: int, folder: str, save_at: int, steps: int, resume: bool):
    """Train FSDP2/HSDP DeMo for ``steps`` steps, saving a DCP checkpoint after ``save_at``;
    with ``resume``, start instead from that checkpoint in fresh processes. Returns the local
    shards at the end and the optimizer's counters."""
    os.environ["TRITON_INTERPRET"] = "0"
    shards = world // replicas
    mesh = make_mesh(replicas, shards)
    model = build_model(seed=0 if not resume else 5)  # a resumed run must take the saved weights
    shard_model(model, mesh if replicas == 1 else mesh["shard"])
    replicate = None if replicas == 1 else mesh.get_group("replicate")
    opt = DeMo(model.named_parameters(), process_group=replicate, **SETTINGS)
    first = 0
    if resume:
        dcp_load(model, opt, folder)
        first = save_at
    for step in range(first, steps):
        x, y = batch(rank, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if not resume and step + 1 == save_at:
            dcp_save(model, opt, folder)
    return {
        "local": [p.to_local().detach().clone() for p in model.parameters()],
        "deltas": [opt.state[p]["delta"].clone() for p in model.parameters()],
        "steps": opt._steps,
    }
