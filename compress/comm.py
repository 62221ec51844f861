"""Asynchronous collectives with byte accounting and timeouts that name their owner.

Every collective is launched with ``async_op=True`` and returns a :class:`Pending`; waiting
on it with a timeout turns "a rank never joined" into an error naming the owner (e.g. the
optimizer) instead of a hang. Byte counts are per rank, ring algorithm volumes
(:mod:`cokit.compress.stats`). Without an initialized process group (or world size 1) the
collectives are local copies and count zero bytes.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from cokit.compress.stats import ring_allgather_bytes, ring_allreduce_bytes


class CollectiveTimeout(RuntimeError):
    """A collective did not complete in time (some rank did not take part)."""


class Pending:
    """A launched collective: ``wait()`` returns its result tensor."""

    def __init__(self, work, result: torch.Tensor, owner: str, what: str, timeout: datetime.timedelta | None):
        self._work, self._result = work, result
        self._owner, self._what, self._timeout = owner, what, timeout

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            try:
                done = self._work.wait(self._timeout) if self._timeout is not None else self._work.wait()
            except RuntimeError as exc:
                raise CollectiveTimeout(self._message(f"failed: {exc}")) from exc
            if done is False:
                raise CollectiveTimeout(self._message("did not complete"))
            self._work = None
        return self._result

    def _message(self, what_happened: str) -> str:
        limit = f" within {self._timeout.total_seconds():g} s" if self._timeout is not None else ""
        return (
            f"{self._owner}: the {self._what} {what_happened}{limit}. Every rank must call the same "
            f"steps with the same parameters; a rank that crashed, skipped a step or diverged in "
            f"control flow leaves the others waiting. Raise `timeout=` if steps are just slow."
        )


class Communicator:
    """Collectives on one process group for one owner, with running byte counts."""

    def __init__(
        self, process_group=None, owner: str = "cokit", timeout: float | datetime.timedelta | None = None
    ):
        self.group = process_group
        self.owner = owner
        if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
            if not timeout > 0:
                raise ValueError(f"{owner}: timeout must be > 0 seconds, got {timeout}")
            timeout = datetime.timedelta(seconds=float(timeout))
        elif timeout is not None and not isinstance(timeout, datetime.timedelta):
            raise TypeError(f"{owner}: timeout must be seconds or a timedelta, got {type(timeout).__name__}")
        self.timeout = timeout
        self.sent = 0
        self.received = 0

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized() and self.world_size > 1

    @property
    def world_size(self) -> int:
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        if not (dist.is_available() and dist.is_initialized()):
            return 0
        return dist.get_rank(self.group)

    def reset_counts(self) -> tuple[int, int]:
        """Return ``(sent, received)`` since the last reset and start again from zero."""
        counts = (self.sent, self.received)
        self.sent = self.received = 0
        return counts

    def all_gather(self, tensor: torch.Tensor, what: str) -> Pending:
        """Start an all-gather of a flat tensor; ``wait()`` gives ``(world_size, numel)``."""
        world = self.world_size
        if not self.distributed:
            return Pending(None, tensor.reshape(1, -1).clone(), self.owner, what, None)
        out = tensor.new_empty(world * tensor.numel())
        work = dist.all_gather_single(out, tensor.reshape(-1), group=self.group, async_op=True)
        nbytes = ring_allgather_bytes(tensor.numel() * tensor.element_size(), world)
        self.sent += nbytes
        self.received += nbytes
        return Pending(work, out.view(world, -1), self.owner, what, self.timeout)

    def all_reduce_mean(self, tensor: torch.Tensor, what: str) -> Pending:
        """Start an in-place all-reduce; ``wait()`` gives the mean over ranks (same tensor)."""
        if not self.distributed:
            return Pending(None, tensor, self.owner, what, None)
        work = dist.all_reduce(tensor, group=self.group, async_op=True)
        nbytes = ring_allreduce_bytes(tensor.numel() * tensor.element_size(), self.world_size)
        self.sent += nbytes
        self.received += nbytes
        return _Scaled(work, tensor, 1.0 / self.world_size, self.owner, what, self.timeout)

    def gather_objects(self, obj: object) -> list:
        """All-gather picklable objects (rare and small: error reports; not counted)."""
        if not self.distributed:
            return [obj]
        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out


class _Scaled(Pending):
    """A pending all-reduce whose sum is scaled once, on first wait (sum -> mean)."""

    def __init__(self, work, result, scale: float, owner: str, what: str, timeout):
        super().__init__(work, result, owner, what, timeout)
        self._scale: float | None = scale

    def wait(self) -> torch.Tensor:
        result = super().wait()
        if self._scale is not None:
            result.mul_(self._scale)
            self._scale = None
        return result
