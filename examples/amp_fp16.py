"""Mixed precision with a GradScaler and DeMo or SparseLoCo, under torchrun (CPU/gloo or GPUs).

    torchrun --standalone --nproc-per-node 2 examples/amp_fp16.py              # DeMo
    torchrun --standalone --nproc-per-node 2 examples/amp_fp16.py --optimizer sparseloco
    torchrun --standalone --nproc-per-node 2 examples/amp_fp16.py --overflow-step 3
    torchrun --standalone --nproc-per-node 2 examples/amp_fp16.py --optimizer sparseloco --overflow-step 2

The forward runs in fp16 under autocast and the loss is scaled by a GradScaler. Both
optimizers take GradScaler's protocol: ``scaler.step(opt)`` hands them the scale and each
rank's ``found_inf``, and they unscale the gradients themselves. ``--overflow-step N`` makes
rank 0's gradients overflow at step N to show what happens; each line prints every rank's
scale (rank 0 first) and, on an overflow, which ranks skipped their step:

* DeMo: every rank agrees (the exchange core's status row) to skip that step, so the ranks'
  collectives stay paired and the replicas identical: no rank's weights change.
* SparseLoCo: only rank 0 skips its local (inner) step; the other ranks take theirs, and the
  next sync brings the replicas back together (with ``dense_warmup``, a warm-up step is
  skipped on every rank, like DeMo's).
* The GradScaler is per rank: only rank 0 saw the inf, so only rank 0's scale halves (1024 to
  512); the other ranks' stays at 1024. Nothing needs the scales to agree: each rank unscales
  its own gradients before anything is exchanged.
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
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(opt)  # unscales; DeMo skips on every rank, SparseLoCo on the rank that overflowed
        scaler.update()
        opt.zero_grad()
        moved = any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
        facts = torch.tensor([scale, scaler.get_scale(), float(moved)], dtype=torch.float64, device=device)
        every = [torch.zeros_like(facts) for _ in range(dist.get_world_size())]
        dist.all_gather(every, facts)
        if rank == 0:
            print(f"step {step:3d}  loss {loss.item():.4f}  {_note(every)}", flush=True)

    flat = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
    seen = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(seen, flat)
    same = all(torch.equal(seen[0], s) for s in seen[1:])
    if rank == 0:
        print("replicas: bit-identical weights" if same else "replicas: DIFFER", flush=True)
    dist.destroy_process_group()
    if not same:
        raise SystemExit(1)


def _note(every: list[torch.Tensor]) -> str:
    """Each rank's scale (rank 0 first), e.g. ``scale 1024/1024``; on an overflow, before ->
    after, and which ranks skipped their step (their weights did not change)."""
    before, after, moved = ([int(t[i].item()) for t in every] for i in range(3))
    text = "scale " + "/".join(map(str, before))
    if before == after:
        return text
    halved = [r for r, (b, a) in enumerate(zip(before, after, strict=True)) if a < b]
    still = [r for r, m in enumerate(moved) if not m]
    if len(still) == len(moved):
        skipped = "skipped on every rank, no rank's weights changed"
    elif still:
        skipped = f"skipped on rank {', '.join(map(str, still))} only, the other ranks stepped"
    else:
        skipped = "every rank's weights changed: a sync followed the skipped local step"
    return f"{text} -> {'/'.join(map(str, after))}  (an inf on rank {', '.join(map(str, halved))}: {skipped})"


if __name__ == "__main__":
    main()
