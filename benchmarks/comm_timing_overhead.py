"""What the always-on communication timing costs: every step pays it, so it must stay small.

    python -m cokit.bench.comm_timing_overhead [--steps 60] [--world 2] [--out FILE] [--overwrite]

Two measurements, side by side in one run:

* per collective: the timer's own calls for one collective (launch mark, record, completion
  callback, wait marks, resolve), in a tight loop without communication;
* per step: DeMo training steps of a small MLP on ``--world`` gloo ranks (CPU), alternating
  blocks with the real timer and with a timer whose methods do nothing, so that both see the
  same machine state; the median step time of each and the overhead in percent.

Prints a table and writes the JSON (atomically) to ``--out`` (default
benchmarks/results/comm_timing/overhead.json). CPU only: on CUDA the marks are events, whose
cost is not measured here.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from cokit.compress.timing import CollectiveTiming, StepTimer, StepTiming
from cokit.files import OutputError, atomic_write_text, prepare_out_file
from cokit.launch import spawn

DEFAULT_OUT = Path("benchmarks/results/comm_timing/overhead.json")
BLOCK = 5  # steps per block; blocks alternate between the two timers


class NullTimer(StepTimer):
    """A timer that records nothing: the baseline."""

    def mark(self, device: torch.device | None = None) -> Any:
        return 0.0

    @contextlib.contextmanager
    def span(self, kind: str, device: torch.device | None = None) -> Iterator[None]:
        yield

    def launched(self, what: str, sent: int, received: int, start: Any) -> CollectiveTiming:
        return CollectiveTiming(what, sent, received, 0.0)

    def watch(self, record: CollectiveTiming, work: Any) -> None:
        pass

    def waited(self, record: CollectiveTiming, start: Any, end: Any) -> None:
        pass

    def take(self) -> StepTiming:
        return StepTiming({}, [], [])


class _Work:
    """A completed collective's stand-in for the per-collective loop."""

    def __init__(self) -> None:
        self.future: torch.futures.Future = torch.futures.Future()
        self.future.set_result(None)

    def get_future(self) -> torch.futures.Future:
        return self.future


def per_collective_us(n: int = 20000) -> float:
    """Microseconds of timer work per collective (plus its share of one encode/decode span)."""
    timer = StepTimer()
    works = [_Work() for _ in range(n)]
    start = time.perf_counter()
    for work in works:
        record = timer.launched("x", 1, 1, timer.mark())
        timer.watch(record, work)
        timer.waited(record, timer.mark(), timer.mark())
    timer.take().resolve()
    return (time.perf_counter() - start) / n * 1e6


def _steps(rank: int, world: int, steps: int) -> dict[str, list[float]]:
    os.environ["TRITON_INTERPRET"] = "0"  # the torch path: what a CPU user runs
    from cokit.compress import DeMo

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
    opt = DeMo(model.parameters(), lr=1e-3, compression_topk=32)
    timers = {"timed": opt.comm.timer, "untimed": NullTimer()}
    g = torch.Generator().manual_seed(rank)
    out: dict[str, list[float]] = {"timed": [], "untimed": []}
    for block in range(2 * (steps // (2 * BLOCK)) + 1):
        name = "timed" if block % 2 else "untimed"
        opt.comm.timer = timers[name]
        for _ in range(BLOCK):
            x = torch.randn(64, 256, generator=g)
            start = time.perf_counter()
            torch.nn.functional.mse_loss(model(x), x).backward()
            opt.step()
            opt.zero_grad()
            if block:  # the first block warms up
                out[name].append(time.perf_counter() - start)
    return out


def run(steps: int, world: int) -> dict[str, Any]:
    """Both measurements (module docstring) as a JSON-ready dict."""
    per_coll = per_collective_us()
    ranks = spawn(world, _steps, steps, timeout=600)
    timed = statistics.median(t for r in ranks for t in r["timed"])
    untimed = statistics.median(t for r in ranks for t in r["untimed"])
    return {
        "machine": f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, CPU (gloo)",
        "world_size": world,
        "steps_each": len(ranks[0]["timed"]),
        "per_collective_us": per_coll,
        "step_ms_timed": timed * 1e3,
        "step_ms_untimed": untimed * 1e3,
        "overhead_percent": (timed - untimed) / untimed * 100.0,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=60, help="timed steps per variant and rank")
    parser.add_argument("--world", type=int, default=2, help="gloo ranks (CPU processes)")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="JSON output file")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    args = parser.parse_args(argv)
    if args.steps < 2 * BLOCK or args.world < 2:
        print(f"comm_timing_overhead: --steps must be >= {2 * BLOCK} and --world >= 2", file=sys.stderr)
        return 2
    try:
        out = prepare_out_file(args.out, overwrite=args.overwrite)
    except OutputError as exc:
        print(f"comm_timing_overhead: {exc}", file=sys.stderr)
        return 2
    result = run(args.steps, args.world)
    print(f"{'measure':<32} {'value':>10}")
    print(f"{'timer work per collective':<32} {result['per_collective_us']:>8.2f} us")
    print(f"{'DeMo step, timed (median)':<32} {result['step_ms_timed']:>8.3f} ms")
    print(f"{'DeMo step, untimed (median)':<32} {result['step_ms_untimed']:>8.3f} ms")
    print(f"{'overhead':<32} {result['overhead_percent']:>8.2f} %")
    atomic_write_text(out, json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
