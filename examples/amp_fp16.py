"""Mixed precision with a GradScaler and DeMo or SparseLoCo, under torchrun (CPU/gloo or GPUs).

    torchrun --standalone --nproc-per-node 2 examples/amp_fp16.py              # DeMo
    torchrun --standalone --nproc-per-node 2 examples/amp_fp16.py --optimizer sparseloco
    torchrun --standalone --nproc-per-node 2 examples/amp_fp16.py --overflow-step 3

The forward runs in fp16 under autocast and the loss is scaled by a GradScaler. Both
optimizers take GradScaler's protocol: ``scaler.step(opt)`` hands them the scale and each
rank's ``found_inf``; they unscale the gradients themselves and every rank agrees (the exchange
core's status row) to skip a step where any rank overflowed, so the ranks' collectives stay
paired and the replicas identical. ``--overflow-step N`` makes rank 0's gradients overflow at
step N to show it: every rank skips that step and the scale halves on every rank.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from cokit.compress import DeMo, SparseLoCo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--optimizer", choices=("demo", "sparseloco"), default="demo")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--overflow-step", type=int, default=None, help="rank 0 overflows at this step")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 1)).to(device)
    if args.optimizer == "demo":
        opt = DeMo(model.parameters(), lr=3e-3, compression_topk=16, timeout=300)
    else:
        opt = SparseLoCo(
            model.parameters(), lambda ps: torch.optim.AdamW(ps, lr=3e-3), sync_every=2, timeout=300
        )
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**10)
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    w_true = torch.randn(32, 1, generator=torch.Generator().manual_seed(7))

    for step in range(args.steps):
        x = torch.randn(64, 32, generator=gen)
        x, y = x.to(device), (x @ w_true).to(device)
        with torch.autocast(device.type, dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        if step == args.overflow_step and rank == 0:
            model[0].weight.grad[0, 0] = float("inf")  # an fp16 overflow on this rank only
        scale = scaler.get_scale()
        scaler.step(opt)  # unscales, and skips on every rank if any rank found an inf
        scaler.update()
        opt.zero_grad()
        if rank == 0:
            note = "  (skipped on every rank: an inf on rank 0)" if scaler.get_scale() < scale else ""
            print(f"step {step:3d}  loss {loss.item():.4f}  scale {scale:g}{note}", flush=True)

    flat = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
    seen = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(seen, flat)
    same = all(torch.equal(seen[0], s) for s in seen[1:])
    if rank == 0:
        print("replicas: bit-identical weights" if same else "replicas: DIFFER", flush=True)
    dist.destroy_process_group()
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
