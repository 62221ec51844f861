"""Telemetry overhead: the demo's training step with and without :class:`cokit.telemetry.Monitor`.

    python -m cokit.bench.telemetry_overhead [--quick] [--out FILE] [--overwrite]

Runs the ``cokit demo`` training step (the character transformer, ``tiny`` preset, 16
sequences per rank, DeMo and AdamW as in the demo) on 2 spawned gloo ranks with a Monitor
that records every other step: the steps with and without it are paired within each run
(odd steps in one repetition, even ones in the next), so the drift of a shared machine hits
both alike. The step time is the interval between consecutive iteration starts, so it
includes everything the Monitor does. Two Monitors: ``jsonl+summary`` (the defaults of
``cokit demo``: each rank's JSONL and the one small all-gather per step for rank 0's
summary) and ``jsonl`` (no collective). Figures:

* ``overhead_pct``: median step time with a Monitor call over the median without, minus one;
* ``monitor_pct``: the median time inside ``Monitor.step`` over the median step without it
  (with the summary this includes waiting for the other rank at the all-gather, time that
  the step's own collectives would otherwise wait).

Target: under 2% of the step. The table is printed and the JSON written atomically to
``--out`` (default ``benchmarks/results/telemetry_overhead.json``; an existing file is
refused unless ``--overwrite``).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from itertools import pairwise
from typing import Any

import torch
import torch.distributed as dist

from cokit.bench.paired_steps import (
    WARMUP_STEPS,
    demo_workload_config,
    out_refused,
    parse_args,
    results,
    write_results,
)

DEFAULT_OUT = os.path.join("benchmarks", "results", "telemetry_overhead.json")
METHODS = ("demo", "adamw")


def _spec(method: str) -> Any:
    from cokit.train import MethodSpec

    if method == "demo":  # the demo's defaults
        options = {"compression_topk": 32, "compression_chunk": 64, "compression_decay": 0.999}
        return MethodSpec("demo", 1e-3, label="demo", options={**options, "payload": "compact"})
    return MethodSpec("adamw", 1e-3, label="adamw")


def _loop(workload: Any, method_name: str, steps: int, seed: int, monitor_kw: dict, phase: int) -> dict:
    """One run of ``steps`` training steps with a Monitor that records every other step (the
    steps ``s`` with ``s % 2 == phase``): the steps with and without it come from the same
    run, so drift of the machine hits both alike."""
    from cokit.telemetry import Monitor
    from cokit.train import build_method

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    model = workload.build_model(seed)
    model.train()
    method = build_method(_spec(method_name), model, None)
    source = method if getattr(method, "comm_stats", None) is not None else method.optimizer
    monitor = Monitor(optimizer=source, method=method_name, **monitor_kw)
    starts: list[float] = []
    used: list[bool] = []
    inside: list[float] = []
    dist.barrier()
    for step in range(1, steps + 1):
        starts.append(time.perf_counter())
        batch = workload.train_batch(seed, step, rank, world)
        loss = workload.loss(model, batch)
        loss.backward()
        method.step()
        method.zero_grad()
        local = float(loss.detach())
        used.append(step % 2 == phase)
        if used[-1]:
            m0 = time.perf_counter()
            monitor.step(step, loss=local, lr=1e-3)
            inside.append(time.perf_counter() - m0)
    starts.append(time.perf_counter())
    monitor.close()
    return {"step_s": [b - a for a, b in pairwise(starts)], "used": used, "monitor_s": inside}


#: what the Monitor does in each variant: the demo's default (JSONL and the rank-0 summary's
#: all-gather), and JSONL alone (no collective)
VARIANTS = {"jsonl+summary": True, "jsonl": False}


def worker(rank: int, world: int, cfg: Any, steps: int, reps: int, warmup: int, seed: int) -> list[dict]:
    """Every rank: for each method, variant and repetition, one run whose odd (or even,
    alternating by repetition) steps call the Monitor; returns this rank's step times (after
    ``warmup`` steps), each marked with or without."""
    torch.set_num_threads(1)  # two ranks share the cores, as in the demo
    workload = cfg.build("cpu")
    rows = []
    with tempfile.TemporaryDirectory(prefix="cokit-telemetry-bench-") as tmp:
        shared = [tmp if rank == 0 else None]
        dist.broadcast_object_list(shared, src=0)  # every rank writes into rank 0's folder
        for rep in range(reps):
            for method in METHODS:
                for variant, gather in VARIANTS.items():
                    kw: dict[str, Any] = {"out_dir": shared[0], "run": f"{method}-{variant}-rep{rep}"}
                    kw["gather"] = gather
                    if not gather:  # a rank's own file only; no collective
                        kw.update(rank=rank, world_size=world)
                    out = _loop(workload, method, steps, seed, kw, phase=rep % 2)
                    rows.append(
                        {
                            "method": method,
                            "variant": variant,
                            "rep": rep,
                            "step_s": out["step_s"][warmup:],
                            "used": out["used"][warmup:],
                            "monitor_s": out["monitor_s"],
                        }
                    )
        dist.barrier()  # rank 0 removes the folder only after every rank closed its files
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Per method and variant: median step time without and with a Monitor call, the
    overhead, and the time spent inside ``Monitor.step``."""
    out = []
    for method in METHODS:
        for variant in VARIANTS:
            mine = [r for r in rows if r["method"] == method and r["variant"] == variant]
            off = [t for r in mine for t, u in zip(r["step_s"], r["used"], strict=True) if not u]
            on = [t for r in mine for t, u in zip(r["step_s"], r["used"], strict=True) if u]
            inside = [t for r in mine for t in r["monitor_s"]]
            if not off or not on:
                continue
            m_off, m_on, m_in = statistics.median(off), statistics.median(on), statistics.median(inside)
            out.append(
                {
                    "method": method,
                    "variant": variant,
                    "steps_without": len(off),
                    "steps_with": len(on),
                    "median_step_ms_without": m_off * 1e3,
                    "median_step_ms_with": m_on * 1e3,
                    "overhead_pct": (m_on / m_off - 1.0) * 100.0,
                    "median_monitor_step_us": m_in * 1e6,
                    "monitor_pct": m_in / m_off * 100.0,
                    "rep_overhead_pct": [
                        (
                            statistics.median([t for t, u in zip(r["step_s"], r["used"], strict=True) if u])
                            / statistics.median(
                                [t for t, u in zip(r["step_s"], r["used"], strict=True) if not u]
                            )
                            - 1.0
                        )
                        * 100.0
                        for r in mine
                    ],
                }
            )
    return out


