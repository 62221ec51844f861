"""GEMM benchmark: correctness on the GPU, TFLOP/s vs torch.matmul, and an occupancy sweep.

    python benchmarks/gemm_bench.py [--quick] [--out benchmarks/out/gemm.json]

On a GPU (CUDA or ROCm):

1. correctness vs a float64 reference: odd shapes, transposed operands, fp16/bf16/fp32
   (ieee and, on NVIDIA, tf32), tiled and persistent forms, an occupancy-shaped launch;
2. the smem_bytes knob on real hardware: blocks/SM from the calculator vs the driver's
   occupancy API, before and after shaping;
3. TFLOP/s of the tuned config vs torch.matmul for bf16/fp16 at 4096^3, 8192^3 and
   16384 x 1024 x 8192 (M x N x K; tuned winners are cached, see COKIT_CACHE_DIR);
4. a sweep over num_warps x smem_bytes x num_sms showing how time grows as occupancy shrinks.

Without a GPU it runs the torch path only (a CPU correctness check of the torch reference,
no timings of Triton kernels) and says so. It never asserts on wall-clock time.
Budget: about 3 minutes on one H200 (``quick=True``: about 1 minute); gpu_check passes a
:class:`~cokit.bench.timing.Budget` per section and a section stops adding points once it is spent.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from typing import Any

import torch

from cokit.bench.timing import Budget, kernel_resources, median_ms
from cokit.files import OutputError, prepare_out_file
from cokit.files import atomic_write_text as atomic_write

# Kernel modules are imported when a section runs (never at import), so that gpu_check
# imports and reports even when one of them fails to.


def _gemm() -> Any:
    from cokit.triton_kernels.gemm import gemm

    return gemm


def _config_cls() -> Any:
    from cokit.triton_kernels.gemm_config import GemmConfig

    return GemmConfig


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}.get(dtype, str(dtype))


def _with_shared_memory(kernel: Any, smem: int, limits: Any) -> Any:
    from cokit.triton_kernels.shaped_launch import with_shared_memory

    return with_shared_memory(kernel, smem, limits)


def _regs(kernel: Any) -> dict[str, Any]:
    """n_regs / n_spills of a compiled kernel (None when unknown)."""
    res = kernel_resources(kernel)
    return {"n_regs": res["n_regs"], "n_spills": res["n_spills"]}


def _out_of_time(rows: list[dict], kind: str, budget: Budget | None, left: int = 1) -> bool:
    """True (and one 'skipped' row) when the budget is spent."""
    if budget is None or not budget.stop(left):
        return False
    rows.append(dict(kind=kind, skipped=f"time budget spent ({left} point(s) left)"))
    return True


OUT_EPS = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}
PERF_SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192), (16384, 1024, 8192)]  # M, N, K


def _bound_ratio(
    c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, precision: str
) -> float:
    """max |c - ref| / bound, bound = 2 (eps_out |ref| + (K 2^-24 + eps_tf32) |A||B|);
    <= 1 passes (same rule as tests/test_gemm.py)."""
    a64, b64 = a.double(), b.double()
    ref = a64 @ b64
    mag = a64.abs() @ b64.abs()
    if bias is not None:
        ref = ref + bias.double()
        mag = mag + bias.double().abs()
    eps_dot = 2.0**-10 if (precision == "tf32" and a.dtype == torch.float32) else 0.0
    tol = 2 * (OUT_EPS[a.dtype] * ref.abs() + (a.shape[1] * 2.0**-24 + eps_dot) * mag) + 1e-30
    err = (c.double() - ref).abs()
    if not torch.isfinite(c).all():
        return math.inf
    return float((err / tol).max())


def _print_table(rows: list[dict], kind: str, cols: list[str]) -> None:
    sel = [r for r in rows if r.get("kind") == kind]
    if not sel:
        return
    print(f"\n[gemm] {kind}")
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in sel)) for c in cols]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)))
    for r in sel:
        print("  ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(cols, widths, strict=True)))


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return "-" if v is None else str(v)


# ---------------------------------------------------------------------- sections
def correctness(
    rows: list[dict], device: torch.device, backend: str, quick: bool, budget: Budget | None = None
) -> None:
    """Kernel vs float64 on odd shapes, transposed operands, every dtype, both forms.

    Each distinct shape/stride specialization is a new compile (seconds each), so the cases
    are a covering list rather than the full product; ``quick`` keeps one odd shape."""
    from cokit.triton_kernels.backend import device_limits
    from cokit.triton_kernels.occupancy import smem_for_blocks

    gemm, GemmConfig = _gemm(), _config_cls()
    precisions = [(torch.float16, "ieee"), (torch.bfloat16, "ieee"), (torch.float32, "ieee")]
    if backend == "cuda":
        precisions.append((torch.float32, "tf32"))
    dtypes = [torch.bfloat16] if quick else [torch.float16, torch.bfloat16, torch.float32]
    odd = [(17, 33, 65)] if quick else [(1, 1, 1), (17, 33, 65), (128, 96, 200)]
    cases = []  # (shape, dtype, precision, form, layout, bias)
    for shape in odd:
        for dtype, precision in precisions:
            cases.append((shape, dtype, precision, "tiled", "nn", True))
    for dtype in dtypes:
        cases.append(((17, 33, 65), dtype, "ieee", "tiled", "tt", False))
        cases.append(((17, 33, 65), dtype, "ieee", "persistent", "tt", False))
        cases.append(((128, 96, 200), dtype, "ieee", "persistent", "nn", True))
    if not quick:
        cases.append(((1000, 1000, 1000), torch.bfloat16, "ieee", "tiled", "nn", True))
        cases.append(((1000, 1000, 1000), torch.bfloat16, "ieee", "persistent", "tt", False))
    stages = 2 if backend == "hip" else 3
    configs = {
        "tiled": GemmConfig(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=stages),
        "persistent": GemmConfig(
            BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=stages, persistent=True, num_sms=7
        ),
    }
    limits = device_limits(device)
    for i, ((M, N, K), dtype, precision, form, layout, with_bias) in enumerate(cases):
        if _out_of_time(rows, "correctness", budget, len(cases) - i + 3):
            return
        a = (
            torch.randn(M, K, device=device).to(dtype)
            if layout == "nn"
            else torch.randn(K, M, device=device).to(dtype).t()
        )
        b = (
            torch.randn(K, N, device=device).to(dtype)
            if layout == "nn"
            else torch.randn(N, K, device=device).to(dtype).t()
        )
        bias = torch.randn(N, device=device).to(dtype) if with_bias else None
        out = torch.full((M, N), float("nan"), device=device, dtype=dtype)
        err = None
        try:
            gemm(a, b, bias, config=configs[form], precision=precision, out=out)
            ratio = _bound_ratio(out, a, b, bias, precision)
        except Exception as exc:  # report, keep going
            ratio, err = math.inf, f"{type(exc).__name__}: {exc}"[:300]
        rows.append(
            dict(
                kind="correctness",
                shape=f"{M}x{N}x{K}",
                dtype=dtype_name(dtype),
                precision=precision,
                form=form,
                layout=layout,
                bias=with_bias,
                err_over_bound=ratio,
                ok=ratio <= 1.0,
                error=err,
            )
        )
    # the default (untuned) choice, an occupancy-shaped launch and an SM carve-out
    M, N, K = 512, 384, 320
    a = torch.randn(M, K, device=device, dtype=torch.bfloat16)
    b = torch.randn(K, N, device=device, dtype=torch.bfloat16)
    extra = (
        ("default-untuned", {"tune": False}),
        ("shaped-1-block", {"config": configs["tiled"].replace(smem_bytes=smem_for_blocks(limits, 1))}),
        (
            "persistent-carveout",
            {"config": configs["persistent"].replace(num_sms=max(1, limits.num_sms - 16))},
        ),
    )
    for i, (name, kw) in enumerate(extra):
        if _out_of_time(rows, "correctness", budget, len(extra) - i):
            return
        err = None
        try:
            c = gemm(a, b, **kw)
            ratio = _bound_ratio(c, a, b, None, "ieee")
        except Exception as exc:
            ratio, err = math.inf, f"{type(exc).__name__}: {exc}"[:300]
        rows.append(
            dict(
                kind="correctness",
                shape=f"{M}x{N}x{K}",
                dtype="bf16",
                precision="ieee",
                form=name,
                layout="nn",
                bias=False,
                err_over_bound=ratio,
                ok=ratio <= 1.0,
                error=err,
            )
        )


def occupancy_check(
    rows: list[dict], device: torch.device, backend: str, quick: bool = False, budget: Budget | None = None
) -> None:
    """The smem_bytes knob on hardware: calculator vs the driver, before and after shaping."""
    from cokit.triton_kernels.backend import device_limits
    from cokit.triton_kernels.gemm import warmup_gemm
    from cokit.triton_kernels.occupancy import driver_occupancy, kernel_occupancy, smem_for_blocks

    GemmConfig = _config_cls()
    limits = device_limits(device)
    stages = 2 if backend == "hip" else 3
    for warps in (4, 8):
        if _out_of_time(rows, "occupancy_check", budget):
            return
        cfg = GemmConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=warps, num_stages=stages)
        try:
            base = warmup_gemm(cfg, torch.bfloat16, device=device)
            occ0 = kernel_occupancy(base, limits)
            variants = [("natural", base, occ0)]
            for blocks in range(occ0.blocks_per_sm - 1, 0, -1):
                smem = smem_for_blocks(limits, blocks)
                if smem < base.metadata.shared:
                    continue
                shaped = _with_shared_memory(base, smem, limits)
                variants.append((f"smem={smem}", shaped, kernel_occupancy(shaped, limits)))
            for name, kern, occ in variants:
                try:
                    drv = driver_occupancy(kern)
                except Exception as exc:  # driver API missing: say so
                    drv = f"unavailable: {exc}"[:200]
                rows.append(
                    dict(
                        kind="occupancy_check",
                        num_warps=warps,
                        variant=name,
                        shared=int(kern.metadata.shared),
                        registers=occ.registers,
                        n_spills=_regs(kern)["n_spills"],
                        blocks_calc=occ.blocks_per_sm,
                        blocks_driver=drv,
                        match=(drv == occ.blocks_per_sm) if isinstance(drv, int) else None,
                        limiting=occ.limiting,
                    )
                )
        except Exception as exc:
            rows.append(
                dict(kind="occupancy_check", num_warps=warps, error=f"{type(exc).__name__}: {exc}"[:300])
            )


def perf(
    rows: list[dict],
    device: torch.device,
    quick: bool,
    cache_dir: str | None = None,
    budget: Budget | None = None,
) -> None:
    """Tuned config vs torch.matmul (tuning time and cache hits recorded)."""
    from cokit.triton_kernels.gemm import select_config, warmup_gemm

    gemm = _gemm()
    from cokit.triton_kernels.tuning_cache import TuningCache

    shapes = PERF_SHAPES[:1] if quick else PERF_SHAPES
    dtypes = [torch.bfloat16] if quick else [torch.bfloat16, torch.float16]
    points = [(shape, dtype) for shape in shapes for dtype in dtypes]
    for i, ((M, N, K), dtype) in enumerate(points):
        if _out_of_time(rows, "perf", budget, len(points) - i):
            return
        a = torch.randn(M, K, device=device, dtype=dtype)
        b = torch.randn(K, N, device=device, dtype=dtype)
        flops = 2.0 * M * N * K
        row: dict[str, Any] = dict(kind="perf", shape=f"{M}x{N}x{K}", dtype=dtype_name(dtype))
        try:
            t0 = time.time()
            with contextlib.suppress(Exception):  # informative only
                key = TuningCache.key(torch.cuda.get_device_name(device), dtype, M, N, K)
                row["cache_hit"] = TuningCache(cache_dir).load(key) is not None
            cfg = select_config(a, b, cache_dir=cache_dir)
            row["tune_s"] = round(time.time() - t0, 1)
            out = torch.empty(M, N, device=device, dtype=dtype)
            gemm(a, b, config=cfg, out=out)
            with contextlib.suppress(Exception):  # this config's compiled kernel (a cache hit): regs, spills
                row.update(_regs(warmup_gemm(cfg, dtype, M, N, K, device=device)))
            ref = torch.matmul(a, b)
            rel = float((out.float() - ref.float()).norm() / ref.float().norm())
            t_ours = median_ms(
                lambda a=a, b=b, cfg=cfg, out=out: gemm(a, b, config=cfg, out=out), True, quick
            )
            t_torch = median_ms(lambda a=a, b=b: torch.matmul(a, b), True, quick)
            row.update(
                config=cfg.spec(),
                ms=t_ours,
                tflops=flops / t_ours / 1e9,
                torch_ms=t_torch,
                torch_tflops=flops / t_torch / 1e9,
                vs_torch=t_torch / t_ours,
                rel_err_vs_torch=rel,
                ok=rel < 1e-2,
            )
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        rows.append(row)


def sweep(
    rows: list[dict], device: torch.device, backend: str, quick: bool, budget: Budget | None = None
) -> None:
    """num_warps x smem_bytes x num_sms on one shape: time and TFLOP/s vs occupancy.

    The base tile (128x128x32) leaves room for more than one block per SM, so that raising
    smem_bytes has residency to take away; num_sms=None is the tiled form, a number is the
    persistent form on that many SMs (the rest carved out)."""
    from cokit.triton_kernels.backend import device_limits
    from cokit.triton_kernels.gemm import warmup_gemm
    from cokit.triton_kernels.occupancy import kernel_occupancy, smem_for_blocks

    gemm, GemmConfig = _gemm(), _config_cls()
    limits = device_limits(device)
    M, N, K = (4096, 4096, 4096) if quick else (8192, 8192, 8192)
    dtype = torch.bfloat16
    base = GemmConfig(
        BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, GROUP_M=8, num_warps=8, num_stages=2 if backend == "hip" else 4
    )
    a = torch.randn(M, K, device=device, dtype=dtype)
    b = torch.randn(K, N, device=device, dtype=dtype)
    out = torch.empty(M, N, device=device, dtype=dtype)
    flops = 2.0 * M * N * K
    sms = limits.num_sms
    num_sms_levels = [None, sms, (3 * sms) // 4, sms // 2] if not quick else [None, sms // 2]
    for warps in (4, 8):
        if _out_of_time(rows, "sweep", budget):
            return
        cfg0 = base.replace(num_warps=warps, smem_bytes=None, persistent=False, num_sms=None)
        try:
            natural = kernel_occupancy(warmup_gemm(cfg0, dtype, M, N, K, device=device), limits)
        except Exception as exc:
            rows.append(dict(kind="sweep", num_warps=warps, error=f"{type(exc).__name__}: {exc}"[:300]))
            continue
        smem_levels: list[int | None] = [None]
        for blocks in range(natural.blocks_per_sm - 1, 0, -1):
            smem_levels.append(smem_for_blocks(limits, blocks))
        if len(smem_levels) > (2 if quick else 3):  # natural, (middle,) one block per SM
            smem_levels = (
                [smem_levels[0]] + ([] if quick else [smem_levels[len(smem_levels) // 2]]) + [smem_levels[-1]]
            )
        for num_sms in num_sms_levels:
            for smem in smem_levels:
                if _out_of_time(rows, "sweep", budget):
                    return
                cfg = cfg0.replace(smem_bytes=smem, persistent=num_sms is not None, num_sms=num_sms)
                row: dict[str, Any] = dict(
                    kind="sweep",
                    shape=f"{M}x{N}x{K}",
                    dtype="bf16",
                    num_warps=warps,
                    num_sms=num_sms or "all (tiled)",
                )
                try:
                    kern = warmup_gemm(cfg.replace(smem_bytes=None), dtype, M, N, K, device=device)
                    if smem is not None:
                        if smem < kern.metadata.shared:
                            continue  # this form needs more than the level: skip the point
                        kern = _with_shared_memory(kern, smem, limits)
                    occ = kernel_occupancy(kern, limits)
                    row.update(
                        smem_bytes=int(kern.metadata.shared),
                        blocks_per_sm=occ.blocks_per_sm,
                        occupancy=occ.occupancy,
                        limiting=occ.limiting,
                        **_regs(kern),
                    )
                    gemm(a, b, config=cfg, out=out)
                    ms = median_ms(lambda cfg=cfg: gemm(a, b, config=cfg, out=out), True, quick)
                    row.update(ms=ms, tflops=flops / ms / 1e9)
                except Exception as exc:
                    row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                rows.append(row)


def cpu_correctness(rows: list[dict], quick: bool = False) -> None:
    """No GPU: the torch path (or the interpreter, if enabled) on small shapes, correctness only."""
    from cokit.triton_kernels.backend import kernel_path

    gemm = _gemm()
    path = kernel_path("cpu")
    shapes = [(17, 33, 65)] if quick else [(1, 1, 1), (17, 33, 65), (128, 96, 200)]
    for M, N, K in shapes:
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            a = torch.randn(M, K).to(dtype)
            b = torch.randn(K, N).to(dtype)
            bias = torch.randn(N).to(dtype)
            c = gemm(a, b, bias)
            ratio = _bound_ratio(c, a, b, bias, "ieee")
            rows.append(
                dict(
                    kind="correctness",
                    path=path,
                    shape=f"{M}x{N}x{K}",
                    dtype=dtype_name(dtype),
                    precision="ieee",
                    form="default",
                    layout="nn",
                    err_over_bound=ratio,
                    ok=ratio <= 1.0,
                )
            )


SECTIONS = ("correctness", "occupancy_check", "perf", "sweep")


def run_section(
    name: str,
    rows: list[dict],
    quick: bool = False,
    cache_dir: str | None = None,
    budget: Budget | None = None,
) -> None:
    """One section on the current GPU (``correctness`` falls back to the CPU check without one);
    exceptions propagate (gpu_check reports the phase as FAILED)."""
    from cokit.triton_kernels.backend import kernel_path

    if not torch.cuda.is_available():
        if name != "correctness":
            raise RuntimeError(f"the GEMM {name} section needs a GPU")
        cpu_correctness(rows, quick)
        return
    device = torch.device("cuda", torch.cuda.current_device())
    backend = kernel_path(device)
    if backend == "torch":
        raise RuntimeError("triton is not importable: no GEMM kernel to check")
    if name == "correctness":
        correctness(rows, device, backend, quick, budget)
    elif name == "occupancy_check":
        occupancy_check(rows, device, backend, quick, budget)
    elif name == "perf":
        perf(rows, device, quick, cache_dir, budget)
    elif name == "sweep":
        sweep(rows, device, backend, quick, budget)
    else:
        raise ValueError(f"unknown GEMM section {name!r}; allowed: {', '.join(SECTIONS)}")


def summarize(rows: list[dict], kinds: tuple[str, ...] = SECTIONS) -> dict[str, Any]:
    """Counts and headline numbers of some rows (one section or all)."""
    sel = [r for r in rows if r.get("kind") in kinds]
    out: dict[str, Any] = {
        "errors": sum(1 for r in sel if r.get("error")),
        "skipped": sum(1 for r in sel if r.get("skipped")),
    }
    checks = [r for r in sel if r.get("kind") == "correctness" and "ok" in r]
    if checks:
        out["correctness_ok"] = all(r.get("ok") for r in checks)
        out["correctness"] = f"{sum(1 for r in checks if r.get('ok'))}/{len(checks)} within bound"
    occ = [r for r in sel if r.get("kind") == "occupancy_check" and r.get("match") is not None]
    if occ:
        out["occupancy_matches_driver"] = all(r["match"] for r in occ)
    tf = [r for r in sel if r.get("kind") == "perf" and r.get("tflops")]
    if tf:
        best = max(tf, key=lambda r: r["tflops"])
        out["best_tflops"] = round(best["tflops"], 1)
        out["best_vs_torch"] = round(best["vs_torch"], 3)
        out["best_shape"] = best["shape"]
    sw = [r for r in sel if r.get("kind") == "sweep" and r.get("tflops")]
    if sw:
        out["sweep_points"] = len(sw)
        out["sweep_tflops_range"] = [
            round(min(r["tflops"] for r in sw), 1),
            round(max(r["tflops"] for r in sw), 1),
        ]
    return out


def print_rows(rows: list[dict], kinds: tuple[str, ...] = SECTIONS) -> None:
    """The tables of the sections in ``kinds``."""
    checks = [r for r in rows if r.get("kind") == "correctness" and r.get("kind") in kinds and "ok" in r]
    if checks:
        bad = [r for r in checks if not r.get("ok")]
        print(f"[gemm] correctness: {len(checks) - len(bad)}/{len(checks)} within bound")
        for r in bad[:10]:
            print(f"  FAIL {r}")
    if "occupancy_check" in kinds:
        _print_table(
            rows,
            "occupancy_check",
            [
                "num_warps",
                "variant",
                "shared",
                "registers",
                "n_spills",
                "blocks_calc",
                "blocks_driver",
                "match",
                "limiting",
                "error",
            ],
        )
    if "perf" in kinds:
        _print_table(
            rows,
            "perf",
            [
                "shape",
                "dtype",
                "config",
                "ms",
                "tflops",
                "torch_tflops",
                "vs_torch",
                "n_regs",
                "n_spills",
                "cache_hit",
                "tune_s",
                "error",
            ],
        )
    if "sweep" in kinds:
        _print_table(
            rows,
            "sweep",
            [
                "num_warps",
                "num_sms",
                "smem_bytes",
                "blocks_per_sm",
                "occupancy",
                "n_regs",
                "n_spills",
                "ms",
                "tflops",
                "error",
            ],
        )
    for r in rows:
        if r.get("kind") in kinds and r.get("skipped"):
            print(f"[gemm] {r['kind']}: {r['skipped']}")


# ---------------------------------------------------------------------- entry points
def run(
    report: dict, quick: bool = False, cache_dir: str | None = None, budget: Budget | None = None
) -> list[dict]:
    """Run every section; add a summary to ``report['gemm']`` and return the rows."""
    t_start = time.time()
    rows: list[dict] = []
    summary: dict[str, Any] = {"quick": quick}
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        summary["note"] = "no GPU: ran the torch/interpreter path only (correctness on small shapes)"
        print(f"[gemm] {summary['note']}")
    else:
        summary["device"] = torch.cuda.get_device_name()
    for name in SECTIONS if on_gpu else ("correctness",):
        t0 = time.time()
        try:
            run_section(name, rows, quick, cache_dir, budget)
        except Exception as exc:  # one broken section must not hide the others
            rows.append(dict(kind=name, error=f"{type(exc).__name__}: {exc}"[:500]))
        summary[f"{name}_s"] = round(time.time() - t0, 1)
    for r in rows:
        r.setdefault("bench", "gemm")
    summary.update(summarize(rows))
    summary["seconds"] = round(time.time() - t_start, 1)
    report["gemm"] = summary
    print_rows(rows)
    print(f"[gemm] done in {summary['seconds']} s")
    return rows


def main(argv: list[str] | None = None) -> int:
    """Command line: run, print the tables, write JSON."""
    import argparse

    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer shapes and sweep points (about 1 minute)")
    p.add_argument(
        "--out",
        default=os.path.join("benchmarks", "out", "gemm.json"),
        help="JSON output file; its folder is checked for writing before anything runs, and an "
        "existing file (an earlier run's) is refused unless --overwrite",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    p.add_argument("--cache-dir", default=None, help="tuning cache directory (default $COKIT_CACHE_DIR)")
    args = p.parse_args(argv)
    try:
        out = prepare_out_file(args.out, overwrite=args.overwrite)
    except OutputError as exc:
        print(f"gemm_bench: error: {exc}", file=sys.stderr, flush=True)
        return 2
    report: dict = {}
    rows = run(report, quick=args.quick, cache_dir=args.cache_dir)
    atomic_write(out, json.dumps({"summary": report["gemm"], "rows": rows}, indent=1, default=str))
    print(f"[gemm] wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
