"""Resilience benchmark: each network policy against the static settings it adapts, on shaped links.

AdamW (dense), DeMo static vs DeMo with :class:`~cokit.compress.BandwidthTargetPolicy`, and
SparseLoCo static vs SparseLoCo with :class:`~cokit.compress.IntervalPolicy` and with the
overlapped sync (``sparseloco-eager``: ``sync="eager"``, judged like a policy against static).

    python benchmarks/resilience.py                        # every profile and method, 3 seeds: about 95 min
    python benchmarks/resilience.py --profiles 10mbit-drops --methods demo-adaptive,sparseloco-interval
    cokit bench resilience --quick                         # the same module

Each run trains the demo workload (``cokit demo``'s char transformer on the stdlib corpus) on
2 gloo ranks inside a :class:`cokit.bench.netbed.Testbed` with one link profile (loopback; tc tbf
100 Mbit, 10 Mbit, 10 Mbit with tail drops; a *simulated* 50 ± 20 ms latency; a 5 s link-down)
for ``--budget-s`` seconds of wall time, and ``--overrun`` (25%) past it. The target of a
(profile, seed) is the held-out loss that the method's static baseline (:data:`BASELINE`:
DeMo's for AdamW and adaptive DeMo, SparseLoCo's for its interval policy) reached at its last
evaluation within the budget; each method's *time to target* is the wall time (evaluations
included) at its first evaluation at or below it (the overrun lets a method that is 1%
slower than static say so, instead of never reaching a target static set at its last step).
An adaptive method meets the target on a profile when its median time is at most the
static one's, and at most :data:`SLOW_RATIO` of it on the slow and lossy profiles
(:data:`SLOW_PROFILES`); times are known at evaluations only, so a median within one
evaluation interval of the goal is reported as such. ``exposed share`` is the part of the
static run's wall time its collectives left exposed: a policy that only hides communication,
at the static settings' quality per step, takes at most that off (the verdict's ``bound``,
``1 - exposed share``). Profiles that need network namespaces are skipped, with the reason,
where they are not permitted.

Writes ``resilience.json`` (every run: curves, bytes, policy decisions, link counters),
``resilience.csv`` (the summary table) and ``resilience.png`` (held-out loss vs wall time per
profile) to ``--out``, and prints the table (markdown).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import json
import math
import os
import platform
import statistics
import sys
import textwrap
import time
from typing import Any

import torch

from cokit.bench.netbed import PROFILES, Testbed, apply_simulated_latency, available, training_started
from cokit.compress.comm import Communicator
from cokit.files import OutputError, atomic_savefig, atomic_write_text, prepare_out_dir
from cokit.train import Method, MethodSpec, run_method
from cokit.workloads import TextWorkload, TextWorkloadConfig
from cokit.workloads.model import ModelConfig
from cokit.workloads.text import VOCAB_SIZE, CorpusConfig

OUTPUTS = ("resilience.json", "resilience.csv", "resilience.png")
METHODS = (
    "adamw",
    "demo-static",
    "demo-adaptive",
    "sparseloco-static",
    "sparseloco-interval",
    "sparseloco-eager",
)
BASELINE = {
    "adamw": "demo-static",
    "demo-static": "demo-static",
    "demo-adaptive": "demo-static",
    "sparseloco-static": "sparseloco-static",
    "sparseloco-interval": "sparseloco-static",
    "sparseloco-eager": "sparseloco-static",
}
ADAPTIVE = ("demo-adaptive", "sparseloco-interval", "sparseloco-eager")
SLOW_PROFILES, SLOW_RATIO = ("10mbit", "10mbit-drops", "latency-50ms-sim"), 0.7


def method_specs(
    lr: float,
    topk: int,
    chunk: int,
    target: float,
    timeout_s: float,
    sign_first: bool = False,
    sparseloco_lr: float = 1e-3,
) -> dict[str, MethodSpec]:
    """The methods compared. DeMo's settings are ``cokit demo``'s defaults, and the adaptive
    one's ladder tries the sign payload at full k first with ``sign_first``; SparseLoCo's are
    the library's defaults with the inner lr ``sparseloco_lr``."""
    policy: dict[str, object] = {"name": "bandwidth", "target": target}
    if sign_first:
        policy["sign_first"] = True
    demo = {
        "compression_topk": topk,
        "compression_chunk": chunk,
        "compression_decay": 0.999,
        "payload": "compact",
    }
    return {
        "adamw": MethodSpec("adamw", lr, label="adamw", timeout=timeout_s),
        "demo-static": MethodSpec("demo", lr, options=demo, label="demo-static", timeout=timeout_s),
        "demo-adaptive": MethodSpec(
            "demo",
            lr,
            options={**demo, "policy": policy},
            label="demo-adaptive",
            timeout=timeout_s,
        ),
        "sparseloco-static": MethodSpec(
            "sparseloco", sparseloco_lr, label="sparseloco-static", timeout=timeout_s
        ),
        "sparseloco-interval": MethodSpec(
            "sparseloco",
            sparseloco_lr,
            options={"policy": {"name": "interval", "target": target}},
            label="sparseloco-interval",
            timeout=timeout_s,
        ),
        "sparseloco-eager": MethodSpec(
            "sparseloco",
            sparseloco_lr,
            options={"sync": "eager"},
            label="sparseloco-eager",
            timeout=timeout_s,
        ),
    }


