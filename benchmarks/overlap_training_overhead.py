"""What the overlap's tuner and priority plumbing cost in the demo's training step (CPU, gloo).

    python -m cokit.bench.overlap_training_overhead [--quick] [--out FILE] [--overwrite]

Runs the ``cokit demo`` training step (the character transformer, ``tiny`` preset, 16
sequences per rank, DeMo with the demo's settings) on 2 spawned gloo ranks, on a model that
:func:`cokit.overlap.training.apply_overlap` put on ``cokit.overlap.Linear`` layers. In every run,
``OverlapTuning.step()`` (time the step, agree on it with the other rank through the exchange
core's status row, feed the tuner, switch configs) is called on every other step: the steps
with and without it are paired within the run (odd steps in one repetition, even ones in
the next), so the drift of a shared machine hits both alike. The step time is the interval
between consecutive iteration starts, so it includes everything the tuner does. Variants:

* ``tuner``: DeMo with ``comm_priority='normal'``;
* ``tuner+priority``: DeMo with ``comm_priority='high'`` (on gloo the priority group is the
  same group: this shows that the plumbing adds nothing to the step).

Figures per variant: the median step time with and without the tuner call, ``overhead_pct``
(their ratio minus one), the median and the mean time inside ``OverlapTuning.step`` and their
shares of the step (``tuner_pct``, ``tuner_mean_pct``: the mean counts the agreements, one per
tuner decision point). Target: under 1% of the step. On CPU the GEMM configs change no timing
(the torch path runs them), so this measures the plumbing, not the tuning. The table is
printed and the JSON written atomically to ``--out`` (default
``benchmarks/results/overlap_training_overhead.json``; an existing file is refused unless
``--overwrite``).
"""

from __future__ import annotations

import os
import statistics
import sys
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

DEFAULT_OUT = os.path.join("benchmarks", "results", "overlap_training_overhead.json")
#: variant -> DeMo's comm_priority
VARIANTS = {"tuner": "normal", "tuner+priority": "high"}
TARGET_PCT = 1.0


def _spec(priority: str) -> Any:
    from cokit.train import MethodSpec

    options = {"compression_topk": 32, "compression_chunk": 64, "compression_decay": 0.999}
    return MethodSpec(
        "demo", 1e-3, label="demo", options={**options, "payload": "compact", "comm_priority": priority}
    )


def _loop(workload: Any, priority: str, steps: int, seed: int, phase: int) -> dict:
    """One run of ``steps`` steps calling the tuner on the steps ``s`` with ``s % 2 == phase``."""
    from cokit.overlap.training import apply_overlap
    from cokit.train import build_method

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    model = workload.build_model(seed)
    model.train()
    method = build_method(_spec(priority), model, None)
    tuning = apply_overlap(model)
    starts: list[float] = []
    used: list[bool] = []
    inside: list[float] = []
    dist.barrier()
    for step in range(1, steps + 1):
        starts.append(time.perf_counter())
        loss = workload.loss(model, workload.train_batch(seed, step, rank, world))
        loss.backward()
        method.step()
        method.zero_grad()
        float(loss.detach())
        used.append(step % 2 == phase)
        if used[-1]:
            t0 = time.perf_counter()
            tuning.step()
            inside.append(time.perf_counter() - t0)
    starts.append(time.perf_counter())
    decisions = len(tuning.decisions)
    tuning.undo()
    return {
        "step_s": [b - a for a, b in pairwise(starts)],
        "used": used,
        "tuner_s": inside,
        "decisions": decisions,
    }


def worker(rank: int, world: int, cfg: Any, steps: int, reps: int, warmup: int, seed: int) -> list[dict]:
    """Every rank: for each variant and repetition, one run whose odd (or even, alternating by
    repetition) steps call the tuner; this rank's step times after ``warmup`` steps."""
    torch.set_num_threads(1)  # two ranks share the cores, as in the demo
    workload = cfg.build("cpu")
    rows = []
    for rep in range(reps):
        for variant, priority in VARIANTS.items():
            out = _loop(workload, priority, steps, seed, phase=rep % 2)
            rows.append(
                {
                    "variant": variant,
                    "rep": rep,
                    "step_s": out["step_s"][warmup:],
                    "used": out["used"][warmup:],
                    "tuner_s": out["tuner_s"],
                    "decisions": out["decisions"],
                }
            )
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Per variant: median step time without and with the tuner call, the overhead, and the
    time inside ``OverlapTuning.step``."""
    out = []
    for variant in VARIANTS:
        mine = [r for r in rows if r["variant"] == variant]
        off = [t for r in mine for t, u in zip(r["step_s"], r["used"], strict=True) if not u]
        on = [t for r in mine for t, u in zip(r["step_s"], r["used"], strict=True) if u]
        inside = [t for r in mine for t in r["tuner_s"]]
        if not off or not on:
            continue
        m_off, m_on, m_in = statistics.median(off), statistics.median(on), statistics.median(inside)
        out.append(
            {
                "variant": variant,
                "steps_without": len(off),
                "steps_with": len(on),
                "median_step_ms_without": m_off * 1e3,
                "median_step_ms_with": m_on * 1e3,
                "overhead_pct": (m_on / m_off - 1.0) * 100.0,
                "median_tuner_step_us": m_in * 1e6,
                "tuner_pct": m_in / m_off * 100.0,
                "mean_tuner_step_us": statistics.fmean(inside) * 1e6,
                "tuner_mean_pct": statistics.fmean(inside) / m_off * 100.0,
                "decisions_per_run": [r["decisions"] for r in mine],
            }
        )
    return out


def table(summary: list[dict]) -> str:
    """The printed table."""
    head = (
        f"{'variant':15s} {'steps':>6s} {'without ms':>11s} {'with ms':>9s} {'overhead':>9s} "
        f"{'in tuning.step':>15s} {'share':>7s} {'mean in it':>11s} {'share':>7s}"
    )
    lines = [head, "-" * len(head)]
    for s in summary:
        lines.append(
            f"{s['variant']:15s} {s['steps_without'] + s['steps_with']:6d} {s['median_step_ms_without']:11.2f} "
            f"{s['median_step_ms_with']:9.2f} {s['overhead_pct']:+8.2f}% {s['median_tuner_step_us']:12.0f} us "
            f"{s['tuner_pct']:6.2f}% {s['mean_tuner_step_us']:8.0f} us {s['tuner_mean_pct']:6.2f}%"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, print the table, write the JSON; exit 0 (2 when --out is refused)."""
    prog = "overlap_training_overhead"
    args, steps, reps = parse_args(prog, __doc__ or "", DEFAULT_OUT, argv)
    if out_refused(prog, args):
        return 2
    from cokit.train import run_distributed

    print(
        f"overlap tuner overhead: demo step (tiny model, 16 seqs/rank, DeMo), 2 gloo ranks, {reps} reps x "
        f"{steps} steps per variant, every other step with a tuner call (first {WARMUP_STEPS} steps not counted)",
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
            k: f"DeMo comm_priority={v!r}, OverlapTuning.step() every other step" for k, v in VARIANTS.items()
        },
        design="a tuner call on every other step of each run; with/without medians over those steps",
        target_pct=TARGET_PCT,
        summary=summary,
        elapsed_s=round(time.perf_counter() - t0, 1),
    )
    write_results(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
