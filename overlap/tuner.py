"""An online tuner for training loops: pick the fastest overlap setting while training runs.

    tuner = OnlineTuner(candidates, guard=StarvationGuard(), log_path="overlap_tuner.jsonl")
    for step in range(steps):
        cfg = tuner.choose()           # a candidate: explored first, then the locked best
        t = run_step_with(cfg)         # time it (or let tuner.step(fn) time it)
        tuner.record(cfg, t)

Phases: **explore** -- every allowed candidate is tried ``trials`` times, round-robin (so
slow drift hits all of them alike); **lock** -- the candidate with the lowest median is used
from then on; **drift** -- while locked, when the median of the last ``window`` times moves
more than ``drift_threshold`` (relative) away from the time it was locked with, the tuner
re-explores (at most once per ``cooldown`` locked calls). Candidates the starvation guard
rejects are never run; a candidate whose measured compute slowdown breaks the guard is
dropped. Every decision is logged (JSON lines: event, candidate, reason, times).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from cokit.triton_kernels._checks import check_int

from .guard import StarvationGuard

__all__ = ["OnlineTuner"]


def _describe(c: Any) -> Any:
    """A JSON-ready description of a candidate."""
    if hasattr(c, "to_dict"):
        return c.to_dict()
    if hasattr(c, "spec"):
        return c.spec()
    return c if isinstance(c, (str, int, float, bool, type(None))) else repr(c)


def _config_of(c: Any) -> Any:
    from cokit.triton_kernels.gemm_config import GemmConfig

    if isinstance(c, GemmConfig):
        return c
    cfg = getattr(c, "config", None)
    return cfg if isinstance(cfg, GemmConfig) else None


class OnlineTuner:
    """Explore candidates, lock the best, re-explore on drift; see the module docstring.

    ``candidates`` are GemmConfigs or any objects (with a ``config`` GemmConfig and an
    optional ``priority`` attribute for the guard). ``guard_kwargs`` are passed to
    :meth:`StarvationGuard.violations` (``limits``, ``dtype``, ``natural_smem``...).
    ``clock`` returns milliseconds for :meth:`step` (default: ``time.perf_counter``; pass a
    CUDA-event timer or synchronize inside ``fn`` on a GPU).
    """

    def __init__(
        self,
        candidates: Sequence[Any],
        *,
        trials: int = 2,
        drift_threshold: float = 0.2,
        window: int = 5,
        cooldown: int = 10,
        guard: StarvationGuard | None = None,
        guard_kwargs: dict[str, Any] | None = None,
        log_path: str | os.PathLike | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if (
            isinstance(candidates, (str, bytes))
            or not isinstance(candidates, Sequence)
            or len(candidates) == 0
        ):
            raise ValueError("candidates must be a non-empty sequence")
        for name, v, lo in (("trials", trials, 1), ("window", window, 1), ("cooldown", cooldown, 0)):
            check_int(name, v, lo)
        if (
            isinstance(drift_threshold, bool)
            or not isinstance(drift_threshold, (int, float))
            or not drift_threshold > 0
        ):
            raise ValueError(
                f"drift_threshold={drift_threshold!r} is invalid; allowed: a number > 0 (relative change)"
            )
        self.trials, self.drift_threshold, self.window, self.cooldown = (
            trials,
            float(drift_threshold),
            window,
            cooldown,
        )
        self.guard = guard
        self.log_path = Path(log_path) if log_path is not None else None
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file: Any = None  # opened on the first event, closed at lock and by close()
        self.clock = clock or (lambda: time.perf_counter() * 1e3)
        self.log: list[dict[str, Any]] = []
        self.calls = 0
        self.explorations = 0
        self.candidates: list[Any] = []
        for c in candidates:
            bad = self._guard_violations(c, guard_kwargs or {})
            if bad:
                self._emit("reject", c, "starvation guard: " + "; ".join(bad))
            else:
                self.candidates.append(c)
        if not self.candidates:
            self.close()
            raise ValueError("the starvation guard rejects every candidate; see the tuner log for why")
        self.locked: Any = None
        self.locked_time: float | None = None
        self._recent: deque[float] = deque(maxlen=window)
        self._locked_calls = 0
        self._start_exploration("initial exploration")

    # ------------------------------------------------------------------ state
    @property
    def state(self) -> str:
        """'exploring' or 'locked'."""
        return "locked" if self.locked is not None else "exploring"

    def _guard_violations(self, c: Any, kwargs: dict[str, Any]) -> list[str]:
        if self.guard is None:
            return []
        return self.guard.violations(_config_of(c), priority=getattr(c, "priority", None), **kwargs)

    def _start_exploration(self, reason: str) -> None:
        self.locked, self.locked_time = None, None
        self._times: dict[int, list[float]] = {i: [] for i in range(len(self.candidates))}
        self._queue = [i for _ in range(self.trials) for i in range(len(self.candidates))]
        self._recent.clear()
        self.explorations += 1
        self._described = [_describe(c) for c in self.candidates]  # the candidates change only here
        self._emit("explore", None, reason, candidates=self._described)

    def _emit(self, event: str, candidate: Any, reason: str, **extra: Any) -> None:
        entry = {
            "event": event,
            "call": getattr(self, "calls", 0),
            "wall_time": time.time(),
            "candidate": _describe(candidate) if candidate is not None else None,
            "reason": reason,
            **extra,
        }
        self.log.append(entry)
        if self.log_path is not None:
            if self._log_file is None:
                self._log_file = self.log_path.open("a", buffering=1)  # line-buffered: readable as written
            self._log_file.write(json.dumps(entry, default=str) + "\n")

    def close(self) -> None:
        """Close the JSONL log (a later event reopens it)."""
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def __enter__(self) -> OnlineTuner:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ API
    def choose(self) -> Any:
        """The candidate to use for the next call."""
        if self.locked is not None:
            return self.locked
        return self.candidates[self._queue[0]]

    def record(self, candidate: Any, elapsed_ms: float, *, compute_slowdown: float | None = None) -> None:
        """Feed the measured time of a call made with ``candidate`` (what :meth:`choose`
        returned). ``compute_slowdown`` (if measured) is checked against the guard."""
        if (
            isinstance(elapsed_ms, bool)
            or not isinstance(elapsed_ms, (int, float))
            or not math.isfinite(elapsed_ms)
            or elapsed_ms < 0
        ):
            raise ValueError(f"elapsed_ms={elapsed_ms!r} is invalid; allowed: a finite time >= 0")
        if candidate is not self.choose() and candidate != self.choose():
            raise ValueError("record() got a different candidate than choose() returned; call choose() first")
        self.calls += 1
        if self.guard is not None:
            bad = self.guard.check_measured(compute_slowdown)
            if bad:
                self._drop(candidate, "; ".join(bad))
                return
        if self.locked is None:
            idx = self._queue.pop(0)
            self._times[idx].append(float(elapsed_ms))
            self._emit("trial", candidate, "exploring", elapsed_ms=float(elapsed_ms))
            if not self._queue:
                self._lock()
            return
        self._locked_calls += 1
        self._recent.append(float(elapsed_ms))
        if len(self._recent) == self.window and self._locked_calls >= self.cooldown:
            now = statistics.median(self._recent)
            change = now / self.locked_time - 1.0 if self.locked_time else 0.0
            if abs(change) > self.drift_threshold:
                self._emit(
                    "drift",
                    self.locked,
                    f"median of last {self.window} calls {now:.4g} ms is "
                    f"{change:+.1%} from the locked {self.locked_time:.4g} ms (threshold "
                    f"{self.drift_threshold:.0%})",
                    recent_ms=list(self._recent),
                )
                self._start_exploration("re-exploring after drift")

    def plan(self) -> list[Any]:
        """The candidates the coming calls will use, in order, while exploring (empty when
        locked): the exploration's order does not depend on the times, only its end does."""
        return [self.candidates[i] for i in self._queue] if self.locked is None else []

    def reexplore(self, reason: str) -> None:
        """Start a new exploration of every candidate now (e.g. when a controller that tunes
        several tuners one at a time saw the step time drift)."""
        self._start_exploration(reason)

    def snapshot(self) -> dict[str, Any]:
        """The decision state as JSON-ready data: equal snapshots and equal recorded times give
        equal decisions (what ranks compare before applying one)."""
        return {
            "candidates": self._described,
            "trials": self.trials,
            "calls": self.calls,
            "explorations": self.explorations,
            "queue": list(self._queue),
            "times": {str(i): ts for i, ts in self._times.items()},
            "locked": None if self.locked is None else self.candidates.index(self.locked),
            "recent": list(self._recent),
            "locked_calls": self._locked_calls,
        }

    def step(self, fn: Callable[[Any], Any]) -> Any:
        """Choose, run ``fn(candidate)`` timed by ``clock``, record; return ``fn``'s result."""
        cand = self.choose()
        t0 = self.clock()
        out = fn(cand)
        self.record(cand, self.clock() - t0)
        return out

    # ------------------------------------------------------------------ internals
    def _lock(self) -> None:
        medians = {i: statistics.median(ts) for i, ts in self._times.items() if ts}
        best = min(medians, key=lambda i: (medians[i], i))
        self.locked, self.locked_time = self.candidates[best], medians[best]
        self._locked_calls = 0
        self._recent.clear()
        ranking = sorted(medians, key=lambda i: medians[i])
        runner = f"; runner-up {medians[ranking[1]]:.4g} ms" if len(ranking) > 1 else ""
        self._emit(
            "lock",
            self.locked,
            f"lowest median over {self.trials} trial(s): {medians[best]:.4g} ms{runner}",
            medians_ms=[
                {"candidate": _describe(self.candidates[i]), "median_ms": medians[i]} for i in ranking
            ],
        )
        self.close()  # locked: events are rare from here on

    def _drop(self, candidate: Any, reason: str) -> None:
        idx = next(i for i, c in enumerate(self.candidates) if c is candidate or c == candidate)
        self._emit("reject", candidate, "starvation guard (measured): " + reason)
        if len(self.candidates) == 1:
            raise RuntimeError("the starvation guard rejected the last candidate: " + reason)
        del self.candidates[idx]
        self._start_exploration("re-exploring without a candidate the guard rejected")
