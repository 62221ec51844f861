"""``cokit plan`` against measured step times on real rate-limited links.

    python -m cokit.bench.plan_validation                       # ~5 min on 2 CPU cores, needs root
    python -m cokit.bench.plan_validation --profiles 10mbit --steps 6 --out /tmp/pv

AdamW with DDP, DeMo and SparseLoCo (their defaults; SparseLoCo syncs every ``--sync-every``
steps) train the demo's ``tiny`` char transformer on 2 gloo ranks (1 thread each) inside a
:class:`cokit.bench.netbed.Testbed`, one link profile at a time. Each run times ``--steps`` steps
after ``--warmup`` (a whole number of SparseLoCo periods) between two barriers.

Compute is calibrated once: each method's step time on loopback is its ``compute_ms`` (what a
user measures on one fast machine). For every shaped profile ``cokit.plan.plan`` then predicts
the step from the link alone (``tc tbf`` rate, burst and TCP's efficiency), and the table gives
predicted, measured and the error. Profiles: 100mbit, 10mbit (the netbed's) and 30mbit, 3mbit
(the same shaper); 10mbit-drops (a queue so short that TCP loses ~20% of its packets) is
reported too, as the case the model does not cover: losses are not in it.

Writes ``plan_validation.json`` and ``plan_validation.md`` atomically to ``--out`` (default
benchmarks/results/plan_validation) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from cokit.bench.netbed import PROFILES, LinkProfile, Testbed, available
from cokit.files import OutputError, atomic_write_text, prepare_out_dir
from cokit.model_shapes import Model
from cokit.plan import Link, Methods, Workload, plan

OUTPUTS = ("plan_validation.json", "plan_validation.md")
DEFAULT_OUT = "benchmarks/results/plan_validation"
METHODS = ("adamw-ddp", "demo", "sparseloco")
EXTRA = {
    "30mbit": LinkProfile("30mbit", rate="30mbit", burst_bytes=100_000, limit_bytes=1_000_000),
    "3mbit": LinkProfile("3mbit", rate="3mbit"),
}
SHAPED = ("100mbit", "30mbit", "10mbit", "3mbit", "10mbit-drops")
TARGET = 0.20  # |predicted - measured| / measured


def profile(name: str) -> LinkProfile:
    return EXTRA[name] if name in EXTRA else PROFILES[name]


def _model(preset: str):
    from cokit.workloads.model import CharTransformer, ModelConfig
    from cokit.workloads.text import VOCAB_SIZE

    return CharTransformer(ModelConfig.preset(preset, VOCAB_SIZE))


def _optimizer(method: str, model: torch.nn.Module, sync_every: int):
    from cokit.compress import DeMo, SparseLoCo

    if method == "adamw-ddp":
        return torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    if method == "demo":
        return DeMo(model.parameters(), lr=1e-3, timeout=600)
    return SparseLoCo(
        model.parameters(),
        lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
        sync_every=sync_every,
        timeout=600,
    )


def _worker(
    rank: int,
    world: int,
    method: str,
    preset: str,
    batch: int,
    seq: int,
    warmup: int,
    steps: int,
    sync_every: int,
) -> dict[str, Any]:
    """One method on this rank: seconds per step over ``steps`` timed steps after ``warmup``."""
    torch.set_num_threads(1)  # two ranks share two cores
    torch.manual_seed(0)
    model = _model(preset)
    opt = _optimizer(method, model, sync_every)
    net = torch.nn.parallel.DistributedDataParallel(model) if method == "adamw-ddp" else model
    gen = torch.Generator().manual_seed(rank)
    vocab = model.tok_emb.num_embeddings

    def step() -> None:
        x = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
        logits = net(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()

    for _ in range(warmup):
        step()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    stats = getattr(opt, "comm_stats", None)
    return {
        "step_s": (time.perf_counter() - start) / steps,
        "sent_per_step": None if stats is None else stats.total_sent_bytes / stats.steps,
    }


def measure(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One Testbed with profile ``name``, one run per method: its measured step (slowest
    rank), the bytes its optimizer counted, and the bytes the shaped links carried."""
    link = profile(name)
    out: dict[str, Any] = {"profile": name, "describe": link.describe(), "methods": {}}
    with Testbed(link, world_size=2) as bed:
        for method in METHODS:
            before = bed.link_stats()
            per_rank = bed.spawn(
                _worker,
                method,
                args.model,
                args.batch,
                args.seq_len,
                args.warmup,
                args.steps,
                args.sync_every,
                timeout=1800,
                env={"TRITON_INTERPRET": None},
            )
            after = bed.link_stats()
            wire = sum(v["bytes"] - before.get(k, {"bytes": 0})["bytes"] for k, v in after.items())
            drops = sum(v["drops"] - before.get(k, {"drops": 0})["drops"] for k, v in after.items())
            out["methods"][method] = {
                "measured_ms": 1e3 * max(r["step_s"] for r in per_rank),
                "sent_per_step": per_rank[0]["sent_per_step"],
                # what the two ranks' link ends sent (frames, setup included): per rank and step
                "wire_per_step": wire / 2 / (args.warmup + args.steps) if after else None,
                "drops": drops,
            }
    return out


