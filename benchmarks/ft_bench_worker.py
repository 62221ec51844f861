"""One replica group (one process) of the fault-tolerance benchmark (:mod:`cokit.bench.ft_bench`).

    python -m cokit.bench.ft_bench_worker --method sparseloco --lighthouse URL --replica N \
        --log out.jsonl [--seed S --syncs 40 --sync-every 5 ...]

It hosts its replica group's TCPStore on loopback, builds a torchft ``Manager`` and trains the
protocol's char-level language model on its own shard of the text, with either torchft's own
``DiLoCo`` (dense fp32 pseudo-gradients, all-reduced) or cokit's SparseLoCo on torchft
(:class:`cokit.compress.ft.FaultTolerant`). Both use the same inner AdamW and sync interval;
DiLoCo's outer step is Nesterov SGD (lr 0.7, momentum 0.9, its paper's), SparseLoCo's its own
default (the mean of the pseudo-gradients) unless ``--sparseloco-outer nesterov``. It
stops once the quorum has committed ``--syncs`` syncs. Every committed sync appends one JSON line
to ``--log`` (the quorum's size, the bytes this replica sent in this sync: SparseLoCo's own count,
DiLoCo's a ring all-reduce of its fp32 payload); replica 0 also writes the held-out loss of the
synced weights every ``--eval-every`` syncs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch.distributed import TCPStore

from cokit.compress.stats import ring_allreduce_bytes
from cokit.workloads.model import ModelConfig
from cokit.workloads.text import VOCAB_SIZE, TextWorkload, TextWorkloadConfig


def _log(path: Path, **row: Any) -> None:
    with open(path, "a") as f:
        f.write(json.dumps({**row, "t": time.time(), "pid": os.getpid()}) + "\n")


def _heldout(workload: TextWorkload, model: torch.nn.Module, batches: list) -> float:
    with torch.no_grad():
        return float(sum(workload.loss(model, b).item() for b in batches) / len(batches))


def _rows(p: torch.Tensor) -> int:
    return p.shape[0] if p.dim() > 1 else 1


def _manager(args: argparse.Namespace, group: Any, state: tuple | None) -> tuple[Any, TCPStore]:
    """A torchft Manager over ``group`` and this replica group's store (keep it: the store's
    server lives as long as the object)."""
    from cokit.compress.ft_group import replica_manager

    load, save = state if state is not None else (None, None)
    return replica_manager(
        group,
        args.lighthouse,
        f"replica_{args.replica}",
        timeout=datetime.timedelta(seconds=args.timeout),
        quorum_timeout=datetime.timedelta(seconds=120),
        load_state_dict=load,
        state_dict=save,
    )


def _outer(params: Any, args: argparse.Namespace) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=args.outer_lr, momentum=args.outer_momentum, nesterov=True)


def train(args: argparse.Namespace) -> None:
    """Train this replica group until the quorum committed ``args.syncs`` syncs (module docstring)."""
    torch.set_num_threads(1)
    config = TextWorkloadConfig(
        model=ModelConfig.preset(args.preset, VOCAB_SIZE),
        batch_size=args.batch,
        eval_batches=args.eval_batches,
    )
    workload = config.build()
    model = workload.build_model(seed=args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    fp8 = sum(_rows(p) * (4 + p.numel() // _rows(p)) for p in model.parameters())  # fp32 scale + fp8 per row
    heldout = workload.heldout_batches() if args.replica == 0 else []
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    _log(args.log, event="start", replica=args.replica, method=args.method, params=n_params, fp8_payload=fp8)
    run = RUNS[args.method](args, model, inner)
    step = run.committed() * args.sync_every  # a healed replica continues at the quorum's step
    seen = run.committed()
    losses: list[float] = []
    while run.committed() < args.syncs:
        run.before_step()
        batch = workload.train_batch(args.seed, step, args.replica, args.replicas)
        loss = workload.loss(model, batch)
        loss.backward()
        run.step()
        losses.append(float(loss))
        step += 1
        if run.committed() > seen:
            seen = run.committed()
            world = run.world()
            row: dict[str, Any] = {"sync": seen, "world": world, "bytes": run.wire_bytes(n_params, world)}
            row["train_loss"] = sum(losses) / max(len(losses), 1)
            losses.clear()
            if heldout and (seen % args.eval_every == 0 or seen >= args.syncs):
                row["heldout"] = _heldout(workload, model, heldout)
            _log(args.log, event="sync", replica=args.replica, heals=run.heals(), **row)
    _log(args.log, event="done", replica=args.replica, sync=run.committed())
    run.shutdown()


class _DiLoCoRun:
    """torchft's DiLoCo: a dense fp32 all-reduce of the pseudo-gradients every ``sync_every`` steps."""

    def __init__(self, args: argparse.Namespace, model: torch.nn.Module, inner: torch.optim.Optimizer):
        from torchft.local_sgd import DiLoCo
        from torchft.process_group import ProcessGroupGloo

        self.group = ProcessGroupGloo(timeout=datetime.timedelta(seconds=args.timeout))
        self.model, self.inner = model, inner
        self.manager, self.store = _manager(args, self.group, (self._load, self._save))
        self.healed = 0
        self.diloco = DiLoCo(
            self.manager, [model], inner, _outer(model.parameters(), args), sync_every=args.sync_every
        )
        self.diloco.__enter__()

    def _save(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "inner": self.inner.state_dict()}

    def _load(self, sd: dict[str, Any]) -> None:
        self.model.load_state_dict(sd["model"])
        self.inner.load_state_dict(sd["inner"])
        self.healed += 1

    def committed(self) -> int:
        return int(self.manager.current_step())

    def before_step(self) -> None:
        self.inner.zero_grad()

    def step(self) -> None:
        self.inner.step()  # DiLoCo's post-step hook syncs every sync_every steps

    def world(self) -> int:
        return int(self.manager.num_participants())

    def heals(self) -> int:
        return self.healed

    def wire_bytes(self, n_params: int, world: int) -> int:
        return ring_allreduce_bytes(4 * n_params, world)  # fp32 pseudo-gradients, one all-reduce per sync

    def shutdown(self) -> None:
        self.diloco.__exit__(None, None, None)
        self.manager.shutdown(wait=False)


