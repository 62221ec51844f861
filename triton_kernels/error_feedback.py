"""Fused error feedback: the encode and decode passes of a DeMo step.

Encode, one pass per tile over a bucket of tensors (docs/design.md §1.1, steps 2-6)::

    delta  = beta * delta + lr * grad          # fp32 buffer, updated in place
    coeffs = DCT(delta)
    sel    = top-k(|coeffs|) per tile           # ties: lower position; order: by position
    delta -= alpha * IDCT(coeffs at sel)        # what is sent leaves the buffer
    payload <- (positions, values) of sel       # values cast to the payload dtype

Decode, one pass per tile (steps 8-9 plus decoupled weight decay)::

    mean   = per position, mean over the ranks that chose it
    update = IDCT(mean)  [-> sign(update)]
    p      = p * (1 - lr * wd) - lr * update

The payload of a bucket is flat: tensors in order, tiles in order, ``min(k, tile_numel)``
slots per tile. Gathered payloads are ``(world_size, payload_numel)``.

Determinism: the decode sums each position's values in rank order (rank 0 first) in
registers of the one program that owns the tile: per rank, a 2-D tile's selection becomes a
dense block through one-hot dots (exact: each output is one ``v * 1``), a 1-D tile's through
one compare-and-add pass per slot. Every rank therefore computes bit-identical parameters
from the same gathered payload, with no scratch memory, atomics or barriers.

Launch configs (``num_warps``, stages, the ``tl.dot`` precision: ``"tf32x3"`` from sm_90,
the hand-split ``"bf16x6"`` before, ``"ieee"`` on AMD and in the interpreter) come from
:mod:`~cokit.triton_kernels.compress_config`.

Layout: Triton kernels + launchers + torch references + ``torch.library`` ops (``cokit::``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import triton
import triton.language as tl

from . import compress_config, tiling
from ._checks import (
    FLOAT_DTYPES,
    check_float_tensor,
    check_number,
    check_positive_int,
    check_same_device,
    check_tensor_list,
)
from .backend import arch_limits, kernel_path
from .dct import (
    WORKSPACE,
    dct_decode_into,
    dct_decode_reference,
    dct_encode_into,
    dct_encode_reference,
    table_pointer,
    transform_block,
)
from .topk import chunk_topk_fast, chunk_topk_reference, topk_select

__all__ = [
    "compile_specs",
    "ef_decode",
    "ef_decode_reference",
    "ef_encode",
    "ef_encode_reference",
    "payload_layout",
]

INDEX_DTYPES = (torch.int16, torch.int32, torch.int64)


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _block_pointers(g, pointers, col: tl.constexpr, ref, r, c, ALIGNED: tl.constexpr):
    """Pointers to the elements of a program's block in one tensor of its class.

    Args:
        g: pointer to the program's geometry row (columns ``tiling.G_*``).
        pointers: int64, ``(n_tensors, 2)`` pointer table of the launch class.
        col (constexpr): the table column (0: buffer, 1: gradient).
        ref: a pointer argument typed like the tensors of that column.
        r: ``(BLOCK_ROWS, 1)`` row indices; c: ``(1, BLOCK_W)`` column indices.
        ALIGNED (constexpr): pointer, block offset and row stride are multiples of 16.
    """
    base = table_pointer(pointers, tl.load(g + 0), col, 2, ref, ALIGNED)
    x_off = tl.load(g + 1)
    row_stride = tl.load(g + 2)
    if ALIGNED:
        x_off = tl.multiple_of(x_off, 16)
        row_stride = tl.multiple_of(row_stride, 16)
    return base + x_off + r * row_stride + c


@triton.jit
def _updated_delta(g, pointers, delta_ref, grad_ref, r, c, mask, beta, lr, ALIGNED: tl.constexpr):
    """``beta * delta + lr * grad`` of a program's block, fp32, read from the buffer and gradient."""
    delta_at = _block_pointers(g, pointers, 0, delta_ref, r, c, ALIGNED)
    grad_at = _block_pointers(g, pointers, 1, grad_ref, r, c, ALIGNED)
    return beta * tl.load(delta_at, mask=mask, other=0.0) + lr * tl.load(grad_at, mask=mask, other=0.0).to(
        tl.float32
    )


