"""Simulated network latency for collectives: a delaying :class:`Communicator`.

This kernel has no ``netem``, so latency and jitter cannot be added on the wire; they are
added above the socket instead. Every collective launched through a
:class:`SimulatedLatencyCommunicator` completes no earlier than ``launch + delay``, where the
delay is drawn per collective as ``mean + jitter * uniform(-1, 1)`` (clipped at 0) from a
generator seeded by ``(seed, rank)``: the same seed gives the same delays. The latency
overlaps the transfer (a caller that waits later sees less of it), as a pipelined network's
would; it is one delay per collective, not per ring hop. Results and byte counts are those of
the wrapped communicator, untouched. Everything here is labelled *simulated*.

    comm = simulate_latency(optimizer, mean_ms=50, jitter_ms=20, seed=0)
    ...train...
    comm.added_s       # seconds of delay actually added (waited) so far
"""

from __future__ import annotations

import dataclasses
import math
import random
import time

import torch

from cokit.compress.comm import Communicator, Pending

__all__ = ["LatencyModel", "SimulatedLatencyCommunicator", "simulate_latency"]


@dataclasses.dataclass(frozen=True)
class LatencyModel:
    """Per-collective latency ``mean_ms ± jitter_ms`` (uniform, clipped at 0), seeded."""

    mean_ms: float
    jitter_ms: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("mean_ms", "jitter_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"simulated latency: {name} must be a finite number of ms, got {value!r}")
            if value < 0:
                raise ValueError(f"simulated latency: {name} must be >= 0 ms, got {value!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"simulated latency: seed must be an integer, got {self.seed!r}")

    @property
    def bounds_s(self) -> tuple[float, float]:
        """The smallest and largest delay one collective can draw, in seconds."""
        return max(0.0, self.mean_ms - self.jitter_ms) / 1e3, (self.mean_ms + self.jitter_ms) / 1e3

    def generator(self, rank: int) -> random.Random:
        """The delay stream of ``rank`` (independent per rank, fixed per seed)."""
        return random.Random(f"cokit-simulated-latency:{self.seed}:{rank}")

    def draw(self, rng: random.Random) -> float:
        """One delay in seconds from ``rng``."""
        return max(0.0, self.mean_ms + self.jitter_ms * rng.uniform(-1.0, 1.0)) / 1e3

    def draws(self, rank: int, n: int) -> list[float]:
        """The first ``n`` delays (seconds) that ``rank`` draws: what a run will add."""
        rng = self.generator(rank)
        return [self.draw(rng) for _ in range(n)]

    def describe(self) -> str:
        """A one-line label that says the latency is simulated."""
        return (
            f"simulated latency {self.mean_ms:g} ± {self.jitter_ms:g} ms per collective "
            f"(seed {self.seed}; added above the socket, not on the wire)"
        )


class _DelayedPending(Pending):
    """A pending collective that is not done before its simulated completion time."""

    def __init__(self, inner: Pending, ready_at: float, comm: SimulatedLatencyCommunicator):
        # No Pending.__init__: every call goes to ``inner``, which holds the work and result.
        self._inner, self._ready_at, self._comm = inner, ready_at, comm
        self._done = False

    def wait(self) -> torch.Tensor:
        result = self._inner.wait()
        if not self._done:
            self._done = True
            timer, record = self._comm.timer, self._inner._record
            start = timer.mark()
            self._comm._sleep_until(self._ready_at)
            if record is not None:  # the simulated wait is exposed; it completes at ready_at
                timer.waited(record, start, timer.mark())
                timer.completed_at(record, self._ready_at)
        return result


class SimulatedLatencyCommunicator(Communicator):
    """A :class:`Communicator` whose collectives complete after a simulated, seeded delay.

    Attributes: ``model`` (the :class:`LatencyModel`), ``delays`` (every delay drawn, seconds,
    in launch order), ``added_s`` (seconds actually waited for the simulation: at most
    ``sum(delays)``, less when a collective was waited for late), ``label`` ("simulated").
    """

    label = "simulated"
    model: LatencyModel

    def __init__(self, inner: Communicator, model: LatencyModel):
        if not isinstance(inner, Communicator):
            raise TypeError(f"simulated latency wraps a cokit Communicator, got {type(inner).__name__}")
        if isinstance(inner, SimulatedLatencyCommunicator):
            raise ValueError(
                f"{inner.owner}: its communicator already simulates latency ({inner.model.describe()}); "
                "wrap the original communicator once, with the total latency you want"
            )
        if not isinstance(model, LatencyModel):
            raise TypeError(f"model must be a LatencyModel, got {type(model).__name__}")
        super().__init__(
            inner.group, owner=inner.owner, timeout=inner.timeout, local=inner.local, timer=inner.timer
        )
        self.sent, self.received = inner.sent, inner.received
        self.model = model
        self.delays: list[float] = []
        self.added_s = 0.0
        self._rng: random.Random | None = None  # made at the first collective: the rank is known then

    def describe(self) -> str:
        return self.model.describe()

    def _next_delay(self) -> float:
        if self._rng is None:
            self._rng = self.model.generator(self.rank)
        delay = self.model.draw(self._rng)
        self.delays.append(delay)
        return delay

    def _sleep_until(self, ready_at: float) -> None:
        left = ready_at - time.perf_counter()
        if left > 0:
            time.sleep(left)
            self.added_s += left

    def _delayed(self, pending: Pending, launched: float) -> Pending:
        if not self.distributed:  # local copies: no network, no latency
            return pending
        return _DelayedPending(pending, launched + self._next_delay(), self)

    def all_gather(self, tensor: torch.Tensor, what: str) -> Pending:
        launched = time.perf_counter()
        return self._delayed(super().all_gather(tensor, what), launched)

    def _all_reduce(self, tensor: torch.Tensor, what: str, mean: bool) -> Pending:
        launched = time.perf_counter()
        return self._delayed(super()._all_reduce(tensor, what, mean), launched)


def simulate_latency(
    optimizer: object, mean_ms: float, jitter_ms: float = 0.0, seed: int = 0
) -> SimulatedLatencyCommunicator:
    """Replace ``optimizer.comm`` (e.g. :class:`cokit.compress.DeMo`'s) by one that adds a
    simulated ``mean_ms ± jitter_ms`` latency to each collective; return the new communicator.

    Parameters and byte counts stay exactly those of the run without latency. Call it before
    a step starts (not while its collectives are in flight).
    """
    model = LatencyModel(mean_ms, jitter_ms, seed)
    comm = getattr(optimizer, "comm", None)
    if not isinstance(comm, Communicator):
        raise TypeError(
            f"simulate_latency needs an object with a cokit Communicator in `.comm` (e.g. DeMo); "
            f"{type(optimizer).__name__} has {type(comm).__name__}"
        )
    wrapped = SimulatedLatencyCommunicator(comm, model)
    optimizer.comm = wrapped  # type: ignore[attr-defined]
    return wrapped