def predict(
    model: Model, compute_ms: dict[str, float], name: str, args: argparse.Namespace
) -> dict[str, dict[str, Any]]:
    """The planner's rows for profile ``name`` (compute from the loopback calibration)."""
    link = profile(name)
    assert link.rate_bps is not None
    result = plan(
        model,
        2,
        Workload(args.batch, args.batch * 2 * 1000, compute_ms=compute_ms),
        Link(link.rate_bps, 0.0, burst_bytes=link.burst_bytes),
        methods=Methods(sync_every=args.sync_every),
        which=METHODS,
    )
    return {r["method"]: r for r in result.rows}


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"Predicted (`cokit plan`, compute calibrated on loopback) against measured step time, "
        f"{report['model']['params'] / 1e6:.2f}M-parameter char transformer, 2 gloo ranks, "
        f"batch {report['settings']['batch']}x{report['settings']['seq_len']}, "
        f"{report['settings']['steps']} timed steps; {report['machine']}.",
        "",
        "| link | method | MB/step | predicted ms | measured ms | error |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for row in report["rows"]:
        lines.append(
            f"| {row['profile']} | {row['method']} | {row['sent_bytes'] / 1e6:.3g} | {row['predicted_ms']:.4g} "
            f"| {row['measured_ms']:.4g} | {row['error'] * 100:+.1f}% |"
        )
    lines += ["", report["verdict"]]
    return "\n".join(lines) + "\n"


def verdict(rows: list[dict[str, Any]]) -> str:
    """Which clean profiles have every method within the target, and the worst miss."""
    clean = sorted({r["profile"] for r in rows if r["profile"] != "10mbit-drops"})
    within = [p for p in clean if all(abs(r["error"]) <= TARGET for r in rows if r["profile"] == p)]
    worst = max((r for r in rows if r["profile"] in clean), key=lambda r: abs(r["error"]), default=None)
    text = (
        f"Within {TARGET:.0%} for every method on {len(within)} of {len(clean)} loss-free profiles "
        f"({', '.join(within) or 'none'})."
    )
    if worst is not None:
        text += f" Largest error there: {worst['error'] * 100:+.1f}% ({worst['profile']}, {worst['method']})."
    return text


def run(args: argparse.Namespace) -> int:
    ok, why = available()
    if not ok:
        print(f"plan_validation: cannot shape links here: {why}", file=sys.stderr)
        return 2
    try:
        out = prepare_out_dir(args.out, OUTPUTS, overwrite=args.overwrite)
    except OutputError as exc:
        print(f"plan_validation: error: {exc}", file=sys.stderr)
        return 2
    module = _model(args.model)
    model = Model(
        args.model,
        f"the demo's {args.model!r} char transformer",
        tuple(tuple(p.shape) for p in module.parameters()),
    )
    print(f"plan_validation: calibrating compute on loopback ({model.params:,} parameters)", flush=True)
    calib = measure("loopback", args)
    compute_ms = {m: calib["methods"][m]["measured_ms"] for m in METHODS}
    print("  compute ms: " + ", ".join(f"{m} {v:.1f}" for m, v in compute_ms.items()), flush=True)
    rows, runs = [], [calib]
    for name in args.profiles:
        print(f"plan_validation: {name} ...", flush=True)
        got = measure(name, args)
        runs.append(got)
        predicted = predict(model, compute_ms, name, args)
        for m in METHODS:
            p, measured = predicted[m], got["methods"][m]["measured_ms"]
            rows.append(
                {
                    "profile": name,
                    "method": m,
                    "sent_bytes": p["sent_bytes"],
                    "measured_sent_bytes": got["methods"][m]["sent_per_step"],
                    "wire_bytes": got["methods"][m]["wire_per_step"],
                    "drops": got["methods"][m]["drops"],
                    "predicted_ms": p["step_ms"],
                    "measured_ms": measured,
                    "error": (p["step_ms"] - measured) / measured,
                }
            )
            print(f"  {m}: predicted {p['step_ms']:.1f} ms, measured {measured:.1f} ms", flush=True)
    report = {
        "model": {"name": model.name, "params": model.params},
        "settings": {k: getattr(args, k) for k in ("batch", "seq_len", "warmup", "steps", "sync_every")},
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads/process -> 1, torch {torch.__version__}",
        "calibration": compute_ms,
        "runs": runs,
        "rows": rows,
        "median_abs_error": statistics.median(abs(r["error"]) for r in rows) if rows else None,
    }
    report["verdict"] = verdict(rows)
    text = markdown(report)
    print(text)
    atomic_write_text(out / OUTPUTS[0], json.dumps(report, indent=2) + "\n")
    atomic_write_text(out / OUTPUTS[1], text)
    print(f"wrote {out / OUTPUTS[0]} and {out / OUTPUTS[1]}")
    return 0


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profiles", nargs="+", default=list(SHAPED), choices=SHAPED, help="shaped links")
    ap.add_argument("--model", default="tiny", help="the demo's model preset (default tiny)")
    ap.add_argument("--batch", type=_positive, default=16, help="sequences per rank per step (16)")
    ap.add_argument("--seq-len", type=_positive, default=64, help="tokens per sequence (64)")
    ap.add_argument("--sync-every", type=_positive, default=5, help="SparseLoCo's period (5)")
    ap.add_argument("--warmup", type=_positive, default=5, help="untimed steps first (5)")
    ap.add_argument("--steps", type=_positive, default=15, help="timed steps (15)")
    ap.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    ap.add_argument("--overwrite", action="store_true", help="replace the files in --out")
    args = ap.parse_args(argv)
    if args.steps % args.sync_every or args.warmup % args.sync_every:
        ap.error("--steps and --warmup must be multiples of --sync-every (whole SparseLoCo periods)")
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
