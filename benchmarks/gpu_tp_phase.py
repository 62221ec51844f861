"""gpu_check phase ``tp_layers``: one rank of a tensor-parallel MLP, with EMULATED communication.

One GPU has no peer, so the phase runs what ONE rank of an ``EMULATED_WORLD``-way tensor-parallel
MLP (``D -> 4D -> D``, ``ColumnParallelLinear`` -> GELU -> ``RowParallelLinear``) computes:
``D -> 4D / EMULATED_WORLD -> D``, at world 1 (on a one-rank NCCL group made here, so the
layers run their real schedules: chunked GEMMs, NCCL collectives that move nothing; without
a group, plain GEMMs). Then:

1. correctness: forward output and input/weight/bias gradients of the layers (plain and
   sequence parallel) against the same MLP on ``nn.Linear``, relative error;
2. speed: forward+backward of the layers vs the ``nn.Linear`` (``F.linear``, cuBLAS) MLP;
3. the layers' forward+backward next to an EMULATED communication
   (:class:`cokit.overlap.emulate.EmulatedComm`: a copy kernel on 1/8 of the SMs) of the bytes
   that rank would all-reduce per step (the row layer's output, the column layer's input
   gradient: two ring all-reduces of ``tokens x D``), measured alone, sequential and
   overlapped (:func:`cokit.overlap.measure.measure`). Labelled EMULATED: it measures
   contention for the GPU, not a network.

On the CPU (``--allow-cpu``) the same at tiny sizes without a process group, the emulation a
copy on a helper thread: a correctness check, no GPU numbers. The GEMM config is tuned once
for the forward shape and used by every GEMM of the layers (tuning each backward shape would
not fit the budget).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

#: the simulated tensor-parallel world: one of its ranks is what runs here
EMULATED_WORLD = 8
#: (tokens, model width D) of the MLP
TP_SHAPES = {"gpu": (8192, 4096), "gpu_quick": (4096, 4096), "cpu": (32, 24)}


def _one_rank_group(ctx: Any) -> tuple[str, bool]:
    """Start a one-rank NCCL group in this process (a HashStore, no port) unless one exists;
    returns (what the layers run on, whether this phase must destroy it)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return f"{dist.get_backend()} ({dist.get_world_size()} ranks, existing group)", False
    if not ctx.on_gpu:
        return "none (world 1 without torch.distributed: no collectives)", False
    try:
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    except Exception as exc:  # the layers still run, without collectives; the row says why
        return f"none (one-rank NCCL group failed: {type(exc).__name__}: {exc})"[:200], False
    return "nccl (1 rank, this process)", True


