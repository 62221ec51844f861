"""Where communication runs: a prioritized side stream and a high-priority process group.

* :class:`CommStream` -- a communication stream (``torch.cuda.Stream(priority=...)``, the
  same call on ROCm) with the stream hand-offs an overlap needs (``wait_for_current``,
  ``join``, ``keep_alive`` = ``record_stream``). On CPU it is a no-op with the same API: CPU
  work runs synchronously, and asynchronous collectives come from gloo's work threads.
* :func:`high_priority_group` -- a process group whose NCCL/RCCL kernels run on
  high-priority streams (``ProcessGroupNCCL.Options(is_high_priority_stream=True)`` passed as
  ``pg_options`` to ``dist.new_group``); for gloo, an ordinary group (no streams).
* :func:`wait_handle` -- waits on what a communication call returned (a ``Work``, a list of
  them, or None for stream-ordered work).

The starvation guard lives in :mod:`cokit.overlap.guard` and is re-exported here.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterable
from typing import Any, cast

import torch
import torch.distributed as dist

from .guard import _is_high

__all__ = [
    "CPU_PRIORITY_RANGE",
    "CommGroup",
    "CommStream",
    "group_is_high_priority",
    "high_priority_group",
    "priority_range",
    "resolve_priority",
    "wait_handle",
]

#: (lowest, highest) stream priority accepted on CPU, where priorities are recorded but have
#: no effect. It mirrors what torch exposes on CUDA (0 = default, lower = higher priority,
#: at most 4 levels); on a GPU the live range from the driver is used instead.
CPU_PRIORITY_RANGE = (0, -3)


def _device(device: torch.device | str | int | None) -> torch.device:
    if device is None:
        return (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
    if isinstance(device, int):
        return torch.device("cuda", device)
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"device {dev} requested but torch sees no GPU")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise ValueError(f"overlap runs on cuda (NVIDIA/AMD) or cpu devices, got {dev}")
    return dev


def priority_range(device: torch.device | str | int | None = None) -> tuple[int, int]:
    """``(lowest, highest)`` stream priority on ``device`` (lower number = higher priority)."""
    dev = _device(device)
    if dev.type == "cuda":
        # a staticmethod (torch's stub types it as an instance method)
        least, greatest = cast(Any, torch.cuda.Stream).priority_range()
        return int(least), int(greatest)
    return CPU_PRIORITY_RANGE


def resolve_priority(priority: str | int, device: torch.device | str | int | None = None) -> int:
    """The integer stream priority for ``'high'`` (the device's highest), ``'normal'`` (0,
    the default stream's) or an integer inside :func:`priority_range`."""
    least, greatest = priority_range(device)
    if priority == "high":
        return greatest
    if priority == "normal":
        return least
    if isinstance(priority, bool) or not isinstance(priority, int) or not greatest <= priority <= least:
        raise ValueError(
            f"priority={priority!r} is invalid; allowed: 'high', 'normal' or an integer from "
            f"{greatest} (highest) to {least} (lowest) on {_device(device)}"
        )
    return priority


class CommStream:
    """A communication stream of a given priority, or its CPU no-op twin.

    Usage on one device (the pattern every schedule follows)::

        cs = CommStream(device, priority="high")
        cs.wait_for_current()         # comm stream waits for inputs made on the current stream
        with cs:                      # work launched here runs on the comm stream
            out = communicate(x)
        cs.keep_alive(x)              # x was allocated on the current stream: record_stream
        compute()                     # runs concurrently on the current stream
        cs.join()                     # current stream waits for the communication
    """

    def __init__(self, device: torch.device | str | int | None = None, priority: str | int = "high") -> None:
        self.device = _device(device)
        self.priority = resolve_priority(priority, self.device)
        self.requested_priority = priority
        self.stream = (
            torch.cuda.Stream(device=self.device, priority=self.priority)
            if self.device.type == "cuda"
            else None
        )
        self._contexts: list[Any] = []

    @property
    def is_noop(self) -> bool:
        """True on CPU: no stream, every method does nothing."""
        return self.stream is None

    def __enter__(self) -> CommStream:
        if self.stream is not None:
            ctx = torch.cuda.stream(self.stream)
            ctx.__enter__()
            self._contexts.append(ctx)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.stream is not None:
            self._contexts.pop().__exit__(*exc)

    def wait_for_current(self) -> None:
        """Make the comm stream wait for everything queued so far on the current stream."""
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def join(self) -> None:
        """Make the current stream wait for everything queued so far on the comm stream."""
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def keep_alive(self, *tensors: torch.Tensor) -> None:
        """``record_stream`` for tensors allocated on another stream and used on this one, so
        the caching allocator does not reuse their memory before the comm stream is done."""
        if self.stream is not None:
            for t in tensors:
                if t.device.type == "cuda":
                    t.record_stream(self.stream)

    def synchronize(self) -> None:
        """Block the host until the comm stream is idle."""
        if self.stream is not None:
            self.stream.synchronize()

    def __repr__(self) -> str:
        kind = "no-op (cpu)" if self.is_noop else f"stream on {self.device}"
        return f"CommStream({kind}, priority={self.priority} [{self.requested_priority!r}])"


def wait_handle(handle: Any) -> None:
    """Wait on what a communication call returned: None (stream-ordered work: nothing to do),
    an object with ``wait()`` (``dist.Work``, a future), or an iterable of those."""
    if handle is None:
        return
    if hasattr(handle, "wait"):
        handle.wait()
        return
    if isinstance(handle, (list, tuple)):
        for h in handle:
            wait_handle(h)
        return
    raise TypeError(
        f"a communication call must return None, an object with wait() (e.g. dist.Work) or a list of them; "
        f"got {type(handle).__name__}"
    )


@dataclasses.dataclass
class CommGroup:
    """A process group and whether its collectives run on high-priority streams."""

    group: Any
    backend: str
    high_priority: bool
    note: str


def high_priority_group(ranks: Iterable[int] | None = None, *, backend: str | None = None) -> CommGroup:
    """A new process group whose NCCL/RCCL work runs on high-priority streams.

    Collective: every rank of the default group must call it, with the same ``ranks``.
    ``backend`` defaults to the default group's. For ``nccl`` (RCCL on ROCm keeps that name)
    the group is created with ``ProcessGroupNCCL.Options(is_high_priority_stream=True)``;
    other backends (gloo) have no streams, so the group is ordinary and says so.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "high_priority_group needs torch.distributed initialized (dist.init_process_group)"
        )
    backend = str(backend or dist.get_backend()).lower()
    ranks = sorted(ranks) if ranks is not None else None
    if backend == "nccl":
        try:
            from torch.distributed import ProcessGroupNCCL
        except ImportError:
            raise RuntimeError("backend 'nccl' requested but this torch build has no NCCL/RCCL") from None
        options = ProcessGroupNCCL.Options(is_high_priority_stream=True)
        group = dist.new_group(ranks, backend="nccl", pg_options=options)
        return CommGroup(group, "nccl", True, "NCCL/RCCL collectives run on high-priority streams")
    group = dist.new_group(ranks, backend=backend)
    return CommGroup(group, backend, False, f"{backend} has no GPU streams: stream priority does not apply")


def group_is_high_priority(group: Any = None) -> bool | None:
    """Whether ``group``'s (default: the default group's) NCCL work runs on high-priority
    streams; False for backends without streams; None when it cannot be told."""
    if isinstance(group, CommGroup):
        return group.high_priority
    if not dist.is_initialized():
        return None
    try:
        backend = dist.get_backend(group)
    except Exception:  # not a group of this process
        return None
    if backend != "nccl":
        return False
    pg: Any = group if group is not None else dist.group.WORLD  # private API below: untyped
    try:
        return bool(pg._get_backend(torch.device("cuda")).options.is_high_priority_stream)
    except Exception:  # private API moved: unknown
        return None


def warn_if_priority_ignored(group: Any, priority: str | int) -> None:
    """Warn when a high priority is asked for collectives of a normal-priority NCCL group."""
    if (
        _is_high(priority)
        and group_is_high_priority(group) is False
        and dist.is_initialized()
        and dist.get_backend(group.group if isinstance(group, CommGroup) else group) == "nccl"
    ):
        warnings.warn(
            "high priority requested, but this NCCL group's collectives run on normal-priority streams; "
            "create the group with cokit.overlap.streams.high_priority_group() (or set TORCH_NCCL_HIGH_PRIORITY=1)",
            stacklevel=3,
        )
