"""DeMo in two-level training stacks, under torchrun (CPU/gloo or GPU/NCCL).

    torchrun --nproc-per-node 2 examples/two_level.py --mode fsdp
    torchrun --nproc-per-node 4 examples/two_level.py --mode hsdp --replicas 2
    torchrun --nproc-per-node 4 examples/two_level.py --mode hierarchy --ranks-per-node 2

* ``fsdp``: FSDP2 ``fully_shard`` on a 1-D mesh; DeMo steps each rank's shards (nothing to
  exchange: FSDP reduce-scatters the gradients).
* ``hsdp``: a 2-D mesh (replicate, shard). FSDP shards over the ``shard`` dimension (fast
  links inside a node) and DeMo exchanges compressed payloads over ``replicate`` (across
  nodes) instead of FSDP's dense all-reduce.
* ``hierarchy``: plain data parallel with ``DeMo(hierarchy=node_groups())``: a dense average
  inside each node, compressed payloads across nodes (``--ranks-per-node`` defaults to
  torchrun's ``LOCAL_WORLD_SIZE``).

Rank 0 prints the loss and the bytes each level carried, and checks that the ranks holding
the same shard ended bit-identical.
"""

from __future__ import annotations

import argparse
import os
import zlib

import torch
import torch.distributed as dist

from cokit.compress import DeMo
from cokit.compress.comm import Communicator
from cokit.compress.groups import node_groups


def _model(width: int) -> torch.nn.Module:
    torch.manual_seed(0)  # every rank starts from the same weights
    return torch.nn.Sequential(
        torch.nn.Linear(32, width), torch.nn.GELU(), torch.nn.Linear(width, width), torch.nn.GELU(),
        torch.nn.Linear(width, 8),
    )  # fmt: skip


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + rank)
    x = torch.randn(32, 32, generator=g)
    return x, torch.sin(x[:, :8]) + 0.5 * x[:, 8:16]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("fsdp", "hsdp", "hierarchy"), default="hsdp")
    parser.add_argument("--replicas", type=int, default=2, help="hsdp: size of the replicate dimension")
    parser.add_argument(
        "--ranks-per-node", type=int, default=None, help="hierarchy: default LOCAL_WORLD_SIZE"
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--width", type=int, default=96)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    on_gpu = backend == "nccl"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    model = _model(args.width).to(device)
    settings = dict(lr=args.lr, compression_topk=8, compression_chunk=16)
    same_shard = list(range(world))  # ranks that must end identical to this one
    if args.mode == "hierarchy":
        opt = DeMo(model.parameters(), hierarchy=node_groups(args.ranks_per_node), **settings)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        replicas = args.replicas if args.mode == "hsdp" else 1
        if world % replicas:
            parser.error(f"--replicas {replicas} does not divide the world of {world} ranks")
        mesh = init_device_mesh(
            device.type, (replicas, world // replicas), mesh_dim_names=("replicate", "shard")
        )
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh["shard"])
        fully_shard(model, mesh=mesh["shard"])
        replicate = mesh.get_group("replicate") if replicas > 1 else None
        opt = DeMo(model.named_parameters(), process_group=replicate, **settings)
        same_shard = dist.get_process_group_ranks(replicate) if replicate is not None else [rank]
    for step in range(args.steps):
        x, y = _batch(rank, step)
        loss = torch.nn.functional.mse_loss(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            stats = opt.comm_stats
            inter = stats.step_sent_bytes - stats.step_intra_sent_bytes
            print(  # what each number is: the fast links inside a node carry the dense part
                f"step {step:3d}  loss {loss.item():.4f}  sent by this rank: {stats.step_intra_sent_bytes:,} B "
                f"inside its node (the fast links) + {inter:,} B across nodes (compressed); a dense "
                f"all-reduce would send {stats.step_dense_bytes:,} B, all of it across the slow links",
                flush=True,
            )
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    crc = zlib.crc32(b"".join(t.detach().cpu().float().numpy().tobytes() for t in local))
    # through cokit's Communicator (a timeout, nothing pickled, the collective held until exit)
    mine_crc = torch.tensor([crc], dtype=torch.int64, device=device)
    crcs = (
        Communicator(owner="two_level example")
        .all_gather(mine_crc, "weights checksum")
        .wait()
        .flatten()
        .tolist()
    )
    if rank == 0:
        mine = {crcs[r] for r in same_shard}
        print(
            f"{args.mode}: ranks {same_shard} hold {'bit-identical' if len(mine) == 1 else 'DIFFERENT'} weights"
        )
    # every rank done with every group (the mesh's too) before any tears them down: a rank that
    # destroys gloo groups while a peer still uses them can abort the peer
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
