"""Where the compressed all-gather stops paying: DeMo's bytes per rank and step against W.

    python -m cokit.bench.exchange_scaling                    # ~50M GPT-like model, W = 2 ... 1024
    python -m cokit.bench.exchange_scaling --model small --world-sizes 2 8 64 --topk 8
    python -m cokit.bench.exchange_scaling --shapes 4096x4096 4096 --out /tmp/scaling

Nothing is sent: the counts come from the layout DeMo uses. ``make_buckets`` splits the
model's parameter shapes into buckets at each world size (bucketing and the dense fallback
included), each compressed bucket's codec (``cokit.compress.payload``, over
``payload_layout``) gives its bytes per rank, and ring volumes give the rest: an all-gather
of ``p`` bytes per rank moves ``(W-1) p``, an all-reduce of ``n`` bytes ``2 (W-1)/W n``, sent
and the same again received. DeMo's per-step status all-gather (the exchange core's fixed-size
row, ``STATUS_ROW`` bytes per rank; ``AGREEMENT_ROW`` inside a node) is included.

Two layouts, each against a dense all-reduce of the gradients in fp32 and in bf16 (the
fallback compares against, and sends its dense tensors in, the same element size):

- flat: one exchange over all ``W`` ranks;
- hierarchical (``DeMo(hierarchy=...)``): ``W = nodes x L`` (``--local-size``, default 8): a
  dense ring all-reduce of the gradients inside each node, bucket ``b`` compressed and
  exchanged across the ``nodes`` ranks of local rank ``b % L`` only, and each bucket's updated
  parameters broadcast inside the node (intra-node bytes, fast links). Inter-node bytes are
  the busiest local rank's; the fallback is decided at the cross-node group's size. Its comparison points are the flat dense ring
  all-reduce and a two-level dense all-reduce (reduce-scatter in the node, all-reduce of a
  1/L shard across nodes, all-gather in the node).

A reduce-scatter of sparse top-k payloads is not a comparison point: every rank picks other
indices, so nothing can be summed on the way. Instead the crossovers are stated: the W at
which the compressed all-gather costs what the dense all-reduce does (``2 n b / p`` for ``n``
elements of ``b`` bytes and a payload of ``p`` bytes per rank), the first W at which a tensor
falls back to dense and the W from which every tensor does.

Writes ``exchange_scaling.json`` and ``exchange_scaling.md`` (the tables) atomically under
``--out`` (default benchmarks/results/exchange_scaling) and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from cokit.compress.buckets import compressed_nbytes
from cokit.compress.payload import codec_names, get_codec
from cokit.compress.traffic import (
    Setup,
    dense_allreduce,
    exchange_traffic,
    hierarchical_traffic,
)
from cokit.files import OutputError, atomic_write_text, prepare_out_dir
from cokit.model_shapes import Model, model_names, named_model, parse_shape

JSON_NAME = "exchange_scaling.json"
MD_NAME = "exchange_scaling.md"
DEFAULT_OUT = Path("benchmarks/results/exchange_scaling")
DEFAULT_WORLDS = tuple(2**i for i in range(1, 11))  # 2 ... 1024
DTYPES = {"fp32": 4, "bf16": 2}  # gradient dtype -> element size of its dense all-reduce
VALUE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# ----------------------------------------------------------------------------- counting


def _compressible(shapes: Sequence[tuple[int, ...]]) -> list[tuple[int, ...]]:
    return [s for s in shapes if len(s) > 0 and math.prod(s) > 0]


def payload_bytes(shapes: Sequence[tuple[int, ...]], setup: Setup) -> int:
    """Compressed bytes per rank with every compressible tensor compressed (no fallback)."""
    t = exchange_traffic(_compressible(shapes), setup, 2, 4, fallback=False)
    return t.compressed  # world 2: (W-1) * payload = payload


def fallback_worlds(shapes: Sequence[tuple[int, ...]], setup: Setup, itemsize: int) -> tuple[int, int]:
    """(first, all): the smallest W (>= 2) at which some / every compressible tensor is sent
    dense; ``sends_dense`` holds from ``ceil(2 n b / p)`` on, per tensor sent alone."""
    worlds = []
    for s in _compressible(shapes):
        p = compressed_nbytes(s, setup.chunk, setup.k, setup.codec, setup.value)
        worlds.append(max(2, -(-2 * itemsize * math.prod(s) // p)))  # ceil
    return min(worlds), max(worlds)


def hierarchical_vs_flat_nodes(n: int, itemsize: int, p: float, local: int) -> float:
    """Nodes at which ``(nodes-1) p`` (inter-node all-gather of ``p`` bytes) equals the flat dense ring
    all-reduce ``2 (W-1)/W n b`` over ``W = nodes * local``: the larger root of
    ``p L x^2 - (p L + 2 n b L) x + 2 n b = 0``."""
    nb = n * itemsize
    a, b, c = p * local, -(p * local + 2 * nb * local), 2 * nb
    return (-b + math.sqrt(b * b - 4 * a * c)) / (2 * a)


CROSSOVER_FIELDS = (
    "payload_bytes_per_rank",
    "dense_bytes",
    "flat_crossover_w",
    "flat_first_dense_w",
    "flat_all_dense_w",
    "hier_vs_flat_dense_w",
    "hier_vs_two_level_dense_w",
    "hier_first_dense_w",
    "hier_all_dense_w",
)


def crossovers(model: Model, setup: Setup, local: int) -> dict[str, dict[str, Any]]:
    """Per gradient dtype: where the all-gather stops paying, flat and hierarchical."""
    shapes = model.shapes
    n = sum(math.prod(s) for s in _compressible(shapes))
    p = payload_bytes(shapes, setup)
    out: dict[str, dict[str, Any]] = {}
    for dtype, b in DTYPES.items():
        if p == 0:  # nothing to compress (only 0-D tensors): always dense
            out[dtype] = dict.fromkeys(CROSSOVER_FIELDS)
            continue
        # a codec without the fallback (reference) keeps compressing at every W
        first, every = fallback_worlds(shapes, setup, b) if setup.codec.dense_fallback else (None, None)
        out[dtype] = {
            "payload_bytes_per_rank": p,
            "dense_bytes": n * b,
            "flat_crossover_w": 2 * n * b / p,
            "flat_first_dense_w": first,
            "flat_all_dense_w": every,
            # each local rank sends ~1/L of the payload across nodes
            "hier_vs_flat_dense_w": local * hierarchical_vs_flat_nodes(n, b, p / local, local),
            "hier_vs_two_level_dense_w": local * 2 * n * b / p,
            "hier_first_dense_w": None if first is None else local * first,
            "hier_all_dense_w": None if every is None else local * every,
        }
    return out


def flat_rows(model: Model, setup: Setup, worlds: Sequence[int]) -> list[dict[str, Any]]:
    """One row per world size: dense all-reduce and DeMo's traffic, per gradient dtype."""
    n = model.params
    rows = []
    for w in worlds:
        row: dict[str, Any] = {"payload": setup.codec.name, "k": setup.k, "world": w}
        for dtype, b in DTYPES.items():
            dense = dense_allreduce(n, b, w)
            t = exchange_traffic(model.shapes, setup, w, b)
            row[dtype] = {"dense_sent": dense, "cokit": t.as_dict(), "ratio": dense / t.sent}
        # today's fallback (fp32 threshold, fp32 dense) against a bf16 DDP
        row["bf16"]["ratio_vs_fp32_fallback"] = row["bf16"]["dense_sent"] / row["fp32"]["cokit"]["sent"]
        rows.append(row)
    return rows