def _worker(
    rank: int,
    world: int,
    spec: MethodSpec,
    cfg: TextWorkloadConfig,
    max_steps: int,
    seed: int,
    eval_every: int,
    budget_s: float,
    overrun: float,
) -> dict[str, Any]:
    """One rank of one run: train for ``budget_s * (1 + overrun)`` seconds (the target is
    taken at ``budget_s``; the rest tells a method slightly slower than static from one that
    never gets there); rank 0 returns the record."""
    torch.set_num_threads(1)  # two ranks share two cores
    workload = cfg.build("cpu")
    built: list[Method] = []

    def start(method: Method) -> None:
        built.append(method)
        holder = (
            method.optimizer if isinstance(getattr(method.optimizer, "comm", None), Communicator) else method
        )
        apply_simulated_latency(holder)  # no-op unless the profile simulates latency
        training_started()  # starts a partition's clock

    result = run_method(
        spec,
        workload,
        max_steps,
        seed,
        eval_every=eval_every,
        time_budget_s=budget_s * (1 + overrun),
        on_start=start,
    )
    record = result.to_dict()
    record["budget_s"] = budget_s
    opt = built[0].optimizer
    comm = getattr(opt, "comm", None) or getattr(built[0], "comm", None)
    record["policy_log"] = getattr(opt, "policy_log", [])
    record["skipped_syncs"] = getattr(opt, "skipped_syncs", 0)
    record["simulated_delay_s"] = getattr(comm, "added_s", 0.0)
    stats = getattr(opt, "comm_stats", None)  # AdamW's all-reduce hook: exposed time not measured
    record["exposed_s"] = stats.total_exposed_s if stats is not None else None
    return record


def time_to_target(record: dict[str, Any], target: float) -> float | None:
    """Wall time at the first evaluation at or below ``target`` (None: never reached)."""
    wall = record["series"]["wall_s"]
    for e in record["evals"]:
        if e["step"] > 0 and e["heldout_loss"] <= target:
            return wall[e["step"] - 1]
    return None


def static_target(record: dict[str, Any]) -> float:
    """A static run's target: its held-out loss at its last evaluation within the budget
    (``record["budget_s"]``; the whole run for records without one)."""
    budget = record.get("budget_s", math.inf)
    wall = record["series"]["wall_s"]
    inside = [e for e in record["evals"] if e["step"] == 0 or wall[e["step"] - 1] <= budget]
    return inside[-1]["heldout_loss"] if inside else record["summary"]["final_heldout_loss"]


