"""Per-chunk top-k: the ``k`` coefficients of largest magnitude in every tile.

Input: a ``(n_tiles, tile_numel)`` matrix (what :func:`cokit.triton_kernels.dct.dct_encode`
returns; any 2-D float tensor works). Output per tile: ``k`` positions and the signed
values at them, ``k`` clamped to the tile size.

Conventions (the same in the kernel, the reference and the fused error-feedback kernel):

* **ties**: among equal magnitudes the lower position wins, so the result is a function of
  the input alone, identical on every rank and every backend;
* **order**: positions are returned in increasing order inside each tile;
* **index dtype**: int16 when a tile has at most 32768 positions, else int32;
* NaN counts as larger than every number (it is selected first); callers that must not
  send NaN check for it before compressing (the DeMo optimizer does).

How (any k, no sort): the int32 bit pattern of ``|x|`` orders like the float, so the k-th
largest magnitude is found by a 31-step bitwise search of per-tile counts; entries above it
are kept, ties at it go to the lowest positions, and a prefix sum gives each kept entry its
slot. This is cheap on GPUs and in the interpreter alike (``tl.topk``'s bitonic network
costs seconds per tile there).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from . import tiling
from ._checks import check_float_tensor, check_positive_int
from .backend import kernel_path

__all__ = ["chunk_topk", "chunk_topk_reference", "compile_specs", "index_dtype_for"]


def index_dtype_for(tile_numel: int) -> torch.dtype:
    """int16 when every position of a tile fits (<= 32768 positions), else int32."""
    return torch.int16 if tile_numel <= 32768 else torch.int32


# ----------------------------------------------------------------------------- kernel


@triton.jit
def tile_sum(x, TWO_D: tl.constexpr):
    """Per-tile sum of a block, broadcastable against it: (1, 1) in TWO_D, (rows, 1) else.

    Args:
        x: int32 or fp32 ``(BLOCK_ROWS, BLOCK_W)`` block (masked entries already zeroed).
        TWO_D (constexpr): True: the block is one tile; False: every row is a tile.
    """
    s = tl.sum(x, axis=1, keep_dims=True)
    if TWO_D:
        s = tl.sum(s, axis=0, keep_dims=True)
    return s


@triton.jit
def tile_cumsum(x, TWO_D: tl.constexpr):
    """Inclusive prefix sum in position order inside each tile (row-major in TWO_D).

    Args:
        x: int32 ``(BLOCK_ROWS, BLOCK_W)`` block (masked entries already zeroed).
        TWO_D (constexpr): True: the block is one tile, positions run row-major over it;
            False: every row is a tile and the sum runs along the row.
    """
    c = tl.cumsum(x, axis=1)
    if TWO_D:
        # Rows before this one, as a 1-D scan of the row totals: a scan along axis 0 of a
        # (rows, 1) block trips an assertion in triton 3.6's scan lowering (ScanOpToLLVM).
        row_total = tl.sum(x, axis=1)
        c += (tl.cumsum(row_total, axis=0) - row_total)[:, None]
    return c


@triton.jit
def topk_select(y, valid, k, TWO_D: tl.constexpr, MASK_LAST: tl.constexpr):
    """Top-k by magnitude of an fp32 block.

    Returns ``(selected, slot)``: a mask of the kept entries and, for each, its rank by
    position inside its tile (0..k-1); both ``(BLOCK_ROWS, BLOCK_W)``.

    The k-th largest magnitude is found bit by bit on the int32 pattern of ``|y|`` (it
    orders like the float; NaN above every number); entries above it are kept, and of
    those equal to it the lowest positions fill the remaining slots.

    Args:
        y: fp32 ``(BLOCK_ROWS, BLOCK_W)`` block of values.
        valid: int1 block of the same shape, the entries that belong to a tile.
        k: int32/int64 scalar, entries kept per tile, ``1 <= k <=`` valid entries of a tile.
        TWO_D (constexpr): True: the whole block is one tile; False: every row is a tile.
        MASK_LAST (constexpr): how the result is formed (both give the same bits).
            True: the slots come from prefix sums of the entries above and at the k-th
            magnitude (one packed scan) and the mask is made last, from integers, so no
            boolean block is live across a scan. AMD holds every boolean of a wavefront in
            a 64-bit SGPR pair (32 SGPRs per block at 16 entries per thread): with the
            mask first, the fused encode spilled 10-64 SGPRs on gfx942, chunk_topk 8-12.
            False: the mask first, the slots from its prefix sum; fewer live integers,
            which ptxas needs (sm_80's 1-D encode at 4 warps: 185 registers, 255 with
            MASK_LAST).
    """
    mag = tl.where(valid, tl.abs(y).to(tl.int32, bitcast=True), -1)
    kth = tile_sum(mag * 0, TWO_D)  # int32 zeros, one per tile
    for i in range(31):
        candidate = kth | (1 << (30 - i))
        enough = tile_sum((mag >= candidate).to(tl.int32), TWO_D) >= k
        kth = tl.where(enough, candidate, kth)
    if MASK_LAST:
        above = (mag > kth).to(tl.int32)
        tied = (mag == kth).to(tl.int32)  # invalid entries have mag -1 < kth
        need = k.to(tl.int32) - tile_sum(above, TWO_D)
        if (y.shape[0] if TWO_D else 1) * y.shape[1] < 32768:
            # both counts in one scan, 16 bits each (under 32768 entries per tile: no carry)
            ranks = tile_cumsum(above + tied * 65536, TWO_D)
            above_rank, tied_rank = ranks & 65535, ranks >> 16
        else:
            above_rank, tied_rank = tile_cumsum(above, TWO_D), tile_cumsum(tied, TWO_D)
        slot = above_rank + tl.minimum(tied_rank, need) - 1
        # order: 1 or 2 above the k-th magnitude, 0 at it among the first `need`, -1 at it
        # after them, below it -2 or -3; mag - kth cannot overflow (mag >= -1, 0 <= kth < 2**31)
        order = 2 * tl.minimum(tl.maximum(mag - kth, -1), 1) - tl.minimum(tl.maximum(tied_rank - need, 0), 1)
        selected = order >= 0
    else:
        above = mag > kth
        tied = valid & (mag == kth)
        need = k - tile_sum(above.to(tl.int32), TWO_D)
        selected = above | (tied & (tile_cumsum(tied.to(tl.int32), TWO_D) <= need))
        slot = tile_cumsum(selected.to(tl.int32), TWO_D) - 1
    return selected, slot


@triton.jit
def _topk_kernel(x, idx_out, val_out, n_rows, n_cols, k, BLOCK_ROWS: tl.constexpr, BLOCK_W: tl.constexpr):
    """Per-row top-k by magnitude: positions (increasing) and values of the ``k`` largest
    ``|x|`` of each row, ties to the lower position.

    Grid: ``(cdiv(n_rows, BLOCK_ROWS),)``; program ``i`` handles rows (tiles)
    ``i * BLOCK_ROWS`` to ``i * BLOCK_ROWS + BLOCK_ROWS - 1`` (rows past ``n_rows`` masked).

    Args:
        x: ``(n_rows, n_cols)`` contiguous row-major, fp32/fp16/bf16: one tile per row.
        idx_out: ``(n_rows, k)`` contiguous, int16 (``n_cols <= 32768``) or int32: the kept
            positions of each row, increasing.
        val_out: ``(n_rows, k)`` contiguous, ``x``'s dtype: ``x`` at those positions.
        n_rows: int32, rows of ``x``.
        n_cols: int32, tile size (row length), ``1 <= n_cols <= BLOCK_W``.
        k: int32, entries kept per row, ``1 <= k <= n_cols``.
        BLOCK_ROWS (constexpr): power of 2, rows per program.
        BLOCK_W (constexpr): power of 2 >= ``n_cols``; columns past ``n_cols`` are masked.
    """
    r = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)[:, None]
    c = tl.arange(0, BLOCK_W)[None, :]
    valid = (r < n_rows) & (c < n_cols)
    v = tl.load(x + r * n_cols + c, mask=valid, other=0.0)
    # mask last on every backend: SGPR-clean on AMD, no more registers on NVIDIA
    selected, slot = topk_select(v.to(tl.float32), valid, k, False, True)
    out = r * k + slot
    tl.store(idx_out + out, c.to(idx_out.dtype.element_ty) + r * 0, mask=selected)
    tl.store(val_out + out, v, mask=selected)


def compile_specs(target: str) -> list[tuple[str, Any, dict[str, str], dict[str, Any], dict[str, Any]]]:
    """Compile-only build (collected by :mod:`cokit.triton_kernels.compile_only`): one
    4096-wide fp32 tile per program, int16 indices, launched as :func:`chunk_topk` does (4
    warps) on every ``target``."""
    sig = {
        "x": "*fp32",
        "idx_out": "*i16",
        "val_out": "*fp32",
        "n_rows": "i32",
        "n_cols": "i32",
        "k": "i32",
        "BLOCK_ROWS": "constexpr",
        "BLOCK_W": "constexpr",
    }
    return [("chunk_topk", _topk_kernel, sig, {"BLOCK_ROWS": 1, "BLOCK_W": 4096}, {"num_warps": 4})]


# ----------------------------------------------------------------------------- launcher


def _topk_impl(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.contiguous()
    n_rows, n_cols = x.shape
    k = min(k, n_cols)
    if kernel_path(x.device) == "torch":
        return chunk_topk_fast(x, k)
    idx = tiling.empty_output((n_rows, k), index_dtype_for(n_cols), x.device)
    vals = tiling.empty_output((n_rows, k), x.dtype, x.device)
    block_w = tiling.next_pow2(n_cols)
    block_rows = max(1, tiling.ONE_D_ELEMENTS // block_w)
    grid = (triton.cdiv(n_rows, block_rows),)
    _topk_kernel[grid](x, idx, vals, n_rows, n_cols, k, BLOCK_ROWS=block_rows, BLOCK_W=block_w, num_warps=4)
    return idx, vals


# ----------------------------------------------------------------------------- reference


def _topk_by_keys(x: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the tie rule by construction: one int64 key per entry, the bits of
    ``|x|`` (ordered like the values for non-negative floats, NaN highest) then the reversed
    position, so equal magnitudes go to the lower position. Unsorted."""
    n = x.shape[1]
    bits = x.abs().float().view(torch.int32).to(torch.int64)
    keys = (bits << 32) | (n - 1 - torch.arange(n, device=x.device))
    top = torch.topk(keys, k, dim=1, sorted=False).values
    return n - 1 - (top & 0xFFFFFFFF)


