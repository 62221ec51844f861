"""CPU DeMo step: cokit's DeMo against a re-implementation of bloc97's reference DeMo.

    python benchmarks/demo_baseline.py                       # 1M, 10M, 50M parameters
    python benchmarks/demo_baseline.py --sizes 1M --steps 5 --out benchmarks/out/demo_baseline.json

Both optimizers run one step on the same transformer-shaped parameters and gradients (fp32,
world size 1, no network), alternating so that both see the same machine load. The
reference (:class:`ReferenceDeMo`) follows github.com/bloc97/DeMo's ``demo.py`` operation by
operation, written anew here: per tensor, ``delta = decay * delta + lr * grad``; chunked DCT
by ``einsum`` with the orthonormal basis; ``topk(|x|, sorted=False)`` per chunk and
``gather``; the transmitted estimate by ``scatter_reduce(mean)`` and the inverse ``einsum``;
the "gathered" payloads (at world size 1, the rank's own) decoded the same way; ``sign``;
an SGD step. Prints the table and writes JSON (atomically) with the ratio per size.
CPU numbers, not GPU numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable

import torch

from cokit.files import OutputError, atomic_write_text, prepare_out_file
from cokit.triton_kernels.tiling import basis_matrix

#: parameter-count presets: (d_model, blocks) of optimizer_bench.layer_shapes
SIZES = {"1M": (256, 1), "10M": (512, 3), "50M": (1024, 4)}


def _chunk_side(n: int, target: int) -> int:
    """bloc97's ``_get_smaller_split``: ``target`` if it divides ``n``, else the largest
    divisor below it (the smallest divisor when none is below), else ``n``."""
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    for i, d in enumerate(divisors):
        if d == target:
            return d
        if d > target:
            return d if i == 0 else divisors[i - 1]
    return n


class ReferenceDeMo(torch.optim.Optimizer):
    """bloc97's DeMo step at world size 1 (what its all-gather returns there: the rank's own
    payload), for timing comparisons. Not part of cokit's API."""

    def __init__(
        self, params: Iterable[torch.Tensor], lr: float, decay: float = 0.999, topk: int = 32, chunk: int = 64
    ):
        super().__init__(params, {"lr": lr})
        self.decay, self.topk, self.chunk = decay, topk, chunk
        self._basis: dict[int, torch.Tensor] = {}

    def _forward(self, n: int) -> torch.Tensor:
        """``F`` with ``x @ F`` = DCT-II along the last axis (bloc97's ``_dct(I)``)."""
        if n not in self._basis:
            self._basis[n] = basis_matrix(n).T.contiguous()
        return self._basis[n]

    def _encode(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() > 1:
            h, w = _chunk_side(x.shape[0], self.chunk), _chunk_side(x.shape[1], self.chunk)
            tiles = x.reshape(x.shape[0] // h, h, x.shape[1] // w, w)
            return torch.einsum("yhxw,hb,wd->yxbd", tiles, self._forward(h), self._forward(w))
        w = _chunk_side(x.shape[0], self.chunk)
        return torch.einsum("xw,wb->xb", x.reshape(-1, w), self._forward(w))

    def _decode(self, c: torch.Tensor) -> torch.Tensor:
        if c.dim() > 2:
            h, w = c.shape[2], c.shape[3]
            x = torch.einsum("yxbd,hb,wd->yhxw", c, self._forward(h), self._forward(w))
            return x.reshape(c.shape[0] * h, c.shape[1] * w)
        return torch.einsum("xb,wb->xw", c, self._forward(c.shape[1])).reshape(-1)

    @staticmethod
    def _compress(c: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        flat = c.reshape(*c.shape[:2], -1) if c.dim() > 2 else c
        k = max(1, min(k, flat.shape[-1]))
        idx = torch.topk(flat.abs(), k=k, dim=-1, largest=True, sorted=False).indices
        return idx, torch.gather(flat, -1, idx)

    @staticmethod
    def _decompress(shape: torch.Size, idx: torch.Tensor, val: torch.Tensor) -> torch.Tensor:
        flat = (
            torch.zeros(*shape[:2], shape[2] * shape[3], dtype=val.dtype)
            if len(shape) > 2
            else torch.zeros(shape)
        )
        flat.scatter_reduce_(-1, idx, val, reduce="mean", include_self=False)
        return flat.reshape(shape)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            lr = group["lr"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "delta" not in state:
                    state["delta"] = torch.zeros_like(p)
                delta = state["delta"]
                delta.mul_(self.decay).add_(p.grad, alpha=lr)
                coeffs = self._encode(delta)
                idx, val = self._compress(coeffs, self.topk)
                delta.sub_(self._decode(self._decompress(coeffs.shape, idx, val)))
                gathered_idx, gathered_val = torch.cat([idx], -1), torch.cat([val], -1)
                update = self._decode(self._decompress(coeffs.shape, gathered_idx, gathered_val))
                p.add_(update.sign_().reshape(p.shape), alpha=-lr)


def make_params(d_model: int, blocks: int, seed: int = 0) -> list[torch.nn.Parameter]:
    """Transformer-shaped fp32 parameters with random gradients."""
    from cokit.bench.optimizer_bench import layer_shapes

    gen = torch.Generator().manual_seed(seed)
    params = []
    for s in layer_shapes(d_model, blocks):
        p = torch.nn.Parameter(torch.randn(s, generator=gen) * 0.02)
        p.grad = torch.randn(s, generator=gen)
        params.append(p)
    return params


def time_steps(opts: dict[str, torch.optim.Optimizer], steps: int) -> dict[str, float]:
    """Median step time (ms) of each optimizer, alternating them step by step after a warm-up."""
    for opt in opts.values():
        opt.step()
    samples: dict[str, list[float]] = {name: [] for name in opts}
    for _ in range(steps):
        for name, opt in opts.items():
            t0 = time.perf_counter()
            opt.step()
            samples[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(v) for name, v in samples.items()}


def run(sizes: list[str], steps: int, topk: int = 32, chunk: int = 64) -> list[dict]:
    """One row per size: both step times and cokit's time over the reference's."""
    from cokit.compress import DeMo

    rows = []
    for name in sizes:
        d_model, blocks = SIZES[name]
        ours, ref = make_params(d_model, blocks), make_params(d_model, blocks)
        n = sum(p.numel() for p in ours)
        print(f"  {name}: {n:,} parameters, {steps} steps each ...", flush=True)
        ms = time_steps(
            {
                "cokit": DeMo(ours, lr=1e-3, compression_topk=topk, compression_chunk=chunk),
                "reference": ReferenceDeMo(ref, lr=1e-3, topk=topk, chunk=chunk),
            },
            steps,
        )
        rows.append(
            {
                "size": name,
                "params": n,
                "cokit_ms": ms["cokit"],
                "reference_ms": ms["reference"],
                "cokit_vs_reference": ms["cokit"] / ms["reference"],
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--steps", type=int, default=7, help="timed steps per optimizer and size (median)")
    ap.add_argument("--topk", type=int, default=32)
    ap.add_argument("--out", default=None, help="JSON results file")
    ap.add_argument("--overwrite", action="store_true")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("--steps must be >= 1")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        ap.error("unset TRITON_INTERPRET: the interpreter is a test path, not the CPU path being timed")
    try:
        out = prepare_out_file(args.out, overwrite=args.overwrite) if args.out else None
    except OutputError as exc:
        ap.error(str(exc))
    print(
        f"DeMo step on CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads), world size 1, k={args.topk}"
    )
    rows = run(args.sizes, args.steps, args.topk)
    print(f"  {'size':<5} {'params':>12} {'cokit ms':>10} {'reference ms':>13} {'cokit/ref':>10}")
    for r in rows:
        print(
            f"  {r['size']:<5} {r['params']:>12,} {r['cokit_ms']:>10.1f} {r['reference_ms']:>13.1f} "
            f"{r['cokit_vs_reference']:>10.2f}"
        )
    if out is not None:
        meta = {
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "steps": args.steps,
            "topk": args.topk,
        }
        atomic_write_text(out, json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