def hierarchical_rows(model: Model, setup: Setup, worlds: Sequence[int], local: int) -> list[dict[str, Any]]:
    """Rows for the world sizes that are ``nodes x local`` with at least 2 nodes."""
    n = model.params
    rows = []
    for w in worlds:
        nodes, rest = divmod(w, local)
        if rest or nodes < 2:
            continue
        row: dict[str, Any] = {
            "payload": setup.codec.name,
            "k": setup.k,
            "world": w,
            "nodes": nodes,
            "local": local,
        }
        for dtype, b in DTYPES.items():
            intra, inter = hierarchical_traffic(model.shapes, setup, nodes, local, b)
            flat_dense = dense_allreduce(n, b, w)
            two_level_inter = dense_allreduce(-(-n // local), b, nodes)
            row[dtype] = {
                "intra_sent": intra,
                "inter": inter.as_dict(),
                "flat_dense_sent": flat_dense,
                "two_level_dense_inter_sent": two_level_inter,
                "ratio_vs_flat_dense": flat_dense / inter.sent,
                "ratio_vs_two_level_dense": two_level_inter / inter.sent,
            }
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------- tables


def _mb(nbytes: float) -> str:
    """Sent + received bytes (twice ``nbytes``) in MB, 3 significant digits."""
    v = 2 * nbytes / 1e6
    return f"{v:.3g}" if v < 1000 else f"{v:,.0f}"


def _x(ratio: float) -> str:
    return f"{ratio:.3g}x" if ratio < 1000 else f"{ratio:,.0f}x"


def _w(w: float | None) -> str:
    return "-" if w is None else f"{w:,.0f}"


def markdown(report: dict[str, Any]) -> str:
    """The report's tables as markdown (flat, hierarchical, crossovers) with their notes."""
    m, s = report["model"], report["settings"]
    local = s["local_size"]
    lines = [
        f"### Exchange bytes against world size: {m['name']}, {m['params'] / 1e6:.1f}M parameters",
        "",
        f"{m['description']}; {m['tensors']} tensors. chunk {s['chunk']}, values {s['value_dtype']}, "
        f"buckets of {s['bucket_cap_mb']:g} MB. MB sent + received per rank per step (ring volumes; "
        "status exchange included). `x` = dense bytes / cokit bytes; `fp32`/`bf16` is the gradient "
        "dtype: the dense all-reduce compared against, the fallback's threshold and its dense "
        "tensors' dtype. `bf16 DDP / today` compares a bf16 DDP with the fp32-threshold fallback.",
        "",
        "| payload | k | W | dense fp32 | cokit | x | dense tensors | dense bf16 | cokit | x "
        "| dense tensors | bf16 DDP / today |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["flat"]:
        f, h = r["fp32"], r["bf16"]
        lines.append(
            f"| {r['payload']} | {r['k']} | {r['world']} | {_mb(f['dense_sent'])} | {_mb(f['cokit']['sent'])} "
            f"| {_x(f['ratio'])} | {f['cokit']['dense_tensors']}/{m['tensors']} | {_mb(h['dense_sent'])} "
            f"| {_mb(h['cokit']['sent'])} | {_x(h['ratio'])} | {h['cokit']['dense_tensors']}/{m['tensors']} "
            f"| {_x(h['ratio_vs_fp32_fallback'])} |"
        )
    if report["hierarchical"]:
        lines += [
            "",
            f"Hierarchical (`DeMo(hierarchy=...)`): W = nodes x {local}. Intra: the gradients' dense "
            "ring all-reduce inside the node, the owners' broadcast of the updated parameters and the "
            f"status agreement (fast links). Inter: the busiest local rank's bytes across nodes (bucket "
            f"b is sent by local rank b % {local} only; fallback at the cross-node group's size; its "
            "status exchange included). x flat: flat dense all-reduce over W / inter; x 2-level: "
            f"inter-node part of a two-level dense all-reduce (a 1/{local} shard across nodes) / inter.",
            "",
            "| payload | k | W | nodes | intra fp32 | inter fp32 | x flat | x 2-level "
            "| intra bf16 | inter bf16 | x flat | x 2-level |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in report["hierarchical"]:
            f, h = r["fp32"], r["bf16"]
            lines.append(
                f"| {r['payload']} | {r['k']} | {r['world']} | {r['nodes']} | {_mb(f['intra_sent'])} "
                f"| {_mb(f['inter']['sent'])} | {_x(f['ratio_vs_flat_dense'])} "
                f"| {_x(f['ratio_vs_two_level_dense'])} | {_mb(h['intra_sent'])} | {_mb(h['inter']['sent'])} "
                f"| {_x(h['ratio_vs_flat_dense'])} | {_x(h['ratio_vs_two_level_dense'])} |"
            )
    lines += [
        "",
        "Crossovers (W at which the compressed all-gather of every tensor costs what the dense "
        "all-reduce does, `2 n b / p`; first / all: the W from which some / every tensor falls "
        f"back to dense; hierarchical with {local} ranks per node; `-`: the payload has no dense "
        "fallback, or nothing is compressed):",
        "",
        "| payload | k | grads | flat: = dense at W | flat: first dense | flat: all dense "
        "| hier: = flat dense at W | hier: = 2-level dense at W | hier: all dense |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for c in report["crossovers"]:
        for dtype in DTYPES:
            x = c[dtype]
            lines.append(
                f"| {c['payload']} | {c['k']} | {dtype} | {_w(x['flat_crossover_w'])} | {_w(x['flat_first_dense_w'])} "
                f"| {_w(x['flat_all_dense_w'])} | {_w(x['hier_vs_flat_dense_w'])} "
                f"| {_w(x['hier_vs_two_level_dense_w'])} | {_w(x['hier_all_dense_w'])} |"
            )
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- run


def run(
    model: Model,
    payloads: Sequence[str],
    topks: Sequence[int],
    worlds: Sequence[int],
    *,
    chunk: int = 64,
    value_dtype: str = "bf16",
    bucket_cap_mb: float = 25.0,
    local: int = 8,
) -> dict[str, Any]:
    """Every table's rows for ``model`` (a JSON-ready dict)."""
    flat, hier, cross = [], [], []
    for name in payloads:
        for k in topks:
            codec = get_codec(name, owner="exchange_scaling")
            setup = Setup(codec, k, chunk, VALUE_DTYPES[value_dtype], int(bucket_cap_mb * 2**20))
            flat += flat_rows(model, setup, worlds)
            hier += hierarchical_rows(model, setup, worlds, local)
            cross.append({"payload": name, "k": k, **crossovers(model, setup, local)})
    return {
        "model": {
            "name": model.name,
            "description": model.description,
            "params": model.params,
            "tensors": len(model.shapes),
            "shapes": [list(s) for s in model.shapes],
        },
        "settings": {
            "chunk": chunk,
            "value_dtype": value_dtype,
            "bucket_cap_mb": bucket_cap_mb,
            "local_size": local,
            "world_sizes": list(worlds),
            "payloads": list(payloads),
            "topk": list(topks),
        },
        "flat": flat,
        "hierarchical": hier,
        "crossovers": cross,
        "notes": [
            "bytes are sent per rank per step; ring collectives receive the same amount",
            "the dense fallback sends its tensors in the gradient dtype (as the DDP hook does)",
            "hierarchical intra-node bytes: a dense ring all-reduce of all gradients over the node",
            "sparse top-k payloads cannot be reduce-scattered (indices differ per rank)",
        ],
    }


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="exchange_scaling", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model", default="gpt-50m", choices=model_names(), help="named model shapes (default gpt-50m)"
    )
    ap.add_argument(
        "--shapes",
        nargs="+",
        metavar="SHAPE",
        help="parameter shapes instead of --model, e.g. 512x2048 2048 scalar",
    )
    ap.add_argument(
        "--world-sizes",
        type=_positive,
        nargs="+",
        default=list(DEFAULT_WORLDS),
        help="W values (default 2 4 ... 1024)",
    )
    ap.add_argument(
        "--payloads",
        nargs="+",
        default=["compact", "sign"],
        choices=codec_names(),
        help="(default compact sign)",
    )
    ap.add_argument("--topk", type=_positive, nargs="+", default=[8, 32], help="k values (default 8 32)")
    ap.add_argument("--chunk", type=_positive, default=64, help="tile target (default 64)")
    ap.add_argument(
        "--value-dtype", default="bf16", choices=tuple(VALUE_DTYPES), help="payload values (default bf16)"
    )
    ap.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DeMo's bucket_cap_mb (default 25)")
    ap.add_argument(
        "--local-size", type=_positive, default=8, help="ranks per node, hierarchical layout (default 8)"
    )
    ap.add_argument("--out", default=str(DEFAULT_OUT), help=f"output folder (default {DEFAULT_OUT})")
    ap.add_argument("--overwrite", action="store_true", help=f"replace {JSON_NAME} / {MD_NAME} in --out")
    args = ap.parse_args(argv)
    if min(args.world_sizes) < 2:
        ap.error(f"--world-sizes must all be >= 2 (a single rank exchanges nothing), got {args.world_sizes}")
    if args.local_size < 2:
        ap.error("--local-size must be >= 2 (ranks per node of the hierarchical layout)")
    if not (math.isfinite(args.bucket_cap_mb) and args.bucket_cap_mb > 0):
        ap.error(f"--bucket-cap-mb must be a positive number, got {args.bucket_cap_mb}")
    if args.shapes:
        try:
            shapes = tuple(parse_shape(s) for s in args.shapes)
        except ValueError as exc:
            ap.error(str(exc))
        model = Model("shapes", f"{len(shapes)} shapes given with --shapes", shapes)
    else:
        model = named_model(args.model)
    if model.params == 0:
        ap.error("the model has no parameters to exchange")
    try:
        out = prepare_out_dir(args.out, (JSON_NAME, MD_NAME), overwrite=args.overwrite)
    except OutputError as exc:
        print(f"exchange_scaling: error: {exc}", file=sys.stderr, flush=True)
        return 2
    report = run(
        model,
        list(dict.fromkeys(args.payloads)),
        sorted(set(args.topk)),
        sorted(set(args.world_sizes)),
        chunk=args.chunk,
        value_dtype=args.value_dtype,
        bucket_cap_mb=args.bucket_cap_mb,
        local=args.local_size,
    )
    text = markdown(report)
    print(text)
    atomic_write_text(out / JSON_NAME, json.dumps(report, indent=2) + "\n")
    atomic_write_text(out / MD_NAME, text)
    print(f"wrote {out / JSON_NAME} and {out / MD_NAME}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
