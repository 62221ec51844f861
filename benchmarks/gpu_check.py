"""The one GPU check: every kernel vs its torch reference on real sizes, then speed.

    python -m cokit.bench.gpu_check [--quick] [--out benchmarks/out/gpu_check] [--only PHASE ...]
    cokit bench gpu-check [--quick] [--out DIR]

Runs in phases, each with its own time budget and caught separately (a failing phase is
FAILED with its traceback in the log and the JSON; the others still run; a phase whose
budget is spent stops adding work and is marked BUDGET):

  env              versions (torch, triton, CUDA/HIP, driver) and the device
  copy_bandwidth   device-to-device copy GB/s (the roofline the kernels are compared with)
  kernels.*        dct, topk, ef_encode, ef_decode: check vs the torch reference (relative
                   error, index agreement), then time both (median of CUDA-event timings),
                   GB/s, % of copy bandwidth against the target (DCT >= 70%, fused encode and
                   decode >= 60%), the static estimate beside it (roofline ms at the chip's
                   data-sheet HBM bandwidth, blocks per SM of the compiled builds), speedup,
                   n_regs/n_spills and the launch config it chose (tuned on the GPU)
  optimizer        DeMo step (Triton kernels, world size 1) vs fused AdamW
  gemm.*           correctness, occupancy vs the driver, TFLOP/s vs torch.matmul, occupancy sweep
  linear           cokit.overlap.Linear TFLOP/s vs torch.nn.functional.linear, bf16 LLM shapes
  linear.compile   cokit.overlap.Linear in torch.compile(fullgraph=True): its GEMM kernel inside
                   Inductor's code, vs eager and vs compiled nn.Linear, dynamic shapes
  overlap          one-GPU study: GEMM next to an EMULATED communication kernel
  train_step_overlap  a small transformer's training step with cokit.overlap.Linear next to an
                   EMULATED communication kernel: sequential, overlapped, shaped + high
                   priority, and the configs cokit.overlap.apply_overlap's tuner locked
  tp_layers        Column/RowParallelLinear MLP at world 1, collectives EMULATED, vs F.linear

Needs a visible GPU and TRITON_INTERPRET unset (else exits 2 with one line); ``--allow-cpu``
runs the torch reference path on the CPU at tiny sizes (no GPU numbers). ``--out`` receives
gpu_check.json and gpu_check.log (everything printed), rewritten atomically after every phase;
it is created and checked for writing before any phase runs, and a folder that already holds
them (an earlier check) is refused unless ``--overwrite`` is given.
Exit status: 0, 1 when a phase FAILED, 2 when the check cannot run here (one line says why).
Sized for one H200: --quick (the compression kernels, gemm.perf, linear, linear.compile and the
overlap phase; `--list` shows which) under 3 minutes, the full run under 8 (mostly Triton
compiles). Linear's target: >= 0.9x F.linear, and of compiled nn.Linear under Inductor.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import functools
import io
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

from cokit.bench.gpu_rows import fmt, print_rows, rel_err
from cokit.bench.gpu_tp_phase import phase_tp_layers
from cokit.bench.gpu_train_step_phase import phase_train_step_overlap

DEFAULT_OUT = os.path.join("benchmarks", "out", "gpu_check")
JSON_NAME, LOG_NAME = "gpu_check.json", "gpu_check.log"
TAG = "[gpu-check]"


# ---------------------------------------------------------------------- context and phases
@dataclass
class Context:
    """What every phase gets: device, mode, the current phase's budget and shared data."""

    device: Any
    on_gpu: bool
    quick: bool
    budget: Any = None  # cokit.bench.timing.Budget of the running phase
    shared: dict | None = None  # data built once and reused by later phases (the bucket)
    out: str | None = None  # the --out folder

    def pick(self, gpu_quick: Any, gpu_full: Any, cpu: Any) -> Any:
        """A size for this run: GPU --quick, GPU full, or the tiny CPU one."""
        if not self.on_gpu:
            return cpu
        return gpu_quick if self.quick else gpu_full


@dataclass
class Phase:
    name: str
    fn: Callable[[Context], dict]
    budget_quick: float  # seconds on one H200 with --quick
    budget_full: float
    needs_gpu: bool = False
    what: str = ""
    in_quick: bool = True  # part of --quick (compression kernels, GEMM/Linear, one overlap phase)


class PhaseFailure(Exception):
    """Raised by a phase hook to test failure handling (see COKIT_GPU_CHECK_FAIL)."""


# ---------------------------------------------------------------------- helpers
def _sync(ctx: Context) -> None:
    if ctx.on_gpu:
        import torch

        torch.cuda.synchronize()


def _run_cmd(cmd: list[str], timeout: float = 10.0) -> str | None:
    """stdout of a command, or None when it is missing, fails or hangs."""
    if shutil.which(cmd[0]) is None:
        return None
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except Exception:
        return None
    return res.stdout.strip() if res.returncode == 0 and res.stdout.strip() else None


def driver_version() -> dict[str, Any]:
    """Best effort: the kernel driver's version (nvidia-smi / rocm-smi, else libcuda's API)."""
    info: dict[str, Any] = {}
    smi = _run_cmd(
        [
            "nvidia-smi",
            "--query-gpu=driver_version,name,memory.total,clocks.max.sm,power.limit",
            "--format=csv,noheader",
        ]
    )
    if smi:
        info["nvidia_smi"] = smi.splitlines()[0]
        info["driver"] = smi.splitlines()[0].split(",")[0].strip()
    with contextlib.suppress(Exception):
        import ctypes

        lib = ctypes.CDLL("libcuda.so.1")
        v = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(v)) == 0:
            info["cuda_driver_api"] = f"{v.value // 1000}.{(v.value % 1000) // 10}"
    if "driver" not in info:
        rocm = _run_cmd(["rocm-smi", "--showdriverversion"])
        if rocm:
            info["driver"] = rocm.splitlines()[-1].split(":")[-1].strip()
    return info


