"""Time to target on slow links: how long each method takes to reach the best dense run's
held-out loss, measured, extrapolated and predicted by ``cokit plan``.

    python -m cokit.bench.time_to_target --out benchmarks/results/time_to_target      # 3 seeds, 3 links
    python -m cokit.bench.time_to_target --seeds 0 --steps 40 --window 10 --profiles 10mbit --out /tmp/ttt

Every method trains the demo's char transformer on 2 gloo ranks (1 thread each) with the same
seeds, steps and lr schedule: AdamW and Muon through a dense all-reduce every step (DDP's way),
SparseLoCo with a Muon inner optimizer (H=5, top-64 of 64x64 tiles, int2: the 30x tier's pick)
and with AdamW, and DeMo (``cokit demo``'s settings).

1. **Steps to target**, on loopback (:class:`cokit.bench.netbed.Testbed` ``loopback``): each
   method and seed runs ``--steps`` steps. The target is the best dense method's final held-out
   loss (the lower of AdamW's and Muon's seed means); a method's steps to target is its first
   evaluation at or below it (the median over seeds; none unless every seed got there).
2. **Seconds per step on each link** (``--profiles``: the netbed's 10 Mbit, 100 Mbit and
   simulated 50 ms latency): each method runs again (the first seed) in a Testbed with that
   profile, for at most ``--budget-s`` seconds or ``--steps`` steps. These methods are synchronous and deterministic,
   so step ``s`` computes the same numbers on any link; the link only changes how long it takes.
   The run checks that: its held-out losses equal loopback's at every evaluation they share.
   Its seconds per step are the mean of the steps' own times (evaluations left out) over whole
   sync periods after ``--window`` steps.
3. **Time to target on a link**: *measured* where the link run itself reached the target within
   its budget (the sum of its steps' times up to there); *extrapolated* always: steps to target
   times seconds per step. ``cokit plan``'s *predicted* time is steps to target times its
   predicted step on that link, with each method's compute from its loopback step (Muon's dense
   run as DDP with Muon's compute). The 50 ms profile is a simulated latency per collective;
   the planner charges it per hop (an all-reduce of 2 ranks has 2), so it predicts that profile's
   dense methods high.

Each compressed method's speed-up is against the faster of AdamW-DDP and Muon-DDP on the same
link. Writes ``time_to_target.json`` (every run's curves and step times) and
``time_to_target.csv`` (the table) atomically to ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import platform
import statistics
import sys
from typing import Any

from cokit.bench.netbed import PROFILES, Testbed, available
from cokit.bench.resilience import _worker as run_on_link
from cokit.files import OutputError, atomic_write_text, prepare_out_dir
from cokit.model_shapes import named_model
from cokit.plan import Link, Methods, Workload, plan
from cokit.train import MethodSpec
from cokit.workloads import TextWorkloadConfig
from cokit.workloads.model import ModelConfig
from cokit.workloads.text import VOCAB_SIZE, CorpusConfig

OUTPUTS = ("time_to_target.json", "time_to_target.csv")
DENSE = ("adamw", "muon")
METHODS = (*DENSE, "sparseloco-muon", "sparseloco-adamw", "demo")
PLANNED = {
    "adamw": "adamw-ddp",
    "muon": "adamw-ddp",
    "sparseloco-muon": "sparseloco",
    "sparseloco-adamw": "sparseloco",
    "demo": "demo",
}
LINKS = ("10mbit", "100mbit", "latency-50ms-sim")
SYNC_EVERY = 5
UNBOUNDED_S = 1e9  # the loopback runs' time budget: none


def method_specs(args: argparse.Namespace) -> dict[str, MethodSpec]:
    """The methods compared (module docstring), each with its lr from the flags."""
    common: dict[str, Any] = {"schedule": "cosine", "warmup": 0.05, "timeout": args.timeout}
    sparse = {"sync_every": SYNC_EVERY, "topk": 64, "chunk": 64, "payload": "int2"}
    return {
        "adamw": MethodSpec("adamw", args.adamw_lr, label="adamw", **common),
        "muon": MethodSpec("muon", args.muon_lr, label="muon", **common),
        "sparseloco-muon": MethodSpec(
            "sparseloco", args.muon_lr, options={**sparse, "inner": "muon"}, label="sparseloco-muon", **common
        ),
        "sparseloco-adamw": MethodSpec(
            "sparseloco", args.adamw_lr, options=dict(sparse), label="sparseloco-adamw", **common
        ),
        "demo": MethodSpec("demo", args.adamw_lr, options={"payload": "compact"}, label="demo", **common),
    }


def workload_config(args: argparse.Namespace) -> TextWorkloadConfig:
    return TextWorkloadConfig(
        corpus=CorpusConfig(),
        model=ModelConfig.preset(args.model, VOCAB_SIZE),
        batch_size=args.batch_size,
    )


def steps_to_target(record: dict[str, Any], target: float) -> int | None:
    """The first evaluated step (> 0) whose held-out loss is at or below ``target``."""
    return next((e["step"] for e in record["evals"] if e["step"] > 0 and e["heldout_loss"] <= target), None)


def seconds_per_step(record: dict[str, Any], skip: int) -> float:
    """Mean seconds of the steps after ``skip`` (each step's own time: batch, forward, backward,
    exchange, update; evaluations left out), over whole SparseLoCo periods (a sync step is
    slower than a local one)."""
    step_s = record["series"]["step_s"]
    end = skip + (len(step_s) - skip) // SYNC_EVERY * SYNC_EVERY
    if end <= skip:
        raise ValueError(f"a run of {len(step_s)} steps has no whole period after step {skip}")
    return statistics.fmean(step_s[skip:end])


def measured_time(record: dict[str, Any], step: int | None) -> float | None:
    """The run's own time to ``step`` (evaluations left out); None: it did not get that far."""
    step_s = record["series"]["step_s"]
    return sum(step_s[:step]) if step is not None and step <= len(step_s) else None


