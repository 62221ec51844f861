"""A static estimate per compression-kernel build: HBM bytes per element and the memory roofline.

The compression kernels (DCT, fused error-feedback encode and decode, chunk top-k, the SM copy)
are memory bound: each element of the parameter tensor is read and written a fixed number of
times, and the per-tile work (the DCT basis, the top-k) stays on chip. So a kernel's best time
is ``bytes per element x elements / HBM bandwidth``. :func:`bytes_per_element` counts a build's
bytes from its signature (the element sizes of what it reads and writes); :data:`CHIPS` holds
the data-sheet HBM bandwidth of the chips each compile target stands for. The estimate leaves
out the basis (cached, one tile per block) and the payload where its size is not fixed by the
build (top-k's ``k``); the fused decode counts ``NOMINAL_RANKS`` ranks' payloads.
"""

from __future__ import annotations

from typing import Any

from .backend import arch_limits
from .occupancy import occupancy

__all__ = ["CHIPS", "NOMINAL_RANKS", "bytes_per_element", "datasheet_gbs", "estimates", "roofline_ms_per_1e9"]

#: compile target -> (chip, HBM GB/s from the vendor's data sheet)
CHIPS: dict[str, tuple[tuple[str, float], ...]] = {
    "sm_80": (("A100", 2039.0),),
    "sm_90": (("H100", 3350.0), ("H200", 4800.0)),
    "gfx90a": (("MI250X", 3277.0),),
    "gfx942": (("MI300X", 5300.0),),
}
#: ranks whose payloads the fused decode reads, for its estimate
NOMINAL_RANKS = 8


def datasheet_gbs(device_name: str) -> tuple[str, float] | None:
    """(chip, HBM GB/s) of a device by its name (``torch.cuda.get_device_name``), or None."""
    upper = device_name.upper()
    for chips in CHIPS.values():
        for chip, gbs in chips:
            if chip in upper:
                return chip, gbs
    return None


_SIZES = {"fp64": 8, "i64": 8, "fp32": 4, "i32": 4, "bf16": 2, "fp16": 2, "i16": 2, "i8": 1, "u8": 1}


def _size(signature: dict[str, str], arg: str) -> int:
    kind = signature[arg]
    if not kind.startswith("*") or kind[1:] not in _SIZES:
        raise ValueError(f"argument {arg!r} is {kind!r}, not a pointer to a known element type")
    return _SIZES[kind[1:]]


def bytes_per_element(label: str, signature: dict[str, str], constexprs: dict[str, Any]) -> float | None:
    """HBM bytes a build moves per element of its tensor (None: not a kernel we model).

    - DCT encode/decode: reads the source, writes the destination.
    - Fused encode: reads the gradient, reads and writes the momentum/error buffer (``delta``),
      writes ``k`` indices and values per tile (``k`` is the launch's, not counted).
    - Fused decode: reads ``NOMINAL_RANKS`` payloads of ``K_POW2`` entries per tile, reads and
      writes the parameter.
    - chunk top-k: reads the input (its ``k`` outputs per chunk are not counted).
    - SM copy: reads and writes.
    """
    s = signature
    if label.startswith(("dct_encode", "dct_decode")):
        return float(_size(s, "src_ref") + _size(s, "dst_ref"))
    if label.startswith("ef_encode"):
        return float(_size(s, "grad_ref") + 2 * _size(s, "delta_ref"))
    if label.startswith("ef_decode"):
        tile = constexprs["BLOCK_W"] ** (2 if constexprs.get("TWO_D") else 1)
        payload = NOMINAL_RANKS * constexprs["K_POW2"] * (_size(s, "indices") + _size(s, "values")) / tile
        return 2 * _size(s, "param_ref") + payload
    if label.startswith("chunk_topk"):
        return float(_size(s, "x"))
    if label.startswith("sm_copy"):
        return float(_size(s, "src") + _size(s, "dst"))
    return None


def roofline_ms_per_1e9(nbytes_per_element: float, hbm_gbs: float) -> float:
    """Milliseconds to move 1e9 elements at ``nbytes_per_element`` through ``hbm_gbs`` GB/s."""
    return nbytes_per_element / hbm_gbs * 1e3


def estimates(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per compile-only report row (``CompiledKernel.as_row``): blocks per SM/CU from its
    registers, shared memory and warps (the occupancy calculator), what limits them, bytes per
    element, and the roofline ms per 1e9 elements on each chip of its target."""
    out = []
    for r in rows:
        occ = occupancy(r["num_warps"], r["shared_bytes"], r["registers"], arch_limits(r["target"]))
        nbytes = r.get("bytes_per_element")
        out.append(
            {
                "name": r["name"],
                "target": r["target"],
                "num_warps": r["num_warps"],
                "num_stages": r.get("num_stages"),
                "blocks_per_sm": occ.blocks_per_sm,
                "limited_by": occ.limiting,
                "bytes_per_element": nbytes,
                "roofline_ms_per_1e9": {
                    chip: None if nbytes is None else roofline_ms_per_1e9(nbytes, gbs)
                    for chip, gbs in CHIPS.get(r["target"], ())
                },
            }
        )
    return out