def chunk_topk_reference(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch top-k with the same tie rule, order and dtypes as the kernel.

    Fast path: ``topk(|x|)`` of ``k + 1`` entries and a sort of the ``k`` kept positions.
    Which of several entries equal to a row's k-th magnitude ``topk`` keeps is unspecified,
    so the rows where such a tie crosses the cut (the (k+1)-th magnitude equals the k-th) or
    the k-th magnitude is NaN are redone with int64 keys that encode the lower-position rule;
    the result is the same as keys for every row.
    """
    n = x.shape[1]
    k = min(k, n)
    mag = x.abs().float()
    top, idx = torch.topk(mag, min(k + 1, n), dim=1, sorted=True)
    kth = top[:, k - 1]
    redo = kth.isnan()
    if k < n:
        redo |= top[:, k] == kth
    idx = idx[:, :k]
    if bool(redo.any()):
        rows = redo.nonzero()[:, 0]
        idx[rows] = _topk_by_keys(x[rows], k)
    idx = idx.sort(dim=1).values
    return idx.to(index_dtype_for(n)), x.gather(1, idx)


_GROUP = 16  # candidate group width of chunk_topk_fast


def chunk_topk_fast(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`chunk_topk_reference`, bit for bit, with ``topk`` over candidates instead of
    whole rows (wide rows: the encode's 64x64 tiles).

    Each row is cut into groups of 16 (strided); the ``k + 1`` groups of largest ``max |x|`` hold every
    entry larger than the row's ``(k+1)``-th magnitude, and at least ``k + 1`` entries no
    smaller than it, so the ``k + 1`` largest magnitudes among their entries are the row's:
    the same k-th and (k+1)-th magnitudes (the same rows redone by keys) and, in the other
    rows, the same unique top-``k`` set. NaN counts as the largest magnitude in both steps.
    Narrow rows (fewer than ``2 * (k + 1)`` groups) take the reference.
    """
    rows, n = x.shape
    k = min(k, n)
    groups = n // _GROUP
    if n % _GROUP or groups < 2 * (k + 1) or not x.is_contiguous() or x.dtype != torch.float32:
        return chunk_topk_reference(x, k)
    # group j of a row: its entries j, j + groups, j + 2 * groups, ... (reductions over the
    # middle dimension vectorize; over 16 adjacent entries they do not)
    xg = x.view(rows, _GROUP, groups)
    group_max = torch.maximum(xg.amax(dim=1), xg.amin(dim=1).neg_())  # max |x| (NaN if any)
    chosen = torch.topk(group_max, k + 1, dim=1, sorted=False).indices
    cand = xg.gather(2, chosen.unsqueeze(1).expand(rows, _GROUP, k + 1)).view(rows, _GROUP * (k + 1))
    top, local = torch.topk(cand.abs_(), k + 1, dim=1, sorted=True)
    local = local[:, :k]
    idx = chosen.gather(1, local % (k + 1)).add_(local // (k + 1) * groups)
    kth = top[:, k - 1]
    redo = kth.isnan() | (top[:, k] == kth)
    if bool(redo.any()):
        where = redo.nonzero()[:, 0]
        idx[where] = _topk_by_keys(x[where], k)
    idx = idx.sort(dim=1).values
    return idx.to(index_dtype_for(n)), x.gather(1, idx)


# ----------------------------------------------------------------------------- op


@torch.library.custom_op("cokit::chunk_topk", mutates_args=())
def _chunk_topk_op(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _topk_impl(x, k)


@_chunk_topk_op.register_fake
def _(x, k):
    n_rows, n_cols = x.shape
    k = min(k, n_cols)
    return x.new_empty((n_rows, k), dtype=index_dtype_for(n_cols)), x.new_empty((n_rows, k))


def chunk_topk(coeffs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row (tile) of ``coeffs``: the ``k`` largest-magnitude entries.

    Returns ``(indices, values)``, both ``(n_tiles, min(k, tile_numel))``; indices are
    positions inside the tile in increasing order (int16 or int32), values keep
    ``coeffs.dtype``. Ties go to the lower position.
    """
    check_float_tensor("coeffs", coeffs)
    check_positive_int("k", k)
    if coeffs.dim() != 2:
        raise ValueError(
            f"coeffs must be 2-D (n_tiles, tile_numel), got shape {tuple(coeffs.shape)}; "
            "dct_encode returns that layout"
        )
    kernel_path(coeffs.device)
    return torch.ops.cokit.chunk_topk(coeffs, k)
