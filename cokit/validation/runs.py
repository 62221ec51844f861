"""One spawn of the study: run a list of jobs on every rank, write one JSON per finished run.

A job is a (workload, method, lr, seed) point. Rank 0 writes ``job.path`` as soon as a run
ends (atomically), so an interrupted study resumes by skipping the files that exist.
"""

from __future__ import annotations

import json
import math
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cokit.files import atomic_write_text
from cokit.train import MethodSpec, RunResult, WorkloadFactory, _device_of, local_device, median, run_method
from cokit.validation.methods import EngineSlot  # importing it registers the "powersgd" method


@dataclass(frozen=True)
class Job:
    """One training run of the study and where its JSON goes."""

    workload: str
    method: str  # the study's label, e.g. "demo-compact-k32-c64"
    family: str  # adamw / sgd / powersgd / demo
    spec: MethodSpec
    seed: int
    steps: int
    eval_every: int
    path: str
    key: str  # identifies the configuration; a JSON with another key is stale
    extra: dict = field(default_factory=dict)
    telemetry_dir: str | None = None  # each rank's telemetry stream goes there (None: off)
    telemetry_run: str | None = None  # its run name, e.g. "text-adamw-lr0.001-s0"


class StudyWorkload:
    """Wraps a workload: models come wrapped in :class:`EngineSlot` (so DDP-based methods can
    hook the forward pass). The held-out batches are built once and reused by every run."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self._heldout: list[Any] | None = None

    def build_model(self, seed: int) -> nn.Module:
        return EngineSlot(self.inner.build_model(seed))

    def train_batch(self, seed: int, step: int, rank: int, world_size: int) -> Any:
        return self.inner.train_batch(seed, step, rank, world_size)

    def heldout_batches(self) -> list[Any]:
        if self._heldout is None:
            self._heldout = self.inner.heldout_batches()
        return self._heldout

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        return self.inner.loss(model, batch)

    def info(self) -> dict:
        return self.inner.info()


@torch.no_grad()
def heldout_accuracy(model: nn.Module, heldout: list[Any], rank: int, world: int) -> float:
    """Top-1 accuracy over all held-out targets (next character, or class): this rank's share
    (batches ``rank::world``) counted on the device, summed over ranks when ``world > 1``.
    NaN for workloads without labels (held-out batches that are not ``(inputs, labels)``)."""
    if not all(isinstance(b, (tuple, list)) and len(b) == 2 for b in heldout):
        return math.nan
    model.eval()
    counts = torch.zeros(2, dtype=torch.float64, device=_device_of(model))  # NCCL/RCCL: GPU tensors
    for x, y in heldout[rank::world]:
        pred = model(x).argmax(-1)
        counts[0] += (pred == y).sum()
        counts[1] += y.numel()
    model.train()
    if world > 1:
        dist.all_reduce(counts)
    return float(counts[0] / counts[1]) if counts[1] else math.nan


def _r(x: float, digits: int = 5) -> float | None:
    """Round to ``digits`` significant digits (keeps the JSON small); NaN/inf -> None."""
    if x is None or not math.isfinite(x):
        return None
    return float(f"{x:.{digits}g}")


def run_record(
    job: Job, result: RunResult | None, accuracy: float, error: str | None, world_size: int, elapsed: float
) -> dict[str, Any]:
    """The JSON document of one run: identity, status, summary and the per-step series."""
    doc: dict[str, Any] = {
        "key": job.key,
        "workload": job.workload,
        "method": job.method,
        "family": job.family,
        "lr": job.spec.lr,
        "seed": job.seed,
        "steps": job.steps,
        "world_size": world_size,
        "options": {k: v for k, v in job.spec.options.items()},
        "schedule": {"name": job.spec.schedule, "warmup": job.spec.warmup},
        "extra": job.extra,
        "elapsed_s": round(elapsed, 2),
    }
    if result is None:
        return {**doc, "status": "failed", "error": error}
    s = result.summary()
    sent = result.bytes_sent
    final_heldout = s["final_heldout_loss"]
    finite = all(math.isfinite(v) for v in result.train_loss) and math.isfinite(final_heldout)
    doc.update(
        {
            "status": "ok" if finite else "diverged",
            "num_params": result.num_params,
            "summary": {
                "final_train_loss": _r(s["final_train_loss"]),
                "final_heldout_loss": _r(final_heldout),
                "heldout_accuracy": _r(accuracy),
                "bytes_per_step": int(median(sent)) if sent else 0,
                "mean_bytes_per_step": _r(s["bytes_per_step"]),
                "total_bytes_sent": int(s["total_bytes_sent"]),
                "dense_bytes_per_step": int(median(result.dense_bytes)),
                "ratio_to_dense": _r(s["compression_ratio"]),
                "time_per_step_s": _r(s["time_per_step_s"], 4),
                "opt_time_per_step_s": _r(s["opt_time_per_step_s"], 4),
                "total_time_s": _r(s["total_time_s"], 4),
                "max_replica_diff": _r(s["max_replica_diff"], 3),
            },
            "evals": [{"step": st, "heldout_loss": _r(v)} for st, v in result.evals],
            "series": {
                "train_loss": [_r(v, 4) for v in result.train_loss],
                "bytes_sent": list(sent),
                "step_s": [_r(v, 3) for v in result.step_s],
                "opt_s": [_r(v, 3) for v in result.opt_s],
            },
        }
    )
    return doc


def write_json(path: str, doc: dict[str, Any]) -> None:
    """Write ``doc`` to ``path`` atomically (a temporary file, then rename)."""
    atomic_write_text(path, json.dumps(doc, indent=None, separators=(",", ":")))


def run_jobs(
    rank: int,
    world_size: int,
    jobs: list[Job],
    factory: WorkloadFactory,
    device: str = "cpu",
    verbose: bool = False,
) -> list[str]:
    """Worker body: build the workload once, run every job, write each run's JSON on rank 0.

    A run that raises (on every rank, as DeMo's non-finite check does) is recorded as
    ``failed`` and the next job starts. Returns the status of each job (rank 0)."""
    workload = StudyWorkload(factory.build(local_device(device)))
    log = (lambda line: print("    " + line, flush=True)) if verbose and rank == 0 else None
    statuses = []
    for i, job in enumerate(jobs, 1):
        t0 = time.perf_counter()
        result, acc, error = None, math.nan, None
        try:
            accuracy: list[float] = []

            def measure(model: nn.Module, out: list[float] = accuracy) -> None:
                out.append(heldout_accuracy(model, workload.heldout_batches(), rank, world_size))

            result = run_method(
                job.spec,
                workload,
                job.steps,
                job.seed,
                eval_every=job.eval_every,
                log=log,
                on_end=measure,
                telemetry_dir=job.telemetry_dir,
                telemetry_run=job.telemetry_run,
            )
            acc = accuracy[0]
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"[:2000]
            if verbose and rank == 0:
                traceback.print_exc()
        elapsed = time.perf_counter() - t0
        doc = run_record(job, result, acc, error, world_size, elapsed)
        statuses.append(doc["status"])
        if rank == 0:
            write_json(job.path, doc)
            s = doc.get("summary", {})
            detail = (
                f"held-out {s['final_heldout_loss']}  acc {s['heldout_accuracy']}  "
                f"{s['mean_bytes_per_step']:.0f} B/step"
                if s
                else doc.get("error", "")[:200]
            )
            print(
                f"  [{i}/{len(jobs)}] {job.workload} {job.method} lr={job.spec.lr:g} seed={job.seed}: "
                f"{doc['status']}  {detail}  ({elapsed:.1f} s)",
                flush=True,
            )
    return statuses
