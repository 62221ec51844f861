"""How long `cokit dashboard` takes and how big its page is, on synthetic telemetry.

    python benchmarks/dashboard_bench.py                      # 1,000 steps x 4 ranks, 2 runs
    python benchmarks/dashboard_bench.py --steps 1000 10000 --ranks 4 8 --out benchmarks/out

For each (steps, ranks) case it writes realistic ``cokit.telemetry/1`` files (two runs, a
DeMo-like compressed one and an AdamW-like dense one, with kernel configs, tuner decisions,
rank-0 summaries and a straggler), then times :func:`cokit.dashboard.build_dashboard` (read,
build the figures, write the page) and reports the HTML size. The target: a 1,000-step,
4-rank run in under 5 s and under 10 MB. Prints a table and writes ``dashboard_bench.json``
atomically. :func:`write_synthetic_telemetry` is also what the tests use.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

JSON_NAME = "dashboard_bench.json"
SCHEMA = "cokit.telemetry/1"

_CONFIGS = [
    {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3},
    {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3},
    {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 4},
]
_BLOCKS = (2, 1, 3)
_LIMITERS = ("shared memory", "shared memory", "registers")


def _full_config(c: dict[str, Any]) -> dict[str, Any]:
    return {
        "persistent": False,
        "num_sms": None,
        "smem_bytes": None,
        "maxnreg": None,
        "waves_per_eu": None,
        "matrix_instr_nonkdim": None,
        "kpack": None,
        **c,
    }


def _record(kind: str, run: str, rank: int, world: int, t: float, **fields: Any) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "kind": kind,
        "run": run,
        "rank": rank,
        "world_size": world,
        "time": t,
        **fields,
    }


def _decisions(
    step: int, steps: int, wall: float, state: dict[str, int], seed: int
) -> tuple[list[dict[str, Any]], int]:
    """The tuner's decisions at ``step`` and the config index it runs: explore 3 configs x 2
    trials, lock the best; drift at 50-70 % of the run (by seed), re-explore and lock another."""
    drift_at = int(steps * (0.5 + 0.1 * (seed % 3)))
    phase = step if step < drift_at else step - drift_at
    now = 1_760_000_000.0 + wall
    out: list[dict[str, Any]] = []
    if phase == 0:
        if step:
            out.append(
                {
                    "event": "drift",
                    "call": step,
                    "wall_time": now,
                    "candidate": _CONFIGS[state["locked"]],
                    "reason": "median of last 8 calls 41.2 ms is +21.0% from the locked 34.1 ms (threshold 15%)",
                }
            )
        reason = "re-exploring after drift" if step else "initial exploration"
        out.append(
            {
                "event": "explore",
                "call": step,
                "wall_time": now,
                "candidate": None,
                "reason": reason,
                "candidates": _CONFIGS,
            }
        )
    if phase < 6:
        cfg = phase % 3
        out.append(
            {
                "event": "trial",
                "call": step,
                "wall_time": now,
                "candidate": _CONFIGS[cfg],
                "reason": "exploring",
                "elapsed_ms": 30.0 + 3 * cfg,
            }
        )
        return out, cfg
    if phase == 6:
        state["locked"] = 0 if step < drift_at else 2
        out.append(
            {
                "event": "lock",
                "call": step,
                "wall_time": now,
                "candidate": _CONFIGS[state["locked"]],
                "reason": "lowest median over 2 trial(s): 31.2 ms; runner-up 33.9 ms",
            }
        )
    return out, state["locked"]


def _rank_lines(
    run: str,
    rank: int,
    ranks: int,
    steps: int,
    method: str,
    seed: int,
    kernels: bool,
    tuner: bool,
    held_out_every: int,
    sync_every: int = 0,
    first_step_s: float | None = None,
) -> tuple[list[dict[str, Any]], list[float]]:
    """One rank's meta and step records, and its step times."""
    rng = random.Random(seed * 1000 + rank)
    compressed = method == "demo" or sync_every > 0
    dense_bytes = 4 * 1_200_000
    t0 = 1_760_000_000.0
    lines = [
        _record(
            "meta",
            run,
            rank,
            ranks,
            t0,
            started="2026-03-01T12:00:00+00:00",
            host="synthetic",
            pid=1000 + rank,
            torch="2.13.0",
            triton="3.9.0",
            device="cpu",
            method=method,
            config={"lr": 1e-3, "steps": steps, "topk": 32 if compressed else None, "world": ranks},
        )
    ]
    times: list[float] = []
    wall = 0.0
    cum_sent = cum_dense = 0
    state = {"locked": 0}
    for step in range(steps):
        decisions, cfg = _decisions(step, steps, wall, state, seed) if tuner else ([], 0)
        straggle = 1.15 if rank == ranks - 1 and steps / 3 <= step < 2 * steps / 3 else 1.0
        compute = 0.030 * straggle * (1.0 + 0.05 * rng.gauss(0, 1)) * (1.0 + 0.04 * cfg)
        if step == 0 and first_step_s is not None:
            compute = first_step_s  # compile / warm-up
        if sync_every > 0:  # SparseLoCo-like: local steps send nothing, a sync sends them all
            syncing = step % sync_every == sync_every - 1
            encode = decode = 0.004 if syncing else 0.0
            comm = 0.04 * (1 + 0.2 * rng.random()) if syncing else 0.0
            exposed = comm * 0.7
            sent = dense_bytes * sync_every // 150 + rng.randrange(0, 2000) if syncing else 0
        elif compressed:
            encode, decode = 0.0021 * (1 + 0.1 * rng.random()), 0.0015 * (1 + 0.1 * rng.random())
            comm = 0.009 * (1 + 0.2 * rng.random())
            exposed = min(comm, 0.0015 + 0.001 * rng.random())
            sent = dense_bytes // 60 + rng.randrange(0, 2000)
        else:
            encode = decode = 0.0
            comm = 0.022 * (1 + 0.2 * rng.random())
            exposed = comm * 0.55
            sent = dense_bytes
        step_s = compute + encode + decode + exposed
        times.append(step_s)
        wall += step_s
        cum_sent += sent
        cum_dense += dense_bytes
        base = 5.5 * math.exp(-step / (steps / 3)) + (2.1 if compressed else 2.0)
        held = (
            base + 0.12
            if rank == 0 and held_out_every and step % held_out_every == held_out_every - 1
            else None
        )
        lines.append(
            _record(
                "step",
                run,
                rank,
                ranks,
                t0 + wall,
                step=step,
                wall_s=wall,
                step_s=step_s if step or first_step_s is not None else None,
                loss=base + 0.08 * rng.gauss(0, 1),
                held_out_loss=held,
                lr=1e-3 * min(1.0, (step + 1) / 20),
                comm={
                    "encode_s": encode,
                    "decode_s": decode,
                    "exposed_s": exposed,
                    "comm_s": comm,
                    "sent_bytes": sent,
                    "received_bytes": sent * (ranks - 1) if compressed else sent,
                    "dense_bytes": dense_bytes,
                    "ratio": cum_dense / cum_sent if cum_sent else None,  # inf is written as null
                    "collectives": [
                        {
                            "what": "all_gather" if compressed else "all_reduce",
                            "sent_bytes": sent,
                            "received_bytes": sent,
                            "comm_s": comm,
                            "exposed_s": exposed,
                        }
                    ],
                    "world_size": ranks,
                    "group_size": ranks,
                },
                compute_s=compute,
                kernels=[
                    {
                        "name": "gemm",
                        "config": _full_config(_CONFIGS[cfg]),
                        "blocks_per_sm": _BLOCKS[cfg],
                        "limiter": _LIMITERS[cfg],
                        "smem_per_block": 98304 if cfg != 2 else 65536,
                        "reserved_sms": 8,
                    }
                ]
                if kernels
                else [],
                tuner=decisions,
                process={"max_memory_bytes": 2_000_000_000 + 1000 * step, "device": "cpu"},
                metrics={"tokens_per_s": 50_000.0 / step_s},
            )
        )
    return lines, times