def same_numbers(loopback: dict[str, Any], link: dict[str, Any]) -> bool:
    """Whether the link run's held-out losses equal loopback's at every step both evaluated."""
    ref = {e["step"]: e["heldout_loss"] for e in loopback["evals"]}
    return all(ref[e["step"]] == e["heldout_loss"] for e in link["evals"] if e["step"] in ref)


def predicted_step_s(
    args: argparse.Namespace, profile: str, compute_ms: dict[str, float]
) -> dict[str, float]:
    """``cokit plan``'s step (s) on ``profile`` for each planned method, from loopback compute."""
    link = PROFILES[profile]
    model = named_model(args.model)
    latency_s = link.latency.mean_ms / 1e3 if link.latency is not None else 0.0
    rate = link.rate_bps if link.rate_bps is not None else 10e9  # loopback: fast
    out = {}
    for method, name in PLANNED.items():
        if method not in compute_ms:
            continue
        result = plan(
            model,
            2,
            Workload(args.batch_size, args.batch_size * 1000, compute_ms={name: compute_ms[method]}),
            Link(rate, latency_s, burst_bytes=link.burst_bytes),
            methods=Methods(sync_every=SYNC_EVERY),
            which=(name,),
        )
        out[method] = result.rows[0]["step_ms"] / 1e3
    return out


