"""Optimizer-step time of DeMo (world size 1: encode + decode, no network) vs AdamW.

Part of ``python -m cokit.bench.gpu_check``; alone: ``python -m cokit.bench.optimizer_bench [--quick]``.
The parameters are transformer-shaped (attention, MLP, norms) with random gradients. On a GPU,
DeMo runs the Triton kernels and AdamW its fused implementation; on a CPU both run torch code
and the numbers say nothing about a GPU.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from cokit.bench.timing import Budget, median_ms


def layer_shapes(d_model: int, layers: int) -> list[tuple[int, ...]]:
    """Parameter shapes of ``layers`` pre-norm transformer blocks."""
    block = [
        (3 * d_model, d_model),
        (3 * d_model,),
        (d_model, d_model),
        (d_model,),
        (4 * d_model, d_model),
        (4 * d_model,),
        (d_model, 4 * d_model),
        (d_model,),
        (d_model,),
        (d_model,),
        (d_model,),
        (d_model,),
    ]
    return block * layers


def run(report: dict | None = None, quick: bool = False, budget: Budget | None = None) -> list[dict]:
    """Time each optimizer on one bucket of parameters; print a table; return rows.

    With a ``budget``, optimizers not yet timed when it is spent are skipped (and counted)."""
    from cokit.compress import DeMo

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
    adamw_kw: dict[str, Any] = {"fused": True} if on_gpu else {"foreach": True}
    cases = [
        ("AdamW", lambda: torch.optim.AdamW(params, lr=1e-4, **adamw_kw)),
        ("DeMo compact k=32", lambda: DeMo(params, lr=1e-4, compression_topk=32)),
        ("DeMo sign k=32", lambda: DeMo(params, lr=1e-4, compression_topk=32, payload="sign")),
        ("DeMo compact k=8", lambda: DeMo(params, lr=1e-4, compression_topk=8)),
    ]
    rows = []
    device_name = torch.cuda.get_device_name() if on_gpu else "cpu"
    for i, (name, make) in enumerate(cases):
        if budget is not None and budget.stop(len(cases) - i):
            print(f"  time budget spent: skipped {', '.join(c[0] for c in cases[i:])}")
            break
        opt = make()
        ms = median_ms(opt.step, on_gpu, quick)
        rows.append(
            {
                "optimizer": name,
                "params": n,
                "dtype": str(dtype).replace("torch.", ""),
                "device": device_name,
                "step_ms": ms,
            }
        )
        if name != "AdamW" and rows[0]["optimizer"] == "AdamW":
            rows[-1]["vs_adamw"] = ms / rows[0]["step_ms"]
    print(
        f"optimizer step, {n:,} parameters ({layers} blocks of d={d_model}, {str(dtype).replace('torch.', '')}) on "
        f"{device_name}; DeMo at world size 1 (encode + decode, no network)"
    )
    for r in rows:
        rel = f"  ({r['vs_adamw']:.2f}x AdamW)" if "vs_adamw" in r else ""
        print(f"  {r['optimizer']:<20} {r['step_ms']:9.2f} ms{rel}")
    if not on_gpu:
        print("  (CPU: torch path, not a GPU number)")
    if report is not None:
        report["optimizer"] = rows
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    run(quick=ap.parse_args().quick)
