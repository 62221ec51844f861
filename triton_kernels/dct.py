"""Tiled orthonormal DCT: DCT-II encode and DCT-III decode of 1-D and 2-D tiles.

Encode turns a tensor into its tile coefficients, a ``(n_tiles, tile_h * tile_w)`` fp32
matrix (tiling rules in :mod:`cokit.triton_kernels.tiling`); decode is the exact inverse. A tile
``X`` becomes ``Y = B_h X B_w^T`` with the orthonormal DCT matrix ``B`` (row 0 scaled by
``1/sqrt(2)``), so the transform preserves the sum of squares (Parseval).

Inputs may be fp32, fp16 or bf16; the math is fp32-class: every ``tl.dot`` takes the launch
config's ``DOT_PRECISION`` (:mod:`cokit.triton_kernels.compress_config`: ``"tf32x3"`` on
sm_90+ tensor cores, six bf16 products split by hand on sm_80 (:func:`dot_fp32`), native fp32
``"ieee"`` MFMA on AMD, ``"ieee"`` under the interpreter; never plain TF32). The ``*_multi``
forms transform a whole bucket of tensors with one launch per tile class instead of one
launch per tensor.

Layout: Triton kernel + launcher + torch reference + ``torch.library`` ops (``cokit::``).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from typing import Any

import torch
import triton
import triton.language as tl

from . import compress_config, tiling
from ._checks import check_float_tensor, check_positive_int, check_same_device, check_tensor_list
from .backend import arch_limits, kernel_path

__all__ = [
    "compile_specs",
    "dct_decode",
    "dct_decode_multi",
    "dct_decode_reference",
    "dct_encode",
    "dct_encode_multi",
    "dct_encode_reference",
]


# ----------------------------------------------------------------------------- kernel


@triton.jit
def table_pointer(table, row, col: tl.constexpr, n_cols: tl.constexpr, ref, ALIGNED: tl.constexpr):
    """The data pointer at ``table[row, col]``, typed like the tensor argument ``ref``.

    The alignment hint is applied here, to the op that makes the pointer: on triton 3.6 a
    ``tl.multiple_of`` on the value a called ``@triton.jit`` function returns is dropped.

    Args:
        table: int64, ``(n_rows, n_cols)`` row-major: data pointers stored as integers
            (:func:`cokit.triton_kernels.tiling.pointer_table`).
        row: int64 scalar, the table row (a tensor's index inside its launch class).
        col (constexpr): the column (which argument), ``0 <= col < n_cols``.
        n_cols (constexpr): columns of the table.
        ref: a pointer argument of the kernel; the result points at ``ref``'s element type.
        ALIGNED (constexpr): the pointer is ``tiling.ALIGN``-byte aligned (a hint).
    """
    pointer = tl.load(table + row * n_cols + col).to(tl.pointer_type(ref.dtype.element_ty), bitcast=True)
    if ALIGNED:
        pointer = tl.multiple_of(pointer, 16)
    return pointer


@triton.jit
def load_basis(bank, off, BLOCK: tl.constexpr, TRANSPOSE: tl.constexpr):
    """The DCT matrix ``B`` of one side (or ``B^T``) from the basis bank, as the zero-padded
    ``BLOCK x BLOCK`` fp32 block stored there: contiguous, unmasked, vectorized loads.

    The alignment hint sits on the offsets computed here: a ``tl.multiple_of`` on ``off``
    (a parameter of this called function) never reached the TTIR, and the loads stayed
    scalar (64 instead of 16 per thread for a 64x64 encode at 4 warps on sm_90). On gfx942 the
    hint is lost when the loads become buffer loads, so the start is also rounded to a
    multiple of 256 (it is one already): that divisibility is derived, not hinted, and the
    basis loads are 128-bit there too (they were 32-bit).

    Args:
        bank: fp32, flat basis bank (:func:`cokit.triton_kernels.tiling.tile_plan`): per side
            ``n``, ``B`` then ``B^T``, each ``BLOCK x BLOCK`` row-major with
            ``BLOCK = max(16, next_pow2(n))``, zero outside ``n x n``.
        off: int64 scalar, element offset of ``B`` in ``bank`` (a multiple of 256).
        BLOCK (constexpr): power of 2 >= 16, the padded side (the tile class's block side).
        TRANSPOSE (constexpr): True returns ``B^T`` (stored right after ``B``).
    """
    i = tl.arange(0, BLOCK)[:, None]
    j = tl.arange(0, BLOCK)[None, :]
    start = (off.to(tl.int32) // 256) * 256
    if TRANSPOSE:
        start += BLOCK * BLOCK
    return tl.load(bank + tl.multiple_of(start + i * BLOCK + j, [1, 16]))


@triton.jit
def split_bf16(x):
    """fp32 ``x`` as three bf16 terms ``hi + mid + lo``, each the rounded rest of the others
    (24 significant bits in all: fp32's)."""
    hi = x.to(tl.bfloat16)
    rest = x - hi.to(tl.float32)
    mid = rest.to(tl.bfloat16)
    lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
    return hi, mid, lo


@triton.jit
def dot_fp32(a, b, key, DOT_PRECISION: tl.constexpr):
    """``a @ b`` of two fp32 blocks at ``DOT_PRECISION``, one ``scf.if`` region per product.

    ``"bf16x6"`` is split by hand (:func:`split_bf16`): the six products of terms whose orders
    add up to at most 2, in the order ``a``'s terms die (lo*hi, mid*mid, mid*hi, hi*lo,
    hi*mid, hi*hi), which keeps the fewest terms live; other precisions go to one ``tl.dot``.
    Each product sits in its own region, under a condition that is always true (``key >= -i``; ``key`` is a
    bank offset, never negative) but that the compiler cannot fold or merge with the next
    one. Why: Triton's NVIDIA layout pass (``warpsPerTileV2``) gives all warps to the rows
    when it finds another dot in the dot's region (here: the accumulator chain, the second
    transform, the inverse), so every warp held the whole right-hand operand and the 64x64
    fused encode spilled 200-400 B per thread on sm_80. With one dot per region it takes a
    2 x 4 warp grid (8 warps) and nothing spills on sm_80, sm_90 (triton 3.6 and 3.9).

    Args:
        a: fp32 ``(M, K)`` block.
        b: fp32 ``(K, N)`` block.
        key: int scalar >= 0 known only at run time (a bank offset).
        DOT_PRECISION (constexpr): ``tl.dot`` input precision, or ``"bf16x6"``.
    """
    acc = tl.zeros((a.shape[0], b.shape[1]), tl.float32)
    if DOT_PRECISION == "bf16x6":
        a_hi, a_mid, a_lo = split_bf16(a)
        b_hi, b_mid, b_lo = split_bf16(b)
        if key >= 0:
            acc = tl.dot(a_lo, b_hi, acc)
        if key >= -1:
            acc = tl.dot(a_mid, b_mid, acc)
        if key >= -2:
            acc = tl.dot(a_mid, b_hi, acc)
        if key >= -3:
            acc = tl.dot(a_hi, b_lo, acc)
        if key >= -4:
            acc = tl.dot(a_hi, b_mid, acc)
        if key >= -5:
            acc = tl.dot(a_hi, b_hi, acc)
    else:
        if key >= 0:
            acc = tl.dot(a, b, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def transform_block(
    x,
    bank,
    bh_off,
    bw_off,
    TWO_D: tl.constexpr,
    INVERSE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_W: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Encode ``B_h x B_w^T`` / decode ``B_h^T x B_w`` of a zero-padded fp32 block.

    In ONE_D mode (``TWO_D`` false) every row of ``x`` is its own 1-D tile: only the
    right-hand transform applies. The dots run at ``DOT_PRECISION`` (:func:`dot_fp32`). The
    bank's matrices are zero outside their ``n x n`` part, so the result is too.

    Args:
        x: fp32 ``(BLOCK_ROWS, BLOCK_W)`` block, zero outside the valid ``h x w`` (TWO_D) or
            ``rows x w`` (ONE_D) part.
        bank: fp32, flat basis bank (see :func:`load_basis`).
        bh_off: int64 scalar, offset of the ``h``-side matrix in ``bank`` (unused in ONE_D).
        bw_off: int64 scalar, offset of the ``w``-side matrix in ``bank``.
        TWO_D (constexpr): the block is one 2-D tile (else rows of 1-D tiles).
        INVERSE (constexpr): False encodes (DCT-II), True decodes (DCT-III).
        BLOCK_ROWS (constexpr): power of 2 >= 16 (``tl.dot``), rows of the block (the padded
            ``h`` side in TWO_D).
        BLOCK_W (constexpr): power of 2 >= 16, columns of the block (the padded ``w`` side).
        DOT_PRECISION (constexpr): ``tl.dot`` input precision (``"tf32x3"``, ``"ieee"``, ...;
            :class:`~cokit.triton_kernels.compress_config.KernelConfig`).

    Returns the transformed fp32 block, zero outside the valid part.
    """
    right = load_basis(bank, bw_off, BLOCK_W, not INVERSE)
    y = dot_fp32(x, right, bw_off, DOT_PRECISION)
    if TWO_D:
        left = load_basis(bank, bh_off, BLOCK_ROWS, INVERSE)
        y = dot_fp32(left, y, bh_off, DOT_PRECISION)
    return y


@triton.jit
def _dct_kernel(
    geometry,
    pointers,
    bank,
    src_ref,
    dst_ref,
    G_COLS: tl.constexpr,
    TWO_D: tl.constexpr,
    INVERSE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_W: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    """DCT-II encode or DCT-III decode of the tiles of a bucket of tensors, fp32-class math.

    Grid: ``(n_programs,)`` of one launch class (:class:`~cokit.triton_kernels.tiling.ClassPlan`);
    program ``i`` handles geometry row ``i``: one ``h x w`` tile (TWO_D) or a block of up to
    ``BLOCK_ROWS`` consecutive 1-D tiles (ONE_D) of one tensor. It loads the block, transforms
    it and stores it; no two programs write the same element.

    Args:
        geometry: int64, ``(n_programs, G_COLS)`` row-major, one row per program (columns
            ``tiling.G_*``): the tensor's row in ``pointers`` (G_TENSOR), the element offset
            of the block in the tensor's matrix view (G_X_OFF) and that view's row stride
            (G_ROW_STRIDE), the offset of the block's coefficients (G_Y_OFF), its valid rows
            (G_ROWS), the tile height and width (G_H, G_W) and the offsets of the ``h x h``
            and ``w x w`` DCT matrices in ``bank`` (G_BH_OFF, G_BW_OFF).
        pointers: int64, ``(n_tensors, 2)`` row-major: per tensor of the class, the data
            pointer of its source (column 0) and destination (column 1), both contiguous.
        bank: fp32, flat: the basis bank of the plan (:func:`load_basis`: per side, ``B`` and
            ``B^T`` zero-padded to the block side).
        src_ref: the class's first source; only its element type is used (every source of
            the launch has it). Encode: the tensor (fp32/fp16/bf16, matrix layout). Decode:
            its fp32 coefficients (tile layout: tiles in order, each row-major).
        dst_ref: the class's first destination, likewise: fp32 coefficients (encode) or the
            tensor (fp32/fp16/bf16, decode).
        G_COLS (constexpr): columns of a geometry row (``tiling.G_COLS``).
        TWO_D (constexpr): True: the block is one 2-D tile; False: rows of 1-D tiles of
            width ``w`` (right-hand transform only).
        INVERSE (constexpr): False encodes (matrix -> tile layout), True decodes.
        BLOCK_ROWS (constexpr): power of 2 >= 16 (``tl.dot``), at least the tile height
            (TWO_D) or the tiles per program (ONE_D); rows past G_ROWS are masked.
        BLOCK_W (constexpr): power of 2 >= 16, at least the tile width; columns past G_W
            are masked.
        DOT_PRECISION (constexpr): ``tl.dot`` input precision of the launch config.
        ALIGNED (constexpr): the class's sources, destinations, row strides and tile widths
            are ``tiling.ALIGN``-aligned (:func:`~cokit.triton_kernels.tiling.aligned`): the
            hints give vectorized loads and stores of the tensor and its coefficients.
    """
    g = geometry + tl.program_id(0) * G_COLS
    tensor = tl.load(g + 0)
    x_off = tl.load(g + 1)
    row_stride = tl.load(g + 2)
    y_off = tl.load(g + 3)
    rows = tl.load(g + 4)
    w = tl.load(g + 6)
    src = table_pointer(pointers, tensor, 0, 2, src_ref, ALIGNED)
    dst = table_pointer(pointers, tensor, 1, 2, dst_ref, ALIGNED)
    if ALIGNED:
        x_off = tl.multiple_of(x_off, 16)
        row_stride = tl.multiple_of(row_stride, 16)
        y_off = tl.multiple_of(y_off, 16)
        w = tl.multiple_of(w, 16)

    r = tl.arange(0, BLOCK_ROWS)[:, None]
    c = tl.arange(0, BLOCK_W)[None, :]
    mask = (r < rows) & (c < w)
    matrix_addr = x_off + r * row_stride + c  # element of the tensor (matrix view)
    tile_addr = y_off + r * w + c  # element of the coefficients (tile layout)
    if INVERSE:
        x = tl.load(src + tile_addr, mask=mask, other=0.0).to(tl.float32)
    else:
        x = tl.load(src + matrix_addr, mask=mask, other=0.0).to(tl.float32)
    y = transform_block(
        x, bank, tl.load(g + 7), tl.load(g + 8), TWO_D, INVERSE, BLOCK_ROWS, BLOCK_W, DOT_PRECISION
    )
    if INVERSE:
        tl.store(dst + matrix_addr, y.to(dst.dtype.element_ty), mask=mask)
    else:
        tl.store(dst + tile_addr, y.to(dst.dtype.element_ty), mask=mask)


def compile_specs(target: str) -> list[tuple[str, Any, dict[str, str], dict[str, Any], dict[str, int]]]:
    """Compile-only builds for ``target`` (collected by :mod:`cokit.triton_kernels.compile_only`):
    encode (bf16 tensor -> fp32 coefficients) and decode (fp32 -> bf16) of every shipped block
    (:func:`~cokit.triton_kernels.tiling.compile_blocks`) with every config of the
    target's backend space, with and without the alignment hints; labels like
    ``dct_encode_2d[w4s1-tf32x3]`` and ``dct_encode_2d[w4s1-tf32x3]+aligned``."""
    limits = arch_limits(target)
    specs = []
    for mode, two_d, rows, width in tiling.compile_blocks():
        for inverse in (False, True):
            kernel = "dct_decode" if inverse else "dct_encode"
            sig = tiling.geometry_signature(
                src_ref="*fp32" if inverse else "*bf16", dst_ref="*bf16" if inverse else "*fp32"
            )
            sig.update(
                dict.fromkeys(
                    ("G_COLS", "TWO_D", "INVERSE", "BLOCK_ROWS", "BLOCK_W", "DOT_PRECISION", "ALIGNED"),
                    "constexpr",
                )
            )
            for cfg in compress_config.config_space(kernel, limits.backend, (rows, width), limits.arch):
                for aligned in (False, True):
                    constexprs = {
                        "G_COLS": tiling.G_COLS,
                        "TWO_D": two_d,
                        "INVERSE": inverse,
                        "BLOCK_ROWS": rows,
                        "BLOCK_W": width,
                        "DOT_PRECISION": cfg.dot_precision,
                        "ALIGNED": aligned,
                    }
                    label = f"{kernel}_{mode}[{cfg.spec()}]" + ("+aligned" if aligned else "")
                    specs.append((label, _dct_kernel, sig, constexprs, cfg.launch_options()))
    return specs


# ----------------------------------------------------------------------------- launcher


def _launch(
    plan: tiling.TilePlan,
    srcs: list[torch.Tensor],
    dsts: list[torch.Tensor],
    inverse: bool,
) -> None:
    """One launch per tile class, each with the config
    :func:`~cokit.triton_kernels.compress_config.select_config` picks (tuned once per block on
    a GPU: the trial launches write only ``dsts``, which the real launch then overwrites)."""
    device = srcs[0].device
    kernel = "dct_decode" if inverse else "dct_encode"
    for cls in plan.classes:
        members = list(cls.tensors)
        columns = [[srcs[i] for i in members], [dsts[i] for i in members]]
        pointers = tiling.pointer_table(columns, device)
        aligned = tiling.aligned([plan.tilings[i] for i in members], [*columns[0], *columns[1]])

        def run(
            cfg: compress_config.KernelConfig,
            cls: tiling.ClassPlan = cls,
            pointers: Any = pointers,
            aligned: bool = aligned,
        ) -> None:
            _dct_kernel[(cls.n_programs,)](
                cls.geometry,
                pointers,
                plan.basis_bank,
                srcs[cls.tensors[0]],
                dsts[cls.tensors[0]],
                G_COLS=tiling.G_COLS,
                TWO_D=not cls.one_d,
                INVERSE=inverse,
                BLOCK_ROWS=cls.block_rows,
                BLOCK_W=cls.block_w,
                DOT_PRECISION=cfg.dot_precision,
                ALIGNED=aligned,
                **cfg.launch_options(),
            )

        block = (cls.block_rows, cls.block_w)
        run(compress_config.select_config(kernel, block, device, run, two_d=not cls.one_d))


def _encode_impl(xs: list[torch.Tensor], chunk: int) -> list[torch.Tensor]:
    xs = [x.contiguous() for x in xs]
    device = xs[0].device
    if kernel_path(device) == "torch":
        return [dct_encode_reference(x, chunk) for x in xs]
    plan = tiling.tile_plan([x.shape for x in xs], chunk, device=device, groups=[x.dtype for x in xs])
    outs = [tiling.empty_output((t.n_tiles, t.tile_numel), torch.float32, device) for t in plan.tilings]
    _launch(plan, xs, outs, inverse=False)
    return outs


def _decode_impl(
    coeffs: list[torch.Tensor], shapes: list[list[int]], chunk: int, dtype: torch.dtype
) -> list[torch.Tensor]:
    coeffs = [c.contiguous() for c in coeffs]
    device = coeffs[0].device
    if kernel_path(device) == "torch":
        return [dct_decode_reference(c, s, chunk).to(dtype) for c, s in zip(coeffs, shapes, strict=True)]
    plan = tiling.tile_plan(shapes, chunk, device=device, groups=[c.dtype for c in coeffs])
    outs = [tiling.empty_output(s, dtype, device) for s in shapes]
    _launch(plan, coeffs, outs, inverse=True)
    return outs


# ----------------------------------------------------------------------------- reference


def _tiles(m: torch.Tensor, t: tiling.TensorTiling) -> torch.Tensor:
    """(rows, cols) matrix -> (tiles_y, tiles_x, h, w) view."""
    return m.reshape(t.rows // t.h, t.h, t.cols // t.w, t.w).transpose(1, 2)


def dct_encode_reference(
    x: torch.Tensor, chunk: int = 64, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Pure-torch encode, computed in ``dtype`` (float64 for test references)."""
    t = tiling.TensorTiling.of(x.shape, chunk)
    bh = tiling.basis_matrix(t.h, dtype, x.device)
    bw = tiling.basis_matrix(t.w, dtype, x.device)
    y = bh @ _tiles(x.to(dtype).reshape(t.rows, t.cols), t) @ bw.T
    return y.reshape(t.n_tiles, t.tile_numel)


def dct_decode_reference(
    coeffs: torch.Tensor, shape: Sequence[int], chunk: int = 64, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Pure-torch decode (inverse of :func:`dct_encode_reference`), computed in ``dtype``."""
    t = tiling.TensorTiling.of(shape, chunk)
    bh = tiling.basis_matrix(t.h, dtype, coeffs.device)
    bw = tiling.basis_matrix(t.w, dtype, coeffs.device)
    y = coeffs.to(dtype).reshape(t.rows // t.h, t.cols // t.w, t.h, t.w)
    x = bh.T @ y @ bw
    return x.transpose(1, 2).reshape(tuple(shape))


# ----------------------------------------------------------------------------- fast torch path
#
# The CPU training path (``kernel_path == "torch"``) computes exactly what the references
# above compute, bit for bit: the same ``bmm`` and ``mm`` calls that ``torch.matmul`` makes for
# ``bh @ tiles @ bw.T`` and ``bh.T @ coeffs @ bw`` (same shapes, strides and transposes, so the
# same BLAS calls), but into reused scratch buffers instead of fresh tensors: on a CPU the
# page faults of fresh multi-megabyte temporaries cost about as much as the transforms.


class Workspace(threading.local):
    """Per-thread fp32 scratch buffers by slot, grown to the largest request and reused.

    Buffers over ``max_numel`` elements are not kept (a one-off fresh tensor instead), so a
    huge tensor does not pin its scratch for the life of the process."""

    max_numel = 1 << 26  # 256 MiB of fp32 per slot

    def __init__(self) -> None:
        self.buffers: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, slot: int, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D buffer of ``numel`` elements (contents undefined), at offset 0 of its storage."""
        key = (slot, dtype, device)
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < numel:
            if numel > self.max_numel:
                return torch.empty(numel, dtype=dtype, device=device)
            buf = self.buffers[key] = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel]

    def clear(self) -> None:
        self.buffers.clear()


WORKSPACE = Workspace()


@functools.lru_cache(maxsize=256)
def _cached_basis(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return tiling.basis_matrix(n, dtype, device)


def dct_encode_into(
    x: torch.Tensor, t: tiling.TensorTiling, work: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor
) -> torch.Tensor:
    """:func:`dct_encode_reference` of a contiguous fp32 ``x`` (tiling ``t``), bit for bit,
    as a ``(n_tiles, tile_numel)`` view of ``out``; ``work`` and ``scratch`` are scratch
    (each ``t.numel`` fp32 elements, 1-D, contiguous, not overlapping ``x`` or ``out``)."""
    r, c, h, w = t.rows // t.h, t.cols // t.w, t.h, t.w
    bh, bw = _cached_basis(h, x.dtype, x.device), _cached_basis(w, x.dtype, x.device)
    tiles = x.view(r, h, c, w).transpose(1, 2)  # _tiles
    # torch.matmul(bh, tiles): bmm of the expanded basis and tiles.reshape(r*c, h, w), a
    # contiguous copy unless that reshape is a view
    try:
        batch = tiles.view(r * c, h, w)
    except RuntimeError:
        batch = scratch.view(r, c, h, w).copy_(tiles).view(r * c, h, w)
    y = torch.bmm(bh.expand(r, c, h, h).reshape(r * c, h, h), batch, out=work.view(r * c, h, w))
    # (...) @ bw.T: matmul folds the batch into the rows of one mm
    torch.mm(y.view(r * c * h, w), bw.t(), out=out.view(r * c * h, w))
    return out.view(t.n_tiles, t.tile_numel)


def dct_decode_into(
    coeffs: torch.Tensor, t: tiling.TensorTiling, work: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """``bh.T @ coeffs @ bw`` of :func:`dct_decode_reference` for contiguous fp32 ``coeffs``
    ``(n_tiles, tile_numel)``, bit for bit, as an ``(r, c, h, w)`` view of ``out`` (tile
    order: the caller writes ``.transpose(1, 2)`` of it into the tensor's layout);
    ``work`` is scratch (``t.numel`` fp32 elements, not overlapping ``coeffs`` or ``out``)."""
    r, c, h, w = t.rows // t.h, t.cols // t.w, t.h, t.w
    bh, bw = _cached_basis(h, coeffs.dtype, coeffs.device), _cached_basis(w, coeffs.dtype, coeffs.device)
    z = torch.bmm(
        bh.t().expand(r, c, h, h).reshape(r * c, h, h), coeffs.view(r * c, h, w), out=work.view(r * c, h, w)
    )
    torch.mm(z.view(r * c * h, w), bw, out=out.view(r * c * h, w))
    return out.view(r, c, h, w)


# ----------------------------------------------------------------------------- ops


@torch.library.custom_op("cokit::dct_encode_multi", mutates_args=())
def _dct_encode_multi_op(xs: list[torch.Tensor], chunk: int) -> list[torch.Tensor]:
    return _encode_impl(xs, chunk)


def _symbolic(shape: Sequence[Any]) -> bool:
    return any(isinstance(d, torch.SymInt) for d in shape)


@_dct_encode_multi_op.register_fake
def _(xs, chunk):
    out = []
    for x in xs:
        if _symbolic(x.shape):
            # The tile grid is a divisor search over the concrete shape: under
            # torch.compile(dynamic=True) the output is (n_tiles, tile_numel) with sizes
            # known at run time, so one graph serves every input shape.
            ctx = torch.library.get_ctx()
            n_tiles, tile_numel = ctx.new_dynamic_size(min=1), ctx.new_dynamic_size(min=1)
            torch._check(n_tiles * tile_numel == x.numel())
            out.append(x.new_empty((n_tiles, tile_numel), dtype=torch.float32))
        else:
            t = tiling.TensorTiling.of(x.shape, chunk)
            out.append(x.new_empty((t.n_tiles, t.tile_numel), dtype=torch.float32))
    return out


def pack_shapes(shapes: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """Shapes as (all dims concatenated, rank of each): op schemas take no nested lists.
    Symbolic sizes (``torch.compile(dynamic=True)``) stay symbolic."""
    return [d if isinstance(d, torch.SymInt) else int(d) for s in shapes for d in s], [len(s) for s in shapes]


def unpack_shapes(dims: Sequence[int], ranks: Sequence[int]) -> list[list[int]]:
    out, pos = [], 0
    for r in ranks:
        out.append(list(dims[pos : pos + r]))
        pos += r
    return out


@torch.library.custom_op("cokit::dct_decode_multi", mutates_args=())
def _dct_decode_multi_op(
    coeffs: list[torch.Tensor], dims: list[int], ranks: list[int], chunk: int, dtype: torch.dtype
) -> list[torch.Tensor]:
    shapes = unpack_shapes(dims, ranks)
    _check_coeff_shapes(coeffs, shapes, chunk)
    return _decode_impl(coeffs, shapes, chunk, dtype)


@_dct_decode_multi_op.register_fake
def _(coeffs, dims, ranks, chunk, dtype):
    return [
        c.new_empty(tuple(s), dtype=dtype) for c, s in zip(coeffs, unpack_shapes(dims, ranks), strict=True)
    ]


def _check_inputs(name: str, xs: list[torch.Tensor], chunk: int) -> None:
    check_positive_int("chunk", chunk)
    for i, x in enumerate(xs):
        check_float_tensor(f"{name}[{i}]" if len(xs) > 1 else name, x)
    check_same_device(**{f"{name}[{i}]": x for i, x in enumerate(xs)})
    kernel_path(xs[0].device)  # rejects devices no kernel runs on


def _check_coeffs(
    coeffs: list[torch.Tensor], shapes: Sequence[Sequence[int]], chunk: int, dtype: torch.dtype
) -> None:
    _check_inputs("coeffs", coeffs, chunk)
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"dtype must be torch.float32, float16 or bfloat16, got {dtype}")
    if len(shapes) != len(coeffs):
        raise ValueError(f"got {len(coeffs)} coefficient tensors but {len(shapes)} shapes")


def _check_coeff_shapes(coeffs: list[torch.Tensor], shapes: list[list[int]], chunk: int) -> None:
    """Each coefficient tensor has its shape's tile grid; checked inside the op, where sizes
    are concrete even in a ``torch.compile(dynamic=True)`` graph."""
    for i, (c, s) in enumerate(zip(coeffs, shapes, strict=True)):
        t = tiling.TensorTiling.of(s, chunk)
        if tuple(c.shape) != (t.n_tiles, t.tile_numel):
            raise ValueError(
                f"coeffs[{i}] has shape {tuple(c.shape)}, but a tensor of shape {tuple(s)} with "
                f"chunk={chunk} has {t.n_tiles} tiles of {t.h}x{t.w}: expected ({t.n_tiles}, {t.tile_numel})"
            )


def dct_encode(x: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    """DCT-II of every tile of ``x``: a ``(n_tiles, tile_numel)`` fp32 tensor."""
    _check_inputs("x", [x], chunk)
    return torch.ops.cokit.dct_encode_multi([x], chunk)[0]


def dct_decode(
    coeffs: torch.Tensor, shape: Sequence[int], chunk: int = 64, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of :func:`dct_encode`: the tensor of ``shape`` (in ``dtype``) from its tile coefficients."""
    _check_coeffs([coeffs], [shape], chunk, dtype)
    return torch.ops.cokit.dct_decode_multi([coeffs], *pack_shapes([shape]), chunk, dtype)[0]


def dct_encode_multi(xs: Sequence[torch.Tensor], chunk: int = 64) -> list[torch.Tensor]:
    """:func:`dct_encode` of a bucket of tensors, one launch per tile class."""
    xs = check_tensor_list("xs", xs)
    _check_inputs("xs", xs, chunk)
    return torch.ops.cokit.dct_encode_multi(xs, chunk)


def dct_decode_multi(
    coeffs: Sequence[torch.Tensor],
    shapes: Sequence[Sequence[int]],
    chunk: int = 64,
    dtype: torch.dtype = torch.float32,
) -> list[torch.Tensor]:
    """:func:`dct_decode` of a bucket of tensors, one launch per tile class."""
    coeffs = check_tensor_list("coeffs", coeffs)
    _check_coeffs(coeffs, shapes, chunk, dtype)
    return torch.ops.cokit.dct_decode_multi(coeffs, *pack_shapes(shapes), chunk, dtype)
