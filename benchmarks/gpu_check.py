"""The one GPU check: every kernel vs its torch reference on real sizes, then speed.

    python benchmarks/gpu_check.py [--quick] [--out benchmarks/out/gpu_check.json]

On a GPU: checks each Triton kernel against the torch reference (relative error, index
agreement), times both (median of CUDA-event timings via triton.testing.do_bench), and
prints time, achieved GB/s against a measured device-to-device copy bandwidth, and the
speedup over the torch reference. Writes everything to JSON. Sized to finish well under
8 minutes on one H200. Then the optimizer-step time of DeMo (Triton kernels, world size 1)
vs fused AdamW on transformer-shaped parameters (benchmarks/optimizer_bench.py).

Then the GEMM part (benchmarks/gemm_bench.py): correctness, TFLOP/s vs torch.matmul and an
occupancy sweep. Then the overlap part (benchmarks/overlap_bench.py): a one-GPU study of a
GEMM next to an EMULATED communication kernel over num_warps / smem_bytes / num_sms /
priority (speedup over sequential, % of ideal); on CPU, a real 2-process gloo measurement.

On a CPU-only machine it runs the torch reference path only, at small sizes, and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Callable

import torch


from cokit.bench.timing import median_ms
from cokit.triton_kernels import backend, dct, error_feedback, tiling, topk


def copy_bandwidth(device: torch.device, on_gpu: bool) -> float:
    """Device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    n = (1 << 30 if on_gpu else 1 << 26) // 4
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), on_gpu)
    return 2 * src.numel() * 4 / ms / 1e6


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def bucket_shapes(quick: bool, on_gpu: bool) -> list[tuple[int, ...]]:
    """A transformer-like bucket: square and MLP matrices plus norm/bias vectors."""
    if not on_gpu:
        return [(256, 256), (256, 512), (512,), (256,)]
    d = 2048 if quick else 4096
    return [(d, d)] * 4 + [(d, 4 * d)] * 2 + [(4 * d, d)] * 2 + [(d,)] * 8


def check_kernels(device: torch.device, on_gpu: bool, quick: bool, bw: float) -> list[dict]:
    shapes = bucket_shapes(quick, on_gpu)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    chunk, k, ranks = 64, 32, 8
    xs = [torch.randn(s, device=device).to(dtype) for s in shapes]
    numel = sum(x.numel() for x in xs)
    esz = xs[0].element_size()
    payload, _ = tiling.payload_shape(shapes, chunk, k)
    rows = []

    def add(name: str, kernel: Callable, reference: Callable, nbytes: int, err: dict) -> None:
        ref_ms = median_ms(reference, on_gpu)
        row = {"kernel": name, "elements": numel, "bytes": nbytes, "torch_ms": ref_ms, **err}
        if on_gpu:
            ms = median_ms(kernel, on_gpu)
            row.update(triton_ms=ms, GBps=nbytes / ms / 1e6, pct_of_copy=100 * nbytes / ms / 1e6 / bw,
                       speedup=ref_ms / ms)
        else:
            row.update(torch_GBps=nbytes / ref_ms / 1e6)
        rows.append(row)
        print(f"  {name}: done", flush=True)

    # DCT encode / decode
    coeffs = dct.dct_encode_multi(xs, chunk)
    ref_coeffs = [dct.dct_encode_reference(x, chunk) for x in xs]
    back = dct.dct_decode_multi(coeffs, shapes, chunk, dtype=torch.float32)
    add("dct_encode", lambda: dct.dct_encode_multi(xs, chunk),
        lambda: [dct.dct_encode_reference(x, chunk) for x in xs], numel * (esz + 4),
        {"rel_err": max(rel_err(c, r) for c, r in zip(coeffs, ref_coeffs)),
         "roundtrip_err": max(rel_err(b, x) for b, x in zip(back, xs))})
    add("dct_decode", lambda: dct.dct_decode_multi(coeffs, shapes, chunk, dtype),
        lambda: [dct.dct_decode_reference(c, s, chunk).to(dtype) for c, s in zip(coeffs, shapes)],
        numel * (4 + esz), {})

    # top-k on the largest tensor's coefficients
    big = max(coeffs, key=lambda c: c.numel())
    idx, vals = topk.chunk_topk(big, k)
    ridx, rvals = topk.chunk_topk_reference(big, k)
    add("chunk_topk", lambda: topk.chunk_topk(big, k), lambda: topk.chunk_topk_reference(big, k),
        big.numel() * 4 + idx.numel() * (idx.element_size() + 4),
        {"index_agreement": float((idx == ridx).float().mean()), "rel_err": rel_err(vals, rvals)})

    # fused error-feedback encode (bf16 grads, fp32 buffers, fp16 payload values)
    deltas = [torch.randn(s, device=device) * 0.01 for s in shapes]
    d_ker, d_ref = [d.clone() for d in deltas], [d.clone() for d in deltas]
    pi, pv = error_feedback.ef_encode(d_ker, xs, beta=0.999, lr=0.01, chunk=chunk, k=k, value_dtype=torch.float16)
    ri, rv = error_feedback.ef_encode_reference(d_ref, xs, 0.999, 0.01, chunk, k, value_dtype=torch.float16)
    enc_bytes = numel * (4 + esz + 4) + payload * (2 + 2)
    encode_err = {"index_agreement": float((pi == ri).float().mean()),
                  "delta_rel_err": max(rel_err(a, b) for a, b in zip(d_ker, d_ref))}
    # timed runs keep updating their own buffers (as training does), outside the checked ones
    add("ef_encode", lambda: error_feedback.ef_encode(d_ker, xs, beta=0.999, lr=0.01, chunk=chunk, k=k,
                                                      value_dtype=torch.float16),
        lambda: error_feedback.ef_encode_reference(d_ref, xs, 0.999, 0.01, chunk, k, value_dtype=torch.float16),
        enc_bytes, encode_err)

    # decode of `ranks` gathered payloads into bf16 parameters
    gidx = torch.stack([pi] * ranks)
    gval = torch.stack([pv * (1 + 0.1 * r) for r in range(ranks)])
    p_ker, p_ref = [x.clone() for x in xs], [x.clone() for x in xs]
    error_feedback.ef_decode(p_ker, gidx, gval, lr=0.01, chunk=chunk, k=k, use_sign=False)
    error_feedback.ef_decode_reference(p_ref, gidx, gval, chunk, k, 0.01, use_sign=False)
    dec_bytes = numel * 2 * esz + ranks * payload * (2 + 2)
    decode_err = max(rel_err(a, b) for a, b in zip(p_ker, p_ref))
    add("ef_decode", lambda: error_feedback.ef_decode(p_ker, gidx, gval, lr=0.01, chunk=chunk, k=k,
                                                      use_sign=False, validate=False),
        lambda: error_feedback.ef_decode_reference(p_ref, gidx, gval, chunk, k, 0.01, use_sign=False),
        dec_bytes, {"rel_err": decode_err})
    return rows


