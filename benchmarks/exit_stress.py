"""Exit stress: the torchrun examples and plain DeMo / SparseLoCo / DDP-hook scripts, run again
and again beside a CPU hog, counting every run that does not end cleanly.

    python -m cokit.bench.exit_stress --runs 50 --hog 2
    python -m cokit.bench.exit_stress --runs 3 --cases amp_fp16-sparseloco hook --jobs 2

A process whose training finished correctly could still abort at exit ("terminate called
without an active exception", SIGABRT) when a gloo worker thread of a process group that
outlived ``destroy_process_group()`` needed the GIL while the interpreter finalized
(:mod:`cokit.compress.teardown`). Each round runs every case once, each under
``torch.distributed.run --standalone`` on CPU ranks (gloo, one thread each, this checkout on
``PYTHONPATH``):

* the examples (``examples/amp_fp16.py`` with DeMo and with SparseLoCo, ``two_level.py``
  (FSDP), ``tp_block.py``), as ``tests/test_examples.py`` launches them;
* ``demo``, ``sparseloco``, ``hook``: this file as a worker (``--worker``): a few steps of a
  small model with DeMo, SparseLoCo, or DDP with ``dct_topk_hook`` and AdamW; then it ends the
  way that aborted: its last collective's Python callback still runs on gloo's thread (for
  about a second) when the script destroys the group and returns. ``--no-release`` makes the
  workers unregister cokit's exit release first: the control, which should abort.

A run is ``ok`` (exit 0, its success line printed, no abort text), an ``abort`` (SIGABRT,
"terminate called", a rank's exit code -6), ``failed`` (any other nonzero exit, or no success
line) or a ``hang`` (past ``--timeout``: its process group is killed). ``--hog N`` keeps N busy
processes running beside the runs; the load average is read before and after. Prints a table,
writes JSON atomically (default ``exit_stress.json``; an existing file is refused unless
``--overwrite``) and exits 1 if any run was not ``ok``. Runs from a source checkout.
"""

from __future__ import annotations

import argparse
import atexit
import concurrent.futures
import dataclasses
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WORKER_DONE = "exit-stress worker: trained"
ABORT_SIGNS = ("terminate called", "SIGABRT", "exitcode  : -6", "exitcode: -6", "Signal 6 ")
OUTCOMES = ("ok", "abort", "failed", "hang")
DEFAULT_OUT = "exit_stress.json"
#: how long the worker's last Python callback runs on gloo's thread after the script returns
LATE_CALLBACK_S = 1.0


@dataclasses.dataclass(frozen=True)
class Case:
    """One script under torchrun: ``args`` after the launcher; ``expect``: its success line."""

    name: str
    args: tuple[str, ...]
    expect: str
    nproc: int = 2


def _example(name: str, script: str, *args: str, expect: str) -> Case:
    return Case(name, (str(ROOT / "examples" / script), *args), expect)


def _worker(name: str) -> Case:
    return Case(name, (str(Path(__file__).resolve()), "--worker", name), WORKER_DONE)


CASES: dict[str, Case] = {
    c.name: c
    for c in (
        _example(
            "amp_fp16-demo", "amp_fp16.py", "--steps", "6", "--overflow-step", "3", expect="bit-identical"
        ),
        _example(
            "amp_fp16-sparseloco",
            "amp_fp16.py",
            *("--optimizer", "sparseloco", "--steps", "6", "--overflow-step", "2"),
            expect="bit-identical",
        ),
        _example("two_level-fsdp", "two_level.py", "--steps", "6", "--mode", "fsdp", expect="bit-identical"),
        _example("tp_block", "tp_block.py", "--steps", "4", expect="matches the dense block"),
        _worker("demo"),
        _worker("sparseloco"),
        _worker("hook"),
    )
}
EXAMPLE_CASES = tuple(name for name, c in CASES.items() if "--worker" not in c.args)


@dataclasses.dataclass(frozen=True)
class Run:
    """One run of a case: its outcome, exit code (None: killed after a hang) and duration."""

    case: str
    outcome: str
    returncode: int | None
    seconds: float
    tail: str = ""