class _SparseLoCoRun:
    """cokit's SparseLoCo on torchft: top-k of each tile, int2 values, error feedback."""

    def __init__(self, args: argparse.Namespace, model: torch.nn.Module, inner: torch.optim.Optimizer):
        from cokit.compress import SparseLoCo
        from cokit.compress.ft import FaultTolerant
        from cokit.compress.ft_group import QuorumGloo

        group = QuorumGloo(timeout=datetime.timedelta(seconds=args.timeout))
        self.manager, self.store = _manager(args, group, None)
        self.opt = SparseLoCo(
            model.named_parameters(),
            inner,
            sync_every=args.sync_every,
            topk=args.topk,
            chunk=args.chunk,
            outer=args.sparseloco_outer,
            outer_lr=args.outer_lr if args.sparseloco_outer == "nesterov" else 1.0,
            outer_momentum=args.outer_momentum,
            timeout=args.timeout,
        )
        self.ft = FaultTolerant(self.manager, self.opt, group)
        self._sent = 0

    def committed(self) -> int:
        return int(self.opt.syncs)  # the quorum's sync count (a healed replica takes its peer's)

    def before_step(self) -> None:
        self.ft.zero_grad()

    def step(self) -> None:
        self.ft.step()

    def world(self) -> int:
        q = self.ft.quorum
        return q.world_size if q is not None else 0

    def heals(self) -> int:
        return self.ft.heals

    def wire_bytes(self, n_params: int, world: int) -> int:
        sent = int(self.opt.comm_stats.total_sent_bytes) - self._sent
        self._sent += sent
        return sent

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


RUNS: dict[str, Any] = {"diloco": _DiLoCoRun, "sparseloco": _SparseLoCoRun}


def parser() -> argparse.ArgumentParser:
    """The worker's flags (the benchmark passes them through)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", choices=sorted(RUNS), required=True)
    ap.add_argument("--lighthouse", required=True)
    ap.add_argument("--replica", type=int, required=True)
    ap.add_argument("--replicas", type=int, default=3, help="data shards (the replica groups of the run)")
    ap.add_argument("--log", type=Path, required=True)
    ap.add_argument(
        "--out", type=Path, help="where this worker's output goes (the benchmark reads it on failure)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--syncs", type=int, default=40)
    ap.add_argument("--sync-every", type=int, default=5)
    ap.add_argument("--preset", default="toy")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--eval-batches", type=int, default=4)
    ap.add_argument("--eval-every", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--outer-lr", type=float, default=0.7)
    ap.add_argument("--outer-momentum", type=float, default=0.9)
    ap.add_argument(
        "--sparseloco-outer",
        choices=("average", "nesterov"),
        default="average",
        help="SparseLoCo's outer step",
    )
    ap.add_argument("--topk", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=10.0)
    return ap


def main() -> None:
    args = parser().parse_args()
    if args.syncs < 1 or args.sync_every < 1 or not math.isfinite(args.lr):
        raise SystemExit("ft_bench_worker: --syncs and --sync-every must be >= 1 and --lr finite")
    train(args)


if __name__ == "__main__":
    main()
