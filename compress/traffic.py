"""What DeMo's and SparseLoCo's exchange puts on the wire, counted from the layout they use.

Nothing is sent: ``make_buckets`` splits the parameter shapes into buckets at a world size
(bucketing and the dense fallback included), each compressed bucket's codec
(:mod:`cokit.compress.payload`) gives its bytes per rank, and ring volumes
(:mod:`cokit.compress.stats`) give the rest, as the optimizers' ``comm_stats`` count them.
The per-step status all-gather (the exchange core's fixed-size row) is included. Used by
``cokit plan`` (step time and cost per epoch) and the exchange-scaling benchmark.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from cokit.compress.adaptation import STATUS_ROW_BYTES
from cokit.compress.agreement import ROW_BYTES
from cokit.compress.buckets import make_buckets
from cokit.compress.payload import PayloadCodec
from cokit.compress.stats import ring_allgather_bytes, ring_allreduce_bytes

__all__ = [
    "AGREEMENT_ROW",
    "STATUS_ROW",
    "Setup",
    "Traffic",
    "dense_allreduce",
    "exchange_traffic",
    "hierarchical_traffic",
]

STATUS_ROW = STATUS_ROW_BYTES  # a rank's status row on the exchange group
AGREEMENT_ROW = ROW_BYTES  # and on an agreement group (a node)


@dataclasses.dataclass(frozen=True)
class Traffic:
    """Bytes one rank sends in one step of DeMo's exchange (ring collectives receive as much)."""

    compressed: int  # the compressed buckets' all-gathers
    dense: int  # the dense buckets' all-reduce
    status: int  # the gradient-status all-gather
    dense_tensors: int  # tensors that went dense
    gathers: int = 0  # all-gathers: the compressed buckets' and the status row's
    reduces: int = 0  # all-reduces: the dense buckets'

    def hops(self, world: int) -> int:
        """Latency-bound steps of its ring collectives over ``world`` ranks."""
        return (world - 1) * (self.gathers + 2 * self.reduces)

    @property
    def sent(self) -> int:
        return self.compressed + self.dense + self.status

    @property
    def received(self) -> int:
        return self.sent

    def as_dict(self) -> dict[str, int]:
        return {**dataclasses.asdict(self), "sent": self.sent, "received": self.received}


@dataclasses.dataclass(frozen=True)
class Setup:
    """What DeMo is configured with, besides the world size and the gradient dtype."""

    codec: type[PayloadCodec]
    k: int
    chunk: int = 64
    value_dtype: torch.dtype = torch.bfloat16
    cap_bytes: int = 25 * 2**20

    @property
    def value(self) -> torch.dtype:
        return self.codec.resolve_value_dtype(self.value_dtype)


def exchange_traffic(
    shapes: Sequence[tuple[int, ...]],
    setup: Setup,
    world: int,
    dense_itemsize: int,
    *,
    fallback: bool | None = None,
    status_world: int | None = None,
    owner: tuple[int, int] | None = None,
) -> Traffic:
    """DeMo's (or a SparseLoCo sync's) bytes per rank for one step over ``world`` ranks (the exchange's group).

    ``dense_itemsize`` is the gradient dtype's element size: the fallback compares against a
    dense all-reduce of that size and sends its dense tensors in it. ``fallback`` defaults to
    the codec's default (DeMo's ``dense_fallback=None``); ``status_world`` is the group of the
    status all-gather (default ``world``). ``owner=(j, L)`` counts only the buckets that local
    rank ``j`` of ``L`` owns in a hierarchy (bucket ``b`` when ``b % L == j``).
    """
    shapes = [tuple(s) for s in shapes]
    buckets = make_buckets(
        [0] * len(shapes),
        shapes,
        [{"compression_chunk": setup.chunk, "compression_topk": setup.k}],
        setup.codec,
        setup.value,
        setup.cap_bytes,
        setup.codec.dense_fallback if fallback is None else fallback,
        world,
        dense_itemsizes=[dense_itemsize] * len(shapes),
    )
    compressed = dense = n_dense = gathers = reduces = 0
    for index, b in enumerate(buckets):
        if owner is not None and index % owner[1] != owner[0]:
            continue
        if b.dense:
            dense += ring_allreduce_bytes(
                dense_itemsize * sum(math.prod(shapes[i]) for i in b.members), world
            )
            n_dense += len(b.members)
            reduces += 1
        else:
            assert b.codec is not None
            compressed += ring_allgather_bytes(b.codec.nbytes, world)
            gathers += 1
    status = ring_allgather_bytes(STATUS_ROW, world if status_world is None else status_world)
    return Traffic(compressed, dense, status, n_dense, gathers + 1, reduces)


def dense_allreduce(n_elements: int, itemsize: int, world: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``n_elements`` of ``itemsize`` bytes."""
    return ring_allreduce_bytes(n_elements * itemsize, world)


def hierarchical_traffic(
    shapes: Sequence[tuple[int, ...]], setup: Setup, nodes: int, local: int, dense_itemsize: int
) -> tuple[int, Traffic]:
    """``DeMo(hierarchy=...)`` over ``nodes x local`` ranks: (intra-node bytes, inter-node traffic).

    Intra: the gradients' dense ring all-reduce inside the node, the owners' broadcast of the
    updated parameters and the status agreement. Inter: the busiest local rank's exchange
    across the ``nodes`` ranks of its local index (bucket ``b`` is sent by local rank
    ``b % local`` only; the fallback is decided at the cross-node group's size).
    """
    n = sum(math.prod(s) for s in shapes)
    inter = max(
        (
            exchange_traffic(shapes, setup, nodes, dense_itemsize, status_world=nodes, owner=(j, local))
            for j in range(local)
        ),
        key=lambda t: t.sent,
    )
    intra = (
        dense_allreduce(n, dense_itemsize, local)
        + n * dense_itemsize
        + ring_allgather_bytes(AGREEMENT_ROW, local)
    )
    return intra, inter
