"""How a step's parameters are split into communication buckets.

Per param group, tensors whose compressed payload would not be smaller than a dense
all-reduce of their buffer in the gradient dtype (prime dimensions, tiny 1-D tensors, 0-D
scalars; at large world sizes, every tensor) go into *dense* buckets, the rest into
*compressed* ones: both packed in reverse parameter order (the order in which backward
produces gradients) into buckets of at most ``cap_bytes`` of fp32 buffer each.
Each compressed bucket travels as its codec's wire tensors, one all-gather each; a codec that
is not ``bucketed`` (``reference``) gets one bucket per tensor, like the DeMo reference.
Empty tensors (a zero dimension) have nothing to send and are in no bucket.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection

import torch

from cokit.compress.payload import PayloadCodec
from cokit.triton_kernels import tiling
from cokit.triton_kernels.error_feedback import payload_layout

_ITEMSIZES = (1, 2, 4, 8)  # element sizes of the dtypes a gradient can have


@dataclasses.dataclass
class Bucket:
    """Tensors that are encoded together and share their collectives."""

    group: int  # param group index
    members: list[int]  # positions in the step's entry list
    dense: bool
    plan: tiling.TilePlan | None = None
    codec: PayloadCodec | None = None  # None for dense buckets
    topk: int | None = None  # coefficients kept per tile (None for dense buckets)


def compressed_nbytes(
    shape: tuple[int, ...], chunk: int, k: int, codec: type[PayloadCodec], value_dtype: torch.dtype
) -> int:
    """Payload bytes per rank for one tensor sent alone."""
    return codec(payload_layout([shape], chunk, k), value_dtype).nbytes


def sends_dense(
    shape: tuple[int, ...],
    chunk: int,
    k: int,
    codec: type[PayloadCodec],
    value_dtype: torch.dtype,
    world_size: int,
    *,
    dense_itemsize: int = 4,
) -> bool:
    """True when a dense ring all-reduce of the tensor costs no more than the ring all-gather
    of its compressed payload.

    ``world_size`` is the size of the group the exchange runs over (taken as at least 2;
    for a hierarchical exchange, the cross-node group). ``dense_itemsize`` is the element
    size of the dense all-reduce, i.e. the gradient dtype (2 for bf16/fp16, 4 for fp32): a
    bf16 model falls back at half the world size of an fp32 one. With ring volumes
    ``(W-1) * payload`` against ``2 (W-1)/W * n * itemsize``, this is
    ``W * payload >= 2 * n * itemsize`` (exact integers).
    """
    check_itemsize(dense_itemsize, "dense_itemsize")
    if len(shape) == 0:
        return True
    w = max(world_size, 2)
    return w * compressed_nbytes(shape, chunk, k, codec, value_dtype) >= 2 * dense_itemsize * math.prod(shape)


def check_itemsize(itemsize: object, name: str) -> int:
    """``itemsize`` if it is a dense element size in bytes (1, 2, 4 or 8), else a ValueError."""
    if not isinstance(itemsize, int) or isinstance(itemsize, bool) or itemsize not in _ITEMSIZES:
        raise ValueError(
            f"{name} must be the gradient dtype's element size in bytes, one of {_ITEMSIZES} "
            f"(2 for bf16/fp16, 4 for fp32; tensor.element_size() gives it), got {itemsize!r}"
        )
    return itemsize


def make_buckets(
    groups: list[int],
    shapes: list[tuple[int, ...]],
    settings: list[dict],
    codec: type[PayloadCodec],
    value_dtype: torch.dtype,
    cap_bytes: int,
    dense_fallback: bool,
    world_size: int,
    *,
    all_dense: bool = False,
    dense_itemsizes: list[int] | None = None,
    dense: Collection[int] = (),
) -> list[Bucket]:
    """Buckets for a step whose entries have param-group ``groups[i]`` and ``shapes[i]``.

    ``settings[g]`` holds ``compression_chunk`` and ``compression_topk`` of group ``g``.
    Dense buckets come first so that their all-reduce starts before any encoding.
    ``all_dense`` sends every tensor dense (a network policy's "go dense" decision).
    ``world_size`` is the size of the group the exchange runs over, and
    ``dense_itemsizes[i]`` the element size of entry i's dense all-reduce (its gradient
    dtype; default 4, fp32, for every entry): both only decide the dense fallback
    (:func:`sends_dense`). The entries in ``dense`` are sent dense whatever their size
    (SparseLoCo's ``dense_params``).
    """
    if dense_itemsizes is None:
        itemsizes = [4] * len(shapes)
    else:
        if len(dense_itemsizes) != len(shapes):
            raise ValueError(
                f"dense_itemsizes has {len(dense_itemsizes)} entries for {len(shapes)} shapes; "
                "give one element size per entry (its gradient's element_size())"
            )
        itemsizes = [check_itemsize(s, f"dense_itemsizes[{i}]") for i, s in enumerate(dense_itemsizes)]
    forced = set(dense)
    dense_members: dict[int, list[int]] = {}
    compressed: dict[int, list[int]] = {}
    for i in reversed(range(len(shapes))):
        if math.prod(shapes[i]) == 0:
            continue  # empty: nothing to send, nothing to update
        g = groups[i]
        chunk, k = settings[g]["compression_chunk"], settings[g]["compression_topk"]
        to_dense = (
            all_dense
            or i in forced
            or len(shapes[i]) == 0
            or (
                dense_fallback
                and sends_dense(
                    shapes[i], chunk, k, codec, value_dtype, world_size, dense_itemsize=itemsizes[i]
                )
            )
        )
        (dense_members if to_dense else compressed).setdefault(g, []).append(i)

    # dense buckets hold at most cap_bytes of fp32 buffer too, so that an all-dense step
    # (large worlds, a policy's "go dense") still splits into several collectives
    buckets = [
        Bucket(g, part, dense=True)
        for g, members in dense_members.items()
        for part in _packed(members, shapes, cap_bytes)
    ]
    for g, members in compressed.items():
        chunk, k = settings[g]["compression_chunk"], settings[g]["compression_topk"]
        parts = [[i] for i in members] if not codec.bucketed else _packed(members, shapes, cap_bytes)
        buckets += [_compressed_bucket(g, part, shapes, chunk, k, codec, value_dtype) for part in parts]
    return buckets


def _packed(members: list[int], shapes: list[tuple[int, ...]], cap_bytes: int) -> list[list[int]]:
    """``members`` in order, cut into runs of at most ``cap_bytes`` of fp32 buffer (a tensor
    larger than the cap is a run of its own)."""
    runs: list[list[int]] = []
    size = 0
    for i in members:
        nbytes = 4 * math.prod(shapes[i])
        if runs and runs[-1] and size + nbytes <= cap_bytes:
            runs[-1].append(i)
            size += nbytes
        else:
            runs.append([i])
            size = nbytes
    return runs


def _compressed_bucket(
    g: int,
    members: list[int],
    shapes: list[tuple[int, ...]],
    chunk: int,
    k: int,
    codec: type[PayloadCodec],
    value_dtype: torch.dtype,
) -> Bucket:
    plan = payload_layout([shapes[i] for i in members], chunk, k)
    return Bucket(g, list(members), False, plan, codec(plan, value_dtype), topk=k)
