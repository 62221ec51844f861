"""What checking peers' payloads costs: DeMo's step with and without ``validate_payload``.

    python -m cokit.bench.payload_validation
    python -m cokit.bench.payload_validation --sizes 1M 10M --ranks 2 8 64 --rounds 9 --out out.json

Per size (fp32 transformer-shaped parameters, one torch thread, world size 1, no network):
the DeMo step (compact payload, k=32) with ``validate_payload=True`` and ``False`` in paired,
interleaved rounds (CPU-time medians, their ratio in one run), and the check alone
(:func:`cokit.compress.peer_check.check_selection`) on the step's gathered payload as ``W`` ranks
would send it (the check reads ``W`` times the payload), next to the decode of the same ``W``
payloads (``ef_decode``, which a rank runs on them anyway). Prints the table and writes JSON
(atomically). CPU numbers, not GPU numbers.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from typing import Any

import torch

from cokit.bench.demo_baseline import SIZES, make_params
from cokit.files import OutputError, atomic_write_text, prepare_out_file


def _cpu(fn) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def run(sizes: list[str], ranks: list[int], rounds: int) -> list[dict[str, Any]]:
    from cokit.compress import DeMo
    from cokit.compress.peer_check import check_selection
    from cokit.triton_kernels.error_feedback import ef_decode

    rows = []
    for size in sizes:
        params = make_params(*SIZES[size])
        opts = {v: DeMo(params, lr=1e-4, compression_topk=32, validate_payload=v) for v in (True, False)}
        for opt in opts.values():
            opt.step()  # first-step work is not timed
        times: dict[bool, list[float]] = {True: [], False: []}
        for r in range(rounds):
            for v in (True, False) if r % 2 == 0 else (False, True):
                times[v].append(_cpu(opts[v].step))
        step = {v: statistics.median(t) for v, t in times.items()}
        # the check alone, on the payload of every compressed bucket as W ranks would send it
        opt = opts[True]
        entries = opt.plan.entries()
        buckets = [b for b in opt.plan.buckets(entries) if not b.dense]
        payloads, members = [], []
        for b in buckets:
            assert b.codec is not None
            members.append([entries[i][2].detach().clone() for i in b.members])
            n = b.codec.plan.payload_numel
            idx = torch.cat(
                [torch.arange(t.k_eff(b.codec.plan.k)).repeat(t.n_tiles) for t in b.codec.plan.tilings]
            )
            payloads.append((b.codec, idx.to(b.codec.plan.index_dtype), torch.randn(n).to(torch.bfloat16)))
        check, decode = {}, {}
        for w in ranks:
            gathered = [
                (c, i.expand(w, -1).contiguous(), v.expand(w, -1).contiguous()) for c, i, v in payloads
            ]

            def one(gathered=gathered) -> None:
                for c, i, v in gathered:
                    check_selection(c, i, v, owner="bench", bucket="b", rank_of=int)

            def decoded(gathered=gathered, members=members) -> None:
                for ps, (c, i, v) in zip(members, gathered, strict=True):
                    ef_decode(ps, i, v, lr=1e-4, chunk=c.plan.chunk, k=c.plan.k, validate=False)

            check[w] = statistics.median(_cpu(one) for _ in range(rounds))
            decode[w] = statistics.median(_cpu(decoded) for _ in range(rounds))
        row = {
            "size": size,
            "params": sum(p.numel() for p in params),
            "payload_slots": sum(c.plan.payload_numel for c, _, _ in payloads),
            "step_ms": {"validated": 1e3 * step[True], "not_validated": 1e3 * step[False]},
            "step_ratio": step[True] / step[False],
            "check_ms": {str(w): 1e3 * t for w, t in check.items()},
            "check_vs_step": {str(w): t / step[False] for w, t in check.items()},
            "decode_ms": {str(w): 1e3 * t for w, t in decode.items()},
            "check_vs_decode": {str(w): check[w] / decode[w] for w in check},
            "rounds": rounds,
        }
        rows.append(row)
        per = ", ".join(
            f"W={w} {1e3 * t:.2f} ms ({100 * t / step[False]:.1f}% of the step, {100 * t / decode[w]:.0f}% of "
            f"the decode of the W payloads)"
            for w, t in check.items()
        )
        print(
            f"{size:>4} ({row['params'] / 1e6:.1f}M, {row['payload_slots']} slots): step "
            f"{row['step_ms']['validated']:.1f} ms validated / {row['step_ms']['not_validated']:.1f} ms not "
            f"= {row['step_ratio']:.3f}x | check alone: {per}",
            flush=True,
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--ranks", nargs="+", type=int, default=[2, 8, 64])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    if args.rounds < 1 or any(w < 1 for w in args.ranks):
        ap.error("--rounds and --ranks must be >= 1")
    try:
        out = prepare_out_file(args.out) if args.out else None
    except OutputError as exc:
        ap.error(str(exc))
    torch.set_num_threads(1)
    print("payload_validation: DeMo compact k=32, world 1, 1 thread, CPU time", flush=True)
    rows = run(args.sizes, args.ranks, args.rounds)
    if out is not None:
        doc = {"machine": platform.platform(), "processor": platform.processor(), "rows": rows}
        atomic_write_text(out, json.dumps(doc, indent=1))
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
