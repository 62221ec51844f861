"""Per-step communication timing: encode, decode, exposed and total communication time.

A :class:`StepTimer` collects one step's marks; :meth:`StepTimer.take` closes the step as a
:class:`StepTiming`, which :class:`~cokit.compress.stats.CommStats` turns into seconds.

* ``encode_s`` / ``decode_s``: the codec work around the collectives (error-feedback encode,
  wire packing; unpacking and decode), summed over buckets.
* ``exposed_s``: the time this rank was blocked waiting on collectives (the communication
  that compute did not hide). It is at most the step time.
* ``comm_s``: the union of the step's collectives' launch-to-completion intervals. Where it
  exceeds ``exposed_s`` the difference ran behind compute (hidden).

Clocks. On CPU, marks are ``perf_counter`` readings taken around the work, and a gloo
collective's completion is stamped by a callback on its future (the moment gloo's thread
finished it, not the moment someone waited). On CUDA, marks are CUDA events recorded on the
current stream, so a step adds no host synchronization: the seconds are read when the stats
are (:meth:`StepTiming.resolve`, by then the events have long completed). There a
collective's completion is the event recorded after its wait, once the stream resumes: an
upper bound on its duration; the exposed time is the stream's stall at the wait.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["CollectiveTiming", "StepTimer", "StepTiming", "empty_timing"]

Mark = Any  # a perf_counter float, or a torch.cuda.Event recorded on the current stream


def _is_event(mark: Mark) -> bool:
    return not isinstance(mark, float)


@dataclass
class CollectiveTiming:
    """One collective of a step: its bytes and its marks (filled in as it runs)."""

    what: str
    sent_bytes: int
    received_bytes: int
    launched: Mark
    completed: Mark | None = None  # set by the future's callback (CPU) or the wait (CUDA)
    waits: list[tuple[Mark, Mark]] = field(default_factory=list)


def empty_timing() -> dict[str, Any]:
    """The resolved timing of a step without communication."""
    return {"encode_s": 0.0, "decode_s": 0.0, "exposed_s": 0.0, "comm_s": 0.0, "collectives": []}


@dataclass
class StepTiming:
    """The marks of one closed step; :meth:`resolve` turns them into seconds."""

    spans: dict[str, list[tuple[Mark, Mark]]]
    collectives: list[CollectiveTiming]
    blocked: list[tuple[Mark, Mark]]

    def ready(self) -> bool:
        """True when resolving would not wait (CPU marks; CUDA events that have completed)."""
        marks = [m for pair in self._pairs() for m in pair]
        return all(not _is_event(m) or m.query() for m in marks)

    def _pairs(self) -> Iterator[tuple[Mark, Mark]]:
        for pairs in self.spans.values():
            yield from pairs
        yield from self.blocked
        for c in self.collectives:
            yield from c.waits
            if c.completed is not None:
                yield c.launched, c.completed

    def resolve(self) -> dict[str, Any]:
        """Seconds: ``encode_s``, ``decode_s``, ``exposed_s``, ``comm_s`` and one entry per
        collective (``what``, ``sent_bytes``, ``received_bytes``, ``comm_s``, ``exposed_s``)."""
        marks = [m for pair in self._pairs() for m in pair]
        if not marks:
            return empty_timing()
        ref = marks[0]
        if _is_event(ref):
            for m in marks:
                m.synchronize()

        def at(m: Mark) -> float:
            return m - ref if not _is_event(m) else ref.elapsed_time(m) / 1e3

        def total(pairs: list[tuple[Mark, Mark]]) -> float:
            return sum(max(at(b) - at(a), 0.0) for a, b in pairs)

        intervals: list[tuple[float, float]] = []
        per_collective: list[dict[str, Any]] = []
        for c in self.collectives:
            span = None
            ends = [at(b) for _, b in c.waits]
            if c.completed is not None:
                done = at(c.completed)
                # a wait that began before completion saw it only when it returned
                ends = [done, *(at(b) for a, b in c.waits if at(a) <= done)]
            if ends:
                span = (at(c.launched), max(ends))
            if span is not None:
                intervals.append(span)
            per_collective.append(
                {
                    "what": c.what,
                    "sent_bytes": c.sent_bytes,
                    "received_bytes": c.received_bytes,
                    "comm_s": max(span[1] - span[0], 0.0) if span is not None else 0.0,
                    "exposed_s": total(c.waits),
                }
            )
        # Blocked windows that are not one collective's wait (the DDP hook's) can hold codec
        # work on other threads (its decode callbacks): that time is encode/decode, not waiting.
        codec = [(at(a), at(b)) for kind in ("encode", "decode") for a, b in self.spans.get(kind, [])]
        blocked = sum(_uncovered(at(a), at(b), codec) for a, b in self.blocked)
        return {
            "encode_s": total(self.spans.get("encode", [])),
            "decode_s": total(self.spans.get("decode", [])),
            "exposed_s": blocked + sum(float(c["exposed_s"]) for c in per_collective),
            "comm_s": _union_length(intervals),
            "collectives": per_collective,
        }


def _uncovered(start: float, end: float, intervals: list[tuple[float, float]]) -> float:
    """Length of ``[start, end]`` that none of ``intervals`` covers."""
    clipped = [(max(a, start), min(b, end)) for a, b in intervals if b > start and a < end]
    return max(end - start, 0.0) - _union_length(clipped)


def _union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by ``intervals`` (overlapping collectives count once)."""
    length, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        length += b - max(a, end)
        end = b
    return length


