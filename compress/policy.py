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


class BandwidthTargetPolicy(NetworkPolicy):
    """Keep exposed communication under ``target`` of the step time.

    The settings form a ladder from most to fewest bytes: dense (if ``allow_dense``), the
    optimizer's own k, k/2, k/4, ... down to ``min_topk_scale``, then the ``sign`` payload at
    that k (if ``allow_sign``); with ``sign_first`` the ``sign`` payload comes at the full k,
    before any halving (k, k+sign, k/2+sign, ...: fewer bytes at every position kept). It starts on the optimizer's own settings. When the exposed
    fraction, averaged over the rung's last 3 steps, is above ``target`` it moves one rung down; when the fraction predicted
    for the rung above is below ``headroom * target``, it moves one rung up. The prediction
    is what that rung was measured to expose when it last ran (a decaying max over its recent
    steps), if that was within ``memory_steps`` steps (links are not bytes-linear: drops,
    windows), else the current
    exposure scaled by the bytes ratio (the rung's last bytes, or twice the bytes), so that
    a link that got faster is tried again. After a move down it holds for ``patience`` steps
    so that the rung is measured. A climb that fails at once (a probe) costs one step and
    doubles how long that rung's measurement is trusted (up to 1000 steps); a climb that holds
    for 6 steps resets it. With ``deadline_s``, a step after one
    whose exposed communication exceeded the deadline skips its sync (at most ``max_skips``
    in a row): its update stays in the error buffers and goes out with the next sync.
    """

    def __init__(
        self,
        target: float = 0.2,
        *,
        min_topk_scale: float = 0.125,
        allow_sign: bool = True,
        allow_dense: bool = True,
        sign_first: bool = False,
        headroom: float = 0.7,
        patience: int = 2,
        deadline_s: float | None = None,
        max_skips: int = 1,
        memory_steps: int = 20,
    ):
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
        self.target = float(target)
        self.min_topk_scale = float(min_topk_scale)
        self.allow_sign = bool(allow_sign)
        self.allow_dense = bool(allow_dense)
        self.sign_first = bool(sign_first) and self.allow_sign
        self.headroom = float(headroom)
        self.patience = patience
        self.deadline_s = None if deadline_s is None else float(deadline_s)
        self.max_skips = max_skips
        self.memory_steps = memory_steps
        self.ladder = self._ladder()
        self.level = 1 if self.allow_dense else 0  # the optimizer's own settings
        self._hold = 0
        self._skips = 0
        self._late = False  # the last synced step overran deadline_s
        self._recent: list[float] = []  # exposed fractions on the current rung since the last move
        self._seen: dict[int, tuple[int, float, int]] = {}  # rung -> (bytes, exposed_s, step) last measured
        self._memory: dict[int, int] = {}  # rung -> how long its measurement holds, after failed probes
        self._probe: int | None = None  # the rung just climbed to, until it proves itself
        self._since_move = 0

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
            f"memory_steps={self.memory_steps})"
        )

    def decide(self, observation: Observation | None) -> Decision:
        if observation is None:
            return self.ladder[self.level]
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
        """Move one rung down when over target (on average over the rung's last few steps: one
        retransmission must not move it), one up when the rung above fits."""
        self._recent = [*self._recent, obs.exposed_fraction][-_WINDOW:]
        self._since_move += 1
        if self._probe is not None and self._since_move > 2 * _WINDOW:  # the climb held
            self._memory.pop(self._probe, None)
            self._probe = None
        if self._hold > 0:
            self._hold -= 1
        elif sum(self._recent) / len(self._recent) > self.target and self.level < len(self.ladder) - 1:
            self._move(+1)
        elif self.level > 0 and self._predicted_fraction(obs) < self.headroom * self.target:
            self._move(-1)

    def _remember(self, obs: Observation) -> None:
        """Record the current rung's bytes and exposure. The exposure kept is a decaying max
        (``max(new, 0.8 * previous)`` while the previous one is fresh): one lucky step on a
        lossy link must not make a rung look safe to climb back to."""
        exposed = obs.exposed_s
        prev = self._seen.get(self.level)
        if prev is not None and obs.step - prev[2] <= self.memory_steps:
            exposed = max(exposed, _DECAY * prev[1])
        self._seen[self.level] = (obs.sent_bytes, exposed, obs.step)

    def _predicted_fraction(self, obs: Observation) -> float:
        """Exposed fraction expected one rung up: as measured there recently, else bytes-scaled."""
        up = self.level - 1
        seen = self._seen.get(up)
        if seen is not None and obs.step - seen[2] <= self._memory.get(up, self.memory_steps):
            exposed = seen[1]
        else:
            if obs.sent_bytes <= 0:
                return math.inf
            if self.ladder[up].dense:
                more = obs.dense_bytes
            else:
                more = seen[0] if seen is not None else 2 * obs.sent_bytes
            exposed = obs.exposed_s * more / obs.sent_bytes
        return exposed / max(obs.step_s - obs.exposed_s + exposed, 1e-12)

    def _move(self, by: int) -> None:
        """Down (``by=+1``): hold ``patience`` steps to measure the new rung; if the rung left
        was a probe that failed at once, trust its measurement twice as long next time
        (exponential backoff, so a link that cannot carry it is probed ever more rarely).
        Up: measured from the next step on, so a failed probe costs one step."""
        if by > 0 and self._probe == self.level:
            self._memory[self.level] = min(2 * self._memory.get(self.level, self.memory_steps), _MAX_MEMORY)
        self._probe = self.level + by if by < 0 else None
        self.level += by
        self._hold = self.patience if by > 0 else 0
        self._recent = []
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
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
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


