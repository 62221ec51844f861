"""``cokit plan``: predicted step time, time and cost per epoch, for AdamW-DDP, DeMo,
SparseLoCo and DeMo's two-level exchange, on your model, links and GPUs.

    cokit plan --model gpt2-124m --world 16 --ranks-per-node 8 --bandwidth 25gbit \\
        --gpu h100 --tokens-per-sample 1024 --batch 8 --dataset-size 10000000 --price-per-hour 2.5
    cokit plan --params 7B --world 64 --ranks-per-node 8 --bandwidth 100gbit --latency-ms 0.02 \\
        --gpu h200 --tokens-per-sample 4096 --batch 4 --dataset-size 1000000
    cokit plan --model mypkg.train:make_model --world 2 --bandwidth 10mbit \\
        --compute-ms adamw-ddp=40,demo=95,sparseloco=42 --batch 32 --dataset-size 50000

Bytes come from the optimizers' real payload layout; compute is measured (--compute-ms: forward
+ backward + optimizer per step, one number or method=ms pairs) or estimated from FLOPs (6 N per
token at --mfu of the GPU's peak); DDP's all-reduce hides behind backward where it can, DeMo's
and SparseLoCo's exchange is exposed (--exposed method=share overrides). The model behind it
and its validation against real runs on rate-limited links: docs/plan.md.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys

from cokit.cli import CliError

JSON_NAME, CSV_NAME, MD_NAME = "plan.json", "plan.csv", "plan.md"
CSV_FIELDS = (
    "method",
    "sent_bytes",
    "comm_ms",
    "exposed_share",
    "exposed_ms",
    "compute_ms",
    "compute_from",
    "step_ms",
    "speedup_vs_adamw_ddp",
    "steps_per_epoch",
    "epoch_s",
    "cost_per_epoch",
    "notes",
)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``cokit plan``."""
    from cokit.model_shapes import model_names
    from cokit.plan import GPUS, METHODS, TCP_EFFICIENCY

    p = subparsers.add_parser(
        "plan",
        help="predict step time and time/cost per epoch for AdamW-DDP, DeMo, SparseLoCo, two-level",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--model",
        help=f"a named model ({', '.join(model_names())}) or an importable factory module:function",
    )
    which.add_argument("--params", help="a bare parameter count, e.g. 124M, 7B (shapes assumed)")
    p.add_argument("--world", type=int, required=True, help="ranks (GPUs) in all")
    p.add_argument("--ranks-per-node", type=int, default=1, help="ranks per node (default 1)")
    p.add_argument("--bandwidth", required=True, help="each rank's link across nodes, e.g. 25gbit, 100mbit")
    p.add_argument("--latency-ms", type=float, default=0.0, help="one-way latency per hop (default 0)")
    p.add_argument(
        "--intra-bandwidth",
        default=None,
        help="each rank's link inside a node (default: the GPU's NVLink/Infinity Fabric, else --bandwidth)",
    )
    p.add_argument(
        "--efficiency",
        type=float,
        default=TCP_EFFICIENCY,
        help=f"goodput / line rate of the inter-node link (default {TCP_EFFICIENCY}: TCP)",
    )
    p.add_argument(
        "--burst-bytes",
        type=int,
        default=0,
        help="a token-bucket shaper's burst on that link, refilled while it idles (default 0)",
    )
    p.add_argument("--gpu", choices=tuple(GPUS), default=None, help="GPU type, for the FLOPs estimate")
    p.add_argument("--price-per-hour", type=float, default=None, help="price of one GPU for an hour")
    p.add_argument("--batch", type=int, required=True, help="samples per rank per step")
    p.add_argument("--dataset-size", type=int, required=True, help="samples in one epoch")
    p.add_argument("--tokens-per-sample", type=int, default=None, help="for the FLOPs estimate")
    p.add_argument("--mfu", type=float, default=0.4, help="model FLOP utilization of the estimate (0.4)")
    p.add_argument(
        "--compute-ms",
        default=None,
        help="measured forward + backward + optimizer per step: ms, or method=ms pairs joined by commas",
    )
    p.add_argument(
        "--exposed", default=None, help="measured exposed share of communication: method=share,..."
    )
    p.add_argument("--grad-dtype", choices=("fp32", "bf16"), default="fp32", help="gradient dtype (fp32)")
    p.add_argument("--demo-topk", type=int, default=32, help="DeMo's compression_topk (32)")
    p.add_argument("--sparseloco-topk", type=int, default=64, help="SparseLoCo's topk (64)")
    p.add_argument("--sync-every", type=int, default=5, help="SparseLoCo's sync_every (5)")
    p.add_argument(
        "--methods", default=",".join(METHODS), help=f"which to plan (default {','.join(METHODS)})"
    )
    p.add_argument(
        "--out", default=None, metavar="DIR", help=f"also write {JSON_NAME}, {CSV_NAME}, {MD_NAME}"
    )
    p.add_argument("--overwrite", action="store_true", help="replace the files in --out")
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of a table")
    p.set_defaults(func=run)
    return p