# ---------------------------------------------------------------------- phases
def phase_env(ctx: Context) -> dict:
    """Versions and the device."""
    import torch

    out: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        "platform": platform.platform(),
    }
    try:
        import triton

        out["triton"] = triton.__version__
    except Exception as exc:
        out["triton"] = f"not importable: {type(exc).__name__}: {exc}"[:200]
    out.update(driver_version())
    if ctx.on_gpu:
        props = torch.cuda.get_device_properties(ctx.device)
        free, _ = torch.cuda.mem_get_info(ctx.device)
        dev = {
            "name": props.name,
            "sm_count": props.multi_processor_count,
            "memory_GiB": round(props.total_memory / 2**30, 1),
            "free_GiB": round(free / 2**30, 1),
            "capability": f"{props.major}.{props.minor}",
            "device_count": torch.cuda.device_count(),
        }
        with contextlib.suppress(Exception):
            from triton.runtime import driver

            target = driver.active.get_current_target()
            dev["triton_target"] = f"{target.backend}:{target.arch}"
            tp = driver.active.utils.get_device_properties(torch.cuda.current_device())
            dev["triton_props"] = {
                k: tp[k]
                for k in (
                    "max_shared_mem",
                    "multiprocessor_count",
                    "sm_clock_rate",
                    "mem_clock_rate",
                    "mem_bus_width",
                )
                if k in tp
            }
            if tp.get("mem_clock_rate") and tp.get("mem_bus_width"):  # kHz, bits; DDR
                dev["hbm_peak_GBps"] = round(2 * tp["mem_clock_rate"] * 1e3 * tp["mem_bus_width"] / 8 / 1e9)
        with contextlib.suppress(Exception):
            from cokit.triton_kernels.backend import device_limits, kernel_path

            lim = device_limits(ctx.device)
            dev["kernel_path"] = kernel_path(ctx.device)
            dev["max_shared_per_block"] = lim.max_shared_per_block
            dev["registers_per_sm"] = lim.registers_per_sm
    else:
        from cokit.triton_kernels.backend import kernel_path

        dev = {
            "name": f"cpu ({platform.processor() or platform.machine()})",
            "threads": torch.get_num_threads(),
            "kernel_path": kernel_path("cpu"),
        }
    out["device"] = dev
    print(
        f"  python {out['python']}  torch {out['torch']}  triton {out['triton']}  "
        f"cuda {out['cuda'] or '-'}  hip {out['hip'] or '-'}  driver {out.get('driver', '-')}"
        f"  (CUDA driver API {out.get('cuda_driver_api', '-')})"
    )
    desc = ", ".join(f"{k} {v}" for k, v in dev.items() if k not in ("name", "triton_props"))
    print(f"  device: {dev['name']}: {desc}")
    out["key"] = (
        f"{dev['name']}, {dev.get('sm_count', '-')} SMs, {dev.get('memory_GiB', '-')} GiB; "
        f"torch {out['torch']}, triton {out['triton']}, driver {out.get('driver', '-')}"
    )
    return out


