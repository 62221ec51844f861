"""A tensor-parallel transformer block under torchrun, checked against the dense block.

    python -m torch.distributed.run --standalone --nproc-per-node 2 examples/tp_block.py --steps 4
    python -m torch.distributed.run --standalone --nproc-per-node 2 examples/tp_block.py --sequence-parallel

Megatron's split of a pre-norm block (layout ``[sequence, batch, hidden]``): attention with a
column-parallel QKV projection (each rank computes ``heads / world`` whole heads: the fused QKV
weight is laid out per head, ``[q, k, v]`` of head 0, then of head 1, ...) and a row-parallel
output projection; the MLP is column-parallel ``fc1``, GELU, row-parallel ``fc2``. One
all-reduce per pass per half, each overlapped with its GEMM by cokit's schedules.
``--sequence-parallel`` shards the LayerNorms and residuals along the sequence: the column
layers all-gather their input rows and the row layers reduce-scatter their outputs (the
LayerNorm weights' gradients are then partial sums, all-reduced before the step).

Every rank builds the dense block from one seed and shards it (``from_linear``); all train
the tensor-parallel block with SGD on the same batches, and rank 0 also trains the dense block.
Each step rank 0 compares the losses and outputs, and at the end the gathered weights; it
prints ``max |tp - dense| = ...`` and ``matches the dense block``, or exits 1. Runs on CPU/gloo,
or GPUs/NCCL when torch sees enough of them.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cokit.overlap import ColumnParallelLinear, RowParallelLinear


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``; causal."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.head_dim = width // heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)  # per head: [q, k, v]
        self.proj = nn.Linear(width, width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # (S, B, 3 * width) dense, (S, B, 3 * width / world) on a rank
        S, B = qkv.shape[:2]
        heads = qkv.shape[-1] // (3 * self.head_dim)  # this rank's heads
        q, k, v = qkv.view(S, B, heads, 3, self.head_dim).permute(3, 1, 2, 0, 4)  # (B, h, S, d) each
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(o.permute(2, 0, 1, 3).reshape(S, B, heads * self.head_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def tensor_parallel(dense: Block, sequence_parallel: bool, chunks: int) -> Block:
    """A copy of ``dense`` with its projections sharded over the default group."""
    tp = copy.deepcopy(dense)
    kw = {"sequence_parallel": sequence_parallel, "chunks": chunks}
    tp.qkv = ColumnParallelLinear.from_linear(dense.qkv, **kw)
    tp.proj = RowParallelLinear.from_linear(dense.proj, **kw)
    tp.fc1 = ColumnParallelLinear.from_linear(dense.fc1, **kw)
    tp.fc2 = RowParallelLinear.from_linear(dense.fc2, **kw)
    return tp


def _batch(step: int, seq: int, batch: int, width: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1000 + step)  # the same batch on every rank
    x = torch.randn(seq, batch, width, generator=g)
    return x.to(device), torch.sin(2 * x).to(device)


def _gather_rows(t: torch.Tensor, world: int) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seq", type=int, default=8, help="sequence length (a multiple of the world size)")
    parser.add_argument("--batch", type=int, default=3)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--heads", type=int, default=4, help="a multiple of the world size")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--chunks", type=int, default=2, help="pieces each overlapped schedule pipelines")
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument(
        "--tolerance", type=float, default=1e-4, help="max |tp - dense| relative to the largest |dense| value"
    )
    args = parser.parse_args(argv)
    on_gpu = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("WORLD_SIZE", 1))
    dist.init_process_group("nccl" if on_gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    if args.heads % world or args.width % args.heads or (args.sequence_parallel and args.seq % world):
        parser.error(
            f"--heads {args.heads} must be a multiple of the world size {world} and divide --width "
            f"{args.width}; with --sequence-parallel, --seq {args.seq} a multiple of {world}"
        )

    torch.manual_seed(0)  # every rank: the same dense block
    dense = Block(args.width, args.heads).to(device)
    tp = tensor_parallel(dense, args.sequence_parallel, args.chunks)
    tp_layers = (ColumnParallelLinear, RowParallelLinear)
    sharded = {id(p) for m in tp.modules() if isinstance(m, tp_layers) for p in m.parameters()}
    replicated = {n: p for n, p in tp.named_parameters() if id(p) not in sharded}  # the LayerNorms
    opt = torch.optim.SGD(tp.parameters(), lr=args.lr, momentum=0.9)
    dense_opt = torch.optim.SGD(dense.parameters(), lr=args.lr, momentum=0.9) if rank == 0 else None
    rows = slice(rank * args.seq // world, (rank + 1) * args.seq // world)
    mode = "sequence parallel" if args.sequence_parallel else "tensor parallel"
    if rank == 0:
        print(f"{mode} block on {world} ranks ({dist.get_backend()}): {tp.qkv}, {tp.proj}", flush=True)
    worst, scale = 0.0, 0.0
    for step in range(args.steps):
        x, y = _batch(step, args.seq, args.batch, args.width, device)
        if args.sequence_parallel:
            out = tp(x[rows])  # this rank's rows
            loss = F.mse_loss(out, y[rows], reduction="sum") / y.numel()
        else:
            out = tp(x)
            loss = F.mse_loss(out, y)
        loss.backward()
        if args.sequence_parallel:
            for p in replicated.values():  # each rank saw its rows only: sum the partial gradients
                assert p.grad is not None
                dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            full_out = _gather_rows(out, world) if args.sequence_parallel else out
            total = loss.detach().clone()
            if args.sequence_parallel:
                dist.all_reduce(total)
        if rank == 0:
            assert dense_opt is not None
            dense_out = dense(x)
            dense_loss = F.mse_loss(dense_out, y)
            dense_loss.backward()
            dense_opt.step()
            dense_opt.zero_grad()
            diff = max(
                (full_out - dense_out.detach()).abs().max().item(), abs(total.item() - dense_loss.item())
            )
            worst, scale = max(worst, diff), max(scale, dense_out.abs().max().item())
            print(
                f"step {step:3d}  loss tp {total.item():.6f}  dense {dense_loss.item():.6f}  "
                f"max |tp - dense| output {diff:.2e}",
                flush=True,
            )
    # the trained weights, gathered (collective: every rank calls)
    gathered = {}
    for name in ("qkv", "proj", "fc1", "fc2"):
        layer = getattr(tp, name)
        gathered[name] = (layer.dense_weight(), layer.dense_bias())
    status = 0
    if rank == 0:
        for name, (w, b) in gathered.items():
            ref = getattr(dense, name)
            worst = max(worst, (w - ref.weight.detach()).abs().max().item())
            worst = max(worst, (b - ref.bias.detach()).abs().max().item())
            scale = max(scale, ref.weight.abs().max().item())
        dense_params = dict(dense.named_parameters())
        for n, p in replicated.items():
            worst = max(worst, (p.detach() - dense_params[n].detach()).abs().max().item())
        tol = args.tolerance * max(scale, 1.0)
        print(f"max |tp - dense| = {worst:.3e} (outputs, losses, weights; tolerance {tol:.1e})")
        if worst <= tol:
            print(f"{mode}: matches the dense block")
        else:
            print(f"{mode}: DIFFERS from the dense block", file=sys.stderr)
            status = 1
    dist.barrier()
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