@triton.jit
def _ef_encode_kernel(
    geometry,
    pointers,
    bank,
    delta_ref,
    grad_ref,
    idx_out,
    val_out,
    beta,
    lr,
    alpha,
    G_COLS: tl.constexpr,
    TWO_D: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_W: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    """Error-feedback encode of the tiles of a bucket (module docstring, encode steps).

    Grid: ``(n_programs,)`` of one launch class; program ``i`` handles geometry row ``i``:
    one ``h x w`` tile (TWO_D) or a block of up to ``BLOCK_ROWS`` 1-D tiles (ONE_D). It
    updates that part of the buffer in place (``beta * delta + lr * grad``), takes its DCT,
    keeps the top-``k`` coefficients of each tile, subtracts ``alpha`` times their inverse
    DCT from the buffer and writes the tile's ``k`` payload slots. Programs touch disjoint
    elements and slots.

    Args:
        geometry: int64, ``(n_programs, G_COLS)`` row-major (columns ``tiling.G_*``), as in
            :func:`cokit.triton_kernels.dct._dct_kernel`, plus the first payload slot of the
            program (G_P_OFF) and the slots per tile (G_K, ``k`` clamped to the tile size).
        pointers: int64, ``(n_tensors, 2)`` row-major: per tensor of the class, the data
            pointers of its buffer (column 0) and gradient (column 1), both contiguous.
        bank: fp32, flat: the basis bank of the plan
            (:func:`~cokit.triton_kernels.dct.load_basis`: per side, ``B`` and ``B^T``
            zero-padded to the block side).
        delta_ref: the class's first buffer (fp32, updated in place); only its type is used.
        grad_ref: the class's first gradient (fp32/fp16/bf16); only its type is used.
        idx_out: ``(payload_numel,)`` int16 or int32, the flat payload's positions: per tile
            (tensors in order, tiles in order) ``k`` positions inside the tile (row-major in
            TWO_D), increasing.
        val_out: ``(payload_numel,)`` fp32/fp16/bf16: the coefficients at those positions.
        beta: fp32, buffer decay, in [0, 1].
        lr: fp32 >= 0, gradient scale.
        alpha: fp32 in [0, 1], fraction of the sent part removed from the buffer.
        G_COLS (constexpr): columns of a geometry row (``tiling.G_COLS``).
        TWO_D (constexpr): True: one 2-D tile per program; False: rows of 1-D tiles.
        BLOCK_ROWS (constexpr): power of 2 >= 16 (``tl.dot``), at least the tile height
            (TWO_D) or the tiles per program (ONE_D); extra rows are masked.
        BLOCK_W (constexpr): power of 2 >= 16, at least the tile width; extra columns masked.
        DOT_PRECISION (constexpr): ``tl.dot`` input precision of the launch config
            (:class:`~cokit.triton_kernels.compress_config.KernelConfig`).
        ALIGNED (constexpr): the class's buffers, gradients, row strides and tile widths are
            ``tiling.ALIGN``-aligned (:func:`~cokit.triton_kernels.tiling.aligned`): the hints
            give vectorized loads and stores.
    """
    g = geometry + tl.program_id(0) * G_COLS
    rows = tl.load(g + 4)
    w = tl.load(g + 6)
    bh_off = tl.load(g + 7)
    bw_off = tl.load(g + 8)
    p_off = tl.load(g + 9)
    k = tl.load(g + 10)
    if ALIGNED:
        w = tl.multiple_of(w, 16)
    r = tl.arange(0, BLOCK_ROWS)[:, None]
    c = tl.arange(0, BLOCK_W)[None, :]
    mask = (r < rows) & (c < w)
    delta = _updated_delta(g, pointers, delta_ref, grad_ref, r, c, mask, beta, lr, ALIGNED)
    coeffs = transform_block(delta, bank, bh_off, bw_off, TWO_D, False, BLOCK_ROWS, BLOCK_W, DOT_PRECISION)
    # AMD ("ieee", also the interpreter) makes the top-k mask last: booleans cost SGPR pairs there
    selected, slot = topk_select(coeffs, mask, k, TWO_D, DOT_PRECISION == "ieee")
    # the payload first: its position and slot blocks are dead before the inverse transform
    if TWO_D:
        position = r * w + c
        out = p_off + slot
    else:
        position = c + r * 0
        out = p_off + r * k + slot
    tl.store(idx_out + out, position.to(idx_out.dtype.element_ty), mask=selected)
    tl.store(val_out + out, coeffs.to(val_out.dtype.element_ty), mask=selected)
    sent = transform_block(
        tl.where(selected, coeffs, 0.0),
        bank,
        bh_off,
        bw_off,
        TWO_D,
        True,
        BLOCK_ROWS,
        BLOCK_W,
        DOT_PRECISION,
    )
    # the buffer's addresses again, read after the payload stores: otherwise ptxas keeps the
    # 64-bit addresses of the first load live through the transforms and the top-k (triton
    # 3.6 spilled them on sm_80). The bf16x6 (sm_80) store goes without the hints: with them
    # triton 3.6's 1-D build at 8 warps spilled 4 B and its 2-D build at 4 warps 8 B.
    if DOT_PRECISION != "ieee":
        # NVIDIA: read the block again (an L2 hit: this program read it just before) instead of
        # holding it through the transforms and the top-k; 16 fewer live fp32 per thread at
        # 4 warps, which lets the bf16x6 (sm_80) encode run at 4 warps (2 blocks per SM)
        # without spills. On AMD the second masked loads cost more SGPRs (exec masks) than
        # the VGPRs they save, so the block stays live there.
        delta = _updated_delta(g, pointers, delta_ref, grad_ref, r, c, mask, beta, lr, ALIGNED)
    delta_at = _block_pointers(g, pointers, 0, delta_ref, r, c, ALIGNED and DOT_PRECISION != "bf16x6")
    tl.store(delta_at, delta - alpha * sent, mask=mask)


@triton.jit
def scatter_rank(pos, val, live, BLOCK_ROWS: tl.constexpr, BLOCK_W: tl.constexpr, PRECISION: tl.constexpr):
    """One rank's selection of one 2-D tile as dense ``(BLOCK_ROWS, BLOCK_W)`` blocks of
    values and of counts (1 where it chose a position), without atomics: the product of a
    one-hot row matrix ``R^T`` (``BLOCK_ROWS x K_POW2``) and a one-hot column matrix scaled
    by the values (``K_POW2 x BLOCK_W``). A rank chooses a position at most once, so every
    output is one product ``v * 1`` plus zeros: exact whenever ``v`` is exact at
    ``PRECISION``.

    Args:
        pos: int64 ``(K_POW2,)``, positions inside the block (``row * BLOCK_W + col``).
        val: fp32 ``(K_POW2,)``, the values (0 in dead slots).
        live: int1 ``(K_POW2,)``, the slots that hold an entry.
        BLOCK_ROWS, BLOCK_W (constexpr): the block (powers of 2 >= 16).
        PRECISION (constexpr): the value dot's input precision: ``"tf32"`` for 16-bit payload
            values on NVIDIA (fp16 and bf16 values are exact in TF32: tensor cores),
            ``"ieee"`` otherwise (fp32 values; AMD's fp32 MFMA; the interpreter).
    """
    hit_r = (tl.arange(0, BLOCK_ROWS)[:, None] == (pos // BLOCK_W)[None, :]) & live[None, :]
    hit_c = tl.arange(0, BLOCK_W)[None, :] == (pos % BLOCK_W)[:, None]
    total = tl.dot(hit_r.to(tl.float32), tl.where(hit_c, val[:, None], 0.0), input_precision=PRECISION)
    count = tl.dot(hit_r.to(tl.float16), hit_c.to(tl.float16))
    return total, count


@triton.jit
def _ef_decode_kernel(
    geometry,
    pointers,
    bank,
    param_ref,
    indices,
    values,
    n_ranks,
    payload_numel,
    lr,
    decay,
    G_COLS: tl.constexpr,
    TWO_D: tl.constexpr,
    USE_SIGN: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_W: tl.constexpr,
    K_POW2: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SCATTER_PRECISION: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    """Error-feedback decode of gathered payloads into the parameters (module docstring).

    Grid: ``(n_programs,)`` of one launch class; program ``i`` handles geometry row ``i``
    (one 2-D tile or a block of 1-D tiles). It adds every rank's values at their positions
    into register accumulators, rank by rank (rank 0 first), takes the per-position mean
    over the ranks that chose it, inverse-transforms it, optionally takes the sign and
    updates its part of the parameter in place. No scratch memory, atomics or barriers:
    the only memory traffic is the payload read and the parameter read and write.

    Args:
        geometry: int64, ``(n_programs, G_COLS)`` row-major, as for the encode kernel
            (G_P_OFF: the program's first payload slot; G_K: slots per tile).
        pointers: int64, ``(n_tensors, 1)``: per tensor of the class, the data pointer of its
            parameter (contiguous, updated in place).
        bank: fp32, flat: the basis bank of the plan
            (:func:`~cokit.triton_kernels.dct.load_basis`: per side, ``B`` and ``B^T``
            zero-padded to the block side).
        param_ref: the class's first parameter (fp32/fp16/bf16); only its type is used.
        indices: ``(n_ranks, payload_numel)`` row-major, int16/int32/int64: each rank's
            positions inside their tiles (validated by the launcher).
        values: ``(n_ranks, payload_numel)`` row-major, fp32/fp16/bf16: the values there.
        n_ranks: int32 >= 1, ranks (rows of ``indices``/``values``).
        payload_numel: int32, slots per rank (the row stride of ``indices``/``values``).
        lr: fp32 >= 0, step size.
        decay: fp32, ``1 - lr * weight_decay``, the factor applied to the parameter first.
        G_COLS (constexpr): columns of a geometry row (``tiling.G_COLS``).
        TWO_D (constexpr): True: one 2-D tile per program (one-hot dots per rank,
            :func:`scatter_rank`); False: rows of 1-D tiles (one compare-and-add pass over
            the block per slot and rank).
        USE_SIGN (constexpr): apply ``sign`` to the decoded update (DeMo's signum step).
        BLOCK_ROWS (constexpr): power of 2 >= 16 (``tl.dot``), as for the encode kernel.
        BLOCK_W (constexpr): power of 2 >= 16, at least the tile width.
        K_POW2 (constexpr): power of 2 >= 16 and >= the largest slots per tile of the class;
            extra slots are masked.
        DOT_PRECISION (constexpr): ``tl.dot`` input precision of the inverse transform.
        SCATTER_PRECISION (constexpr): input precision of the one-hot value dots
            (:func:`scatter_rank`; exact for the payload's value dtype).
        ALIGNED (constexpr): the class's parameters, row strides and tile widths are
            ``tiling.ALIGN``-aligned (:func:`~cokit.triton_kernels.tiling.aligned`): the
            hints give vectorized parameter loads and stores.
    """
    g = geometry + tl.program_id(0) * G_COLS
    tensor = tl.load(g + 0)
    x_off = tl.load(g + 1)
    row_stride = tl.load(g + 2)
    rows = tl.load(g + 4)
    w = tl.load(g + 6)
    p_off = tl.load(g + 9)
    k = tl.load(g + 10)
    param_ptr = table_pointer(pointers, tensor, 0, 1, param_ref, ALIGNED)
    if ALIGNED:
        x_off = tl.multiple_of(x_off, 16)
        row_stride = tl.multiple_of(row_stride, 16)
        w = tl.multiple_of(w, 16)

    r = tl.arange(0, BLOCK_ROWS)[:, None]
    c = tl.arange(0, BLOCK_W)[None, :]
    mask = (r < rows) & (c < w)
    total = tl.zeros((BLOCK_ROWS, BLOCK_W), dtype=tl.float32)
    n = tl.zeros((BLOCK_ROWS, BLOCK_W), dtype=tl.float32)
    if TWO_D:
        j = tl.arange(0, K_POW2)
        live = j < k
        src = p_off + j  # int64: ranks * payload_numel may pass 2**31
        for _ in range(n_ranks):
            pos = tl.load(indices + src, mask=live, other=0).to(tl.int64)
            val = tl.load(values + src, mask=live, other=0.0).to(tl.float32)
            # positions are row * w + col; the one-hot dots index the block as row * BLOCK_W + col
            part, hits = scatter_rank(
                (pos // w) * BLOCK_W + pos % w, val, live, BLOCK_ROWS, BLOCK_W, SCATTER_PRECISION
            )
            total += part
            n += hits
            src += payload_numel
    else:
        row = tl.arange(0, BLOCK_ROWS)
        row_live = row < rows
        if DOT_PRECISION == "ieee":
            # AMD: rows past the last tile read the last tile's slots, so the loads need no
            # mask (a masked load keeps an exec mask per row in SGPRs: 20 spilled at 4
            # waves). What those rows add stays in them: the 1-D transform is row by row and
            # the parameter store is masked. ptxas keeps fewer registers with masked loads.
            row = tl.minimum(row, rows - 1)
        tile_slots = p_off + row.to(tl.int64) * k
        for _ in range(n_ranks):
            for s in range(k):
                if DOT_PRECISION == "ieee":
                    pos = tl.load(indices + tile_slots + s)
                    val = tl.load(values + tile_slots + s)
                else:
                    pos = tl.load(indices + tile_slots + s, mask=row_live, other=-1)
                    val = tl.load(values + tile_slots + s, mask=row_live, other=0.0)
                hit = c == pos.to(tl.int32)[:, None]
                total += tl.where(hit, val.to(tl.float32)[:, None], 0.0)
                n += hit.to(tl.float32)
            tile_slots += payload_numel
    mean = tl.where(n > 0, total / tl.maximum(n, 1.0), 0.0)
    update = transform_block(
        mean, bank, tl.load(g + 7), tl.load(g + 8), TWO_D, True, BLOCK_ROWS, BLOCK_W, DOT_PRECISION
    )
    if USE_SIGN:
        update = tl.where(update > 0, 1.0, tl.where(update < 0, -1.0, 0.0))
    addr = x_off + r * row_stride + c
    p = tl.load(param_ptr + addr, mask=mask, other=0.0).to(tl.float32)
    p = p * decay - lr * update
    tl.store(param_ptr + addr, p.to(param_ptr.dtype.element_ty), mask=mask)


#: one compile-only build: (label, kernel, signature, constexprs, launch options)
CompileSpec = tuple[str, Any, dict[str, str], dict[str, Any], dict[str, int]]


def compile_specs(target: str) -> list[CompileSpec]:
    """Compile-only builds for ``target`` (collected by :mod:`cokit.triton_kernels.compile_only`):
    encode and decode of the shipped blocks (64x64 tiles, blocks of 64-wide 1-D tiles); bf16
    gradients and parameters, int16 indices, fp16 values, k = 32."""
    return _encode_compile_specs(target) + _decode_compile_specs(target)


def _encode_compile_specs(target: str) -> list[CompileSpec]:
    """Encode builds: every shipped block x every config of the target backend's space, with
    and without the alignment hints (label suffix ``+aligned``)."""
    limits = arch_limits(target)
    specs = []
    for mode, two_d, rows, width in tiling.compile_blocks():
        sig = tiling.geometry_signature(
            delta_ref="*fp32",
            grad_ref="*bf16",
            idx_out="*i16",
            val_out="*fp16",
            beta="fp32",
            lr="fp32",
            alpha="fp32",
        )
        sig.update(
            dict.fromkeys(
                ("G_COLS", "TWO_D", "BLOCK_ROWS", "BLOCK_W", "DOT_PRECISION", "ALIGNED"), "constexpr"
            )
        )
        for cfg in compress_config.config_space(
            "ef_encode", limits.backend, (rows, width), limits.arch, two_d
        ):
            for aligned in (False, True):
                constexprs = {
                    "G_COLS": tiling.G_COLS,
                    "TWO_D": two_d,
                    "BLOCK_ROWS": rows,
                    "BLOCK_W": width,
                    "DOT_PRECISION": cfg.dot_precision,
                    "ALIGNED": aligned,
                }
                label = f"ef_encode_{mode}[{cfg.spec()}]" + ("+aligned" if aligned else "")
                specs.append((label, _ef_encode_kernel, sig, constexprs, cfg.launch_options()))
    return specs


def _decode_compile_specs(target: str) -> list[CompileSpec]:
    """Decode builds: every shipped block x every config of the target backend's space, with
    and without the alignment hints (signum update, 32 slots per tile)."""
    limits = arch_limits(target)
    specs: list[CompileSpec] = []
    for mode, two_d, rows, width in tiling.compile_blocks():
        sig = tiling.geometry_signature(
            param_ref="*bf16",
            indices="*i16",
            values="*fp16",
            n_ranks="i32",
            payload_numel="i32",
            lr="fp32",
            decay="fp32",
        )
        sig.update(
            dict.fromkeys(
                (
                    "G_COLS",
                    "TWO_D",
                    "USE_SIGN",
                    "BLOCK_ROWS",
                    "BLOCK_W",
                    "K_POW2",
                    "DOT_PRECISION",
                    "SCATTER_PRECISION",
                    "ALIGNED",
                ),
                "constexpr",
            )
        )
        for cfg in compress_config.config_space(
            "ef_decode", limits.backend, (rows, width), limits.arch, two_d
        ):
            for aligned in (False, True):
                constexprs = {
                    "G_COLS": tiling.G_COLS,
                    "TWO_D": two_d,
                    "USE_SIGN": True,
                    "BLOCK_ROWS": rows,
                    "BLOCK_W": width,
                    "K_POW2": 32,
                    "DOT_PRECISION": cfg.dot_precision,
                    "SCATTER_PRECISION": scatter_precision(cfg, torch.float16),
                    "ALIGNED": aligned,
                }
                label = f"ef_decode_{mode}[{cfg.spec()}]" + ("+aligned" if aligned else "")
                specs.append((label, _ef_decode_kernel, sig, constexprs, cfg.launch_options()))
    return specs


# ----------------------------------------------------------------------------- launchers


def payload_layout(shapes: Sequence[Sequence[int]], chunk: int, k: int) -> tiling.TilePlan:
    """The tiling and payload offsets of a bucket: ``.payload_numel`` slots per rank,
    ``.payload_offsets[i]`` the first slot of tensor i, ``.index_dtype`` the index dtype."""
    return tiling.tile_plan(shapes, chunk, k)


def _contiguous_work(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _encode_impl(deltas, grads, beta, lr, alpha, chunk, k, value_dtype):
    device = deltas[0].device
    if kernel_path(device) == "torch":
        if all(d.is_contiguous() for d in deltas):
            return ef_encode_fast(deltas, grads, beta, lr, chunk, k, alpha=alpha, value_dtype=value_dtype)
        return ef_encode_reference(deltas, grads, beta, lr, chunk, k, alpha=alpha, value_dtype=value_dtype)
    plan = tiling.tile_plan([d.shape for d in deltas], chunk, k, device, groups=[g.dtype for g in grads])
    work = [_contiguous_work(d) for d in deltas]
    grads = [g.contiguous() for g in grads]
    idx = tiling.empty_output((plan.payload_numel,), plan.index_dtype, device)
    vals = tiling.empty_output((plan.payload_numel,), value_dtype, device)
    for cls in plan.classes:
        members = list(cls.tensors)
        _encode_class(
            plan, cls, [work[i] for i in members], [grads[i] for i in members], idx, vals, beta, lr, alpha
        )
    for d, wk in zip(deltas, work, strict=True):
        if wk is not d:
            d.copy_(wk)
    return idx, vals


def _encode_class(
    plan: tiling.TilePlan,
    cls: tiling.ClassPlan,
    bufs: list[torch.Tensor],
    grads: list[torch.Tensor],
    idx: torch.Tensor,
    vals: torch.Tensor,
    beta: float,
    lr: float,
    alpha: float,
) -> None:
    """The encode launch of one tile class (its contiguous buffers and gradients, in class
    order) with the config :func:`~cokit.triton_kernels.compress_config.select_config` picks.
    The encode updates the buffers in place, so tuning trials run on copies: cloned buffers,
    the same gradients, scratch payload outputs."""
    device = idx.device

    def launch(cfg: compress_config.KernelConfig, bs: list[torch.Tensor], i_out, v_out) -> None:
        pointers = tiling.pointer_table([bs, grads], device)
        _ef_encode_kernel[(cls.n_programs,)](
            cls.geometry,
            pointers,
            plan.basis_bank,
            bs[0],
            grads[0],
            i_out,
            v_out,
            float(beta),
            float(lr),
            float(alpha),
            G_COLS=tiling.G_COLS,
            TWO_D=not cls.one_d,
            BLOCK_ROWS=cls.block_rows,
            BLOCK_W=cls.block_w,
            DOT_PRECISION=cfg.dot_precision,
            ALIGNED=aligned,
            **cfg.launch_options(),
        )

    aligned = tiling.aligned([plan.tilings[i] for i in cls.tensors], [*bufs, *grads])
    scratch: list[Any] = []

    def trial(cfg: compress_config.KernelConfig) -> None:
        if not scratch:  # made once, on the first trial launch (a cache hit makes none)
            scratch.extend([[b.clone() for b in bufs], torch.empty_like(idx), torch.empty_like(vals)])
        launch(cfg, *scratch)

    block = (cls.block_rows, cls.block_w)
    launch(
        compress_config.select_config("ef_encode", block, device, trial, two_d=not cls.one_d), bufs, idx, vals
    )


def scatter_precision(config: compress_config.KernelConfig, value_dtype: torch.dtype) -> str:
    """The decode's one-hot value-dot precision (exact for ``value_dtype``): TF32 tensor
    cores for 16-bit values where the config's dots are not plain fp32 (NVIDIA), else ``"ieee"``."""
    if config.dot_precision != "ieee" and value_dtype in (torch.float16, torch.bfloat16):
        return "tf32"
    return "ieee"


def _decode_impl(params, indices, values, chunk, k, lr, weight_decay, use_sign):
    device = params[0].device
    if kernel_path(device) == "torch":
        ef_decode_fast(params, indices, values, chunk, k, lr, weight_decay=weight_decay, use_sign=use_sign)
        return
    plan = tiling.tile_plan([p.shape for p in params], chunk, k, device, groups=[p.dtype for p in params])
    work = [_contiguous_work(p) for p in params]
    indices, values = indices.contiguous(), values.contiguous()
    for cls in plan.classes:
        members = list(cls.tensors)
        pointers = tiling.pointer_table([[work[i] for i in members]], device)
        aligned = tiling.aligned([plan.tilings[i] for i in members], [work[i] for i in members])
        # The decode updates the parameters in place, so it is never timed on them: it
        # takes the tuned config when there is one, else the space's default.
        block = (cls.block_rows, cls.block_w)
        cfg = compress_config.select_config("ef_decode", block, device, two_d=not cls.one_d)
        _ef_decode_kernel[(cls.n_programs,)](
            cls.geometry,
            pointers,
            plan.basis_bank,
            work[members[0]],
            indices,
            values,
            indices.shape[0],
            plan.payload_numel,
            float(lr),
            1.0 - float(lr) * float(weight_decay),
            G_COLS=tiling.G_COLS,
            TWO_D=not cls.one_d,
            USE_SIGN=use_sign,
            BLOCK_ROWS=cls.block_rows,
            BLOCK_W=cls.block_w,
            K_POW2=max(tiling.MIN_BLOCK, tiling.next_pow2(cls.max_k)),
            DOT_PRECISION=cfg.dot_precision,
            SCATTER_PRECISION=scatter_precision(cfg, values.dtype),
            ALIGNED=aligned,
            **cfg.launch_options(),
        )
    for p, wk in zip(params, work, strict=True):
        if wk is not p:
            p.copy_(wk)


# ----------------------------------------------------------------------------- references


def ef_encode_reference(
    deltas: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    beta: float,
    lr: float,
    chunk: int,
    k: int,
    *,
    alpha: float = 1.0,
    value_dtype: torch.dtype = torch.float32,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch encode, math in ``dtype``; updates ``deltas`` in place, returns the payload."""
    all_idx, all_vals = [], []
    plan = tiling.tile_plan([d.shape for d in deltas], chunk, k)
    for d, g, t in zip(deltas, grads, plan.tilings, strict=True):
        # in place when the buffer already has the math dtype (the CPU training path)
        buf = d if d.dtype == dtype else d.to(dtype)
        buf.mul_(beta).add_(g.to(dtype), alpha=lr)
        coeffs = dct_encode_reference(buf, chunk, dtype)
        idx, vals = chunk_topk_reference(coeffs, k)
        sparse = torch.zeros_like(coeffs).scatter_(1, idx.long(), vals)
        buf.sub_(dct_decode_reference(sparse, t.shape, chunk, dtype), alpha=alpha)
        if buf is not d:
            d.copy_(buf)
        all_idx.append(idx.flatten().to(plan.index_dtype))
        all_vals.append(vals.flatten().to(value_dtype))
    return torch.cat(all_idx), torch.cat(all_vals)


def ef_decode_reference(
    params: Sequence[torch.Tensor],
    indices: torch.Tensor,
    values: torch.Tensor,
    chunk: int,
    k: int,
    lr: float,
    *,
    weight_decay: float = 0.0,
    use_sign: bool = True,
    dtype: torch.dtype = torch.float32,
) -> None:
    """Pure-torch decode, math in ``dtype``: DeMo's mean over ranks, IDCT, sign, update."""
    plan = tiling.tile_plan([p.shape for p in params], chunk, k)
    ranks = indices.shape[0]
    for p, t, off in zip(params, plan.tilings, plan.payload_offsets, strict=True):
        ke = t.k_eff(k)
        span = slice(off, off + t.n_tiles * ke)
        idx = indices[:, span].reshape(ranks, t.n_tiles, ke).transpose(0, 1).reshape(t.n_tiles, -1)
        val = values[:, span].reshape(ranks, t.n_tiles, ke).transpose(0, 1).reshape(t.n_tiles, -1)
        dense = torch.zeros(t.n_tiles, t.tile_numel, dtype=dtype, device=p.device)
        dense.scatter_reduce_(1, idx.long(), val.to(dtype), reduce="mean", include_self=False)
        update = dct_decode_reference(dense, t.shape, chunk, dtype)
        if use_sign:
            update.sign_()
        if p.dtype == dtype:
            p.mul_(1 - lr * weight_decay).sub_(update, alpha=lr)
        else:
            p.copy_(p.to(dtype) * (1 - lr * weight_decay) - lr * update)


# ----------------------------------------------------------------------------- fast torch path


def ef_encode_fast(
    deltas: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    beta: float,
    lr: float,
    chunk: int,
    k: int,
    *,
    alpha: float = 1.0,
    value_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`ef_encode_reference` (fp32 math) bit for bit, for contiguous fp32 ``deltas``:
    the same elementwise ops on the same layouts and the same BLAS calls
    (:func:`~cokit.triton_kernels.dct.dct_encode_into`), with reused scratch buffers
    instead of fresh temporaries and a top-k over candidates
    (:func:`~cokit.triton_kernels.topk.chunk_topk_fast`)."""
    plan = tiling.tile_plan([d.shape for d in deltas], chunk, k)
    all_idx, all_vals = [], []
    for d, g, t in zip(deltas, grads, plan.tilings, strict=True):
        d.mul_(beta).add_(g.to(torch.float32), alpha=lr)
        n = t.numel
        a, b, c = (WORKSPACE.get(slot, n, torch.float32, d.device) for slot in range(3))
        coeffs = dct_encode_into(d, t, b, c, a)  # in c
        idx, vals = chunk_topk_fast(coeffs, k)
        sparse = coeffs.zero_().scatter_(1, idx.long(), vals)  # zeros_like(coeffs).scatter_
        x = dct_decode_into(sparse, t, b, a)  # in a, tile order
        # the decoded tensor in its own (contiguous) layout, as the reference's reshape copy
        dec = c.view(t.rows // t.h, t.h, t.cols // t.w, t.w).copy_(x.transpose(1, 2)).view(d.shape)
        d.sub_(dec, alpha=alpha)
        all_idx.append(idx.flatten().to(plan.index_dtype))
        all_vals.append(vals.flatten().to(value_dtype))
    return torch.cat(all_idx), torch.cat(all_vals)


def ef_decode_fast(
    params: Sequence[torch.Tensor],
    indices: torch.Tensor,
    values: torch.Tensor,
    chunk: int,
    k: int,
    lr: float,
    *,
    weight_decay: float = 0.0,
    use_sign: bool = True,
) -> None:
    """:func:`ef_decode_reference` (fp32 math) bit for bit, with reused scratch buffers.

    One rank's payload with strictly increasing positions per tile (what :func:`ef_encode`
    sends) is scattered with ``scatter_add_`` onto zeros: the reference's
    ``scatter_reduce_(mean, include_self=False)`` computes ``(0 + v) / 1`` there, the same
    value. Other payloads take the reference's mean."""
    plan = tiling.tile_plan([p.shape for p in params], chunk, k)
    ranks = indices.shape[0]
    for p, t, off in zip(params, plan.tilings, plan.payload_offsets, strict=True):
        ke = t.k_eff(k)
        span = slice(off, off + t.n_tiles * ke)
        idx = indices[:, span].reshape(ranks, t.n_tiles, ke).transpose(0, 1).reshape(t.n_tiles, -1).long()
        val = values[:, span].reshape(ranks, t.n_tiles, ke).transpose(0, 1).reshape(t.n_tiles, -1)
        val = val.to(torch.float32)
        a, b, c = (WORKSPACE.get(slot, t.numel, torch.float32, p.device) for slot in range(3))
        dense = a.view(t.n_tiles, t.tile_numel).zero_()
        if ranks == 1 and (ke == 1 or bool((idx[:, 1:] > idx[:, :-1]).all())):
            dense.scatter_add_(1, idx, val)
        else:
            dense.scatter_reduce_(1, idx, val, reduce="mean", include_self=False)
        x = dct_decode_into(dense, t, b, c).transpose(1, 2)  # in c
        update = a.view(t.rows // t.h, t.h, t.cols // t.w, t.w)
        if use_sign:
            torch.sign(x, out=update)
        else:
            update.copy_(x)
        update = update.view(p.shape)
        if p.dtype == torch.float32:
            p.mul_(1 - lr * weight_decay).sub_(update, alpha=lr)
        else:
            p.copy_(p.to(torch.float32) * (1 - lr * weight_decay) - lr * update)


# ----------------------------------------------------------------------------- ops


@torch.library.custom_op("cokit::ef_encode", mutates_args=("deltas",))
def _ef_encode_op(
    deltas: list[torch.Tensor],
    grads: list[torch.Tensor],
    beta: float,
    lr: float,
    alpha: float,
    chunk: int,
    k: int,
    value_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _encode_impl(deltas, grads, beta, lr, alpha, chunk, k, value_dtype)


@_ef_encode_op.register_fake
def _(deltas, grads, beta, lr, alpha, chunk, k, value_dtype):
    numel, index_dtype = tiling.payload_shape([d.shape for d in deltas], chunk, k)
    return deltas[0].new_empty(numel, dtype=index_dtype), deltas[0].new_empty(numel, dtype=value_dtype)


@torch.library.custom_op("cokit::ef_decode", mutates_args=("params",))
def _ef_decode_op(
    params: list[torch.Tensor],
    indices: torch.Tensor,
    values: torch.Tensor,
    chunk: int,
    k: int,
    lr: float,
    weight_decay: float,
    use_sign: bool,
) -> None:
    _decode_impl(params, indices, values, chunk, k, lr, weight_decay, use_sign)


@_ef_decode_op.register_fake
def _(params, indices, values, chunk, k, lr, weight_decay, use_sign):
    return None


def ef_encode(
    deltas: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    *,
    beta: float,
    lr: float,
    chunk: int = 64,
    k: int = 32,
    alpha: float = 1.0,
    value_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused error-feedback encode of a bucket (module docstring); updates ``deltas``.

    ``deltas`` are fp32 buffers shaped like ``grads`` (fp32/fp16/bf16). Returns the flat
    payload ``(indices, values)`` of :func:`payload_layout` ``(shapes, chunk, k)``.
    """
    deltas = check_tensor_list("deltas", deltas)
    grads = check_tensor_list("grads", grads)
    if len(deltas) != len(grads):
        raise ValueError(f"got {len(deltas)} deltas but {len(grads)} grads")
    check_positive_int("chunk", chunk)
    check_positive_int("k", k)
    beta, lr, alpha = (
        check_number("beta", beta, 0.0, 1.0),
        check_number("lr", lr, 0.0),
        check_number("alpha", alpha, 0.0, 1.0),
    )
    if value_dtype not in FLOAT_DTYPES:
        raise TypeError(f"value_dtype must be torch.float32, float16 or bfloat16, got {value_dtype}")
    for i, (d, g) in enumerate(zip(deltas, grads, strict=True)):
        check_float_tensor(f"deltas[{i}]", d, (torch.float32,))
        check_float_tensor(f"grads[{i}]", g)
        if d.shape != g.shape:
            raise ValueError(f"deltas[{i}] has shape {tuple(d.shape)} but grads[{i}] has {tuple(g.shape)}")
    check_same_device(
        **{f"deltas[{i}]": d for i, d in enumerate(deltas)}, **{f"grads[{i}]": g for i, g in enumerate(grads)}
    )
    kernel_path(deltas[0].device)
    return torch.ops.cokit.ef_encode(deltas, grads, beta, lr, alpha, chunk, k, value_dtype)


def _check_payload(plan: tiling.TilePlan, indices: torch.Tensor, values: torch.Tensor) -> None:
    if indices.dtype not in INDEX_DTYPES:
        raise TypeError(f"indices must be int16, int32 or int64, got {indices.dtype}")
    check_float_tensor("values", values)
    if indices.dim() != 2 or values.shape != indices.shape:
        raise ValueError(
            f"indices and values must both be (world_size, payload_numel), got {tuple(indices.shape)} "
            f"and {tuple(values.shape)}"
        )
    if indices.shape[1] != plan.payload_numel:
        raise ValueError(
            f"payload has {indices.shape[1]} slots per rank, but these parameters with chunk={plan.chunk}, "
            f"k={plan.k} need {plan.payload_numel}: payload and tensors do not match"
        )
    for t, off in zip(plan.tilings, plan.payload_offsets, strict=True):
        span = indices[:, off : off + t.n_tiles * t.k_eff(plan.k)]
        bad = (span < 0) | (span >= t.tile_numel)
        if bool(bad.any()):
            rank, slot = (int(v) for v in bad.nonzero()[0])
            raise ValueError(
                f"payload index {int(span[rank, slot])} of rank {rank} (slot {off + slot}) is out of range "
                f"[0, {t.tile_numel}) for a tensor of shape {t.shape}"
            )
        tiles = span.reshape(indices.shape[0], t.n_tiles, -1).sort(dim=-1).values
        if bool((tiles[..., 1:] == tiles[..., :-1]).any()):
            raise ValueError(f"payload repeats a position inside one tile of a tensor of shape {t.shape}")


def ef_decode(
    params: Sequence[torch.Tensor],
    indices: torch.Tensor,
    values: torch.Tensor,
    *,
    lr: float,
    chunk: int = 64,
    k: int = 32,
    weight_decay: float = 0.0,
    use_sign: bool = True,
    validate: bool = True,
) -> None:
    """Decode gathered payloads ``(world_size, payload_numel)`` and update ``params`` in place.

    ``validate`` checks every index against its tile (one cheap pass over the payload);
    switch it off only for payloads produced by :func:`ef_encode` in this process.
    """
    params = check_tensor_list("params", params)
    check_positive_int("chunk", chunk)
    check_positive_int("k", k)
    lr = check_number("lr", lr, 0.0)
    weight_decay = check_number("weight_decay", weight_decay, 0.0)
    for i, p in enumerate(params):
        check_float_tensor(f"params[{i}]", p)
    check_same_device(**{f"params[{i}]": p for i, p in enumerate(params)}, indices=indices, values=values)
    kernel_path(params[0].device)
    if validate:
        _check_payload(tiling.tile_plan([p.shape for p in params], chunk, k), indices, values)
    torch.ops.cokit.ef_decode(params, indices, values, chunk, k, lr, weight_decay, bool(use_sign))
