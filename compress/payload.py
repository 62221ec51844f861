"""Payload codecs: how one bucket's top-k selection travels as a single byte buffer.

A bucket's selection is ``P`` slots (``cokit.triton_kernels.error_feedback.payload_layout``): an
index (position in its tile) and a value per slot. Codecs turn it into one flat ``uint8``
buffer, so that a whole bucket goes in one all-gather, and back from the gathered
``(world_size, nbytes)`` buffer:

- ``compact``: int16 indices (int32 for tiles of more than 32768 positions) and fp16/bf16/fp32
  values;
- ``sign``: the same indices, one sign bit per value and one scale per tile (the mean |value|
  of the tile's selection); decoded values are ``±scale``.

Sections start at 8-byte offsets so that every one of them can be viewed in its own dtype.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from cokit.triton_kernels.tiling import TilePlan

PayloadKind = Literal["reference", "compact", "sign"]
PAYLOAD_KINDS: tuple[str, ...] = ("reference", "compact", "sign")
_ALIGN = 8


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


@dataclasses.dataclass(frozen=True)
class Section:
    """One typed region of a payload buffer."""

    name: str
    dtype: torch.dtype
    numel: int
    offset: int  # bytes

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


class PayloadCodec:
    """Packs a bucket's ``(indices, values)`` into bytes and unpacks gathered payloads."""

    def __init__(self, plan: TilePlan, kind: PayloadKind, value_dtype: torch.dtype):
        if kind not in ("compact", "sign"):
            raise ValueError(f"bucketed payload kind must be 'compact' or 'sign', got {kind!r}")
        self.plan, self.kind, self.value_dtype = plan, kind, value_dtype
        slots = plan.payload_numel
        self.tile_slots = [(t.n_tiles, t.k_eff(plan.k)) for t in plan.tilings]
        self.n_tiles = sum(n for n, _ in self.tile_slots)
        self._slots_per_tile: dict[torch.device, torch.Tensor] = {}  # for sign decode, per device
        layout = [("indices", plan.index_dtype, slots)]
        if kind == "compact":
            layout.append(("values", value_dtype, slots))
        else:
            layout += [("signs", torch.uint8, -(-slots // 8)), ("scales", value_dtype, self.n_tiles)]
        self.sections: dict[str, Section] = {}
        offset = 0
        for name, dtype, numel in layout:
            self.sections[name] = Section(name, dtype, numel, offset)
            offset = _aligned(offset + numel * dtype.itemsize)
        self.nbytes = offset

    # ------------------------------------------------------------------ encode side
    def pack(self, indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """One rank's flat payload ``(P,)`` indices and fp32 values -> ``(nbytes,)`` uint8."""
        out = torch.zeros(self.nbytes, dtype=torch.uint8, device=indices.device)
        self._put(out, "indices", indices)
        if self.kind == "compact":
            self._put(out, "values", values)
        else:
            self._put(out, "signs", _pack_bits(values < 0))
            self._put(out, "scales", self._tile_scales(values))
        return out

    def _put(self, out: torch.Tensor, name: str, data: torch.Tensor) -> None:
        s = self.sections[name]
        out[s.offset:s.offset + s.nbytes].view(s.dtype).copy_(data)

    def _tile_scales(self, values: torch.Tensor) -> torch.Tensor:
        mags = values.float().abs()
        scales, pos = [], 0
        for n_tiles, ke in self.tile_slots:
            scales.append(mags[pos:pos + n_tiles * ke].view(n_tiles, ke).mean(dim=1))
            pos += n_tiles * ke
        return torch.cat(scales)

    # ------------------------------------------------------------------ decode side
    def unpack(self, gathered: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(world_size, nbytes)`` uint8 -> ``(indices, values)``, each ``(world_size, P)``."""
        if gathered.dim() != 2 or gathered.shape[1] != self.nbytes or gathered.dtype != torch.uint8:
            raise ValueError(
                f"gathered payload must be uint8 (world_size, {self.nbytes}), got {gathered.dtype} "
                f"{tuple(gathered.shape)}: the ranks disagree on the bucket layout"
            )
        indices = self._get(gathered, "indices")
        if self.kind == "compact":
            return indices, self._get(gathered, "values")
        signs = _unpack_bits(self._get(gathered, "signs"), self.plan.payload_numel)
        scales = self._get(gathered, "scales").float()
        repeats = self._slots_per_tile.get(gathered.device)
        if repeats is None:
            repeats = torch.tensor([ke for n, ke in self.tile_slots for _ in range(n)], device=gathered.device)
            self._slots_per_tile[gathered.device] = repeats
        per_slot = scales.repeat_interleave(repeats, dim=1, output_size=self.plan.payload_numel)
        return indices, torch.where(signs, -per_slot, per_slot)

    def _get(self, gathered: torch.Tensor, name: str) -> torch.Tensor:
        s = self.sections[name]
        return gathered[:, s.offset:s.offset + s.nbytes].contiguous().view(s.dtype)


_BIT_WEIGHTS = [1 << i for i in range(8)]


def _pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Bool ``(n,)`` -> uint8 ``(ceil(n/8),)``, bit i of byte j is element 8j+i."""
    n = bits.numel()
    padded = torch.zeros(-(-n // 8) * 8, dtype=torch.uint8, device=bits.device)
    padded[:n] = bits.to(torch.uint8)
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=bits.device)
    return (padded.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8)


def _unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """uint8 ``(..., m)`` -> bool ``(..., n)``; inverse of :func:`_pack_bits` per row."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = (packed.unsqueeze(-1) >> shifts) & 1
    return bits.flatten(-2)[..., :n].bool()


def reference_nbytes(plan: TilePlan) -> int:
    """Bytes per rank of the reference payload (int64 indices + fp32 values)."""
    return plan.payload_numel * (8 + 4)
