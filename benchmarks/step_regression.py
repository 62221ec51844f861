"""CPU step time before and after a change, in one run: this tree against another commit.

    python -m cokit.bench.step_regression --baseline-ref 0dad9ee
    python -m cokit.bench.step_regression --baseline-ref HEAD~3 --sizes 1M 10M --rounds 9 --out out.json

The baseline commit is exported (``git archive``) into a temporary folder; one worker process
imports cokit from it and another from this tree (both with one torch thread, world size 1, fp32
transformer-shaped parameters and fixed random gradients). The rounds alternate between the
two workers (and their order) so that both see the same machine load, and each time is the
worker's own CPU time. Reported per size: medians of DeMo (compact, k=32), DeMo (sign) and
SparseLoCo (defaults, averaged over one sync period) divided by AdamW (foreach) in the same
worker, and this tree's median over the baseline's. Prints the table and writes JSON
(atomically). CPU numbers, not GPU numbers.

Beside the ratios, each round times a memory-bound control in both workers (copying a 64 MiB
buffer: the same torch code in both trees), so its after/before ratio shows how far the
run's noise alone moves a ratio. The load average is read before any work and after the last
round (:mod:`cokit.bench.machine_load`): on a busy machine (1-minute load above
``--max-load`` x the cores, default 0.5) the benchmark refuses to run, saying why, unless
``--allow-busy``; then the results say ``"headline": false`` and why.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from cokit.bench import machine_load
from cokit.bench.demo_baseline import SIZES
from cokit.files import OutputError, atomic_write_text, prepare_out_file

ROOT = Path(__file__).resolve().parents[1]
CASES = ("AdamW", "DeMo compact", "DeMo sign", "SparseLoCo")
CONTROL = "control (64 MiB copy)"

# The worker runs in a plain python with cokit importable from one tree; it reads one JSON
# command per line and answers one JSON line. Only APIs both trees have are used.
WORKER = r"""
import json, sys, time, torch
torch.set_num_threads(1)
from cokit.compress import DeMo, SparseLoCo
from cokit.bench.optimizer_bench import layer_shapes

cases = {}
for line in sys.stdin:
    cmd = json.loads(line)
    if cmd["op"] == "setup":
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in layer_shapes(cmd["d_model"], cmd["blocks"])]
        grads = [torch.randn_like(p) for p in params]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        cases = {
            "AdamW": (torch.optim.AdamW(params, lr=1e-4, foreach=True), 1),
            "DeMo compact": (DeMo(params, lr=1e-4, compression_topk=32), 1),
            "DeMo sign": (DeMo(params, lr=1e-4, compression_topk=32, payload="sign"), 1),
            "SparseLoCo": (SparseLoCo(params), 15),  # 15 steps: three syncs at the default H=5
        }
        for opt, period in cases.values():  # warm up: first-step work (buffers, checks) is not timed
            for _ in range(period):
                opt.step()
        n = sum(p.numel() for p in params)
        print(json.dumps({"params": n}), flush=True)
    elif cmd["op"] == "control":  # memory-bound, the same torch code in both trees
        src = torch.ones(16 * 2**20)
        dst = torch.empty_like(src)
        dst.copy_(src)
        start = time.process_time()
        for _ in range(8):
            dst.copy_(src)
        print(json.dumps({"seconds": (time.process_time() - start) / 8}), flush=True)
    elif cmd["op"] == "time":
        opt, period = cases[cmd["case"]]
        start = time.process_time()
        for _ in range(period):
            opt.step()
        print(json.dumps({"seconds": (time.process_time() - start) / period}), flush=True)
"""


class Worker:
    """One long-lived process timing with cokit from ``tree`` (``script``: the worker's code,
    default the optimizer steps' :data:`WORKER`)."""

    def __init__(self, tree: Path, script: str = WORKER) -> None:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["PYTHONPATH"] = str(tree)
        env["OMP_NUM_THREADS"] = "1"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", script],
            env=env,
            cwd=tree,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def ask(self, **cmd: Any) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"a benchmark worker died (exit code {self.proc.wait()})")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


