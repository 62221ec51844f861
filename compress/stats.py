"""Byte accounting for compressed and dense collectives.

All counts are per rank: what this rank puts on the wire and what it takes off it. A dense
ring all-reduce of ``n`` bytes sends and receives ``2 (W-1)/W * n`` bytes per rank; an
all-gather of ``n`` bytes per rank sends ``(W-1) * n`` and receives ``(W-1) * n`` (ring).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Generic, TypeVar, overload

from cokit.compress.timing import StepTiming, empty_timing


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


#: the seconds of a step's timing (:func:`~cokit.compress.timing.empty_timing`) that
#: :class:`CommStats` keeps per step (``step_<key>``) and in total (``total_<key>``)
SECONDS = ("encode_s", "decode_s", "exposed_s", "comm_s")
T = TypeVar("T")


class _LastStep(Generic[T]):
    """A read-only :class:`CommStats` attribute: one entry of the last step's timing, settled
    (its CUDA events waited on) when first read."""

    def __init__(self, key: str, doc: str) -> None:
        self.key, self.__doc__ = key, doc

    @overload
    def __get__(self, stats: None, owner: type) -> _LastStep[T]: ...
    @overload
    def __get__(self, stats: CommStats, owner: type) -> T: ...
    def __get__(self, stats: CommStats | None, owner: type) -> T | _LastStep[T]:
        if stats is None:
            return self
        stats.settle()
        return stats._step[self.key]


@dataclass
class CommStats:
    """What one rank sent and received, and how long it took: last step and running totals.

    ``step_dense_bytes`` is what a dense ring all-reduce of the same gradients (in their own
    dtype) would have sent this step; ``ratio`` is ``total_dense_bytes / total_sent_bytes``.
    The timing fields (:mod:`cokit.compress.timing`: ``encode_s``, ``decode_s``, ``exposed_s``
    and ``comm_s``, per step and in total, and ``step_collectives``: one dict per collective)
    are current on CPU. On CUDA the last step's are read from its events when first asked for
    (through :meth:`settle`, :meth:`as_dict` or the ``step_*_s`` properties), so that a step
    never waits on the GPU; :meth:`record` settles the previous step first.
    ``world_size`` is the global world, ``group_size`` the size of the group exchanged over.
    Two-level exchanges (``DeMo(hierarchy=...)``, DTensor meshes) also count the part of the
    bytes that stays inside a node or shard group (``*_intra_*``; included in ``*_sent_bytes``
    and ``*_received_bytes``); ``intra_group_size`` is that group's size (1: one level).
    """

    steps: int = 0
    step_sent_bytes: int = 0
    step_received_bytes: int = 0
    step_dense_bytes: int = 0
    total_sent_bytes: int = 0
    total_received_bytes: int = 0
    total_dense_bytes: int = 0
    world_size: int = 1
    group_size: int = 1
    intra_group_size: int = 1
    step_intra_sent_bytes: int = 0
    step_intra_received_bytes: int = 0
    total_intra_sent_bytes: int = 0
    total_intra_received_bytes: int = 0
    total_encode_s: float = 0.0
    total_decode_s: float = 0.0
    total_exposed_s: float = 0.0
    total_comm_s: float = 0.0
    _pending: StepTiming | None = field(default=None, repr=False, compare=False)
    _step: dict[str, Any] = field(default_factory=empty_timing, repr=False, compare=False)

    @property
    def ratio(self) -> float:
        """Dense bytes / sent bytes over all steps (inf when nothing was sent)."""
        if self.total_sent_bytes == 0:
            return float("inf") if self.total_dense_bytes else 1.0
        return self.total_dense_bytes / self.total_sent_bytes

    def record(
        self,
        sent: int,
        received: int,
        dense: int,
        timing: StepTiming | None = None,
        world_size: int | None = None,
        group_size: int | None = None,
        *,
        intra: tuple[int, int] = (0, 0),
        intra_group_size: int | None = None,
    ) -> None:
        """Close one step with its byte counts and (optionally) its timing marks; ``intra``:
        the ``(sent, received)`` part of them inside a node or shard group."""
        self.settle()
        self.steps += 1
        self.step_sent_bytes, self.step_received_bytes, self.step_dense_bytes = sent, received, dense
        self.total_sent_bytes += sent
        self.total_received_bytes += received
        self.total_dense_bytes += dense
        self.step_intra_sent_bytes, self.step_intra_received_bytes = intra
        self.total_intra_sent_bytes += intra[0]
        self.total_intra_received_bytes += intra[1]
        if intra_group_size is not None:
            self.intra_group_size = intra_group_size
        if world_size is not None:
            self.world_size = world_size
        if group_size is not None:
            self.group_size = group_size
        self._step = empty_timing()
        self._pending = timing
        if timing is not None and timing.ready():
            self.settle()

    def settle(self) -> None:
        """Turn the last step's timing marks into seconds (waits on its CUDA events, if any)."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        self._step = pending.resolve()
        for key in SECONDS:
            setattr(self, f"total_{key}", getattr(self, f"total_{key}") + self._step[key])

    step_encode_s = _LastStep[float]("encode_s", "Seconds spent encoding payloads in the last step.")
    step_decode_s = _LastStep[float]("decode_s", "Seconds spent decoding payloads in the last step.")
    step_exposed_s = _LastStep[float](
        "exposed_s", "Seconds this rank was blocked waiting on collectives in the last step."
    )
    step_comm_s = _LastStep[float](
        "comm_s", "Seconds the last step's collectives ran (union of their intervals)."
    )
    step_collectives = _LastStep[list[dict[str, Any]]](
        "collectives", "The last step's collectives: what, bytes sent/received, ``comm_s``, ``exposed_s``."
    )

    def as_dict(self) -> dict[str, Any]:
        """Plain dict (JSON-ready): every field, ``ratio`` and the last step's timing."""
        self.settle()
        out: dict[str, Any] = {
            f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")
        }
        out["ratio"] = self.ratio
        for key in SECONDS:
            out[f"step_{key}"] = self._step[key]
        out["step_collectives"] = [dict(c) for c in self._step["collectives"]]
        return out

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> CommStats:
        """Totals from :meth:`as_dict` output (older checkpoints without timing load too)."""
        names = {f.name for f in fields(cls) if not f.name.startswith("_")}
        return cls(**{k: v for k, v in saved.items() if k in names})
