"""Byte accounting for compressed and dense collectives.

All counts are per rank: what this rank puts on the wire and what it takes off it. A dense
ring all-reduce of ``n`` bytes sends and receives ``2 (W-1)/W * n`` bytes per rank; an
all-gather of ``n`` bytes per rank sends ``(W-1) * n`` and receives ``(W-1) * n`` (ring).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


def ring_allreduce_bytes(nbytes: int, world_size: int) -> int:
    """Bytes one rank sends (and receives) in a ring all-reduce of an ``nbytes`` buffer."""
    if world_size <= 1:
        return 0
    return (2 * (world_size - 1) * nbytes) // world_size


def dense_allreduce_bytes(tensors, world_size: int) -> int:
    """Bytes one rank sends in a ring all-reduce of all ``tensors`` (each in its own dtype)."""
    return ring_allreduce_bytes(sum(t.numel() * t.element_size() for t in tensors), world_size)


def ring_allgather_bytes(nbytes_per_rank: int, world_size: int) -> int:
    """Bytes one rank sends (and receives) in a ring all-gather of ``nbytes_per_rank`` each."""
    return max(world_size - 1, 0) * nbytes_per_rank


@dataclass
class CommStats:
    """What one rank sent and received: last step and running totals.

    ``step_dense_bytes`` is what a dense ring all-reduce of the same gradients (in their own
    dtype) would have sent this step; ``ratio`` is ``total_dense_bytes / total_sent_bytes``.
    """

    steps: int = 0
    step_sent_bytes: int = 0
    step_received_bytes: int = 0
    step_dense_bytes: int = 0
    total_sent_bytes: int = 0
    total_received_bytes: int = 0
    total_dense_bytes: int = 0

    @property
    def ratio(self) -> float:
        """Dense bytes / sent bytes over all steps (inf when nothing was sent)."""
        if self.total_sent_bytes == 0:
            return float("inf") if self.total_dense_bytes else 1.0
        return self.total_dense_bytes / self.total_sent_bytes

    def record(self, sent: int, received: int, dense: int) -> None:
        """Close one step with its byte counts."""
        self.steps += 1
        self.step_sent_bytes, self.step_received_bytes, self.step_dense_bytes = sent, received, dense
        self.total_sent_bytes += sent
        self.total_received_bytes += received
        self.total_dense_bytes += dense

    def as_dict(self) -> dict:
        """Plain dict (JSON-ready), including ``ratio``."""
        return {**asdict(self), "ratio": self.ratio}
