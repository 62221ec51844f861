"""Optimizer-step time of DeMo (world size 1: encode + decode, no network) vs AdamW.

Part of ``benchmarks/gpu_check.py``; alone: ``python benchmarks/optimizer_bench.py [--quick]``.
The parameters are transformer-shaped (attention, MLP, norms) with random gradients. On a GPU,
DeMo runs the Triton kernels and AdamW its fused implementation; on a CPU both run torch code
and the numbers say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch


from cokit.compress import DeMo
from cokit.bench.timing import median_ms


def layer_shapes(d_model: int, layers: int) -> list[tuple[int, ...]]:
    """Parameter shapes of ``layers`` pre-norm transformer blocks."""
    block = [(3 * d_model, d_model), (3 * d_model,), (d_model, d_model), (d_model,),
             (4 * d_model, d_model), (4 * d_model,), (d_model, 4 * d_model), (d_model,),
             (d_model,), (d_model,), (d_model,), (d_model,)]
    return block * layers


def run(report: dict | None = None, quick: bool = False) -> list[dict]:
    """Time each optimizer on one bucket of parameters; print a table; return rows."""
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    d_model, layers = (1024, 4 if quick else 12) if on_gpu else (256, 2)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    shapes = layer_shapes(d_model, layers)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, device=device, dtype=dtype) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    n = sum(p.numel() for p in params)
    adamw_kw = {"fused": True} if on_gpu else {"foreach": True}
    cases = [
        ("AdamW", lambda: torch.optim.AdamW(params, lr=1e-4, **adamw_kw)),
        ("DeMo compact k=32", lambda: DeMo(params, lr=1e-4, compression_topk=32)),
        ("DeMo sign k=32", lambda: DeMo(params, lr=1e-4, compression_topk=32, payload="sign")),
        ("DeMo compact k=8", lambda: DeMo(params, lr=1e-4, compression_topk=8)),
    ]
    rows = []
    for name, make in cases:
        opt = make()
        ms = median_ms(opt.step, on_gpu, quick)
        rows.append({"optimizer": name, "params": n, "dtype": str(dtype).replace("torch.", ""),
                     "device": torch.cuda.get_device_name() if on_gpu else "cpu", "step_ms": ms})
    print(f"optimizer step, {n:,} parameters ({layers} blocks of d={d_model}, {rows[0]['dtype']}) on "
          f"{rows[0]['device']}; DeMo at world size 1 (encode + decode, no network)")
    for r in rows:
        print(f"  {r['optimizer']:<20} {r['step_ms']:9.2f} ms")
    if not on_gpu:
        print("  (CPU: torch path, not a GPU number)")
    if report is not None:
        report["optimizer"] = rows
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    run(quick=ap.parse_args().quick)