def summarize(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (profile, method): steps to target, step time, the three times to target and
    the speed-up against the faster dense method on that link (seed medians)."""
    loop = report["loopback"]
    rows = []
    for profile, per_method in report["links"].items():
        times: dict[str, float | None] = {}
        for method, link in per_method.items():
            steps = [steps_to_target(r, report["target"]) for r in loop[method].values()]
            reached = [s for s in steps if s is not None]
            step = statistics.median(reached) if len(reached) == len(steps) else None
            step_s = seconds_per_step(link["record"], report["settings"]["window"])
            extrapolated = step * step_s if step is not None else None
            times[method] = extrapolated
            predicted = report["predicted"][profile].get(method)
            seed = report["settings"]["seeds"][0]  # the link runs' seed
            measured = measured_time(link["record"], steps_to_target(loop[method][seed], report["target"]))
            rows.append(
                {
                    "profile": profile,
                    "method": method,
                    "steps_to_target": step,
                    "seeds_reached": f"{len(reached)}/{len(steps)}",
                    "seconds_per_step": step_s,
                    "measured_s": measured,
                    "extrapolated_s": extrapolated,
                    "predicted_s": predicted * step if (predicted is not None and step is not None) else None,
                    "same_numbers_as_loopback": link["same_numbers"],
                    "bytes_per_step": link["record"]["summary"]["bytes_per_step"],
                }
            )
        dense = [t for m in DENSE if (t := times.get(m)) is not None]
        best = min(dense) if dense else None
        for row in rows:
            if row["profile"] == profile:
                t = row["extrapolated_s"]
                row["speedup_vs_best_dense"] = best / t if (best is not None and t) else None
    return rows


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| link | method | steps to target | seeds | s/step | measured s | extrapolated s | plan s "
        "| vs faster dense | bytes/step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['profile']} | {r['method']} | {_fmt(r['steps_to_target'], '.0f')} | {r['seeds_reached']} "
            f"| {r['seconds_per_step']:.3f} | {_fmt(r['measured_s'], '.1f')} | {_fmt(r['extrapolated_s'], '.1f')} "
            f"| {_fmt(r['predicted_s'], '.1f')} | {_fmt(r['speedup_vs_best_dense'], '.2f')}x "
            f"| {r['bytes_per_step']:,.0f} |"
        )
    return "\n".join(lines)


def _csv(rows: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]) if rows else [])
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def _run(
    profile: str, spec: MethodSpec, args: argparse.Namespace, seed: int, budget_s: float
) -> dict[str, Any]:
    with Testbed(profile, world_size=2) as bed:
        (record, *_) = bed.spawn(
            run_on_link,
            spec,
            workload_config(args),
            args.steps,
            seed,
            args.eval_every,
            budget_s,
            0.0,
            timeout=budget_s + 1800 if budget_s < UNBOUNDED_S else 7200,
            env={"TRITON_INTERPRET": None},
        )
    return record


def run(args: argparse.Namespace) -> int:
    out = prepare_out_dir(args.out, OUTPUTS, overwrite=args.overwrite)
    if any(PROFILES[p].namespaces for p in args.profiles):
        ok, why = available()
        if not ok:
            raise SystemExit(f"time_to_target: the shaped profiles need network namespaces: {why}")
    specs = {m: s for m, s in method_specs(args).items() if m in args.methods}
    load = os.getloadavg()
    loop: dict[str, dict[int, dict[str, Any]]] = {}
    for seed in args.seeds:  # methods interleaved within a seed: a load change hits them alike
        for method, spec in specs.items():
            print(f"loopback: {method} seed {seed} ({args.steps} steps) ...", flush=True)
            loop.setdefault(method, {})[seed] = _run("loopback", spec, args, seed, UNBOUNDED_S)
    dense = [m for m in DENSE if m in loop]
    if not dense:
        raise SystemExit("time_to_target: give at least one dense method (adamw, muon): it sets the target")
    best = min(
        dense, key=lambda m: statistics.fmean(r["summary"]["final_heldout_loss"] for r in loop[m].values())
    )
    target = statistics.fmean(r["summary"]["final_heldout_loss"] for r in loop[best].values())
    compute_ms = {m: 1e3 * seconds_per_step(loop[m][args.seeds[0]], args.window) for m in loop}
    links: dict[str, dict[str, Any]] = {}
    for profile in args.profiles:
        for method, spec in specs.items():
            print(f"{profile}: {method} (at most {args.budget_s:g} s) ...", flush=True)
            record = _run(profile, spec, args, args.seeds[0], args.budget_s)
            links.setdefault(profile, {})[method] = {
                "record": record,
                "same_numbers": same_numbers(loop[method][args.seeds[0]], record),
            }
    report: dict[str, Any] = {
        "command": " ".join(["python -m cokit.bench.time_to_target", *sys.argv[1:]]),
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "overwrite")},
        "machine": {"platform": platform.platform(), "load_before": load, "load_after": os.getloadavg()},
        "best_dense": best,
        "target": target,
        "loopback": loop,
        "links": links,
        "predicted": {p: predicted_step_s(args, p, compute_ms) for p in args.profiles},
    }
    rows = summarize(report)
    report["rows"] = rows
    print(markdown(rows))
    atomic_write_text(out / "time_to_target.json", json.dumps(report, indent=1, default=str) + "\n")
    atomic_write_text(out / "time_to_target.csv", _csv(rows))
    print(f"wrote {out}/time_to_target.json and .csv")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    ap.add_argument("--profiles", nargs="+", choices=sorted(PROFILES), default=list(LINKS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=600, help="steps of every run (the lr schedule's length)")
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--window", type=int, default=20, help="steps before the step time is measured")
    ap.add_argument("--budget-s", type=float, default=120.0, help="the most a link run trains (s)")
    ap.add_argument("--model", default="tiny", help="cokit.workloads.model.MODEL_PRESETS")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--adamw-lr", type=float, default=3e-3, help="AdamW's lr (SparseLoCo's and DeMo's too)")
    ap.add_argument("--muon-lr", type=float, default=0.02, help="Muon's lr (SparseLoCo-Muon's inner too)")
    ap.add_argument("--timeout", type=float, default=600.0, help="each collective's timeout (s)")
    ap.add_argument("--out", default="benchmarks/results/time_to_target")
    ap.add_argument("--overwrite", action="store_true")
    args = ap.parse_args(argv)
    if args.steps < 2 * SYNC_EVERY or args.eval_every < 1 or not 0 <= args.window < args.steps:
        ap.error(f"--steps must be >= {2 * SYNC_EVERY}, --eval-every >= 1 and 0 <= --window < --steps")
    if args.budget_s <= 0 or args.timeout <= 0:
        ap.error("--budget-s and --timeout must be > 0")
    try:
        return run(args)
    except OutputError as exc:
        ap.error(str(exc))
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