class IntervalPolicy(NetworkPolicy):
    """For infrequent-sync optimizers (:class:`~cokit.compress.SparseLoCo`): keep the time
    blocked on a sync under ``target`` of the interval it closes, by widening the interval.

    Each observation is one whole interval (its local steps and the sync that ends it): the
    slowest rank's wall time and the least time any rank was blocked. Above ``target`` the
    interval doubles (``sync_scale`` 1, 2, 4, ... up to ``max_scale``); when the fraction
    predicted at half the interval (the same blocked time over half the compute) is below
    ``headroom * target`` it halves again, so a link that got faster gets the optimizer's
    own ``sync_every`` back. The decision for the next interval is taken at a sync, from the
    interval before it (the one whose times every rank has exchanged).
    """

    def __init__(self, target: float = 0.2, *, max_scale: int = 8, headroom: float = 0.7):
        if not (_is_number(target) and 0 < target < 1):
            raise ValueError(f"IntervalPolicy: target must be in (0, 1), got {target!r}")
        if not (isinstance(max_scale, int) and not isinstance(max_scale, bool) and max_scale >= 1):
            raise ValueError(f"IntervalPolicy: max_scale must be an integer >= 1, got {max_scale!r}")
        if max_scale & (max_scale - 1):
            raise ValueError(f"IntervalPolicy: max_scale must be a power of 2, got {max_scale}")
        if not (_is_number(headroom) and 0 < headroom < 1):
            raise ValueError(f"IntervalPolicy: headroom must be in (0, 1), got {headroom!r}")
        self.target, self.max_scale, self.headroom = float(target), max_scale, float(headroom)
        self.scale = 1

    def describe(self) -> str:
        return (
            f"IntervalPolicy(target={self.target:g}, max_scale={self.max_scale}, headroom={self.headroom:g})"
        )

    def decide(self, observation: Observation | None) -> Decision:
        if observation is not None and observation.synced and observation.step_s > 0:
            blocked = observation.exposed_s
            compute = max(observation.step_s - blocked, 0.0)
            if observation.exposed_fraction > self.target and self.scale < self.max_scale:
                self.scale *= 2
            elif self.scale > 1 and blocked / max(compute / 2 + blocked, 1e-12) < self.headroom * self.target:
                self.scale //= 2
        return Decision(sync_scale=self.scale)

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        scale = state.get("scale")
        if not (isinstance(scale, int) and 1 <= scale <= self.max_scale):
            raise ValueError(
                f"{self.describe()}: saved sync scale {scale!r} is outside 1..{self.max_scale}; the "
                "checkpoint was saved with other policy settings"
            )
        self.scale = scale


_DECAY = 0.8  # per observation, of a rung's remembered worst exposure
_WINDOW = 3  # steps averaged before moving down
_MAX_MEMORY = 1000  # steps: the longest a failed probe's measurement is trusted


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
