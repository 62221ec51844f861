"""Train a small model with DeMo under torchrun, checkpointing every rank; resume after a fault.

    torchrun --nproc-per-node 2 --max-restarts 1 tests/torchrun_resume_worker.py \
        --ckpt DIR --steps 12 --kill-at 6 --out FILE

The restart recipe of docs/optimizers.md ("Restarting after a fault"), as a runnable script. Every
``--every`` steps each rank saves ``DIR/rank<r>-step<s>.pt`` (model and optimizer
``state_dict()``, written atomically; the newest few are kept). On start, the ranks agree on
the newest step that *every* rank has saved and all load it, so a rank that died between
two saves costs at most ``--every`` steps. ``--kill-at S`` makes rank 1 SIGKILL itself at
the start of step S, once (a marker file in DIR remembers it): torchrun then restarts every
rank (``--max-restarts``), which resume from the checkpoints. At the end each rank writes
its parameters and how it started to ``FILE.rank<r>`` (torch.save, atomically).
"""

from __future__ import annotations

import argparse
import datetime
import io
import os
import re
import signal
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from cokit.compress import DeMo
from cokit.files import atomic_write_bytes

KEEP = 3  # checkpoints kept per rank: ranks are at most one save apart when one dies


def _model() -> nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)  # a function of (rank, step) only
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def _save(path: Path, obj: object) -> None:
    buf = io.BytesIO()
    torch.save(obj, buf)
    atomic_write_bytes(path, buf.getvalue())


def _saved_steps(ckpt: Path, rank: int) -> list[int]:
    pattern = re.compile(rf"rank{rank}-step(\d+)\.pt")
    return sorted(int(m.group(1)) for f in ckpt.iterdir() if (m := pattern.fullmatch(f.name)))


def _common_step(ckpt: Path, rank: int, world: int) -> int:
    """The newest step every rank has a checkpoint of (0: none, start fresh)."""
    everyone: list = [None] * world
    dist.all_gather_object(everyone, _saved_steps(ckpt, rank))
    common = set.intersection(*(set(s) for s in everyone))
    return max(common, default=0)


def _init_group() -> None:
    """The env:// group, its keys under this attempt's own prefix: torchrun's workers share
    the rendezvous store across restarts, where a restarted rank can read the previous
    attempt's addresses and fail to connect (pytorch/pytorch#135712; the other way out is
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)."""
    store, rank, world = next(dist.rendezvous("env://"))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"attempt{attempt}", store),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),  # a stuck peer is an error, not a 30 min wait
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True, help="checkpoint folder (shared by the ranks)")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--every", type=int, default=1, help="checkpoint every N steps (default 1)")
    ap.add_argument("--kill-at", type=int, default=None, help="rank 1 SIGKILLs itself at this step, once")
    ap.add_argument("--timeout", type=float, default=60.0, help="DeMo's collective timeout (s)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.environ["TRITON_INTERPRET"] = "0"  # kernels take the torch path on CPU
    torch.set_num_threads(1)
    _init_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt = Path(args.ckpt)
    ckpt.mkdir(parents=True, exist_ok=True)

    model = _model()
    opt = DeMo(model.named_parameters(), lr=3e-3, compression_topk=8, timeout=args.timeout)
    start = _common_step(ckpt, rank, world)
    if start:
        state = torch.load(ckpt / f"rank{rank}-step{start}.pt", weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
    marker = ckpt / "killed-once"
    for step in range(start + 1, args.steps + 1):
        if step == args.kill_at and rank == 1 and not marker.exists():
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = _batch(rank, step)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % args.every == 0 or step == args.steps:
            _save(
                ckpt / f"rank{rank}-step{step}.pt",
                {"model": model.state_dict(), "optimizer": opt.state_dict()},
            )
            for old in _saved_steps(ckpt, rank)[:-KEEP]:
                (ckpt / f"rank{rank}-step{old}.pt").unlink()
    result = {
        "params": [p.detach().clone() for p in model.parameters()],
        "resumed_from": start,
        "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
    }
    _save(Path(f"{args.out}.rank{rank}"), result)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