def resolution(record: dict[str, Any], at_s: float) -> float:
    """The wall time between the two evaluations around ``at_s`` (the last two when it is the
    end): what a time to target can be told apart by, in seconds."""
    wall = record["series"]["wall_s"]
    times = [wall[e["step"] - 1] for e in record["evals"] if e["step"] > 0]
    after = next((i for i, t in enumerate(times) if t >= at_s), len(times) - 1)
    return times[after] - times[after - 1] if after > 0 else times[0]


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (profile, method): medians over seeds and the ratio to the method's static
    baseline (:data:`BASELINE`), per seed."""
    by_key: dict[tuple[str, int], dict[str, dict]] = {}
    for r in runs:
        by_key.setdefault((r["profile"], r["seed"]), {})[r["method"]] = r
    for methods in by_key.values():
        for name, rec in methods.items():
            static = methods.get(BASELINE[name])
            target = static_target(static) if static else math.nan
            base = time_to_target(static, target) if static else None
            rec["target_loss"] = target
            rec["time_to_target_s"] = time_to_target(rec, target) if static else None
            t = rec["time_to_target_s"]
            rec["ratio_to_static"] = t / base if (t is not None and base) else None
            rec["resolution"] = resolution(static, base) / base if (static and base) else None
    rows = []
    profiles = list(dict.fromkeys(r["profile"] for r in runs))
    for profile in profiles:
        for method in METHODS:
            recs = [r for r in runs if r["profile"] == profile and r["method"] == method]
            if not recs:
                continue
            ratios = [r["ratio_to_static"] for r in recs if r["ratio_to_static"] is not None]
            reached = [r["time_to_target_s"] for r in recs if r["time_to_target_s"] is not None]
            shares = [
                r["exposed_s"] / r["summary"]["total_time_s"]
                for r in recs
                if r.get("exposed_s") is not None and r["summary"]["total_time_s"] > 0
            ]
            rows.append(
                {
                    "profile": profile,
                    "method": method,
                    "baseline": BASELINE[method],
                    "seeds": len(recs),
                    "reached": len(reached),
                    "time_to_target_s": statistics.median(reached) if reached else None,
                    "ratio_median": statistics.median(ratios) if len(ratios) == len(recs) else None,
                    "ratio_min": min(ratios) if ratios else None,
                    "ratio_max": max(ratios) if ratios else None,
                    "total_s": statistics.median(r["summary"]["total_time_s"] for r in recs),
                    "steps": statistics.median(r["summary"]["steps"] for r in recs),
                    "final_heldout": statistics.median(r["summary"]["final_heldout_loss"] for r in recs),
                    "bytes_per_step": statistics.median(r["summary"]["bytes_per_step"] for r in recs),
                    "exposed_share": statistics.median(shares) if shares else None,
                    "resolution": max((r["resolution"] for r in recs if r.get("resolution")), default=None),
                    "skipped_syncs": sum(r["skipped_syncs"] for r in recs),
                    "decisions": statistics.median(len(r["policy_log"]) for r in recs),
                }
            )
    return rows


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The summary as a markdown table (the one in docs/benchmarks.md)."""
    lines = [
        "| profile | method | reached target | time to target (s) | vs static: median [min, max] | "
        "total (s) | steps | final held-out | bytes/step | exposed share |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = (
            f"{_fmt(r['ratio_median'], '.2f')}x [{_fmt(r['ratio_min'], '.2f')}, {_fmt(r['ratio_max'], '.2f')}]"
            if r["ratio_min"] is not None
            else "-"
        )
        lines.append(
            f"| {r['profile']} | {r['method']} | {r['reached']}/{r['seeds']} | "
            f"{_fmt(r['time_to_target_s'], '.1f')} | {ratio} | {_fmt(r['total_s'], '.1f')} | "
            f"{_fmt(r['steps'], '.0f')} | {_fmt(r['final_heldout'], '.3f')} | {_fmt(r['bytes_per_step'], ',.0f')} | "
            f"{_fmt(r.get('exposed_share'), '.0%')} |"
        )
    return "\n".join(lines)


def verdicts(rows: list[dict[str, Any]]) -> list[str]:
    """One line per adaptive method and profile: its target (no later than its static
    baseline; at most :data:`SLOW_RATIO` of its time on :data:`SLOW_PROFILES`), met or missed
    by how much, and the bound the static run's exposed share puts on any policy. Times are
    only known at evaluations: a median within one evaluation interval of the goal says so."""
    lines = []
    for row in rows:
        if row["method"] not in ADAPTIVE:
            continue
        static = next(
            (r for r in rows if r["profile"] == row["profile"] and r["method"] == row["baseline"]), None
        )
        goal = SLOW_RATIO if row["profile"] in SLOW_PROFILES else 1.0
        share = static.get("exposed_share") if static else None
        bound = f"; bound {1 - share:.2f}x (static exposed {share:.0%})" if share is not None else ""
        spread = (
            f"[{_fmt(row['ratio_min'], '.2f')}, {_fmt(row['ratio_max'], '.2f')}] over {row['seeds']} seed(s)"
        )
        head = f"{row['profile']}: {row['method']} vs {row['baseline']}, target <= {goal:g}x"
        if row["ratio_median"] is None:
            lines.append(
                f"{head}: MISSED, reached the target loss in {row['reached']}/{row['seeds']} runs{bound}"
            )
            continue
        ratio, res = row["ratio_median"], row["resolution"] or 0.0
        if ratio <= goal:
            met = "met"
        elif ratio <= goal + res:  # the times differ by less than one evaluation interval
            met = f"met within one evaluation interval ({res:.2f}x)"
        else:
            met = f"MISSED by {ratio - goal:.2f}x"
        lines.append(f"{head}: {met}, median {ratio:.2f}x, spread {spread}{bound}")
    return lines


