"""What ``cokit.overlap.Linear`` and ``apply_overlap`` cost on CPU, against ``nn.Linear``: this
tree and another commit, in one run.

    python -m cokit.bench.linear_cpu_overhead --baseline-ref HEAD
    python -m cokit.bench.linear_cpu_overhead --baseline-ref 7e501f1~1 --rounds 21 --out out.json

Where the Triton GEMM cannot help (CPU tensors without ``TRITON_INTERPRET``) the layer should
cost what ``nn.Linear`` costs (target: within 5%, forward and backward) and ``apply_overlap``
should leave a training step as fast as without it. Cases, each ``cokit`` against ``torch``
in the same worker:

* ``fwd MxKxN`` / ``fwd+bwd MxKxN`` at 64x48x40 and 256x512x512 (fp32; an ``(M, K)`` input,
  ``K -> N`` layer; ``fwd+bwd`` also computes the input's gradient): ``Linear.from_linear(l)``
  against the ``nn.Linear`` ``l`` it shares its parameters with;
* ``step``: a small MLP's training step (64 x 256 input, 256-512-512-256 with GELU, MSE,
  AdamW foreach) on a model ``apply_overlap(model, opt)`` swapped (its step hook runs every
  step: the whole per-step cost), against the same model untouched.

One worker process per tree (the baseline exported with ``git archive``, as
:mod:`cokit.bench.step_regression` does; one torch thread, no ``TRITON_INTERPRET``). Each
round times every case's four (tree, variant) pairs, in an order that rotates from round to
round, then a memory-bound control (a 64 MiB copy: the same torch code in both trees) in both
workers; a sample is the worker's own CPU time (``time.process_time``) over a loop sized to
about 50 ms. Reported per case: medians, ``cokit / torch`` in each tree (ratio of the medians
of one run), ``after / before`` for each variant (``torch``'s is the same code in both trees:
noise), and the control's ``after / before``. The load average is read before any work and
after the last round (:mod:`cokit.bench.machine_load`): a busy machine is refused unless
``--allow-busy``, which marks the results as no headline. Prints a table; writes JSON
atomically (default ``benchmarks/results/linear_cpu_overhead.json``; an existing file is
refused unless ``--overwrite``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import tempfile
from pathlib import Path
from typing import Any

from cokit.bench import machine_load
from cokit.bench.step_regression import ROOT, Worker, export

DEFAULT_OUT = os.path.join("benchmarks", "results", "linear_cpu_overhead.json")
SHAPES = ("64x48x40", "256x512x512")
CASES = (*(f"{kind} {shape}" for shape in SHAPES for kind in ("fwd", "fwd+bwd")), "step")
VARIANTS = ("torch", "cokit")
TREES = ("before", "after")
TARGET = 1.05  # cokit / torch at most this

# The worker: plain python with cokit importable from one tree; one JSON command per line in,
# one JSON line out. Only APIs both trees have (cokit.overlap.layers.Linear, apply_overlap).
WORKER = r"""
import copy, json, sys, time, torch
torch.set_num_threads(1)
from cokit.overlap.layers import Linear
from cokit.overlap.training import apply_overlap

def layer_case(kind, m, k, n, variant):
    torch.manual_seed(0)
    ref = torch.nn.Linear(k, n)
    layer = Linear.from_linear(ref) if variant == "cokit" else ref
    x = torch.randn(m, k, requires_grad=kind == "fwd+bwd")
    if kind == "fwd":
        return lambda: layer(x)
    g = torch.randn(m, n)
    return lambda: layer(x).backward(g)

def step_case(variant):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 512), torch.nn.GELU(),
        torch.nn.Linear(512, 256),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    if variant == "cokit":
        apply_overlap(model, opt)  # its post-hook runs OverlapTuning.step() after every opt.step()
    x, y = torch.randn(64, 256), torch.randn(64, 256)
    def step():
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return step

def loop(fn, n):
    start = time.process_time()
    for _ in range(n):
        fn()
    return time.process_time() - start

cases = {}
for line in sys.stdin:
    cmd = json.loads(line)
    if cmd["op"] == "setup":
        for case in cmd["cases"]:
            for variant in cmd["variants"]:
                if case == "step":
                    fn = step_case(variant)
                else:
                    kind, shape = case.split()
                    fn = layer_case(kind, *map(int, shape.split("x")), variant)
                n = 1
                while loop(fn, n) < 0.01:  # warm up and size the loop: about 50 ms a sample
                    n *= 2
                n = max(1, round(n * 0.05 / max(loop(fn, n), 1e-6)))
                cases[(case, variant)] = (fn, n)
        print(json.dumps({"loops": {f"{c} {v}": n for (c, v), (_, n) in cases.items()}}), flush=True)
    elif cmd["op"] == "time":
        fn, n = cases[(cmd["case"], cmd["variant"])]
        print(json.dumps({"seconds": loop(fn, n) / n}), flush=True)
    elif cmd["op"] == "control":  # memory-bound, the same torch code in both trees
        src = torch.ones(16 * 2**20)
        dst = torch.empty_like(src)
        dst.copy_(src)
        print(json.dumps({"seconds": loop(lambda: dst.copy_(src), 8) / 8}), flush=True)
"""


def _orders(r: int) -> list[tuple[str, str]]:
    """Round ``r``'s order of the (tree, variant) pairs: every pair leads once in 4 rounds."""
    pairs = [(t, v) for t in TREES for v in VARIANTS]
    k = r % len(pairs)
    return pairs[k:] + pairs[:k]


