"""Bytes per step of DeMo vs a dense all-reduce, measured on a real gloo group.

    python benchmarks/compress_bytes.py                 # ~1M-parameter transformer, world 4
    python benchmarks/compress_bytes.py --world 2 --topk 8 32 --out benchmarks/out

For each payload (reference, compact, sign) and top-k, every rank runs a few DeMo steps on the
same model and reads ``optimizer.comm_stats``: bytes this rank sent in the last step (ring
volumes of the tensors actually handed to the collectives), the dense all-reduce it replaced
(the model's gradients in their own dtype), the ratio and the optimizer-step time. Prints a
table and writes ``compress_bytes.json``. CPU/gloo times are not GPU times.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch

from cokit.compress import DeMo, codec_names
from cokit.files import OutputError, atomic_write_text, prepare_out_dir
from cokit.launch import spawn

JSON_NAME = "compress_bytes.json"


def build_model(d_model: int = 128, layers: int = 4, vocab: int = 256) -> torch.nn.Module:
    """A small transformer encoder (about 1M parameters at the defaults)."""
    layer = torch.nn.TransformerEncoderLayer(d_model, nhead=4, dim_feedforward=4 * d_model, batch_first=True)
    return torch.nn.Sequential(
        torch.nn.Embedding(vocab, d_model),
        torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False),
        torch.nn.Linear(d_model, vocab),
    )


def _worker(rank: int, world: int, cases: list[dict], steps: int) -> list[dict]:
    """One rank: every case in turn; returns this rank's rows."""
    rows = []
    for case in cases:
        torch.manual_seed(0)
        model = build_model()
        opt = DeMo(
            model.parameters(),
            lr=1e-3,
            compression_topk=case["topk"],
            compression_chunk=case["chunk"],
            payload=case["payload"],
        )
        gen = torch.Generator().manual_seed(rank)
        step_times = []
        for _ in range(steps):
            tokens = torch.randint(0, 256, (8, 64), generator=gen)
            logits = model(tokens)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(-1, 1).flatten())
            opt.zero_grad()
            loss.backward()
            start = time.perf_counter()
            opt.step()
            step_times.append(time.perf_counter() - start)
        s = opt.comm_stats
        rows.append(
            {
                **case,
                "params": sum(p.numel() for p in model.parameters()),
                "sent_bytes_per_step": s.step_sent_bytes,
                "received_bytes_per_step": s.step_received_bytes,
                "dense_bytes_per_step": s.step_dense_bytes,
                "ratio": s.step_dense_bytes / max(s.step_sent_bytes, 1),
                "step_ms_median": 1e3 * sorted(step_times)[len(step_times) // 2],
            }
        )
    return rows


def run(world: int, topks: list[int], chunk: int, steps: int) -> list[dict]:
    """Spawn ``world`` gloo ranks and measure every (payload, topk) case."""
    cases = [{"payload": p, "topk": k, "chunk": chunk} for p in codec_names() for k in topks]
    return spawn(world, _worker, cases, steps, timeout=1800, env={"TRITON_INTERPRET": None})[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4, help="gloo ranks (default 4)")
    ap.add_argument("--topk", type=int, nargs="+", default=[4, 8, 32], help="top-k values (default 4 8 32)")
    ap.add_argument("--chunk", type=int, default=64, help="chunk (default 64)")
    ap.add_argument("--steps", type=int, default=3, help="steps per case (default 3)")
    ap.add_argument(
        "--out",
        default="benchmarks/out",
        help=f"output folder (default benchmarks/out); checked for writing before anything runs, and "
        f"refused when it already holds {JSON_NAME} unless --overwrite",
    )
    ap.add_argument("--overwrite", action="store_true", help=f"replace an existing {JSON_NAME} in --out")
    args = ap.parse_args(argv)
    if args.world < 2 or args.steps < 1:
        ap.error("--world must be >= 2 and --steps >= 1")
    try:
        out = prepare_out_dir(args.out, (JSON_NAME,), overwrite=args.overwrite)
    except OutputError as exc:
        print(f"compress_bytes: error: {exc}", file=sys.stderr, flush=True)
        return 2
    rows = run(args.world, args.topk, args.chunk, args.steps)
    print(
        f"DeMo bytes per step, {rows[0]['params']:,} parameters, world {args.world} (gloo, {platform.machine()} CPU)"
    )
    print(f"{'payload':>10} {'k':>4} {'sent/step':>12} {'dense/step':>12} {'ratio':>8} {'step ms':>8}")
    for r in rows:
        print(
            f"{r['payload']:>10} {r['topk']:>4} {r['sent_bytes_per_step']:>12,} {r['dense_bytes_per_step']:>12,} "
            f"{r['ratio']:>8.1f} {r['step_ms_median']:>8.1f}"
        )
    report = {
        "world": args.world,
        "chunk": args.chunk,
        "machine": platform.platform(),
        "torch": torch.__version__,
        "rows": rows,
    }
    atomic_write_text(out / JSON_NAME, json.dumps(report, indent=2))
    print(f"wrote {out / JSON_NAME}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