def export(ref: str, into: Path) -> Path:
    """The tree of commit ``ref`` of this repository, written under ``into``."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", ref], capture_output=True, check=False
    )
    if archive.returncode != 0:
        raise SystemExit(f"step_regression: cannot export {ref!r}: {archive.stderr.decode().strip()}")
    tree = into / "baseline"
    tree.mkdir()
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(tree, filter="data")
    return tree


def run(baseline: Path, sizes: list[str], rounds: int) -> list[dict]:
    """Time every case in both trees, alternating; rows per size with medians and ratios."""
    rows = []
    for size in sizes:
        d_model, blocks = SIZES[size]
        workers = {"before": Worker(baseline), "after": Worker(ROOT)}
        try:
            n = {
                name: w.ask(op="setup", d_model=d_model, blocks=blocks)["params"]
                for name, w in workers.items()
            }
            times: dict[tuple[str, str], list[float]] = {}
            for r in range(rounds):
                order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
                for case in CASES:
                    for name in order:
                        times.setdefault((name, case), []).append(
                            workers[name].ask(op="time", case=case)["seconds"]
                        )
                for name in order:
                    times.setdefault((name, CONTROL), []).append(workers[name].ask(op="control")["seconds"])
            med = {key: statistics.median(v) for key, v in times.items()}
            row: dict[str, Any] = {"size": size, "params": n["after"], "rounds": rounds}
            row[f"{CONTROL} ms"] = {name: 1e3 * med[(name, CONTROL)] for name in workers}
            row[f"{CONTROL} after / before"] = med[("after", CONTROL)] / med[("before", CONTROL)]
            for case in CASES:
                row[f"{case} ms"] = {name: 1e3 * med[(name, case)] for name in workers}
                if case != "AdamW":
                    row[f"{case} / AdamW"] = {
                        name: med[(name, case)] / med[(name, "AdamW")] for name in workers
                    }
                row[f"{case} after / before"] = med[("after", case)] / med[("before", case)]
            rows.append(row)
            print(_line(row), flush=True)
        finally:
            for w in workers.values():
                w.close()
    return rows


def _line(row: dict) -> str:
    parts = [f"{row['size']:>4} ({row['params'] / 1e6:.1f}M)"]
    for case in CASES[1:]:
        ratio = row[f"{case} / AdamW"]
        parts.append(f"{case}/AdamW {ratio['before']:.2f} -> {ratio['after']:.2f}")
    parts.append("after/before " + ", ".join(f"{c} {row[f'{c} after / before']:.2f}" for c in CASES))
    parts.append(f"control after/before {row[f'{CONTROL} after / before']:.2f}")
    return " | ".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--baseline-ref", help="a commit of this repository to compare against")
    where.add_argument("--baseline-tree", type=Path, help="a checkout (folder) to compare against")
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    machine_load.add_arguments(ap)
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    try:
        out = prepare_out_file(args.out) if args.out else None
    except OutputError as exc:
        ap.error(str(exc))
    gate = machine_load.LoadGate.from_args("step_regression", args)
    if not gate.start():
        return 3
    with tempfile.TemporaryDirectory(prefix="cokit-step-regression-") as tmp:
        baseline = export(args.baseline_ref, Path(tmp)) if args.baseline_ref else args.baseline_tree.resolve()
        print(
            f"step_regression: {baseline} (before) vs {ROOT} (after), world 1, 1 thread, CPU time", flush=True
        )
        rows = run(baseline, args.sizes, args.rounds)
    gate.finish(own=1)  # the workers take turns: one busy process
    banner = gate.banner()
    if banner is not None:
        print(banner)
    doc = {
        "baseline": args.baseline_ref or str(args.baseline_tree),
        "machine": platform.platform(),
        "processor": platform.processor(),
        "cores": os.cpu_count(),
        "load": gate.record(),
        "headline": gate.headline,
        "rows": rows,
    }
    if out is not None:
        atomic_write_text(out, json.dumps(doc, indent=1))
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