def write_synthetic_telemetry(
    root: str | os.PathLike,
    run: str,
    *,
    steps: int = 200,
    ranks: int = 2,
    method: str = "demo",
    kernels: bool = True,
    tuner: bool = True,
    summary: bool = True,
    end: bool = True,
    seed: int = 0,
    held_out_every: int = 25,
    sync_every: int = 0,
    first_step_s: float | None = None,
) -> list[Path]:
    """Write ``root/telemetry/<run>/rank<r>.jsonl`` for ``ranks`` ranks in the telemetry schema.

    ``method="demo"`` sends compressed payloads (ratio ~60, a few ms exposed, most comm hidden);
    anything else behaves like a dense all-reduce (ratio 1, more exposed). The last rank
    straggles by 15 % in the middle third. With ``tuner``, every rank's tuner explores three
    configs, locks, drifts at 50-70 % (by seed) and re-locks; ``kernels`` records the config in use; rank 0
    writes per-step ``summary`` records across ranks. ``sync_every=H`` makes a SparseLoCo-like
    run: zero bytes on H - 1 steps out of H, then one sync sending them all (ratio ~150 at
    syncs). ``first_step_s`` gives step 0 that step time (a compile/warm-up outlier); by
    default step 0 has no ``step_s``. Returns the files written.
    """
    folder = Path(root) / "telemetry" / run
    folder.mkdir(parents=True, exist_ok=True)
    per_rank = [
        _rank_lines(
            run, r, ranks, steps, method, seed, kernels, tuner, held_out_every, sync_every, first_step_s
        )
        for r in range(ranks)
    ]
    t0 = 1_760_000_000.0
    if summary and ranks > 1:
        lines0 = per_rank[0][0]
        for step in range(1, steps):
            col = [per_rank[r][1][step] for r in range(ranks)]
            lines0.append(
                _record(
                    "summary",
                    run,
                    0,
                    ranks,
                    t0 + step,
                    step=step,
                    step_s_max=max(col),
                    step_s_min=min(col),
                    slowest_rank=max(range(ranks), key=col.__getitem__),
                    exposed_s_max=0.003,
                    ranks=ranks,
                )
            )
    paths = []
    for rank, (lines, times) in enumerate(per_rank):
        if end:
            lines.append(_record("end", run, rank, ranks, t0 + sum(times), steps=steps, wall_s=sum(times)))
        path = folder / f"rank{rank}.jsonl"
        path.write_text("".join(json.dumps(rec) + "\n" for rec in lines))
        paths.append(path)
    return paths


