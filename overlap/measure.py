"""Measure a compute/communication pair: alone, sequential and overlapped, with every metric.

A *workload* (any object with the four ``run_*`` methods of :class:`Workload`; the
schedules of :mod:`cokit.overlap.schedules` are workloads) is run in rounds; each round times, in
order, compute alone, communication alone, both one after the other, and both overlapped
(with the compute spans inside the overlapped run timed separately: compute under overlap).
``warmup`` rounds are discarded, ``repeats`` rounds are kept. Times come from CUDA events
on the current stream on a GPU and from a monotonic clock (``time.perf_counter``) on CPU.
In a process group the ranks meet at a barrier before every timed phase (outside the timing).

The result carries the medians and spreads of every time and of every metric of docs/design.md
1.2 (metrics from the median times, and per-round metrics for their spread).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from cokit.triton_kernels._checks import check_int

from .metrics import METRIC_NAMES, OverlapMetrics, Spread, compute_metrics, summarize

__all__ = ["TIME_NAMES", "Clock", "OverlapResult", "Probe", "Workload", "measure"]

#: the timed phases, in the order a round runs them (plus compute under overlap).
TIME_NAMES = ("compute", "communicate", "sequential", "overlapped", "compute_under_overlap")


class Clock:
    """Timestamps: CUDA events on the current stream (GPU) or ``time.perf_counter`` (CPU)."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.gpu = self.device.type == "cuda"
        self.name = "cuda-events" if self.gpu else "monotonic (time.perf_counter)"

    def mark(self) -> Any:
        """A timestamp: a recorded CUDA event on the current stream, or seconds on CPU."""
        if self.gpu:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(torch.cuda.current_stream(self.device))
            return ev
        return time.perf_counter()

    def synchronize(self) -> None:
        """Wait for the device (no-op on CPU)."""
        if self.gpu:
            torch.cuda.synchronize(self.device)

    def elapsed_ms(self, start: Any, end: Any) -> float:
        """Milliseconds between two marks (on GPU, after :meth:`synchronize`)."""
        if self.gpu:
            return float(start.elapsed_time(end))
        return (end - start) * 1e3


class Probe:
    """Collects spans of compute inside an overlapped run; ``total_ms`` is their sum."""

    def __init__(self, clock: Clock | None = None) -> None:
        self.clock = clock
        self.spans: list[tuple[Any, Any]] = []

    @contextlib.contextmanager
    def span(self) -> Iterator[None]:
        """Time the enclosed compute (a no-op when the probe has no clock)."""
        if self.clock is None:
            yield
            return
        start = self.clock.mark()
        yield
        self.spans.append((start, self.clock.mark()))

    def total_ms(self) -> float | None:
        """Sum of the spans (None when nothing was timed); synchronize the clock first on GPU."""
        if self.clock is None or not self.spans:
            return None
        return sum(self.clock.elapsed_ms(a, b) for a, b in self.spans)


#: a probe that times nothing (for running a schedule outside a measurement).
NULL_PROBE = Probe(None)


@runtime_checkable
class Workload(Protocol):
    """What :func:`measure` runs. Each method returns once its work is done on CPU, or, on a
    GPU, queued with the current stream ordered after it (comm streams joined, works waited)."""

    device: torch.device

    def run_compute(self) -> Any: ...

    def run_communicate(self) -> Any: ...

    def run_sequential(self) -> Any: ...

    def run_overlapped(self, probe: Probe = NULL_PROBE) -> Any: ...