class StepTimer:
    """Collects one step's marks; thread-safe (completion callbacks run on gloo's threads).

    ``clock``: the CPU clock (``time.perf_counter``; tests pass a fake one). CUDA tensors are
    timed with CUDA events instead (module docstring).
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._inside = threading.local()  # the span kinds open on each thread
        self._open()

    def _open(self) -> None:
        self._spans: dict[str, list[tuple[Mark, Mark]]] = {}
        self._collectives: list[CollectiveTiming] = []
        self._blocked: list[tuple[Mark, Mark]] = []

    def mark(self, device: torch.device | None = None) -> Mark:
        """Now, on ``device``'s clock (a CUDA event on the current stream for CUDA devices)."""
        if device is not None and device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return float(self.clock())

    @contextlib.contextmanager
    def span(self, kind: str, device: torch.device | None = None) -> Iterator[None]:
        """Time the body as ``kind`` (``"encode"`` or ``"decode"``); inside a span of the same
        kind on the same thread it is already counted (the hook's decode holds validation's)."""
        open_kinds: set[str] = self._inside.__dict__.setdefault("kinds", set())
        if kind in open_kinds:
            yield
            return
        open_kinds.add(kind)
        start = self.mark(device)
        try:
            yield
        finally:
            open_kinds.discard(kind)
            end = self.mark(device)
            with self._lock:
                self._spans.setdefault(kind, []).append((start, end))

    def launched(self, what: str, sent: int, received: int, start: Mark) -> CollectiveTiming:
        """A collective started at ``start`` (a :meth:`mark` taken just before launching it);
        returns its record for :meth:`watch` and :meth:`waited`."""
        record = CollectiveTiming(what, sent, received, start)
        with self._lock:
            self._collectives.append(record)
        return record

    def watch(self, record: CollectiveTiming, work: Any) -> None:
        """Stamp ``record``'s completion from ``work``'s future (CPU collectives only)."""
        if _is_event(record.launched):
            return
        get_future = getattr(work, "get_future", None)
        if get_future is None:
            return

        def done(_fut: Any) -> None:
            stamp = float(self.clock())
            with self._lock:
                if record.completed is None:
                    record.completed = stamp

        try:
            future = get_future()
        except RuntimeError:  # some works have no future (gloo's reduce-scatter): the wait's end
            return
        future.add_done_callback(done)

    def completed_at(self, record: CollectiveTiming, stamp: Mark) -> None:
        """``record`` completes no earlier than ``stamp``: a CPU reading (a simulated delay,
        later than its callback's stamp) or, on CUDA, the first event after its completion."""
        with self._lock:
            done = record.completed
            later = done is not None and not _is_event(stamp) and not _is_event(done) and done < stamp
            if done is None or later:
                record.completed = stamp

    def waited(self, record: CollectiveTiming, start: Mark, end: Mark) -> None:
        """This rank was blocked on ``record`` from ``start`` to ``end``. A collective launched
        in an earlier, closed step (SparseLoCo's ``sync="eager"`` round) is blocked time of the
        open step: its own step's timing may be resolved already."""
        with self._lock:
            if any(c is record for c in self._collectives):
                record.waits.append((start, end))
            else:
                self._blocked.append((start, end))
            if _is_event(end) and record.completed is None:  # CUDA: completion is the wait's end
                record.completed = end

    def blocked(self, start: Mark, end: Mark) -> None:
        """This rank was blocked waiting on communication outside any one collective's wait
        (e.g. DDP finishing its buckets after backward)."""
        with self._lock:
            self._blocked.append((start, end))

    def take(self) -> StepTiming:
        """Close the step: its marks, and start the next step empty."""
        with self._lock:
            timing = StepTiming(self._spans, self._collectives, self._blocked)
            self._open()
        return timing

    def discard(self) -> None:
        """Drop the open step's marks (a step that raised before it finished)."""
        with self._lock:
            self._open()