def measure(steps: int, ranks: int, repeats: int = 3) -> dict[str, Any]:
    """Write two synthetic runs of ``steps`` x ``ranks`` and time building their dashboard
    (best of ``repeats``; the first build also pays plotly's imports)."""
    from cokit.dashboard import build_dashboard

    with tempfile.TemporaryDirectory(prefix="cokit-dashboard-bench.") as tmp:
        root = Path(tmp) / "runs"
        t0 = time.perf_counter()
        files = write_synthetic_telemetry(root, "demo-DeMo", steps=steps, ranks=ranks, method="demo", seed=1)
        files += write_synthetic_telemetry(
            root, "demo-AdamW", steps=steps, ranks=ranks, method="adamw", seed=2
        )
        gen_s = time.perf_counter() - t0
        telemetry_bytes = sum(f.stat().st_size for f in files)
        times = []
        out = Path(tmp) / "dashboard.html"
        for _ in range(repeats):
            t0 = time.perf_counter()
            build_dashboard([root], out, overwrite=True, log=None)
            times.append(time.perf_counter() - t0)
        html_bytes = out.stat().st_size
    return {
        "steps": steps,
        "ranks": ranks,
        "runs": 2,
        "telemetry_bytes": telemetry_bytes,
        "generate_s": gen_s,
        "build_s_first": times[0],
        "build_s_best": min(times),
        "html_bytes": html_bytes,
        "meets_target": steps != 1000 or ranks != 4 or (max(times) < 5.0 and html_bytes < 10e6),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, nargs="+", default=[1000], help="steps per run (default 1000)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[4], help="ranks per run (default 4)")
    ap.add_argument(
        "--repeats", type=int, default=3, help="builds per case; best and first reported (default 3)"
    )
    ap.add_argument(
        "--out",
        default="benchmarks/out",
        help=f"output folder (default benchmarks/out); checked before anything runs, and refused when it "
        f"already holds {JSON_NAME} unless --overwrite",
    )
    ap.add_argument("--overwrite", action="store_true", help=f"replace an existing {JSON_NAME} in --out")
    args = ap.parse_args(argv)
    if min(args.steps) < 1 or min(args.ranks) < 1 or args.repeats < 1:
        ap.error("--steps, --ranks and --repeats must be >= 1")
    from cokit.files import OutputError, atomic_write_text, prepare_out_dir

    try:
        out = prepare_out_dir(args.out, (JSON_NAME,), overwrite=args.overwrite)
    except OutputError as exc:
        print(f"dashboard_bench: error: {exc}", file=sys.stderr, flush=True)
        return 2
    rows = [measure(s, r, args.repeats) for s in args.steps for r in args.ranks]
    print(f"cokit dashboard build, 2 runs overlaid ({platform.machine()} CPU, {os.cpu_count()} cores)")
    print(f"{'steps':>7} {'ranks':>5} {'jsonl MB':>9} {'first s':>8} {'best s':>7} {'html MB':>8} target")
    for r in rows:
        target = "-" if (r["steps"], r["ranks"]) != (1000, 4) else ("ok" if r["meets_target"] else "MISSED")
        print(
            f"{r['steps']:>7} {r['ranks']:>5} {r['telemetry_bytes'] / 1e6:>9.2f} {r['build_s_first']:>8.2f} "
            f"{r['build_s_best']:>7.2f} {r['html_bytes'] / 1e6:>8.2f} {target}"
        )
    import plotly

    report = {
        "target": "1,000 steps x 4 ranks: build < 5 s, HTML < 10 MB",
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "plotly": plotly.__version__,
        "rows": rows,
    }
    atomic_write_text(out / JSON_NAME, json.dumps(report, indent=2))
    print(f"wrote {out / JSON_NAME}")
    return 0 if all(r["meets_target"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