def plot(runs: list[dict[str, Any]], path: str) -> None:
    """Held-out loss vs wall time, one panel per profile (the first seed of each); dotted: each
    static baseline's target, in its colour."""
    from cokit.display import pyplot

    plt = pyplot()
    profiles = list(dict.fromkeys(r["profile"] for r in runs))
    cols = min(3, len(profiles))
    rows = math.ceil(len(profiles) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.8 * rows), squeeze=False)
    colors = {
        "adamw": "black",
        "demo-static": "tab:blue",
        "demo-adaptive": "tab:orange",
        "sparseloco-static": "tab:green",
        "sparseloco-interval": "tab:red",
        "sparseloco-eager": "tab:purple",
    }
    for ax, profile in zip(axes.flat, profiles, strict=True):
        recs = [r for r in runs if r["profile"] == profile]
        seed = min(r["seed"] for r in recs)
        for r in recs:
            if r["seed"] != seed:
                continue
            wall = [0.0] + r["series"]["wall_s"]
            xs = [wall[e["step"]] for e in r["evals"]]
            ys = [e["heldout_loss"] for e in r["evals"]]
            ax.plot(xs, ys, color=colors.get(r["method"]), label=r["method"], lw=1.5)
        for baseline in dict.fromkeys(BASELINE[r["method"]] for r in recs):  # each baseline's target
            target = next(
                (r["target_loss"] for r in recs if r["seed"] == seed and r["method"] == baseline), None
            )
            if target is not None and math.isfinite(target):
                ax.axhline(target, color=colors.get(baseline), ls=":", lw=1)
        ax.set_title(textwrap.fill(PROFILES[profile].describe(), 70), fontsize=7)
        ax.set_xlabel("wall time (s)")
        ax.set_ylabel("held-out loss")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(profiles) :]:
        ax.set_visible(False)
    fig.tight_layout()
    atomic_savefig(fig, path, dpi=120)
    plt.close(fig)


