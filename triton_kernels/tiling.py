"""How tensors are cut into DCT tiles, and the tables that let one launch cover many tensors.

Rules (docs/design.md §1.1, step 3):

* a tensor is viewed as a matrix: 0-D and 1-D tensors as one row, N-D tensors as
  ``(shape[0], prod(shape[1:]))`` (a conv weight becomes ``(out, in*kh*kw)``);
* per matrix dimension of size ``s``, the tile side is the largest divisor of ``s`` that is
  ``<= chunk``;
* tiles are numbered row-major over the tile grid; a tile's coefficients are stored
  row-major, so the coefficients of a tensor form a ``(n_tiles, tile_h * tile_w)`` matrix.

A tile whose height is 1 is a contiguous run of the tensor (mode ``ONE_D``): a kernel
program transforms a block of such rows at once. Taller tiles (mode ``TWO_D``) get one
program each. Tiles are padded to power-of-2 blocks (at least 16, the smallest ``tl.dot``)
and masked, so any side works.

A :class:`TilePlan` groups the tiles of a list of tensors into launch classes (same mode and
padded block) and holds one int64 *geometry row* per program (see ``G_*`` below). Kernels
receive, besides that table, a small per-call table of data pointers per tensor, so that
tensors need not be copied into one buffer.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import torch

__all__ = [
    "ClassPlan",
    "TensorTiling",
    "TilePlan",
    "aligned",
    "basis_matrix",
    "chunk_side",
    "compile_blocks",
    "empty_output",
    "flat_positions",
    "from_tiles",
    "geometry_signature",
    "next_pow2",
    "payload_shape",
    "pointer_table",
    "tile_plan",
    "tile_view",
    "tiles_into",
    "to_tiles",
]

# Columns of a geometry row, one row per kernel program.
G_TENSOR = 0  # index of the tensor inside its launch class (row of the pointer table)
G_X_OFF = 1  # element offset of the program's first element in the tensor (matrix layout)
G_ROW_STRIDE = 2  # elements between matrix rows
G_Y_OFF = 3  # element offset in the tensor's coefficients (tile layout)
G_ROWS = 4  # valid rows of the block: tile height (TWO_D) or number of tiles (ONE_D)
G_H = 5  # tile height (1 in ONE_D)
G_W = 6  # tile width
G_BH_OFF = 7  # offset of the h x h DCT matrix in the basis bank
G_BW_OFF = 8  # offset of the w x w DCT matrix in the basis bank
G_P_OFF = 9  # offset of the program's first payload slot in the flat payload
G_K = 10  # payload slots per tile (k clamped to the tile size)
G_COLS = 11
MIN_BLOCK = 16  # tl.dot needs every dimension >= 16
ONE_D_ELEMENTS = 4096  # elements per program in ONE_D mode


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def chunk_side(size: int, chunk: int) -> int:
    """Largest divisor of ``size`` that is ``<= chunk``."""
    if chunk <= 0:
        raise ValueError(f"chunk must be a positive integer, got {chunk}")
    for d in range(min(size, chunk), 0, -1):
        if size % d == 0:
            return d
    return 1


@dataclasses.dataclass(frozen=True)
class TensorTiling:
    """Tiling of one tensor shape."""

    shape: tuple[int, ...]
    rows: int  # matrix view
    cols: int
    h: int  # tile side along rows
    w: int  # tile side along cols

    @classmethod
    def of(cls, shape: Sequence[int], chunk: int) -> TensorTiling:
        shape = tuple(int(s) for s in shape)
        numel = math.prod(shape)
        if numel == 0:
            raise ValueError(f"cannot tile an empty tensor (shape {shape})")
        if len(shape) <= 1:
            rows, cols = 1, numel
        else:
            rows, cols = shape[0], numel // shape[0]
        return cls(shape, rows, cols, chunk_side(rows, chunk), chunk_side(cols, chunk))

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def tile_numel(self) -> int:
        return self.h * self.w

    @property
    def n_tiles(self) -> int:
        return self.numel // self.tile_numel

    @property
    def one_d(self) -> bool:
        return self.h == 1

    def k_eff(self, k: int) -> int:
        return min(k, self.tile_numel)

    def block(self) -> tuple[int, int]:
        """(BLOCK_ROWS, BLOCK_W) of the launch class this tensor's tiles go to."""
        bw = max(MIN_BLOCK, next_pow2(self.w))
        if self.one_d:
            return max(MIN_BLOCK, ONE_D_ELEMENTS // bw), bw
        return max(MIN_BLOCK, next_pow2(self.h)), bw


# ---------------------------------------------------------------- tile matrices in torch
# The raw-domain view of the kernels' tile layout (no DCT): a tensor as its (n_tiles,
# tile_numel) matrix and back, and the flat positions of tile coordinates.


def to_tiles(x: torch.Tensor, t: TensorTiling) -> torch.Tensor:
    """A tensor -> its ``(n_tiles, tile_numel)`` tile matrix (the DCT's tile order)."""
    m = x.reshape(t.rows // t.h, t.h, t.cols // t.w, t.w).transpose(1, 2)
    return m.reshape(t.n_tiles, t.tile_numel)


def tiles_into(buf: torch.Tensor, x: torch.Tensor, t: TensorTiling) -> torch.Tensor:
    """:func:`to_tiles` of a contiguous ``x``, written into the contiguous fp32 ``buf``."""
    m = buf.view(t.n_tiles, t.tile_numel)
    m.view(t.rows // t.h, t.cols // t.w, t.h, t.w).copy_(tile_view(x, t))
    return m


def flat_positions(ix: torch.Tensor, t: TensorTiling) -> torch.Tensor:
    """Flat positions in the tensor (row-major) of the tile positions ``ix`` ``(..., n_tiles, k)``."""
    tiles = torch.arange(t.n_tiles, device=ix.device).unsqueeze(1)
    ty, tx = tiles // (t.cols // t.w), tiles % (t.cols // t.w)
    ix = ix.long()
    r, c = ix // t.w, ix % t.w
    return ((ty * t.h + r) * t.cols + tx * t.w + c).view(-1)


def tile_view(x: torch.Tensor, t: TensorTiling) -> torch.Tensor:
    """A contiguous ``x`` as an ``(tiles_y, tiles_x, h, w)`` view (the tile order)."""
    return x.view(t.rows // t.h, t.h, t.cols // t.w, t.w).transpose(1, 2)


def from_tiles(m: torch.Tensor, t: TensorTiling) -> torch.Tensor:
    """Inverse of :func:`to_tiles`."""
    x = m.reshape(t.rows // t.h, t.cols // t.w, t.h, t.w).transpose(1, 2)
    return x.reshape(t.shape)


@functools.lru_cache(maxsize=256)
def _basis64(n: int) -> torch.Tensor:
    i = torch.arange(n, dtype=torch.float64)
    b = torch.cos(math.pi * (2 * i[None, :] + 1) * i[:, None] / (2 * n)) * math.sqrt(2.0 / n)
    b[0] /= math.sqrt(2.0)
    return b


def basis_matrix(
    n: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Orthonormal DCT-II matrix ``B`` (``n x n``): ``y = B x``, ``x = B^T y``."""
    return _basis64(n).to(dtype=dtype, device=device)


def payload_shape(shapes: Sequence[Sequence[int]], chunk: int, k: int) -> tuple[int, torch.dtype]:
    """(slots per rank, index dtype) of a bucket's payload; no tensors are built."""
    tilings = [TensorTiling.of(s, chunk) for s in shapes]
    numel = sum(t.n_tiles * t.k_eff(k) for t in tilings)
    return numel, (torch.int16 if max(t.tile_numel for t in tilings) <= 32768 else torch.int32)


@dataclasses.dataclass(frozen=True)
class ClassPlan:
    """Programs of one launch: same mode and padded block shape."""

    one_d: bool
    block_rows: int
    block_w: int
    max_k: int  # largest k_eff of a tile in this class (sets the top-k width)
    tensors: tuple[int, ...]  # plan-level indices of the tensors in this class
    geometry: torch.Tensor  # (n_programs, G_COLS) int64, on the plan's device

    @property
    def n_programs(self) -> int:
        return self.geometry.shape[0]


@dataclasses.dataclass(frozen=True)
class TilePlan:
    """Tiling of a bucket of tensors, with payload offsets for a given k."""

    tilings: tuple[TensorTiling, ...]
    chunk: int
    k: int
    payload_offsets: tuple[int, ...]  # first payload slot of each tensor
    payload_numel: int  # slots in the whole bucket's payload (per rank)
    classes: tuple[ClassPlan, ...]
    basis_bank: torch.Tensor  # per side: B and B^T zero-padded to the block side, fp32, flat
    index_dtype: torch.dtype  # int16 when every tile has <= 32768 positions, else int32


def _geometry_rows(t: TensorTiling, local: int, bank_off: dict[int, int], p_off: int, k: int):
    ke = t.k_eff(k)
    if t.one_d:
        rows, _ = t.block()
        for first in range(0, t.n_tiles, rows):
            n = min(rows, t.n_tiles - first)
            off = first * t.w
            yield (local, off, t.w, off, n, 1, t.w, bank_off[1], bank_off[t.w], p_off + first * ke, ke)
        return
    tiles_x = t.cols // t.w
    for tile in range(t.n_tiles):
        ty, tx = divmod(tile, tiles_x)
        x_off = ty * t.h * t.cols + tx * t.w
        yield (
            local,
            x_off,
            t.cols,
            tile * t.tile_numel,
            t.h,
            t.h,
            t.w,
            bank_off[t.h],
            bank_off[t.w],
            p_off + tile * ke,
            ke,
        )


@functools.lru_cache(maxsize=64)
def _tile_plan(
    shapes: tuple[tuple[int, ...], ...], chunk: int, k: int, device: str, groups: tuple
) -> TilePlan:
    tilings = tuple(TensorTiling.of(s, chunk) for s in shapes)
    sides = sorted({1} | {t.h for t in tilings} | {t.w for t in tilings})
    bank_off, parts, pos = {}, [], 0
    for n in sides:  # B then B^T, each zero-padded to the block side (load_basis)
        side = max(MIN_BLOCK, next_pow2(n))
        padded = torch.zeros(side, side, dtype=torch.float64)
        padded[:n, :n] = basis_matrix(n)
        bank_off[n] = pos
        parts += [padded.flatten(), padded.T.flatten()]
        pos += 2 * side * side
    offsets, p = [], 0
    for t in tilings:
        offsets.append(p)
        p += t.n_tiles * t.k_eff(k)

    launches: dict[tuple, list[int]] = {}
    for i, t in enumerate(tilings):
        launches.setdefault((t.one_d, *t.block(), groups[i]), []).append(i)
    classes = []
    for (one_d, brows, bw, _), members in launches.items():
        rows = []
        for local, i in enumerate(members):
            rows.extend(_geometry_rows(tilings[i], local, bank_off, offsets[i], k))
        geometry = torch.tensor(rows, dtype=torch.int64, device=device).reshape(-1, G_COLS)
        max_k = max(tilings[i].k_eff(k) for i in members)
        classes.append(ClassPlan(one_d, brows, bw, max_k, tuple(members), geometry))
    _, index_dtype = payload_shape(shapes, chunk, k)
    return TilePlan(
        tilings,
        chunk,
        k,
        tuple(offsets),
        p,
        tuple(classes),
        torch.cat(parts).to(torch.float32).to(device),
        index_dtype,
    )


def tile_plan(
    shapes: Sequence[Sequence[int]],
    chunk: int,
    k: int = 1,
    device: torch.device | str = "cpu",
    groups: Sequence[object] | None = None,
) -> TilePlan:
    """The (cached) tiling of tensors of ``shapes`` for tile target ``chunk`` and top-``k``.

    ``groups`` (one hashable per tensor, e.g. its dtype) keeps tensors of different groups
    in different launches: a launch reads every tensor through one pointer type.
    """
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk <= 0:
        raise ValueError(f"chunk must be a positive integer, got {chunk!r}")
    if not isinstance(k, int) or isinstance(k, bool) or k <= 0:
        raise ValueError(f"k must be a positive integer, got {k!r}")
    if len(shapes) == 0:
        raise ValueError("need at least one tensor")
    key = tuple(tuple(int(s) for s in shape) for shape in shapes)
    groups = tuple(groups) if groups is not None else (None,) * len(key)
    if len(groups) != len(key):
        raise ValueError(f"groups has {len(groups)} entries for {len(key)} shapes")
    return _tile_plan(key, chunk, k, str(torch.device(device)), groups)


#: the alignment (elements, and bytes for pointers) an ALIGNED launch may promise the compiler
ALIGN = 16


def aligned(tilings: Sequence[TensorTiling], tensors: Sequence[torch.Tensor]) -> bool:
    """Whether a launch class may tell the compiler that its addresses are ALIGN-aligned: every
    tensor's data is ALIGN-byte aligned and every row stride (the matrix view's columns, a 1-D
    tile's width) and tile width is a multiple of ALIGN elements, so every tile row starts
    on an ALIGN boundary (vectorized loads and stores, fewer address registers)."""
    return all(t.data_ptr() % ALIGN == 0 for t in tensors) and all(
        tt.w % ALIGN == 0 and (tt.one_d or tt.cols % ALIGN == 0) for tt in tilings
    )


def pointer_table(columns: Sequence[Sequence[torch.Tensor]], device: torch.device) -> torch.Tensor:
    """``(n_tensors, n_columns)`` int64 table of data pointers, one column per argument.

    Tables are cached by their pointer values (an optimizer passes the same buffers every
    step), so a repeated launch neither builds nor copies one to the device again. The
    kernels only read them; callers must not write to the returned tensor.
    """
    rows = tuple(tuple(t.data_ptr() for t in row) for row in zip(*columns, strict=True))
    return _pointer_table(rows, str(torch.device(device)))


@functools.lru_cache(maxsize=512)
def _pointer_table(rows: tuple[tuple[int, ...], ...], device: str) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)


def empty_output(shape: Sequence[int], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Where every kernel output is allocated: tests replace it to poison outputs."""
    return torch.empty(tuple(shape), dtype=dtype, device=device)


# ----------------------------------------------------------------------------- compile-only specs
def compile_blocks() -> tuple[tuple[str, bool, int, int], ...]:
    """(mode label, TWO_D, BLOCK_ROWS, BLOCK_W) of the typical launch classes that the tiled
    kernels' compile-only builds use: 64x64 tiles (TWO_D) and blocks of 64-wide 1-D tiles."""
    return (("2d", True, 64, 64), ("1d", False, ONE_D_ELEMENTS // 64, 64))


def geometry_signature(**refs: str) -> dict[str, str]:
    """Triton signature of a tiled kernel's leading arguments (geometry table, pointer table,
    basis bank) followed by ``refs`` (name -> Triton type, e.g. ``src_ref='*bf16'``)."""
    return {"geometry": "*i64", "pointers": "*i64", "bank": "*fp32", **refs}
