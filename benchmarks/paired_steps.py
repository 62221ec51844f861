"""What the paired-step overhead benchmarks share: the demo's workload, the command line and
the results file.

A paired-step benchmark (``telemetry_overhead``, ``overlap_training_overhead``) runs the
``cokit demo`` training step on 2 spawned gloo ranks and calls the thing it measures on every
other step of each run, so the steps with and without it meet the same drift of a shared
machine; it prints a table and writes one JSON results file atomically.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from typing import Any

import torch

WARMUP_STEPS = 5  # the first steps of each run, not counted


def demo_workload_config(quick: bool) -> Any:
    """The demo's character transformer (``tiny`` preset, 16 sequences per rank) on stdlib text."""
    from cokit.workloads import CorpusConfig, ModelConfig, TextWorkloadConfig
    from cokit.workloads.text import VOCAB_SIZE

    return TextWorkloadConfig(
        corpus=CorpusConfig(max_chars=200_000 if quick else 400_000),
        model=ModelConfig.preset("tiny", VOCAB_SIZE),
        batch_size=16,
    )


def parse_args(
    prog: str, doc: str, default_out: str, argv: list[str] | None
) -> tuple[argparse.Namespace, int, int]:
    """``--quick``, ``--steps`` (default 80; quick 30), ``--reps`` (default 4; quick 2),
    ``--out``, ``--overwrite``; returns the arguments, the steps per run and the repetitions."""
    ap = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps and repetitions (about a minute)")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default 80; quick 30)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions per variant (default 4; quick 2)")
    ap.add_argument("--out", default=default_out, help=f"JSON results file (default {default_out})")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    args = ap.parse_args(argv)
    steps = args.steps or (30 if args.quick else 80)
    reps = args.reps or (2 if args.quick else 4)
    if steps < 10 or reps < 1:
        ap.error(f"--steps must be >= 10 and --reps >= 1, got {steps} and {reps}")
    return args, steps, reps


def out_refused(prog: str, args: argparse.Namespace) -> bool:
    """True (with the reason on stderr) when ``--out`` cannot be written, before any work."""
    from cokit.files import OutputError, prepare_out_file

    try:
        prepare_out_file(args.out, overwrite=args.overwrite)
    except OutputError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return True
    return False


def results(benchmark: str, steps: int, reps: int, **fields: Any) -> dict[str, Any]:
    """The results document: what ran where, then ``fields``."""
    return {
        "benchmark": benchmark,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "torch": torch.__version__,
        "world_size": 2,
        "backend": "gloo",
        "steps_per_run": steps,
        "reps": reps,
        "warmup_steps": WARMUP_STEPS,
        **fields,
    }


def write_results(path: str, doc: dict[str, Any]) -> None:
    """Write the JSON atomically and say where."""
    from cokit.files import atomic_write_text

    atomic_write_text(path, json.dumps(doc, indent=2) + "\n")
    print(f"wrote {path}")