def phase_tp_layers(ctx: Any) -> dict:
    """The ``tp_layers`` phase (see the module docstring); ``ctx`` is gpu_check's Context."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    from cokit.bench.gpu_rows import fmt, print_rows, rel_err
    from cokit.bench.timing import median_ms
    from cokit.compress.stats import ring_allreduce_bytes
    from cokit.overlap.emulate import EmulatedComm
    from cokit.overlap.schedules import Overlap
    from cokit.overlap.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    dtype = torch.bfloat16 if ctx.on_gpu else torch.float32
    limit = 2e-2 if ctx.on_gpu else 1e-5
    tokens, width = TP_SHAPES["cpu" if not ctx.on_gpu else "gpu_quick" if ctx.quick else "gpu"]
    hidden = 4 * width // EMULATED_WORLD  # this rank's share of the 4D features
    group, own_group = _one_rank_group(ctx)
    rows: list[dict] = []
    problems: list[str] = []
    try:
        torch.manual_seed(0)
        fc1 = nn.Linear(width, hidden, device=ctx.device, dtype=dtype)
        fc2 = nn.Linear(hidden, width, device=ctx.device, dtype=dtype)
        x = torch.randn(tokens, width, device=ctx.device, dtype=dtype)
        r = torch.randn(tokens, width, device=ctx.device, dtype=dtype)
        config = None
        if ctx.on_gpu:
            from cokit.triton_kernels.gemm import select_config

            config = select_config(x, fc1.weight.t())

        def dense_step(inp: torch.Tensor) -> torch.Tensor:
            y = fc2(F.gelu(fc1(inp)))
            y.backward(r)
            return y

        ref_x = x.clone().requires_grad_(True)
        ref_y = dense_step(ref_x).detach()
        ref = {
            "y": ref_y,
            "grad_x": ref_x.grad,
            "w1": fc1.weight.grad,
            "b1": fc1.bias.grad,
            "w2": fc2.weight.grad,
            "b2": fc2.bias.grad,
        }
        ref = {k: v.detach().clone() for k, v in ref.items() if v is not None}
        layers = {}
        for sp in (False, True):
            col = ColumnParallelLinear.from_linear(fc1, sequence_parallel=sp, config=config)
            row = RowParallelLinear.from_linear(fc2, sequence_parallel=sp, config=config)
            layers[sp] = (col, row)
            xt = x.clone().requires_grad_(True)
            y = row(F.gelu(col(xt)))
            y.backward(r)
            got = {
                "y": y.detach(),
                "grad_x": xt.grad,
                "w1": col.weight.grad,
                "b1": col.bias.grad,
                "w2": row.weight.grad,
                "b2": row.bias.grad,
            }
            errs = {f"rel_err_{k}": rel_err(got[k], v) for k, v in ref.items()}
            rows.append(
                {
                    "what": f"correctness ({'sequence parallel' if sp else 'plain'})",
                    "shape": f"{tokens}x{width}->{hidden}->{width}",
                    "max_rel_err": max(errs.values()),
                    **errs,
                }
            )
            for k, v in errs.items():
                if not v <= limit:
                    problems.append(f"{'sp ' if sp else ''}{k}={fmt(v)} (limit {limit})")
        print_rows(rows, ["what", "shape", "max_rel_err"])
        fc1.zero_grad(set_to_none=True)
        fc2.zero_grad(set_to_none=True)

        col, row = layers[False]
        x_req = x.clone().requires_grad_(True)

        def tp_step() -> torch.Tensor:
            y = row(F.gelu(col(x_req)))
            y.backward(r)
            return y

        timing: dict[str, Any] = {
            "what": "fwd+bwd timing",
            "shape": f"{tokens}x{width}->{hidden}->{width}",
            "dtype": str(dtype).replace("torch.", ""),
            "group": group,
            "config": config.spec() if config is not None else "default",
        }
        if not ctx.budget.stop():
            timing["dense_ms"] = median_ms(
                functools.partial(dense_step, x.clone().requires_grad_(True)), ctx.on_gpu, ctx.quick
            )
            timing["tp_ms"] = median_ms(tp_step, ctx.on_gpu, ctx.quick)
            timing["tp_vs_dense"] = timing["dense_ms"] / timing["tp_ms"]  # > 1: the layers are faster
        if not ctx.budget.stop():
            esz = torch.finfo(dtype).bits // 8
            nbytes = 2 * ring_allreduce_bytes(tokens * width * esz, EMULATED_WORLD)
            if ctx.on_gpu:
                from cokit.triton_kernels.backend import device_limits

                n_sms = max(1, device_limits(ctx.device).num_sms // 8)
                comm = EmulatedComm(nbytes, ctx.device, n_sms=n_sms, exclusive_sms=True)
            else:
                comm = EmulatedComm(nbytes, ctx.device)
            try:
                ov = Overlap(tp_step, comm, device=ctx.device, label="tp mlp fwd+bwd + EMULATED comm")
                res = ov.measure(repeats=3 if ctx.quick or not ctx.on_gpu else 5, warmup=1)
            finally:
                comm.close()
            m = res.metrics
            timing.update(
                emulated=True,
                comm=comm.label,
                emulated_world=EMULATED_WORLD,
                comm_bytes=nbytes,
                T_comp=m.t_comp,
                T_comm=m.t_comm,
                T_seq=m.t_seq,
                T_ovl=m.t_ovl,
                overlap_speedup=m.speedup,
                comm_hidden=m.comm_hidden,
            )
            if "dense_ms" in timing:
                timing["ovl_vs_dense"] = timing["dense_ms"] / m.t_ovl
        rows.append(timing)
        cols = ["what", "dense_ms", "tp_ms", "tp_vs_dense", "T_comm", "T_seq", "T_ovl", "overlap_speedup"]
        print_rows([timing], [*cols, "comm_hidden", "ovl_vs_dense"])
        print(f"  {timing.get('comm', 'EMULATED communication: not measured (budget)')}; layers on: {group}")
    finally:
        if own_group:
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
    key = f"max rel_err {fmt(max(r['max_rel_err'] for r in rows if 'max_rel_err' in r))}"
    t = rows[-1]
    if "tp_vs_dense" in t:
        key += f"; x{t['tp_vs_dense']:.2f} vs dense F.linear"
    if "overlap_speedup" in t:
        key += f"; EMULATED {EMULATED_WORLD}-way comm: overlap x{t['overlap_speedup']:.2f}, {100 * t['comm_hidden']:.0f}% hidden"
    return {"rows": rows, "problems": problems, "key": key}