def run(baseline: Path, rounds: int, cases: tuple[str, ...] = CASES) -> dict[str, Any]:
    """Time every case in both trees, interleaved; medians and ratios per case."""
    workers = {"before": Worker(baseline, WORKER), "after": Worker(ROOT, WORKER)}
    try:
        loops = {
            tree: w.ask(op="setup", cases=list(cases), variants=list(VARIANTS))["loops"]
            for tree, w in workers.items()
        }
        times: dict[tuple[str, str, str], list[float]] = {}
        control: dict[str, list[float]] = {t: [] for t in TREES}
        for r in range(rounds):
            for case in cases:
                for tree, variant in _orders(r):
                    seconds = workers[tree].ask(op="time", case=case, variant=variant)["seconds"]
                    times.setdefault((case, tree, variant), []).append(seconds)
            for tree in TREES if r % 2 == 0 else TREES[::-1]:
                control[tree].append(workers[tree].ask(op="control")["seconds"])
    finally:
        for w in workers.values():
            w.close()
    rows = [summarize(case, times) for case in cases]
    med_control = {t: statistics.median(v) for t, v in control.items()}
    return {
        "rows": rows,
        "control": {
            "what": "64 MiB fp32 copy_ (memory-bound, the same torch code in both trees)",
            "ms": {t: 1e3 * v for t, v in med_control.items()},
            "after / before": med_control["after"] / med_control["before"],
        },
        "loops": loops,
    }


def summarize(case: str, times: dict[tuple[str, str, str], list[float]]) -> dict[str, Any]:
    """One case's medians (us), ``cokit / torch`` per tree, ``after / before`` per variant."""
    med = {(t, v): statistics.median(times[(case, t, v)]) for t in TREES for v in VARIANTS}
    ratio = {t: med[(t, "cokit")] / med[(t, "torch")] for t in TREES}
    return {
        "case": case,
        "samples": len(times[(case, "after", "cokit")]),
        "us": {t: {v: 1e6 * med[(t, v)] for v in VARIANTS} for t in TREES},
        "cokit / torch": ratio,
        "after / before": {v: med[("after", v)] / med[("before", v)] for v in VARIANTS},
        "target": TARGET,
        "met": ratio["after"] <= TARGET,
    }


def table(result: dict[str, Any]) -> str:
    """The printed table."""
    head = (
        f"{'case':20s} {'torch us':>9s} {'cokit us':>9s} {'cokit/torch before':>19s} {'after':>7s} "
        f"{'target':>7s} {'cokit after/before':>19s} {'torch after/before':>19s}"
    )
    lines = [head, "-" * len(head)]
    for row in result["rows"]:
        ratio, change = row["cokit / torch"], row["after / before"]
        verdict = "met" if row["met"] else f"missed by {100 * (ratio['after'] / TARGET - 1):.1f}%"
        lines.append(
            f"{row['case']:20s} {row['us']['after']['torch']:9.1f} {row['us']['after']['cokit']:9.1f} "
            f"{ratio['before']:19.3f} {ratio['after']:7.3f} {verdict:>7s} {change['cokit']:19.3f} "
            f"{change['torch']:19.3f}"
        )
    c = result["control"]
    lines.append(
        f"control: {c['what']}: after/before {c['after / before']:.3f} "
        f"({c['ms']['before']:.2f} ms / {c['ms']['after']:.2f} ms)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run, print, write; exit 0, 2 (bad arguments or --out refused) or 3 (busy machine)."""
    ap = argparse.ArgumentParser(prog="linear_cpu_overhead", description=(__doc__ or "").split("\n\n")[0])
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--baseline-ref", help="a commit of this repository to compare against")
    where.add_argument("--baseline-tree", type=Path, help="a checkout (folder) to compare against")
    ap.add_argument("--rounds", type=int, default=15, help="interleaved rounds (default 15)")
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--out", default=DEFAULT_OUT, help=f"JSON results file (default {DEFAULT_OUT})")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    machine_load.add_arguments(ap)
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    from cokit.files import OutputError, atomic_write_text, prepare_out_file

    try:
        out = prepare_out_file(args.out, overwrite=args.overwrite)
    except OutputError as exc:
        ap.error(str(exc))
    gate = machine_load.LoadGate.from_args("linear_cpu_overhead", args)
    if not gate.start():
        return 3
    with tempfile.TemporaryDirectory(prefix="cokit-linear-cpu-") as tmp:
        baseline = export(args.baseline_ref, Path(tmp)) if args.baseline_ref else args.baseline_tree.resolve()
        print(
            f"linear_cpu_overhead: {baseline} (before) vs {ROOT} (after); 1 thread, CPU time, "
            f"{args.rounds} interleaved rounds",
            flush=True,
        )
        result = run(baseline, args.rounds, tuple(args.cases))
    gate.finish(own=1)  # the workers take turns: one busy process
    banner = gate.banner()
    if banner is not None:
        print(banner)
    print(table(result))
    import torch

    doc = {
        "benchmark": "linear_cpu_overhead",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "baseline": args.baseline_ref or str(args.baseline_tree),
        "machine": {"platform": platform.platform(), "cpu": platform.processor(), "cores": os.cpu_count()},
        "torch": torch.__version__,
        "rounds": args.rounds,
        "load": gate.record(),
        "headline": gate.headline,
        **result,
    }
    atomic_write_text(out, json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
