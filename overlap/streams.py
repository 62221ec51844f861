"""Where communication runs: a prioritized side stream and a high-priority process group.

* :class:`CommStream` -- a communication stream (``torch.cuda.Stream(priority=...)``, the
  same call on ROCm) with the stream hand-offs an overlap needs (``wait_for_current``,
  ``join``, ``keep_alive`` = ``record_stream``). On CPU it is a no-op with the same API: CPU
  work runs synchronously, and asynchronous collectives come from gloo's work threads.
* :func:`high_priority_group` -- a process group whose NCCL/RCCL kernels run on
  high-priority streams (``ProcessGroupNCCL.Options(is_high_priority_stream=True)`` passed as
  ``pg_options`` to ``dist.new_group``); for gloo, an ordinary group (no streams). It, the
  priority rules and :class:`CommGroup` live in :mod:`cokit.compress.priority`, which the
  compression front ends' ``comm_priority=`` uses too; they are re-exported here.
* :func:`wait_handle` -- waits on what a communication call returned (a ``Work``, a list of
  them, or None for stream-ordered work).

The starvation guard lives in :mod:`cokit.overlap.guard` and is re-exported here.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist

from cokit.compress import priority as _priority
from cokit.compress.priority import (
    CPU_PRIORITY_RANGE,
    CommGroup,
    group_is_high_priority,
    high_priority_group,
    is_high,
)

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
    return _priority.priority_range(_device(device))


def resolve_priority(priority: str | int, device: torch.device | str | int | None = None) -> int:
    """The integer stream priority for ``'high'`` (the device's highest), ``'normal'`` (0,
    the default stream's) or an integer inside :func:`priority_range`
    (:func:`cokit.compress.priority.resolve_priority`)."""
    return _priority.resolve_priority(priority, _device(device))


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


def warn_if_priority_ignored(group: Any, priority: str | int) -> None:
    """Warn when a high priority is asked for collectives of a normal-priority NCCL group."""
    if (
        is_high(priority)
        and group_is_high_priority(group) is False
        and dist.is_initialized()
        and dist.get_backend(group.group if isinstance(group, CommGroup) else group) == "nccl"
    ):
        warnings.warn(
            "high priority requested, but this NCCL group's collectives run on normal-priority streams; "
            "create the group with cokit.overlap.streams.high_priority_group() (or set TORCH_NCCL_HIGH_PRIORITY=1)",
            stacklevel=3,
        )
