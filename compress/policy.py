"""Network policies: adapt what DeMo sends to the link it runs on, deterministically.

Each step, every rank contributes its measurements of the previous step (wall time and the
time it was blocked waiting on collectives) to the step's status exchange; the optimizer
combines them (slowest step time, least blocked time: a straggler makes the others wait, not
itself) into one :class:`Observation` that is the same on every rank. The policy answers with a :class:`Decision` (scale k, switch payload, go dense,
or skip this sync and keep the update in the error buffers). Because the inputs and the
policy's own state are the same everywhere, every rank takes the same decision on the same
step and the replicas stay bit-identical.

    from cokit.compress import DeMo
    from cokit.compress.policy import BandwidthTargetPolicy
    opt = DeMo(model.parameters(), lr=3e-4, policy=BandwidthTargetPolicy(target=0.2))
    ...
    opt.policy_log     # every change of decision, with the observation behind it

:class:`StaticPolicy` (the default) is today's behaviour: it never changes anything and adds
no bytes to the status exchange.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from typing import Any

__all__ = [
    "BandwidthTargetPolicy",
    "Decision",
    "IntervalPolicy",
    "NetworkPolicy",
    "Observation",
    "StaticPolicy",
]


@dataclasses.dataclass(frozen=True)
class Observation:
    """The previous step as every rank agrees on it: ``step_s`` is the slowest rank's step
    time, ``exposed_s`` the least time any rank was blocked on collectives.

    ``sent_bytes`` and ``dense_bytes`` are this rank's ring volumes (the same on every rank):
    what the step sent, and what a dense all-reduce of the same gradients would have sent.
    ``synced`` is False when that step skipped its sync.
    """

    step: int
    step_s: float
    exposed_s: float
    sent_bytes: int
    dense_bytes: int
    synced: bool = True

    @property
    def exposed_fraction(self) -> float:
        """Share of the step spent blocked on communication (0 when the step took no time)."""
        return self.exposed_s / self.step_s if self.step_s > 0 else 0.0

    @property
    def effective_bandwidth(self) -> float:
        """Bytes sent per second blocked (a lower bound on the link's rate; inf when the
        step was never blocked)."""
        return self.sent_bytes / self.exposed_s if self.exposed_s > 0 else math.inf


@dataclasses.dataclass(frozen=True)
class Decision:
    """What one step sends.

    ``topk_scale`` multiplies every group's ``compression_topk`` (at least 1 coefficient per
    tile); ``payload`` overrides the optimizer's codec (None keeps it); ``dense`` sends every
    buffer with a dense all-reduce; ``skip_sync`` sends nothing: the gradient goes into the
    error buffers (``delta = decay * delta + lr * grad``) and the parameters stay as they are.
    ``sync_scale`` multiplies an infrequent-sync optimizer's interval (SparseLoCo's
    ``sync_every``): the local steps until the next sync.
    """

    topk_scale: float = 1.0
    payload: str | None = None
    dense: bool = False
    skip_sync: bool = False
    sync_scale: int = 1

    def describe(self) -> str:
        """A short label, e.g. ``"k x0.25, sign"``, ``"dense"`` or ``"skip sync"``."""
        if self.skip_sync:
            return "skip sync"
        if self.dense:
            return "dense"
        if self.sync_scale != 1:
            return f"sync every x{self.sync_scale}"
        parts = [f"k x{self.topk_scale:g}"]
        if self.payload is not None:
            parts.append(self.payload)
        return ", ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class NetworkPolicy(abc.ABC):
    """Decides, from agreed measurements only, what each step sends.

    Subclasses must be deterministic functions of the observations they have seen (no clocks,
    no randomness without a fixed seed), set ``observes`` to True when they need measurements,
    and keep their evolving state in ``state_dict()`` so that a checkpoint resumes them.
    ``describe()`` names the policy and its settings: the optimizer compares it across ranks.
    """

    observes: bool = True

    @abc.abstractmethod
    def decide(self, observation: Observation | None) -> Decision:
        """The decision for the coming step; ``observation`` is None on the first step and
        the first step after a restart."""

    @abc.abstractmethod
    def describe(self) -> str:
        """Name and settings, e.g. ``"BandwidthTargetPolicy(target=0.2, ...)"``."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"{self.describe()} keeps no state, got {sorted(state)}")