def classify(returncode: int | None, output: str, expect: str, *, timed_out: bool = False) -> str:
    """``hang``, ``abort``, ``failed`` or ``ok`` for a run that exited with ``returncode``
    (torchrun's, or a signal's negative number) and printed ``output`` (stdout and stderr)."""
    if timed_out:
        return "hang"
    if returncode in (-signal.SIGABRT, 128 + signal.SIGABRT) or any(s in output for s in ABORT_SIGNS):
        return "abort"
    if returncode != 0 or expect not in output:
        return "failed"
    return "ok"


def command(case: Case, *, release: bool = True) -> list[str]:
    """The torchrun command line of ``case``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(case.nproc)]
    extra = ["--no-release"] if not release and "--worker" in case.args else []
    return [*cmd, *case.args, *extra]


def run_env() -> dict[str, str]:
    """This checkout importable, the torch path (no ``TRITON_INTERPRET``), one thread a rank."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return {**env, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "0"}


def run_once(case: Case, timeout_s: float, *, release: bool = True) -> Run:
    """Run ``case`` once in a session of its own (a hang kills every rank with the launcher)."""
    start = time.monotonic()
    proc = subprocess.Popen(
        command(case, release=release),
        cwd=ROOT,
        env=run_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        timed_out = True
    seconds = time.monotonic() - start
    outcome = classify(None if timed_out else proc.returncode, output, case.expect, timed_out=timed_out)
    tail = "" if outcome == "ok" else output[-3000:]
    return Run(case.name, outcome, None if timed_out else proc.returncode, seconds, tail)


def run_stress(
    cases: list[str],
    runs: int,
    *,
    timeout_s: float = 300.0,
    jobs: int = 1,
    release: bool = True,
    progress: Callable[[int, int, Run], None] | None = None,
) -> list[Run]:
    """``runs`` rounds of every case in ``cases``, ``jobs`` at a time; every run's result
    (``progress(done, total, run)`` after each)."""
    todo = [CASES[name] for _ in range(runs) for name in cases]
    results: list[Run] = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(run_once, c, timeout_s, release=release) for c in todo]
        for fut in concurrent.futures.as_completed(futures):
            results.append(fut.result())
            if progress is not None:
                progress(len(results), len(todo), results[-1])
    return results