def phase_copy(ctx: Context) -> dict:
    """Device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    import torch

    from cokit.bench.timing import median_ms

    n = ctx.pick(1 << 30, 1 << 30, 1 << 24) // 4
    src = torch.randn(n, device=ctx.device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), ctx.on_gpu, ctx.quick)
    bw = 2 * src.numel() * 4 / ms / 1e6
    assert ctx.shared is not None
    ctx.shared["copy_GBps"] = bw
    print(f"  copy of {src.numel() * 4 / 2**20:.0f} MiB: {ms:.3f} ms, {bw:.0f} GB/s (read + write)")
    return {"copy_GBps": bw, "bytes": src.numel() * 4, "ms": ms, "key": f"{bw:.0f} GB/s"}


def bucket_shapes(ctx: Context) -> list[tuple[int, ...]]:
    """A transformer-like bucket: square and MLP matrices plus norm/bias vectors."""
    if not ctx.on_gpu:
        return [(128, 128), (128, 256), (256,), (128,)]
    d = 2048 if ctx.quick else 4096
    return [(d, d)] * 4 + [(d, 4 * d)] * 2 + [(4 * d, d)] * 2 + [(d,)] * 8


CHUNK, TOPK, RANKS = 64, 32, 8


def _bucket(ctx: Context) -> dict:
    """The bucket every kernel phase uses (built once): bf16 grads on a GPU, fp32 on CPU."""
    import torch

    assert ctx.shared is not None
    if "bucket" not in ctx.shared:
        shapes = bucket_shapes(ctx)
        dtype = torch.bfloat16 if ctx.on_gpu else torch.float32
        gen = torch.Generator(device=ctx.device).manual_seed(0)
        xs = [torch.randn(s, device=ctx.device, generator=gen).to(dtype) for s in shapes]
        ctx.shared["bucket"] = {
            "shapes": shapes,
            "dtype": dtype,
            "xs": xs,
            "numel": sum(x.numel() for x in xs),
            "esz": xs[0].element_size(),
        }
    return ctx.shared["bucket"]


def _kernel_modules() -> list[Any]:
    from cokit.triton_kernels import dct, error_feedback, topk

    return [dct, topk, error_feedback]


def _time_row(
    ctx: Context,
    name: str,
    kernel: Callable,
    reference: Callable,
    nbytes: int,
    errs: dict,
    resources: list[dict],
) -> dict:
    """Time ``kernel`` (GPU) and ``reference``; one printed row with GB/s, registers and the
    launch configs the kernel chose (tuned on the GPU, once per block), e.g.
    ``2d|64x64=w8s1-tf32x3``. ``nbytes`` is every byte the kernel moves (no scratch exists)."""
    from cokit.bench.timing import median_ms, resources_text
    from cokit.triton_kernels import compress_config

    b = _bucket(ctx)
    chosen = compress_config.selected_configs(name) if name in compress_config.KERNELS else {}
    row: dict[str, Any] = {
        "kernel": name,
        "elements": b["numel"],
        "bytes": nbytes,
        **errs,
        "n_regs": resources_text(resources, "n_regs"),
        "n_spills": resources_text(resources, "n_spills"),
        "config": " ".join(f"{blk}={spec}" for blk, spec in sorted(chosen.items())) or "-",
        "compiled": resources,
    }
    bw = (ctx.shared or {}).get("copy_GBps")
    if ctx.on_gpu:
        if not ctx.budget.stop():
            ms = median_ms(kernel, True, ctx.quick)
            row.update(triton_ms=ms, GBps=nbytes / ms / 1e6)
            if bw:
                row["pct_of_copy"] = 100 * nbytes / ms / 1e6 / bw
                row["target"] = copy_target(name, row["pct_of_copy"])
            row.update(static_estimate(ctx, nbytes, resources))
        if not ctx.budget.stop():
            row["torch_ms"] = median_ms(reference, True, ctx.quick)
            if "triton_ms" in row:
                row["speedup"] = row["torch_ms"] / row["triton_ms"]
        cols = [
            "kernel",
            "triton_ms",
            "torch_ms",
            "GBps",
            "pct_of_copy",
            "target",
            "roofline_ms",
            "blocks_per_sm",
            "speedup",
            "n_regs",
            "n_spills",
            "config",
        ]
    else:
        ms = median_ms(reference, False, ctx.quick)
        row.update(torch_ms=ms, torch_GBps=nbytes / ms / 1e6)
        cols = ["kernel", "torch_ms", "torch_GBps", "n_regs", "n_spills", "config"]
    cols += [k for k in errs]
    print_rows([row], cols)
    return row


#: cokit.overlap.Linear's target: at least this fraction of F.linear's (and compiled nn.Linear's) speed
LINEAR_TARGET = 0.9
#: the issue's targets on an H200: % of device copy bandwidth per compression kernel
COPY_TARGETS = {"dct_encode": 70.0, "dct_decode": 70.0, "ef_encode": 60.0, "ef_decode": 60.0}


def static_estimate(ctx: Context, nbytes: int, resources: list[dict]) -> dict[str, Any]:
    """Beside a measured kernel: its memory roofline at the chip's data-sheet HBM bandwidth and
    the blocks per SM its compiled builds allow (``cokit info --kernels``' estimate, live)."""
    import torch

    from cokit.triton_kernels.backend import device_limits
    from cokit.triton_kernels.occupancy import occupancy
    from cokit.triton_kernels.roofline import datasheet_gbs

    out: dict[str, Any] = {}
    chip = datasheet_gbs(torch.cuda.get_device_name(ctx.device))
    if chip is not None:
        out["roofline_ms"] = nbytes / (chip[1] * 1e6)
    limits = device_limits(ctx.device)
    blocks = sorted(
        {
            occupancy(r["num_warps"], r["shared"] or 0, r["n_regs"], limits).blocks_per_sm
            for r in resources
            if r.get("num_warps")
        }
    )
    if blocks:
        out["blocks_per_sm"] = "/".join(map(str, blocks))
    return out


def copy_target(name: str, pct: float | None) -> str | None:
    """``'>=70%: met'`` or ``'>=70%: missed by 12 pts'`` for a kernel with a target."""
    target = COPY_TARGETS.get(name)
    if target is None or pct is None:
        return None
    return f">={target:.0f}%: met" if pct >= target else f">={target:.0f}%: missed by {target - pct:.0f} pts"


def _judge(row: dict, limits: dict[str, float]) -> list[str]:
    """Problems: errors above their limit (or not finite), index agreement below its floor."""
    problems = []
    for key, limit in limits.items():
        v = row.get(key)
        if v is None:
            continue
        bad = v < limit if "agreement" in key else not (v <= limit)
        if bad:
            problems.append(f"{row['kernel']}: {key}={fmt(v)} (limit {limit})")
    return problems


def _kernel_result(rows: list[dict], problems: list[str]) -> dict:
    key = "; ".join(
        f"{r['kernel']} "
        + (
            f"{r['GBps']:.0f} GB/s"
            + (f" {r['pct_of_copy']:.0f}% of copy" if "pct_of_copy" in r else "")
            + (f" ({r['target']})" if r.get("target") else "")
            + f" x{r.get('speedup', float('nan')):.2f}"
            if "GBps" in r
            else f"torch {r['torch_ms']:.2f} ms"
        )
        for r in rows
    )
    return {"rows": rows, "problems": problems, "key": key}


def phase_dct(ctx: Context) -> dict:
    import torch

    from cokit.bench.timing import KernelWatch
    from cokit.triton_kernels import dct

    b = _bucket(ctx)
    xs, shapes, dtype, numel, esz = b["xs"], b["shapes"], b["dtype"], b["numel"], b["esz"]
    with KernelWatch(_kernel_modules()) as enc:
        coeffs = dct.dct_encode_multi(xs, CHUNK)
        _sync(ctx)
    ref = [dct.dct_encode_reference(x, CHUNK) for x in xs]
    with KernelWatch(_kernel_modules()) as dec:
        back = dct.dct_decode_multi(coeffs, shapes, CHUNK, dtype=torch.float32)
        _sync(ctx)
    errs = {
        "rel_err": max(rel_err(c, r) for c, r in zip(coeffs, ref, strict=True)),
        "roundtrip_err": max(rel_err(x2, x) for x2, x in zip(back, xs, strict=True)),
    }
    del back, ref
    rows = [
        _time_row(
            ctx,
            "dct_encode",
            lambda: dct.dct_encode_multi(xs, CHUNK),
            lambda: [dct.dct_encode_reference(x, CHUNK) for x in xs],
            numel * (esz + 4),
            errs,
            enc.resources,
        )
    ]
    problems = _judge(rows[0], {"rel_err": 1e-2, "roundtrip_err": 1e-2})
    if not ctx.budget.stop():
        rows.append(
            _time_row(
                ctx,
                "dct_decode",
                lambda: dct.dct_decode_multi(coeffs, shapes, CHUNK, dtype),
                lambda: [
                    dct.dct_decode_reference(c, s, CHUNK).to(dtype)
                    for c, s in zip(coeffs, shapes, strict=True)
                ],
                numel * (4 + esz),
                {},
                dec.resources,
            )
        )
    assert ctx.shared is not None
    ctx.shared["coeffs"] = coeffs
    return _kernel_result(rows, problems)


def _coeffs(ctx: Context) -> list[Any]:
    """DCT coefficients of the bucket (the torch reference when the dct phase did not run)."""
    from cokit.triton_kernels import dct

    assert ctx.shared is not None
    if "coeffs" not in ctx.shared:
        ctx.shared["coeffs"] = [dct.dct_encode_reference(x, CHUNK) for x in _bucket(ctx)["xs"]]
    return ctx.shared["coeffs"]


def phase_topk(ctx: Context) -> dict:
    from cokit.bench.timing import KernelWatch
    from cokit.triton_kernels import topk

    big = max(_coeffs(ctx), key=lambda c: c.numel())
    with KernelWatch(_kernel_modules()) as w:
        idx, vals = topk.chunk_topk(big, TOPK)
        _sync(ctx)
    ridx, rvals = topk.chunk_topk_reference(big, TOPK)
    errs = {"index_agreement": float((idx == ridx).float().mean()), "rel_err": rel_err(vals, rvals)}
    row = _time_row(
        ctx,
        "chunk_topk",
        lambda: topk.chunk_topk(big, TOPK),
        lambda: topk.chunk_topk_reference(big, TOPK),
        big.numel() * 4 + idx.numel() * (idx.element_size() + 4),
        errs,
        w.resources,
    )
    return _kernel_result([row], _judge(row, {"index_agreement": 0.99, "rel_err": 1e-2}))


def _payload(ctx: Context) -> tuple[Any, Any]:
    """(indices, values) of one encoded step: from the ef_encode phase, else the torch reference."""
    import torch

    from cokit.triton_kernels import error_feedback

    assert ctx.shared is not None
    if "payload" not in ctx.shared:
        b = _bucket(ctx)
        deltas = [torch.randn(s, device=ctx.device) * 0.01 for s in b["shapes"]]
        ctx.shared["payload"] = error_feedback.ef_encode_reference(
            deltas, b["xs"], 0.999, 0.01, CHUNK, TOPK, value_dtype=torch.float16
        )
    return ctx.shared["payload"]


def phase_ef_encode(ctx: Context) -> dict:
    """Fused error-feedback encode (bf16 grads, fp32 buffers, fp16 payload values)."""
    import torch

    from cokit.bench.timing import KernelWatch
    from cokit.triton_kernels import error_feedback, tiling

    b = _bucket(ctx)
    xs, shapes, numel, esz = b["xs"], b["shapes"], b["numel"], b["esz"]
    payload, _ = tiling.payload_shape(shapes, CHUNK, TOPK)
    gen = torch.Generator(device=ctx.device).manual_seed(1)
    deltas = [torch.randn(s, device=ctx.device, generator=gen) * 0.01 for s in shapes]
    d_ker, d_ref = [d.clone() for d in deltas], [d.clone() for d in deltas]
    del deltas
    with KernelWatch(_kernel_modules()) as w:
        pi, pv = error_feedback.ef_encode(
            d_ker, xs, beta=0.999, lr=0.01, chunk=CHUNK, k=TOPK, value_dtype=torch.float16
        )
        _sync(ctx)
    ri, _ = error_feedback.ef_encode_reference(d_ref, xs, 0.999, 0.01, CHUNK, TOPK, value_dtype=torch.float16)
    errs = {
        "index_agreement": float((pi == ri).float().mean()),
        "delta_rel_err": max(rel_err(a, r) for a, r in zip(d_ker, d_ref, strict=True)),
    }
    assert ctx.shared is not None
    ctx.shared["payload"] = (pi, pv)
    # timed runs keep updating their own buffers (as training does), outside the checked ones
    row = _time_row(
        ctx,
        "ef_encode",
        lambda: error_feedback.ef_encode(
            d_ker, xs, beta=0.999, lr=0.01, chunk=CHUNK, k=TOPK, value_dtype=torch.float16
        ),
        lambda: error_feedback.ef_encode_reference(
            d_ref, xs, 0.999, 0.01, CHUNK, TOPK, value_dtype=torch.float16
        ),
        numel * (4 + esz + 4) + payload * (2 + 2),
        errs,
        w.resources,
    )
    return _kernel_result([row], _judge(row, {"index_agreement": 0.99, "delta_rel_err": 1e-2}))


def phase_ef_decode(ctx: Context) -> dict:
    """Decode of RANKS gathered payloads into the bucket's parameters."""
    import torch

    from cokit.bench.timing import KernelWatch
    from cokit.triton_kernels import error_feedback, tiling

    b = _bucket(ctx)
    xs, shapes, numel, esz = b["xs"], b["shapes"], b["numel"], b["esz"]
    payload, _ = tiling.payload_shape(shapes, CHUNK, TOPK)
    pi, pv = _payload(ctx)
    gidx = torch.stack([pi] * RANKS)
    gval = torch.stack([pv * (1 + 0.1 * r) for r in range(RANKS)])
    p_ker, p_ref = [x.clone() for x in xs], [x.clone() for x in xs]
    with KernelWatch(_kernel_modules()) as w:
        error_feedback.ef_decode(p_ker, gidx, gval, lr=0.01, chunk=CHUNK, k=TOPK, use_sign=False)
        _sync(ctx)
    error_feedback.ef_decode_reference(p_ref, gidx, gval, CHUNK, TOPK, 0.01, use_sign=False)
    errs = {"rel_err": max(rel_err(a, r) for a, r in zip(p_ker, p_ref, strict=True))}
    row = _time_row(
        ctx,
        "ef_decode",
        lambda: error_feedback.ef_decode(
            p_ker, gidx, gval, lr=0.01, chunk=CHUNK, k=TOPK, use_sign=False, validate=False
        ),
        lambda: error_feedback.ef_decode_reference(p_ref, gidx, gval, CHUNK, TOPK, 0.01, use_sign=False),
        numel * 2 * esz + RANKS * payload * (2 + 2),
        errs,
        w.resources,
    )
    return _kernel_result([row], _judge(row, {"rel_err": 5e-2}))


def phase_optimizer(ctx: Context) -> dict:
    from cokit.bench import optimizer_bench

    rows = optimizer_bench.run(None, quick=ctx.quick, budget=ctx.budget)
    key = ", ".join(f"{r['optimizer']} {r['step_ms']:.2f} ms" for r in rows)
    return {"rows": rows, "key": key}


def _gemm_phase(section: str) -> Callable[[Context], dict]:
    def phase(ctx: Context) -> dict:
        from cokit.bench import gemm_bench

        rows: list[dict] = []
        cache_dir = os.path.join(ctx.out, "tuning_cache") if ctx.out else None  # a folder we know is writable
        gemm_bench.run_section(section, rows, quick=ctx.quick, cache_dir=cache_dir, budget=ctx.budget)
        gemm_bench.print_rows(rows, (section,))
        summary = gemm_bench.summarize(rows, (section,))
        problems = [
            f"{r.get('shape', '')} {r.get('dtype', '')} {r.get('form', r.get('variant', ''))}: "
            f"{r.get('error') or 'outside the error bound'}"
            for r in rows
            if r.get("error") or r.get("ok") is False
        ]
        if summary.get("occupancy_matches_driver") is False:
            problems.append("occupancy calculator disagrees with the driver")
        parts = [summary.get("correctness")]
        if "best_tflops" in summary:
            parts.append(
                f"best {summary['best_tflops']} TFLOP/s ({summary['best_shape']}, "
                f"x{summary['best_vs_torch']} vs torch)"
            )
        if "occupancy_matches_driver" in summary:
            parts.append(f"driver agrees: {summary['occupancy_matches_driver']}")
        if "sweep_tflops_range" in summary:
            lo, hi = summary["sweep_tflops_range"]
            parts.append(f"{summary['sweep_points']} points, {lo}-{hi} TFLOP/s")
        return {
            "rows": rows,
            "summary": summary,
            "problems": problems[:20],
            "key": "; ".join(p for p in parts if p),
        }

    phase.__name__ = f"phase_gemm_{section}"
    return phase


#: (M tokens, N out_features, K in_features) of the Linear rows: bf16 LLM shapes
LINEAR_SHAPES = [(4096, 4096, 4096), (8192, 8192, 1024)]


def phase_linear(ctx: Context) -> dict:
    """``cokit.overlap.Linear`` (bf16, tuned GEMM) vs ``torch.nn.functional.linear``: error against
    a float64 reference, then TFLOP/s of both and their ratio (target: >= 0.9)."""
    import torch
    import torch.nn.functional as F

    from cokit.bench.timing import median_ms
    from cokit.overlap.layers import Linear

    dtype = torch.bfloat16 if ctx.on_gpu else torch.float32
    shapes = LINEAR_SHAPES if ctx.on_gpu else [(64, 48, 40)]
    if ctx.on_gpu and ctx.quick:
        shapes = shapes[:1]
    rows, problems = [], []
    for M, N, K in shapes:
        if ctx.budget.stop():
            break
        gen = torch.Generator(device=ctx.device).manual_seed(M + N + K)
        layer = Linear(K, N, device=ctx.device, dtype=dtype)
        x = torch.randn(M, K, device=ctx.device, dtype=dtype, generator=gen)
        bias = layer.bias
        assert bias is not None
        with torch.no_grad():
            out = layer(x)
            ref = (x.double() @ layer.weight.double().T + bias.double()).to(dtype)
            err = rel_err(out, ref)
            flop = 2.0 * M * N * K
            row: dict[str, Any] = {
                "shape": f"{M}x{N}x{K}",
                "dtype": str(dtype).replace("torch.", ""),
                "rel_err": err,
            }
            row["cokit_ms"] = median_ms(functools.partial(layer, x), ctx.on_gpu, ctx.quick)
            row["torch_ms"] = median_ms(
                functools.partial(F.linear, x, layer.weight, layer.bias), ctx.on_gpu, ctx.quick
            )
        row["cokit_TFLOPs"] = flop / row["cokit_ms"] / 1e9
        row["torch_TFLOPs"] = flop / row["torch_ms"] / 1e9
        row["vs_torch"] = row["cokit_TFLOPs"] / row["torch_TFLOPs"]
        if not err <= 2e-2:
            problems.append(f"{row['shape']}: rel_err={fmt(err)} (limit 0.02)")
        rows.append(row)
    print_rows(
        rows,
        ["shape", "dtype", "cokit_ms", "torch_ms", "cokit_TFLOPs", "torch_TFLOPs", "vs_torch", "rel_err"],
    )
    key = "; ".join(
        f"{r['shape']} {r['cokit_TFLOPs']:.0f} TFLOP/s x{r['vs_torch']:.2f} vs F.linear "
        f"(>=0.9: {'met' if r['vs_torch'] >= LINEAR_TARGET else 'missed'})"
        for r in rows
    )
    return {"rows": rows, "problems": problems, "key": key}


#: (tokens, model width) of the compiled MLP block: Linear(D, 4D), GELU, Linear(4D, D)
MLP_SHAPES = {"gpu": (8192, 4096), "gpu_quick": (4096, 4096), "cpu": (64, 48)}


def phase_linear_compile(ctx: Context) -> dict:
    """``cokit.overlap.Linear`` inside ``torch.compile(fullgraph=True)``: an MLP block. On a GPU,
    Inductor must compile cokit's GEMM kernel into its own code (the ``cokit::linear``
    ``triton_op``), not call an opaque op; the compiled block must equal the eager one, and
    its time is set beside eager cokit and the same block on ``nn.Linear``, compiled. A
    second token count under ``dynamic=True`` must reuse the graph. On the CPU the
    ``aot_eager`` backend traces the same graph (no GPU numbers)."""
    import torch
    from torch import nn

    from cokit.bench.timing import median_ms
    from cokit.overlap.layers import Linear

    dtype = torch.bfloat16 if ctx.on_gpu else torch.float32
    tokens, width = MLP_SHAPES["cpu" if not ctx.on_gpu else "gpu_quick" if ctx.quick else "gpu"]
    backend = "inductor" if ctx.on_gpu else "aot_eager"
    torch.manual_seed(0)
    model = nn.Sequential(Linear(width, 4 * width), nn.GELU(), Linear(4 * width, width))
    model = model.to(ctx.device, dtype)
    baseline = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
    baseline = baseline.to(ctx.device, dtype)
    baseline.load_state_dict(model.state_dict())  # the same weights: Linear's state dict is nn.Linear's
    x = torch.randn(tokens, width, device=ctx.device, dtype=dtype)
    problems: list[str] = []
    torch._dynamo.reset()
    with torch.no_grad():
        eager = model(x)  # tunes the GEMMs' shapes: the trace below reads the tuning cache
        compiled = torch.compile(model, fullgraph=True, backend=backend)
        if ctx.on_gpu:
            from torch._inductor.utils import run_and_get_code

            out, codes = run_and_get_code(compiled, x)
            code = "\n".join(codes)
            in_graph = "_gemm_kernel" in code and "gemm_launch" not in code
            if not in_graph:
                problems.append("Inductor did not compile cokit's GEMM kernel into its graph")
        else:
            out, in_graph = compiled(x), None
        err = rel_err(out, eager)
        if not err <= 2e-2:
            problems.append(f"compiled vs eager rel_err={fmt(err)} (limit 0.02)")
        row: dict[str, Any] = {
            "shape": f"{tokens}x{width}->{4 * width}->{width}",
            "dtype": str(dtype).replace("torch.", ""),
            "backend": backend,
            "kernel_in_graph": in_graph,
            "rel_err": err,
            "eager_ms": median_ms(functools.partial(model, x), ctx.on_gpu, ctx.quick),
            "compiled_ms": median_ms(functools.partial(compiled, x), ctx.on_gpu, ctx.quick),
        }
        torch_compiled = torch.compile(baseline, fullgraph=True, backend=backend)
        row["torch_compiled_ms"] = median_ms(functools.partial(torch_compiled, x), ctx.on_gpu, ctx.quick)
        row["vs_torch_compiled"] = row["torch_compiled_ms"] / row["compiled_ms"]
        dynamic = torch.compile(model, fullgraph=True, dynamic=True, backend=backend)
        before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        for n in (tokens // 2, tokens // 2 + 8):
            dynamic(x[:n])
        row["dynamic_graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"] - before
        if row["dynamic_graphs"] != 1:
            problems.append(f"dynamic=True compiled {row['dynamic_graphs']} graphs for 2 token counts")
    cols = ["shape", "dtype", "backend", "kernel_in_graph", "eager_ms", "compiled_ms", "torch_compiled_ms"]
    print_rows([row], [*cols, "vs_torch_compiled", "dynamic_graphs", "rel_err"])
    key = (
        f"kernel in graph: {in_graph}; compiled {row['compiled_ms']:.3g} ms, "
        f"x{row['vs_torch_compiled']:.2f} vs compiled nn.Linear "
        f"(>=0.9: {'met' if row['vs_torch_compiled'] >= LINEAR_TARGET else 'missed'})"
    )
    return {"rows": [row], "problems": problems, "key": key}


def phase_overlap(ctx: Context) -> dict:
    from cokit.bench import overlap_bench

    report: dict = {}
    rows = overlap_bench.run(
        report, quick=ctx.quick, budget=ctx.budget, tiny=not ctx.on_gpu, raise_errors=True
    )
    summary = report.get("overlap", {})
    best = summary.get("best") or {}
    key = f"{summary.get('points', 0)} points"
    if summary.get("noise_points"):
        key += f" ({summary['noise_points']} beyond the physical bounds: noise, never best)"
    if best:
        key += f", best speedup {fmt(best.get('speedup'))} ({fmt(best.get('pct_of_ideal'))}% of ideal)"
    elif summary.get("points"):
        key += ", none within the physical bounds"
    problems = [str(r.get("error")) for r in rows if r.get("error")][:20]
    return {"rows": rows, "summary": summary, "problems": problems, "key": key}


def default_phases() -> list[Phase]:
    """Every phase in order, with its budgets (seconds on one H200: --quick, full)."""
    return [
        Phase("env", phase_env, 15, 15, what="versions and device"),
        Phase("copy_bandwidth", phase_copy, 10, 10, what="device copy GB/s"),
        Phase("kernels.dct", phase_dct, 15, 30, what="DCT encode/decode"),
        Phase("kernels.topk", phase_topk, 10, 20, what="chunk top-k"),
        Phase("kernels.ef_encode", phase_ef_encode, 12, 25, what="fused error-feedback encode"),
        Phase("kernels.ef_decode", phase_ef_decode, 12, 25, what="fused decode of 8 payloads"),
        Phase("optimizer", phase_optimizer, 18, 40, what="DeMo step vs fused AdamW", in_quick=False),
        Phase("gemm.correctness", _gemm_phase("correctness"), 22, 45, what="GEMM vs float64", in_quick=False),
        Phase(
            "gemm.occupancy",
            _gemm_phase("occupancy_check"),
            8,
            15,
            needs_gpu=True,
            what="blocks/SM: calculator vs driver",
            in_quick=False,
        ),
        Phase("gemm.perf", _gemm_phase("perf"), 18, 75, needs_gpu=True, what="tuned GEMM TFLOP/s vs torch"),
        Phase(
            "gemm.sweep", _gemm_phase("sweep"), 15, 60, needs_gpu=True, what="occupancy sweep", in_quick=False
        ),
        Phase("linear", phase_linear, 20, 45, what="cokit.overlap.Linear vs F.linear (bf16)"),
        Phase("linear.compile", phase_linear_compile, 40, 70, what="Linear in torch.compile (Inductor)"),
        Phase("overlap", phase_overlap, 25, 90, what="GEMM + EMULATED comm on one GPU"),
        Phase(
            "train_step_overlap",
            phase_train_step_overlap,
            35,
            80,
            what="training step + EMULATED comm: sequential, overlapped, shaped+high, tuner",
            in_quick=False,
        ),
        Phase(
            "tp_layers",
            phase_tp_layers,
            20,
            40,
            what="TP MLP fwd+bwd vs F.linear, EMULATED comm",
            in_quick=False,
        ),
    ]


# ---------------------------------------------------------------------- output
class Tee(io.TextIOBase):
    """Writes to the real stream and keeps a copy (the log)."""

    def __init__(self, stream: TextIO, log: list[str]) -> None:
        self.stream, self.log = stream, log

    def write(self, s: str) -> int:
        self.log.append(s)
        with contextlib.suppress(Exception):
            self.stream.write(s)
        return len(s)

    def flush(self) -> None:
        with contextlib.suppress(Exception):
            self.stream.flush()

    def fileno(self) -> int:
        return self.stream.fileno()

    def isatty(self) -> bool:
        return False


def check_writable(folder: str, overwrite: bool = True, flag: str = "--out") -> str | None:
    """None when ``folder`` can be created and written (and, unless ``overwrite``, holds no
    earlier check's results), else why not (one line: what is wrong and what to do)."""
    from cokit.files import OutputError, prepare_out_dir

    try:
        prepare_out_dir(folder, (JSON_NAME, LOG_NAME), overwrite=overwrite, flag=flag)
    except OutputError as exc:
        return str(exc)
    return None


def write_outputs(folder: str, report: dict, log: list[str]) -> None:
    from cokit.files import atomic_write_text as atomic_write

    atomic_write(os.path.join(folder, JSON_NAME), json.dumps(report, indent=1, default=str))
    atomic_write(os.path.join(folder, LOG_NAME), "".join(log))


def summary_table(phases: list[dict]) -> None:
    print("\n" + "=" * 100)
    print(f"{TAG} summary")
    rows = [
        {
            "phase": p["name"],
            "status": p["status"],
            "seconds": f"{p['seconds']:.1f}",
            "budget": f"{p['budget_s']:.0f}" if p.get("budget_s") is not None else "-",
            "key numbers": (p.get("key") or p.get("error") or p.get("note") or "")[:110],
        }
        for p in phases
    ]
    print_rows(rows, ["phase", "status", "seconds", "budget", "key numbers"])


# ---------------------------------------------------------------------- main
def environment_problem(allow_cpu: bool) -> str | None:
    """Why this process cannot run the check (one line), or None."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return (
            "TRITON_INTERPRET is set: Triton kernels would run in the CPU interpreter, which times "
            "nothing real; unset it (env -u TRITON_INTERPRET ...)"
        )
    import torch

    if not torch.cuda.is_available() and not allow_cpu:
        return (
            "no GPU visible (torch.cuda.is_available() is False): this check needs a CUDA or ROCm GPU; "
            "--allow-cpu runs the torch reference path on the CPU instead"
        )
    return None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m cokit.bench.gpu_check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--quick", action="store_true", help="smaller sizes and fewer points (< 3 min on one H200)"
    )
    p.add_argument(
        "--out",
        default=DEFAULT_OUT,
        help=f"folder for {JSON_NAME} and {LOG_NAME} (default {DEFAULT_OUT}); checked before any "
        "phase runs and refused when it holds an earlier check's results, unless --overwrite",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an earlier check's results in --out (default: refuse such a folder)",
    )
    p.add_argument(
        "--allow-cpu", action="store_true", help="without a GPU, run the torch reference path on CPU"
    )
    p.add_argument(
        "--only",
        nargs="+",
        default=None,
        metavar="PHASE",
        help="run only these phases (names or prefixes, e.g. kernels gemm.perf)",
    )
    p.add_argument(
        "--time-limit",
        type=float,
        default=None,
        help="total seconds; phases that would start later are SKIPPED "
        "(default 170 with --quick, 470 without)",
    )
    p.add_argument("--list", action="store_true", help="list the phases and their budgets, then exit")
    return p


def _selected(phases: list[Phase], only: list[str] | None) -> list[Phase]:
    if not only:
        return phases
    return [p for p in phases if any(p.name == o or p.name.startswith(o.rstrip(".") + ".") for o in only)]


def main(argv: list[str] | None = None, phases: list[Phase] | None = None) -> int:
    args = build_parser().parse_args(argv)
    phases = default_phases() if phases is None else phases
    if args.list:
        for ph in phases:
            quick = f"{ph.budget_quick:>5.0f} s quick" if ph.in_quick else "  (not in --quick)"
            print(f"{ph.name:<20} {quick}  {ph.budget_full:>5.0f} s full  {ph.what}")
        return 0
    problem = environment_problem(args.allow_cpu)
    if problem is None:
        problem = check_writable(args.out, overwrite=args.overwrite)
    if problem is not None:
        print(f"gpu_check: error: {problem}", file=sys.stderr, flush=True)
        return 2
    chosen = _selected(phases, args.only)
    if args.quick and args.only is None:
        chosen = [p for p in chosen if p.in_quick]
    if not chosen:
        print(
            f"gpu_check: error: --only {' '.join(args.only)} matches no phase; "
            f"allowed: {', '.join(p.name for p in phases)}",
            file=sys.stderr,
            flush=True,
        )
        return 2
    log: list[str] = []
    real_out, real_err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = Tee(real_out, log), Tee(real_err, log)
    try:
        return _run(args, chosen, log)
    finally:
        sys.stdout, sys.stderr = real_out, real_err


def _run(args: argparse.Namespace, phases: list[Phase], log: list[str]) -> int:
    import torch

    from cokit.bench.timing import Budget

    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    limit = args.time_limit if args.time_limit is not None else (170.0 if args.quick else 470.0)
    total = Budget(limit)
    ctx = Context(device=device, on_gpu=on_gpu, quick=args.quick, shared={}, out=args.out)
    _ensure_triton_cache()
    mode = "gpu" if on_gpu else "cpu (torch reference path, tiny sizes: no GPU numbers)"
    report: dict[str, Any] = {
        "tool": "cokit.bench.gpu_check",
        "argv": sys.argv[1:],
        "quick": args.quick,
        "mode": mode,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "time_limit_s": limit,
        "complete": False,
        "phases": [],
    }
    fail_hook = os.environ.get("COKIT_GPU_CHECK_FAIL", "")  # tests: make these phases raise
    print(
        f"{TAG} {'--quick' if args.quick else 'full run'} on {mode}; {len(phases)} phases, "
        f"time limit {limit:.0f} s; writing {os.path.abspath(args.out)}",
        flush=True,
    )
    if not on_gpu:
        print(
            f"{TAG} no GPU: the torch reference path only, at tiny sizes; Triton kernel timings need a GPU",
            flush=True,
        )
    for i, ph in enumerate(phases, 1):
        budget_s = ph.budget_quick if args.quick else ph.budget_full
        entry: dict[str, Any] = {
            "name": ph.name,
            "what": ph.what,
            "budget_s": budget_s,
            "status": "SKIPPED",
            "seconds": 0.0,
        }
        report["phases"].append(entry)
        head = f"{TAG} [{i}/{len(phases)}] {ph.name}"
        if ph.needs_gpu and not on_gpu:
            entry["note"] = "needs a GPU"
        elif total.spent():
            entry["note"] = f"total time limit of {limit:.0f} s spent"
        else:
            budget = Budget(max(1.0, min(budget_s, total.left())))
            ctx.budget = budget
            print(f"{head}: start ({ph.what}; budget {budget.seconds:.0f} s)", flush=True)
            watchdog = _arm_watchdog(3 * budget_s + 60)
            try:
                if ph.name in fail_hook.split(","):
                    raise PhaseFailure(f"COKIT_GPU_CHECK_FAIL asked phase {ph.name} to fail")
                result = ph.fn(ctx) or {}
                _sync(ctx)
                entry["status"] = "OK"
                if result.get("problems"):
                    entry["status"] = "WARN"
                    for p in result["problems"]:
                        print(f"  problem: {p}")
                if budget.cut:
                    entry["status"] = "BUDGET" if entry["status"] == "OK" else entry["status"] + "+BUDGET"
                    entry["cut"] = budget.cut
                entry["key"] = result.pop("key", "")
                entry["result"] = result
            except Exception as exc:
                tb = traceback.format_exc()
                entry.update(status="FAILED", error=f"{type(exc).__name__}: {exc}"[:300], traceback=tb)
                print(tb, end="", flush=True)
            finally:
                if watchdog:
                    faulthandler.cancel_dump_traceback_later()
            entry["seconds"] = round(budget.elapsed(), 2)
            entry["over_budget"] = budget.elapsed() > budget_s
            if on_gpu:
                with contextlib.suppress(Exception):
                    torch.cuda.empty_cache()
        extra = entry.get("key") or entry.get("error") or entry.get("note") or ""
        over = " (over budget)" if entry.get("over_budget") else ""
        print(
            f"{head}: {entry['status']} in {entry['seconds']:.1f} s{over}{': ' + extra[:160] if extra else ''}",
            flush=True,
        )
        report["elapsed_s"] = round(total.elapsed(), 1)
        _save(args.out, report, log)
    report["complete"] = True
    report["elapsed_s"] = round(total.elapsed(), 1)
    report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    counts = {
        s: sum(1 for p in report["phases"] if p["status"].startswith(s))
        for s in ("OK", "WARN", "BUDGET", "FAILED", "SKIPPED")
    }
    report["counts"] = counts
    summary_table(report["phases"])
    print(
        f"{TAG} done in {report['elapsed_s']:.0f} s: " + ", ".join(f"{v} {k}" for k, v in counts.items() if v)
    )
    print(
        f"{TAG} wrote {os.path.join(args.out, JSON_NAME)} and {os.path.join(args.out, LOG_NAME)}", flush=True
    )
    _save(args.out, report, log)
    return 1 if counts["FAILED"] else 0


def _save(folder: str, report: dict, log: list[str]) -> None:
    try:
        write_outputs(folder, report, log)
    except Exception as exc:  # keep running: the results still reach stdout
        print(f"{TAG} could not write {folder}: {type(exc).__name__}: {exc}", file=sys.__stderr__, flush=True)


def _ensure_triton_cache() -> None:
    """Point TRITON_CACHE_DIR at a temporary folder when ~/.triton cannot be written."""
    if os.environ.get("TRITON_CACHE_DIR"):
        return
    if (
        check_writable(os.path.join(os.path.expanduser("~"), ".triton", "cache"), flag="TRITON_CACHE_DIR")
        is not None
    ):
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="cokit_triton_cache_")
        print(f"{TAG} ~/.triton is not writable: TRITON_CACHE_DIR={os.environ['TRITON_CACHE_DIR']}")


def _arm_watchdog(seconds: float) -> bool:
    """Print every thread's stack to stderr if a phase hangs this long (does not kill)."""
    stream = sys.__stderr__
    if stream is None:
        return False
    try:
        faulthandler.dump_traceback_later(seconds, repeat=False, file=stream, exit=False)
    except Exception:
        return False
    return True


if __name__ == "__main__":
    raise SystemExit(main())