def print_table(rows: list[dict], on_gpu: bool) -> None:
    cols = (["kernel", "triton_ms", "torch_ms", "GBps", "pct_of_copy", "speedup"] if on_gpu
            else ["kernel", "torch_ms", "torch_GBps"])
    extra = sorted({k for r in rows for k in r if "err" in k or "agreement" in k})
    cols += extra
    print("  ".join(f"{c:>14}" for c in cols))
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c, "")
            cells.append(f"{v:>14.4g}" if isinstance(v, float) else f"{v!s:>14}")
        print("  ".join(cells))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes (a minute on a GPU)")
    parser.add_argument("--out", default=os.path.join("benchmarks", "out", "gpu_check.json"),
                        help="where to write the JSON report")
    args = parser.parse_args(argv)

    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    report: dict = {"device": torch.cuda.get_device_name() if on_gpu else "cpu",
                    "path": backend.kernel_path(device), "torch": torch.__version__}
    if not on_gpu:
        print("No GPU visible: running the torch reference path only, at small sizes. "
              "Triton kernel timings need a GPU.")
    else:
        print(f"GPU: {report['device']} (kernel path {report['path']})")
    bw = copy_bandwidth(device, on_gpu)
    report["copy_GBps"] = bw
    print(f"device copy bandwidth (read + write): {bw:.0f} GB/s")
    print("compression kernels:")
    report["compression"] = check_kernels(device, on_gpu, args.quick, bw)
    print_table(report["compression"], on_gpu)

    import optimizer_bench  # beside this file; DeMo vs AdamW optimizer-step time (world size 1)

    print("optimizer step:")
    optimizer_bench.run(report, quick=args.quick)

    import gemm_bench  # beside this file; adds report["gemm"]

    print("GEMM:")
    report["gemm_rows"] = gemm_bench.run(report, quick=args.quick)

    import overlap_bench  # beside this file; adds report["overlap"] (one GPU: EMULATED comm)

    print("overlap:")
    report["overlap_rows"] = overlap_bench.run(report, quick=args.quick, budget_s=90.0 if args.quick else 240.0)

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2, default=str)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