def summarize(results: list[Run], cases: list[str]) -> dict[str, dict[str, Any]]:
    """Per case: the count of each outcome, runs, and the median seconds of a run."""
    out: dict[str, dict[str, Any]] = {}
    for name in cases:
        mine = [r for r in results if r.case == name]
        seconds = sorted(r.seconds for r in mine)
        out[name] = {
            "runs": len(mine),
            **{o: sum(r.outcome == o for r in mine) for o in OUTCOMES},
            "median_s": round(seconds[len(seconds) // 2], 2) if seconds else None,
        }
    return out


def table(summary: dict[str, dict[str, Any]]) -> str:
    """The summary as a markdown table, a total row last."""
    head = "| case | runs | ok | abort | failed | hang | median s |"
    lines = [head, "|" + "---|" * 7]
    for name, s in summary.items():
        lines.append(
            f"| {name} | {s['runs']} | {s['ok']} | {s['abort']} | {s['failed']} | {s['hang']} | {s['median_s']} |"
        )
    total = {k: sum(s[k] for s in summary.values()) for k in ("runs", *OUTCOMES)}
    lines.append(
        f"| **all** | {total['runs']} | {total['ok']} | {total['abort']} | {total['failed']} | {total['hang']} | |"
    )
    return "\n".join(lines)


class Hog:
    """``n`` busy-looping processes beside the runs (a context manager)."""

    def __init__(self, n: int):
        self.n = n
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> Hog:
        for _ in range(self.n):
            self.procs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()


# --------------------------------------------------------------------------- the worker


def worker(kind: str, *, release: bool = True) -> None:
    """Train a small model for a few steps with ``kind`` (demo, sparseloco, hook) on the
    torchrun group, then end with the last collective's Python callback still running."""
    import torch
    import torch.distributed as dist

    from cokit.compress import DeMo, SparseLoCo
    from cokit.compress.hooks import DCTTopKState, dct_topk_hook
    from cokit.compress.teardown import release_captured_groups

    if not release:
        atexit.unregister(release_captured_groups)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model: torch.nn.Module = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1)
    )
    if kind == "demo":
        opt: torch.optim.Optimizer = DeMo(model.parameters(), lr=1e-3, compression_topk=8, timeout=300)
    elif kind == "sparseloco":
        opt = SparseLoCo(
            model.parameters(), lambda ps: torch.optim.AdamW(ps, lr=1e-3), sync_every=2, timeout=300
        )
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
        state = DCTTopKState(topk=8, chunk=64, payload="compact", warmup_steps=1, timeout=300)
        model.register_comm_hook(state, dct_topk_hook)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(4):
        x = torch.randn(16, 32, generator=gen)
        torch.nn.functional.mse_loss(model(x), x[:, :1]).backward()
        opt.step()
        opt.zero_grad()
    if rank == 0:
        print(WORKER_DONE, flush=True)
    # the script's last collective; its Python callback outlives the script on gloo's thread
    work = dist.all_reduce(torch.ones(4), async_op=True)
    work.get_future().add_done_callback(lambda _: time.sleep(LATE_CALLBACK_S))
    del work
    dist.destroy_process_group()


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    """Run, print, write; exit 0 (every run ok), 1 (some run was not) or 2 (bad arguments)."""
    ap = argparse.ArgumentParser(prog="exit_stress", description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=10, help="rounds; each runs every case once (default 10)")
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--hog", type=int, default=0, help="busy processes beside the runs (default 0)")
    ap.add_argument("--jobs", type=int, default=1, help="runs at a time (default 1)")
    ap.add_argument(
        "--timeout", type=float, default=300.0, help="seconds before a run is a hang (default 300)"
    )
    ap.add_argument(
        "--no-release", action="store_true", help="the control: workers without cokit's exit release"
    )
    ap.add_argument("--out", default=DEFAULT_OUT, help=f"JSON results file (default {DEFAULT_OUT})")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    ap.add_argument("--worker", choices=("demo", "sparseloco", "hook"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker, release=not args.no_release)
        return 0
    if args.runs < 1 or args.jobs < 1 or args.hog < 0 or not args.timeout > 0:
        ap.error("--runs and --jobs must be >= 1, --hog >= 0, --timeout > 0")
    if not (ROOT / "examples").is_dir():
        ap.error(f"exit_stress runs from a source checkout: no examples/ next to {Path(__file__).parent}")
    from cokit.files import OutputError, atomic_write_text, prepare_out_file

    try:
        out = prepare_out_file(args.out, overwrite=args.overwrite)
    except OutputError as exc:
        ap.error(str(exc))
    load_before = os.getloadavg()
    print(
        f"exit_stress: {args.runs} round(s) of {len(args.cases)} case(s), {args.jobs} at a time, "
        f"{args.hog} hog(s); load {load_before[0]:.2f}",
        flush=True,
    )
    start = time.monotonic()
    with Hog(args.hog):
        results = run_stress(
            args.cases,
            args.runs,
            timeout_s=args.timeout,
            jobs=args.jobs,
            release=not args.no_release,
            progress=lambda done, total, r: print(
                f"[{done}/{total}] {r.case}: {r.outcome} ({r.seconds:.1f} s)", flush=True
            ),
        )
        load_after = os.getloadavg()
    summary = summarize(results, args.cases)
    print(table(summary))
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} ({os.cpu_count()} cores)")
    bad = [r for r in results if r.outcome != "ok"]
    for r in bad[:3]:
        print(f"--- {r.case}: {r.outcome} (exit {r.returncode})\n{r.tail[-1500:]}")
    import torch

    doc = {
        "benchmark": "exit_stress",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": ["python", "-m", "cokit.bench.exit_stress", *(sys.argv[1:] if argv is None else argv)],
        "machine": {"platform": platform.platform(), "cores": os.cpu_count()},
        "torch": torch.__version__,
        "python": platform.python_version(),
        "runs": args.runs,
        "hog": args.hog,
        "jobs": args.jobs,
        "release": not args.no_release,
        "load_before": list(load_before),
        "load_after": list(load_after),
        "wall_s": round(time.monotonic() - start, 1),
        "example_runs": sum(summary[n]["runs"] for n in args.cases if n in EXAMPLE_CASES),
        "cases": summary,
        "not_ok": [dataclasses.asdict(r) for r in bad],
    }
    atomic_write_text(out, json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