def _csv(rows: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]) if rows else ["profile"])
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmark's options (also ``cokit bench resilience``'s)."""
    p.add_argument(
        "--profiles", default=",".join(PROFILES), help=f"comma-separated subset of {', '.join(PROFILES)}"
    )
    p.add_argument(
        "--methods", default=",".join(METHODS), help=f"comma-separated subset of {', '.join(METHODS)}"
    )
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds for every profile (default 0,1,2)")
    p.add_argument("--budget-s", type=float, default=60.0, help="wall-time budget of each run (default 60)")
    p.add_argument(
        "--overrun",
        type=float,
        default=0.25,
        help="each run goes on for this share of the budget past it, so that a method a little "
        "slower than static still reaches static's loss at the budget (default 0.25)",
    )
    p.add_argument(
        "--max-steps", type=int, default=100_000, help="step cap of each run (default: the budget decides)"
    )
    p.add_argument(
        "--eval-every", type=int, default=10, help="held-out evaluation every N steps (default 10)"
    )
    p.add_argument("--model", default="tiny", help="model preset of the demo workload (default tiny)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per rank per step (default 16)")
    p.add_argument("--max-chars", type=int, default=500_000, help="corpus characters (default 500000)")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate of every method (default 1e-3)")
    p.add_argument("--topk", type=int, default=32, help="DeMo coefficients per tile (default 32)")
    p.add_argument("--chunk", type=int, default=64, help="DeMo tile side (default 64)")
    p.add_argument(
        "--sparseloco-lr",
        type=float,
        default=1e-3,
        help="SparseLoCo's inner lr (default 1e-3, `cokit demo`'s on this workload)",
    )
    p.add_argument(
        "--policy-target",
        type=float,
        default=0.2,
        help="the adaptive methods keep exposed communication under this fraction of the step (default 0.2)",
    )
    p.add_argument(
        "--policy-sign-first",
        action="store_true",
        help="adaptive DeMo switches to the sign payload at full k before halving k",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="collective timeout of every method in seconds (default 120)",
    )
    p.add_argument("--quick", action="store_true", help="20 s budgets, seed 0 only (a smoke run, no spread)")
    p.add_argument("--out", default=os.path.join("benchmarks", "out", "resilience"), help="output folder")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier run's results in --out")


def _ints(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"{flag} must be comma-separated integers, got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Run the benchmark for parsed options; returns the exit status."""
    if args.quick:
        args.budget_s, args.seeds = 20.0, "0"
    profiles = [x for x in args.profiles.split(",") if x]
    methods = [x for x in args.methods.split(",") if x]
    for name, known, flag in ((profiles, PROFILES, "--profiles"), (methods, METHODS, "--methods")):
        unknown = [x for x in name if x not in known]
        if unknown:
            raise SystemExit(f"{flag}: unknown {unknown}; choose from {', '.join(known)}")
    if not (math.isfinite(args.budget_s) and args.budget_s > 0):
        raise SystemExit(f"--budget-s must be a positive number of seconds, got {args.budget_s}")
    if not (math.isfinite(args.overrun) and 0 <= args.overrun <= 4):
        raise SystemExit(f"--overrun must be a share of the budget from 0 to 4, got {args.overrun}")
    seeds = _ints(args.seeds, "--seeds")
    try:
        out = prepare_out_dir(args.out, OUTPUTS, overwrite=args.overwrite)
    except OutputError as exc:
        raise SystemExit(str(exc)) from None
    try:
        model = ModelConfig.preset(args.model, VOCAB_SIZE)
        cfg = TextWorkloadConfig(CorpusConfig(max_chars=args.max_chars), model, batch_size=args.batch_size)
        n_params = TextWorkload(cfg).build_model(0).num_params()
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    specs = method_specs(
        args.lr,
        args.topk,
        args.chunk,
        args.policy_target,
        args.timeout,
        args.policy_sign_first,
        args.sparseloco_lr,
    )
    ok, why = available()
    runs: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    baselines = list(dict.fromkeys(BASELINE[m] for m in methods))  # a static run sets each target
    order = [*baselines, *[m for m in methods if m not in baselines]]
    plan = [(p, s, m) for p in profiles for s in seeds for m in order]
    print(
        f"resilience: {len(plan)} runs of {args.budget_s:g} s (+{args.overrun:.0%}); {args.model} model, {n_params:,} parameters, "
        f"2 ranks (gloo, CPU)",
        flush=True,
    )
    started = time.perf_counter()
    for i, (profile, seed, method) in enumerate(plan, 1):
        link = PROFILES[profile]
        if link.namespaces and not ok:
            skipped[profile] = why
            continue
        print(f"[{i}/{len(plan)}] {profile} seed {seed} {method} ...", flush=True)
        with Testbed(link, world_size=2) as bed:
            record = bed.spawn(
                _worker,
                specs[method],
                cfg,
                args.max_steps,
                seed,
                args.eval_every,
                args.budget_s,
                args.overrun,
                timeout=args.budget_s * (1 + args.overrun) * 4 + 300,
                env={"TRITON_INTERPRET": None},
            )[0]
            record.update(
                profile=profile,
                method=method,
                link=link.describe(),
                link_stats=bed.stats,
                partitions=bed.partitions,
            )
        s = record["summary"]
        print(
            f"    {s['steps']} steps, held-out {s['final_heldout_loss']:.3f}, {s['bytes_per_step']:,.0f} B/step, "
            f"{len(record['policy_log'])} decision(s), {time.perf_counter() - started:.0f} s so far",
            flush=True,
        )
        runs.append(record)
    for profile, reason in skipped.items():
        print(f"skipped {profile}: {reason}", flush=True)
    rows = summarize(runs)
    table = markdown_table(rows)
    judged = verdicts(rows)
    report = {
        "benchmark": "resilience",
        "command": " ".join(sys.argv),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
        "gpu": "not measured on a GPU: CPU ranks, gloo",
        "settings": {k: v for k, v in vars(args).items()},
        "workload": {
            "model": dataclasses.asdict(model),
            "num_params": n_params,
            "batch_size": args.batch_size,
        },
        "profiles": {p: PROFILES[p].describe() for p in profiles},
        "skipped": skipped,
        "summary": rows,
        "verdicts": judged,
        "runs": runs,
    }
    atomic_write_text(out / "resilience.json", json.dumps(report, indent=1, default=str))
    atomic_write_text(out / "resilience.csv", _csv(rows))
    if runs:
        plot(runs, str(out / "resilience.png"))
    print(table)
    for line in judged:
        print(line)
    print(f"wrote {out}/resilience.json, .csv, .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