def _pairs(text: str, flag: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in text.split(","):
        name, sep, value = item.partition("=")
        try:
            if not sep:
                raise ValueError
            out[name.strip()] = float(value)
        except ValueError:
            raise CliError(f"{flag}: {item!r} is not method=number (e.g. demo=95,adamw-ddp=40)") from None
    return out


def _compute(text: str | None) -> float | dict[str, float] | None:
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        return _pairs(text, "--compute-ms")


def build(args: argparse.Namespace):
    """The :class:`cokit.plan.Plan` the arguments ask for (CliError on bad input). Every
    number is range-checked by :data:`cokit.plan.LIMITS` before anything is planned; the
    message names the option, its range and what to give."""
    from cokit.model_shapes import counted_model, factory_model, named_model, parse_count
    from cokit.plan import Link, Methods, PlanInputError, Workload, check_input, parse_rate, plan

    flags = {"params": "--params" if args.params is not None else ""}
    try:
        if args.tokens_per_sample is not None:
            check_input("cokit plan", "tokens_per_sample", args.tokens_per_sample)
        if args.params is not None:
            model = counted_model(parse_count(args.params))
        elif ":" in args.model:
            model = factory_model(args.model)
        else:
            model = named_model(args.model)
        inter = Link(parse_rate(args.bandwidth), args.latency_ms / 1e3, args.efficiency, args.burst_bytes)
        if args.intra_bandwidth is None:
            intra = None
        else:
            flags["bits_per_s"] = "--intra-bandwidth"
            intra = Link(parse_rate(args.intra_bandwidth), 0.0, 1.0)
            del flags["bits_per_s"]
        tokens = None if args.tokens_per_sample is None else args.tokens_per_sample * args.batch
        workload = Workload(
            args.batch, args.dataset_size, _compute(args.compute_ms), tokens, args.gpu, args.mfu
        )
        methods = Methods(
            demo_topk=args.demo_topk,
            sparseloco_topk=args.sparseloco_topk,
            sync_every=args.sync_every,
            grad_itemsize=4 if args.grad_dtype == "fp32" else 2,
        )
        which = [m.strip() for m in args.methods.split(",") if m.strip()]
        exposed = None if args.exposed is None else _pairs(args.exposed, "--exposed")
        return plan(
            model,
            args.world,
            workload,
            inter,
            ranks_per_node=args.ranks_per_node,
            intra=intra,
            methods=methods,
            price_per_hour=args.price_per_hour,
            exposed=exposed,
            which=which,
        )
    except PlanInputError as exc:
        raise CliError(exc.cli_message(flags)) from None
    except ValueError as exc:
        raise CliError(str(exc)) from None


def csv_text(rows: list[dict]) -> str:
    """The rows as CSV with a fixed header."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=CSV_FIELDS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def run(args: argparse.Namespace) -> int:
    """Plan, print the table (or JSON), and write the files when --out is given."""
    from cokit.files import OutputError, WriteError, atomic_write_text, prepare_out_dir

    result = build(args)
    inputs = result.inputs
    if args.json:
        print(json.dumps(result.as_dict(), indent=2))
    else:
        m = inputs["model"]
        print(
            f"plan: {m['description']} ({m['params'] / 1e6:,.1f}M parameters), world {args.world} "
            f"({args.ranks_per_node} per node), {args.bandwidth} across nodes"
        )
        print(result.table())
        for r in result.rows:
            if r["notes"]:
                print(f"  {r['method']}: {r['notes']}")
        if args.price_per_hour is None:
            print("  (give --price-per-hour for the cost per epoch)")
    if args.out is not None:
        try:
            out = prepare_out_dir(args.out, (JSON_NAME, CSV_NAME, MD_NAME), overwrite=args.overwrite)
            atomic_write_text(out / JSON_NAME, json.dumps(result.as_dict(), indent=2) + "\n")
            atomic_write_text(out / CSV_NAME, csv_text(result.rows))
            atomic_write_text(out / MD_NAME, result.table() + "\n")
        except (OutputError, WriteError) as exc:
            raise CliError(str(exc)) from None
        print(f"wrote {out / JSON_NAME}, {out / CSV_NAME} and {out / MD_NAME}", file=sys.stderr)
    return 0