@dataclasses.dataclass
class OverlapResult:
    """Times (ms) and metrics of one measured workload on one rank."""

    label: str
    device: str
    timer: str
    repeats: int
    warmup: int
    rank: int
    world_size: int
    emulated: bool  # True when the communication side is an emulation, not a collective
    comm: str  # what the communication side is
    times: dict[str, Spread]
    metrics: OverlapMetrics
    metric_spread: dict[str, Spread]
    info: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready nested dict."""
        return {
            "label": self.label,
            "device": self.device,
            "timer": self.timer,
            "repeats": self.repeats,
            "warmup": self.warmup,
            "rank": self.rank,
            "world_size": self.world_size,
            "emulated": self.emulated,
            "comm": self.comm,
            "times_ms": {k: v.to_dict() for k, v in self.times.items()},
            "metrics": self.metrics.to_dict(),
            "metric_spread": {k: v.to_dict() for k, v in self.metric_spread.items()},
            "info": self.info,
        }

    def flat(self) -> dict[str, Any]:
        """One flat row (CSV-ready): medians and IQRs of times, metrics and their IQRs."""
        row: dict[str, Any] = {
            "label": self.label,
            "device": self.device,
            "rank": self.rank,
            "world_size": self.world_size,
            "emulated": self.emulated,
            "comm": self.comm,
        }
        row.update(self.info)
        for k, s in self.times.items():
            row[f"{k}_ms"] = s.median
            row[f"{k}_iqr_ms"] = s.iqr
        m = self.metrics
        row.update(t_seq_ms=m.t_seq, ideal_ms=m.ideal)
        for k in METRIC_NAMES:
            row[k] = getattr(m, k)
            if k in self.metric_spread:
                row[f"{k}_iqr"] = self.metric_spread[k].iqr
        return row

    def format(self) -> str:
        """A human-readable table."""
        tag = " [EMULATED communication]" if self.emulated else ""
        lines = [
            f"{self.label}{tag}: {self.comm}",
            f"  device {self.device}, rank {self.rank}/{self.world_size}, timer {self.timer}, "
            f"{self.repeats} repeats after {self.warmup} warm-up",
            f"  {'time (ms)':<24}{'median':>10}{'q1':>10}{'q3':>10}{'min':>10}{'max':>10}",
        ]
        for k, s in self.times.items():
            lines.append(f"  {k:<24}{s.median:>10.3f}{s.q1:>10.3f}{s.q3:>10.3f}{s.min:>10.3f}{s.max:>10.3f}")
        m = self.metrics
        lines.append(f"  {'T_seq = T_comp + T_comm':<24}{m.t_seq:>10.3f}")
        lines.append(f"  {'ideal = max(...)':<24}{m.ideal:>10.3f}")
        lines.append(f"  {'metric (from medians)':<24}{'value':>10}{'q1':>10}{'q3':>10}   (per-round spread)")
        for k in METRIC_NAMES:
            v = getattr(m, k)
            sp = self.metric_spread.get(k)
            val = "-" if v is None else f"{v:.4f}"
            spread = f"{sp.q1:>10.4f}{sp.q3:>10.4f}" if sp else ""
            lines.append(f"  {k:<24}{val:>10}{spread}")
        return "\n".join(lines)


def measure(
    workload: Workload,
    *,
    repeats: int = 10,
    warmup: int = 2,
    barrier: bool = True,
    label: str | None = None,
    info: dict[str, Any] | None = None,
    clock: Clock | None = None,
) -> OverlapResult:
    """Run ``workload`` alone/sequential/overlapped for ``warmup + repeats`` rounds; return
    medians, spreads and every metric. Every rank of the workload's group must call it.
    ``clock`` replaces the device's clock (an object with ``mark``, ``synchronize``,
    ``elapsed_ms`` and ``name``; tests use a virtual one)."""
    check_int("repeats", repeats, 1)
    check_int("warmup", warmup, 0)
    if not isinstance(workload, Workload):
        raise TypeError(
            f"{type(workload).__name__} is not a workload: it needs device, run_compute, run_communicate, "
            "run_sequential and run_overlapped"
        )
    clock = clock or Clock(workload.device)
    group = getattr(workload, "group", None)
    in_group = dist.is_available() and dist.is_initialized() and getattr(workload, "uses_group", True)
    world = dist.get_world_size(group) if in_group else 1
    rank = dist.get_rank(group) if in_group else 0

    def timed(fn: Callable[[], Any]) -> float:
        clock.synchronize()
        if barrier and in_group and world > 1:
            dist.barrier(group=group)
            clock.synchronize()
        start = clock.mark()
        fn()
        end = clock.mark()
        clock.synchronize()
        return clock.elapsed_ms(start, end)

    samples: dict[str, list[float]] = {k: [] for k in TIME_NAMES}
    rounds: list[OverlapMetrics] = []
    for i in range(warmup + repeats):
        t_comp = timed(workload.run_compute)
        t_comm = timed(workload.run_communicate)
        t_seq = timed(workload.run_sequential)
        probe = Probe(clock)
        t_ovl = timed(functools.partial(workload.run_overlapped, probe))
        t_under = probe.total_ms()
        if i < warmup:
            continue
        for k, v in zip(TIME_NAMES, (t_comp, t_comm, t_seq, t_ovl, t_under), strict=True):
            if v is not None:
                samples[k].append(v)
        rounds.append(
            compute_metrics(_positive(t_comp), _positive(t_comm), _positive(t_ovl), t_under, _positive(t_seq))
        )
    times = {k: summarize(v) for k, v in samples.items() if v}
    med = {k: s.median for k, s in times.items()}
    metrics = compute_metrics(
        _positive(med["compute"]),
        _positive(med["communicate"]),
        _positive(med["overlapped"]),
        med.get("compute_under_overlap"),
        _positive(med["sequential"]),
    )
    spread = {}
    for k in METRIC_NAMES:
        vals = [getattr(r, k) for r in rounds if getattr(r, k) is not None]
        if vals:
            spread[k] = summarize(vals)
    return OverlapResult(
        label=str(label or getattr(workload, "label", type(workload).__name__)),
        device=str(workload.device),
        timer=clock.name,
        repeats=repeats,
        warmup=warmup,
        rank=rank,
        world_size=world,
        emulated=bool(getattr(workload, "emulated", False)),
        comm=str(getattr(workload, "comm_label", "communication")),
        times=times,
        metrics=metrics,
        metric_spread=spread,
        info={**getattr(workload, "info", {}), **(info or {})},
    )


def _positive(ms: float) -> float:
    """Clock resolution guard: a phase measured as 0 ms (empty work) counts as 1 ns."""
    return ms if ms > 0 else 1e-6