class StaticPolicy(NetworkPolicy):
    """Always the optimizer's own settings (the behaviour without a policy)."""

    observes = False

    def decide(self, observation: Observation | None) -> Decision:
        return Decision()

    def describe(self) -> str:
        return "StaticPolicy()"


@dataclasses.dataclass(eq=False, repr=False)  # the settings are its fields; state is kept aside
class BandwidthTargetPolicy(NetworkPolicy):
    """Keep exposed communication under ``target`` of the step time, and never pay for a
    change that does not pay back ("no regret").

    The settings form a ladder from most to fewest bytes: dense (if ``allow_dense``, off by
    default), the optimizer's own k, k/2, k/4, ... down to ``min_topk_scale``, then the
    ``sign`` payload at that k (if ``allow_sign``); with ``sign_first`` the ``sign`` payload
    comes at the full k, before any halving (k, k+sign, k/2+sign, ...: fewer bytes at every
    position kept). It starts on the optimizer's own settings. Dense is opt-in because a
    dense DeMo step is not a better version of a compressed one: in the resilience benchmark
    (3 seeds per profile) the dense rung paid on no profile for every seed, and three
    one-step dense probes per 100 Mbit run cost every seed static DeMo's final loss.

    **Down** (fewer bytes): when the exposed fraction of the rung's last 3 steps (their
    median: one stall or retransmission does not move it) is above ``target``, it moves one
    rung down on trial. After ``patience`` steps it compares the new rung's exposed time
    with the old one's (medians again): a bandwidth-bound link cuts it in proportion to the
    bytes; if it fell by less than ``pay_share`` of that bytes-proportional cut (or by less
    than ``target / 4`` of the step), the link is not bandwidth-bound for this payload
    (latency, a stall): it moves back up and does not try that move again for
    ``2 * memory_steps`` steps, doubling at each refusal (up to 1000 steps), unless the
    rung's exposure grows past 1.5x what it was when refused, over target (the link
    changed). So on a latency-bound link it stays on the optimizer's own settings (what
    :class:`StaticPolicy` sends) instead of losing quality for no speed.

    **Up** (more bytes): the rung above is predicted from what it was measured to expose
    when it last ran (a decaying max over its recent steps) if that was within
    ``memory_steps`` steps (longer after failed probes), and it climbs when the predicted
    fraction is below ``headroom * target``. An older measurement is not trusted alone
    (links change); the prediction then comes from *link-bound* steps only (steps that
    exposed at least ``target / 4`` of the step: a payload that rode a burst or the socket
    buffers says nothing about the rate beyond them), as fresh as above, scaled by bytes
    from the largest such payload; with no such step there is no prediction. A climb that
    is not backed by a fresh measurement is a probe, and a probe must be cheap: it is taken
    when predicted to fit (and the rung never failed), or else when its cost if it fails
    (the larger of the prediction and what the rung's last failed probe exposed; one step
    time when there is neither) is at most ``probe_budget`` of the time since that rung's
    last failed probe (since the start when it never failed), doubled at each failure in a
    row. A probe that fails at once costs one step and also doubles how long the rung's
    measurement is trusted (up to 1000 steps); one that holds for 6 steps clears both. So a
    slow link is probed for dense once per ever longer window (a 1.4 s failure at 10 Mbit
    waits 70 s, then 140 s, ...), and a fast one reaches dense after about
    ``1 / probe_budget`` steps.

    With ``deadline_s``, a step after one whose exposed communication exceeded the
    deadline skips its sync (at most ``max_skips`` in a row): its update stays in the error
    buffers and goes out with the next sync. Every decision is a function of the agreed
    observations and the state (``state_dict()``) only.
    """

    target: float = 0.2
    _: dataclasses.KW_ONLY
    min_topk_scale: float = 0.125
    allow_sign: bool = True
    allow_dense: bool = False
    sign_first: bool = False
    headroom: float = 0.7
    patience: int = 2
    deadline_s: float | None = None
    max_skips: int = 1
    memory_steps: int = 20
    pay_share: float = 0.5
    probe_budget: float = 0.02

    def __post_init__(self) -> None:
        """Check the settings (each error names one), store them as plain numbers, then start
        on the optimizer's own settings."""
        target, min_topk_scale, headroom = self.target, self.min_topk_scale, self.headroom
        patience, max_skips, memory_steps = self.patience, self.max_skips, self.memory_steps
        deadline_s, pay_share, probe_budget = self.deadline_s, self.pay_share, self.probe_budget
        if not (_is_number(target) and 0 < target < 1):
            raise ValueError(f"BandwidthTargetPolicy: target must be in (0, 1), got {target!r}")
        if not (_is_number(min_topk_scale) and 0 < min_topk_scale <= 1):
            raise ValueError(
                f"BandwidthTargetPolicy: min_topk_scale must be in (0, 1], got {min_topk_scale!r}"
            )
        if not (_is_number(headroom) and 0 < headroom < 1):
            raise ValueError(f"BandwidthTargetPolicy: headroom must be in (0, 1), got {headroom!r}")
        for name, value in (("patience", patience), ("max_skips", max_skips), ("memory_steps", memory_steps)):
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
                raise ValueError(f"BandwidthTargetPolicy: {name} must be an integer >= 0, got {value!r}")
        if deadline_s is not None and not (_is_number(deadline_s) and deadline_s > 0):
            raise ValueError(
                f"BandwidthTargetPolicy: deadline_s must be a positive number of seconds or None, "
                f"got {deadline_s!r}"
            )
        if not (_is_number(pay_share) and 0 < pay_share <= 1):
            raise ValueError(
                "BandwidthTargetPolicy: pay_share (the share of the bytes-proportional cut in exposed "
                f"time a move down must deliver) must be in (0, 1], got {pay_share!r}"
            )
        if not (_is_number(probe_budget) and 0 < probe_budget < 1):
            raise ValueError(
                "BandwidthTargetPolicy: probe_budget (a failed probe's cost as a share of the time "
                f"since the rung's last failed probe) must be in (0, 1), got {probe_budget!r}"
            )
        for name in ("target", "min_topk_scale", "headroom", "pay_share", "probe_budget"):
            setattr(self, name, float(getattr(self, name)))
        self.allow_sign, self.allow_dense = bool(self.allow_sign), bool(self.allow_dense)
        self.sign_first = bool(self.sign_first) and self.allow_sign
        self.deadline_s = None if deadline_s is None else float(deadline_s)
        self.ladder = self._ladder()
        self.level = 1 if self.allow_dense else 0  # the optimizer's own settings
        self._hold = 0
        self._skips = 0
        self._late = False  # the last synced step overran deadline_s
        self._recent: list[float] = []  # exposed fractions on the current rung since the last move
        self._recent_s: list[float] = []  # exposed seconds, the same steps
        self._seen: dict[int, tuple[int, float, int]] = {}  # rung -> (bytes, exposed_s, step) last measured
        self._bound: dict[int, tuple[int, float, int]] = {}  # rung -> (bytes, exposed_s, step) link-bound
        self._memory: dict[int, int] = {}  # rung -> how long its measurement holds, after failed probes
        self._failed: dict[int, tuple[float, float, int]] = {}  # rung -> (cost_s, at elapsed_s, in a row)
        self._refused: dict[int, tuple[int, int, float]] = {}  # rung -> (until step, backoff, exposed_s)
        self._trial: tuple[int, int, float] | None = None  # move down on trial: (rung left, bytes, exposed_s)
        self._probe: int | None = None  # the rung just climbed to, until it proves itself
        self._since_move = 0
        self._elapsed = 0.0  # seconds: the sum of the observed step times

    def _ladder(self) -> list[Decision]:
        rungs = [Decision(dense=True)] if self.allow_dense else []
        scale = 1.0
        if self.sign_first:
            rungs.append(Decision())
        while scale >= self.min_topk_scale:
            rungs.append(Decision(topk_scale=scale, payload="sign" if self.sign_first else None))
            scale /= 2
        if self.allow_sign and not self.sign_first:
            rungs.append(Decision(topk_scale=rungs[-1].topk_scale, payload="sign"))
        return rungs

    def describe(self) -> str:
        return (
            f"BandwidthTargetPolicy(target={self.target:g}, min_topk_scale={self.min_topk_scale:g}, "
            f"allow_sign={self.allow_sign}, allow_dense={self.allow_dense}, "
            f"{'sign_first=True, ' if self.sign_first else ''}headroom={self.headroom:g}, "
            f"patience={self.patience}, deadline_s={self.deadline_s}, max_skips={self.max_skips}, "
            f"memory_steps={self.memory_steps}, pay_share={self.pay_share:g}, "
            f"probe_budget={self.probe_budget:g})"
        )

    def decide(self, observation: Observation | None) -> Decision:
        if observation is None:
            return self.ladder[self.level]
        if math.isfinite(observation.step_s) and observation.step_s > 0:
            self._elapsed += observation.step_s
        if observation.synced:  # a skipped step measures nothing about the link
            self._skips = 0
            self._remember(observation)
            self._late = self.deadline_s is not None and observation.exposed_s > self.deadline_s
            self._adapt(observation)
        if self._late and self._skips < self.max_skips:
            self._skips += 1
            return Decision(skip_sync=True)
        return self.ladder[self.level]

    def _adapt(self, obs: Observation) -> None:
        """Judge a move down on trial once its rung is measured; else move one rung down when
        over target (on average over the rung's last few steps: one retransmission must not
        move it) and the move is not refused, or one up when the rung above fits or is cheap
        enough to probe."""
        self._recent = [*self._recent, obs.exposed_fraction][-_WINDOW:]
        self._recent_s = [*self._recent_s, obs.exposed_s][-_WINDOW:]
        self._since_move += 1
        if self._probe is not None and self._since_move > 2 * _WINDOW:  # the climb held
            self._memory.pop(self._probe, None)
            self._failed.pop(self._probe, None)
            self._probe = None
        if self._hold > 0:
            self._hold -= 1
            return
        if self._trial is not None:
            left, before_bytes, before_s = self._trial
            self._trial = None
            if not self._paid(before_bytes, before_s, obs):
                self._refuse(left, obs.step, before_s)
                return
            self._refused.pop(left, None)  # it paid: that move is welcome again at once
        over = _median(self._recent) > self.target
        if over and self.level < len(self.ladder) - 1 and self._may_move_down(obs):
            self._move(+1)
        elif self.level > 0 and self._may_climb(obs):
            self._move(-1)

    def _paid(self, before_bytes: int, before_s: float, obs: Observation) -> bool:
        """Did the move down cut the exposed time by ``pay_share`` of what a bandwidth-bound
        link would (the same share as the bytes), and by at least ``target / 4`` of a step
        (microseconds saved after a stall do not count)?"""
        if before_bytes <= 0 or obs.sent_bytes >= before_bytes:
            return False
        expected = before_s * (1 - obs.sent_bytes / before_bytes)
        cut = before_s - _median(self._recent_s)
        return expected > 0 and cut >= self.pay_share * expected and cut >= _BOUND * self.target * obs.step_s

    def _refuse(self, left: int, step: int, exposed_s: float) -> None:
        """Back up to ``left`` and refuse the move down from it for an ever longer while."""
        prev = self._refused.get(left)
        backoff = min(2 * prev[1], _MAX_MEMORY) if prev is not None else max(2 * self.memory_steps, _WINDOW)
        self._refused[left] = (step + backoff, backoff, exposed_s)
        self._probe = None
        self.level = left
        self._hold = 0
        self._recent, self._recent_s = [], []
        self._since_move = 0

    def _may_move_down(self, obs: Observation) -> bool:
        refused = self._refused.get(self.level)
        if refused is None or obs.step >= refused[0]:
            return True
        # the link got slower since the refusal: what did not pay then may pay now
        return _median(self._recent) > self.target and _median(self._recent_s) > _CHANGED * refused[2]

    def _may_climb(self, obs: Observation) -> bool:
        """A fresh measurement of the rung above decides alone; else a probe, taken when
        predicted to fit from link-bound steps (and the rung never failed), or when its cost
        if it fails fits ``probe_budget`` of the time since the rung last failed."""
        up = self.level - 1
        seen = self._seen.get(up)
        if seen is not None and obs.step - seen[2] <= self._memory.get(up, self.memory_steps):
            return self._fraction(obs, seen[1]) < self.headroom * self.target
        predicted = self._predicted_exposure(obs)
        failed = self._failed.get(up)
        if (
            failed is None
            and predicted is not None
            and self._fraction(obs, predicted) < self.headroom * self.target
        ):
            return True
        if failed is not None:
            cost = max(failed[0], predicted or 0.0) * 2 ** min(failed[2] - 1, 30)
            since = self._elapsed - failed[1]
        else:
            cost = predicted if predicted is not None else obs.step_s  # never measured: one step
            since = self._elapsed
        return cost <= self.probe_budget * since

    def _predicted_exposure(self, obs: Observation) -> float | None:
        """Exposed seconds expected one rung up, from link-bound steps only: the largest such
        payload's exposure, scaled by bytes. None when no step loaded the link."""
        fresh = [
            r for k, r in self._bound.items() if obs.step - r[2] <= self._memory.get(k, self.memory_steps)
        ]
        if not fresh:
            return None
        up = self.level - 1
        seen = self._seen.get(up)
        if seen is not None:
            more = seen[0]
        elif self.ladder[up].dense:
            more = obs.dense_bytes
        else:
            more = 2 * obs.sent_bytes
        sent, exposed, _ = max(fresh, key=lambda r: (r[0], r[2]))
        return exposed * more / sent if sent > 0 else None

    def _fraction(self, obs: Observation, exposed: float) -> float:
        return exposed / max(obs.step_s - obs.exposed_s + exposed, 1e-12)

    def _remember(self, obs: Observation) -> None:
        """Record the current rung's bytes and exposure. The exposure kept is a decaying max
        (``max(new, 0.8 * previous)`` while the previous one is fresh): one lucky step on a
        lossy link must not make a rung look safe to climb back to. A step that exposed at
        least ``target / 4`` of its time loaded the link: it is kept apart (the same way) as
        evidence of the link's rate; the rung's record of it is dropped once it is
        ``memory_steps`` old and the rung no longer loads the link."""
        fresh = self.memory_steps
        exposed = obs.exposed_s
        prev = self._seen.get(self.level)
        if prev is not None and obs.step - prev[2] <= fresh:
            exposed = max(exposed, _DECAY * prev[1])
        self._seen[self.level] = (obs.sent_bytes, exposed, obs.step)
        bound = self._bound.get(self.level)
        if obs.exposed_fraction >= _BOUND * self.target and obs.sent_bytes > 0:
            exposed = obs.exposed_s
            if bound is not None and obs.step - bound[2] <= fresh:
                exposed = max(exposed, _DECAY * bound[1])
            self._bound[self.level] = (obs.sent_bytes, exposed, obs.step)
        elif bound is not None and obs.step - bound[2] > fresh:
            del self._bound[self.level]

    def _move(self, by: int) -> None:
        """Down (``by=+1``): on trial, held ``patience`` steps so that the rung is measured
        (unless it returns from a probe that failed at once: then the rung's measurement is
        trusted twice as long and its failure recorded, so a link that cannot carry it is
        probed ever more rarely). Up: a probe, measured from the next step on, so a failed
        probe costs one step."""
        if by > 0:
            if self._probe == self.level:
                self._memory[self.level] = min(
                    2 * self._memory.get(self.level, self.memory_steps), _MAX_MEMORY
                )
                failed = self._failed.get(self.level)
                cost = sum(self._recent_s) / len(self._recent_s) if self._recent_s else 0.0
                self._failed[self.level] = (cost, self._elapsed, 1 if failed is None else failed[2] + 1)
                self._trial = None
            else:
                seen = self._seen.get(self.level)
                before = _median(self._recent_s) if self._recent_s else 0.0
                self._trial = (self.level, seen[0] if seen is not None else 0, before)
        else:
            self._trial = None
        self._probe = self.level + by if by < 0 else None
        self.level += by
        self._hold = self.patience if by > 0 else 0
        self._recent, self._recent_s = [], []
        self._since_move = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "level": self.level,
            "hold": self._hold,
            "skips": self._skips,
            "late": self._late,
            "seen": {k: list(v) for k, v in self._seen.items()},
            "recent": list(self._recent),
            "memory": dict(self._memory),
            "probe": self._probe,
            "since_move": self._since_move,
            "recent_s": list(self._recent_s),
            "bound": {k: list(v) for k, v in self._bound.items()},
            "failed": {k: list(v) for k, v in self._failed.items()},
            "refused": {k: list(v) for k, v in self._refused.items()},
            "trial": None if self._trial is None else list(self._trial),
            "elapsed": self._elapsed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume; a state saved before ``recent_s``, ``bound``, ``failed``, ``refused``,
        ``trial`` and ``elapsed`` existed loads with them empty (zero)."""
        level = state.get("level")
        if not (isinstance(level, int) and 0 <= level < len(self.ladder)):
            raise ValueError(
                f"{self.describe()}: saved level {level!r} is outside its ladder of {len(self.ladder)} "
                "rungs; the checkpoint was saved with other policy settings"
            )
        self.level = level
        self._hold = int(state.get("hold", 0))
        self._skips = int(state.get("skips", 0))
        self._late = bool(state.get("late", False))
        self._seen = {int(k): (int(b), float(e), int(s)) for k, (b, e, s) in state.get("seen", {}).items()}
        self._recent = [float(f) for f in state.get("recent", [])]
        self._memory = {int(k): int(v) for k, v in state.get("memory", {}).items()}
        probe = state.get("probe")
        self._probe = None if probe is None else int(probe)
        self._since_move = int(state.get("since_move", 0))
        self._recent_s = [float(f) for f in state.get("recent_s", [])]
        self._bound = {int(k): (int(b), float(e), int(s)) for k, (b, e, s) in state.get("bound", {}).items()}
        self._failed = {
            int(k): (float(c), float(t), int(n)) for k, (c, t, n) in state.get("failed", {}).items()
        }
        self._refused = {
            int(k): (int(u), int(b), float(e)) for k, (u, b, e) in state.get("refused", {}).items()
        }
        trial = state.get("trial")
        self._trial = None if trial is None else (int(trial[0]), int(trial[1]), float(trial[2]))
        self._elapsed = float(state.get("elapsed", 0.0))


class IntervalPolicy(NetworkPolicy):
    """For infrequent-sync optimizers (:class:`~cokit.compress.SparseLoCo`): keep the time
    blocked on a sync under ``target`` of the interval it closes, by widening the interval.

    Each observation is one whole interval (its local steps and the sync that ends it): the
    slowest rank's wall time and the least time any rank was blocked. Above ``target`` the
    interval doubles (``sync_scale`` 1, 2, 4, ... up to ``max_scale``): one sync's blocked
    time over more compute, which pays on any link (latency- or bandwidth-bound). When the
    fraction predicted at half the interval (the same blocked time over half the compute)
    is below ``headroom * target`` it halves again, so a link that got faster gets the
    optimizer's own ``sync_every`` back. That prediction fails where a wide interval lets a
    shaped link's burst refill (a sync that looks free only because it is rare): a halving
    that is widened back at the next sync is a failed probe, and halving to that scale again
    waits until its cost (the blocked time of the interval that failed), doubled at each
    failure in a row, is at most ``probe_budget`` of the time since it failed; a halving that
    holds for 2 syncs clears the record. The decision for the next interval is taken at a
    sync, from the interval before it (the one whose times every rank has exchanged).
    """

    def __init__(
        self, target: float = 0.2, *, max_scale: int = 8, headroom: float = 0.7, probe_budget: float = 0.02
    ):
        if not (_is_number(target) and 0 < target < 1):
            raise ValueError(f"IntervalPolicy: target must be in (0, 1), got {target!r}")
        if not (isinstance(max_scale, int) and not isinstance(max_scale, bool) and max_scale >= 1):
            raise ValueError(f"IntervalPolicy: max_scale must be an integer >= 1, got {max_scale!r}")
        if max_scale & (max_scale - 1):
            raise ValueError(f"IntervalPolicy: max_scale must be a power of 2, got {max_scale}")
        if not (_is_number(headroom) and 0 < headroom < 1):
            raise ValueError(f"IntervalPolicy: headroom must be in (0, 1), got {headroom!r}")
        if not (_is_number(probe_budget) and 0 < probe_budget < 1):
            raise ValueError(
                "IntervalPolicy: probe_budget (a failed halving's cost as a share of the time since "
                f"it last failed) must be in (0, 1), got {probe_budget!r}"
            )
        self.target, self.max_scale, self.headroom = float(target), max_scale, float(headroom)
        self.probe_budget = float(probe_budget)
        self.scale = 1
        self._probe: int | None = None  # the scale just halved to, until it holds
        self._held = 0  # syncs the probe has held
        self._failed: dict[int, tuple[float, float, int]] = {}  # scale -> (cost_s, at elapsed_s, in a row)
        self._elapsed = 0.0  # seconds: the sum of the observed intervals

    def describe(self) -> str:
        return (
            f"IntervalPolicy(target={self.target:g}, max_scale={self.max_scale}, headroom={self.headroom:g}, "
            f"probe_budget={self.probe_budget:g})"
        )

    def decide(self, observation: Observation | None) -> Decision:
        if observation is not None and observation.synced and observation.step_s > 0:
            if math.isfinite(observation.step_s):
                self._elapsed += observation.step_s
            blocked = observation.exposed_s
            compute = max(observation.step_s - blocked, 0.0)
            if observation.exposed_fraction > self.target and self.scale < self.max_scale:
                if self._probe == self.scale:  # the halving failed at once
                    failed = self._failed.get(self.scale)
                    self._failed[self.scale] = (
                        blocked,
                        self._elapsed,
                        1 if failed is None else failed[2] + 1,
                    )
                self._probe = None
                self.scale *= 2
            elif (
                self.scale > 1
                and blocked / max(compute / 2 + blocked, 1e-12) < self.headroom * self.target
                and self._may_narrow()
            ):
                self.scale //= 2
                self._probe, self._held = self.scale, 0
            elif self._probe is not None:
                self._held += 1
                if self._held >= 2:  # the halving held
                    self._failed.pop(self._probe, None)
                    self._probe = None
        return Decision(sync_scale=self.scale)

    def _may_narrow(self) -> bool:
        failed = self._failed.get(self.scale // 2)
        if failed is None:
            return True
        cost, at, in_a_row = failed
        return cost * 2 ** min(in_a_row - 1, 30) <= self.probe_budget * (self._elapsed - at)

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "probe": self._probe,
            "held": self._held,
            "failed": {k: list(v) for k, v in self._failed.items()},
            "elapsed": self._elapsed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume; a state saved with only ``scale`` loads with no probe and no failures."""
        scale = state.get("scale")
        if not (isinstance(scale, int) and 1 <= scale <= self.max_scale):
            raise ValueError(
                f"{self.describe()}: saved sync scale {scale!r} is outside 1..{self.max_scale}; the "
                "checkpoint was saved with other policy settings"
            )
        self.scale = scale
        probe = state.get("probe")
        self._probe = None if probe is None else int(probe)
        self._held = int(state.get("held", 0))
        self._failed = {
            int(k): (float(c), float(t), int(n)) for k, (c, t, n) in state.get("failed", {}).items()
        }
        self._elapsed = float(state.get("elapsed", 0.0))


_DECAY = 0.8  # per observation, of a rung's remembered worst exposure
_WINDOW = 3  # steps averaged before moving down
_MAX_MEMORY = 1000  # steps: the longest a failed probe's measurement is trusted (or a move down refused)
_BOUND = 0.25  # of target: a step that exposed at least this share of its time loaded the link
_CHANGED = 1.5  # a refused move down is tried again early once the exposure grows this much


def _median(values: list[float]) -> float:
    """The median (a single stall among a rung's last few steps does not move it)."""
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