def table(summary: list[dict]) -> str:
    """The printed table."""
    head = (
        f"{'method':8s} {'monitor':14s} {'steps':>6s} {'without ms':>11s} {'with ms':>9s} "
        f"{'overhead':>9s} {'in Monitor.step':>16s} {'share':>7s}"
    )
    lines = [head, "-" * len(head)]
    for s in summary:
        lines.append(
            f"{s['method']:8s} {s['variant']:14s} {s['steps_without'] + s['steps_with']:6d} "
            f"{s['median_step_ms_without']:11.2f} {s['median_step_ms_with']:9.2f} {s['overhead_pct']:+8.2f}% "
            f"{s['median_monitor_step_us']:13.0f} us {s['monitor_pct']:6.2f}%"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, print the table, write the JSON; exit 0 (2 when --out is refused)."""
    prog = "telemetry_overhead"
    args, steps, reps = parse_args(prog, __doc__ or "", DEFAULT_OUT, argv)
    if out_refused(prog, args):
        return 2
    from cokit.train import run_distributed

    print(
        f"telemetry overhead: demo step (tiny model, 16 seqs/rank), 2 gloo ranks, {reps} reps x "
        f"{steps} steps per method and Monitor, every other step with a Monitor call (first "
        f"{WARMUP_STEPS} steps of each run not counted)",
        flush=True,
    )
    t0 = time.perf_counter()
    config = demo_workload_config(args.quick)
    rows = run_distributed(worker, config, steps, reps, WARMUP_STEPS, 0, world_size=2, device="cpu")
    summary = summarize(rows)
    print(table(summary))
    doc = results(
        prog,
        steps,
        reps,
        variants={
            "jsonl+summary": "JSONL sink + the per-step summary all-gather (cokit demo's defaults)",
            "jsonl": "JSONL sink only (gather=False)",
        },
        design="a Monitor call on every other step of each run; with/without medians over those steps",
        target_pct=2.0,
        summary=summary,
        elapsed_s=round(time.perf_counter() - t0, 1),
    )
    write_results(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
