"""The optimizer's side of a network policy: measure, agree, decide, log.

:class:`PolicyDriver` times each step (wall time between the ends of consecutive steps, and
the time spent blocked waiting on collectives), packs the previous step's two numbers into
the status exchange as raw float64 bytes and hands the policy an
:class:`~cokit.compress.policy.Observation` of what comes back: the step time is the max over
ranks, the blocked time the min, because a straggler's lateness shows up as waiting on every
other rank but not on the straggler: only waiting that every rank sees is the link's. Every rank sees
the same bytes, so every rank builds the same observation and takes the same decision.
Changes of decision are kept in ``log`` and sent to the ``cokit.compress.policy`` logger.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from cokit.compress.agreement import ROW_BYTES
from cokit.compress.policy import (
    BandwidthTargetPolicy,
    Decision,
    IntervalPolicy,
    NetworkPolicy,
    Observation,
    StaticPolicy,
)

__all__ = [
    "MEASUREMENT_BYTES",
    "POLICIES",
    "POLICIES_FOR",
    "STATUS_ROW_BYTES",
    "PolicyDriver",
    "make_policy",
]

logger = logging.getLogger("cokit.compress.policy")

POLICIES: dict[str, type[NetworkPolicy]] = {
    "static": StaticPolicy,
    "bandwidth": BandwidthTargetPolicy,
    "interval": IntervalPolicy,
}
#: the policies each optimizer can follow: DeMo changes what a step sends, SparseLoCo when it syncs.
POLICIES_FOR: dict[str, tuple[str, ...]] = {
    "DeMo": ("static", "bandwidth"),
    "SparseLoCo": ("static", "interval"),
}
MEASUREMENT_BYTES = 16  # two float64: step_s, exposed_s (in every status row: rows have one size)
#: a rank's status row on DeMo's and SparseLoCo's exchange group (an agreement group's: ROW_BYTES)
STATUS_ROW_BYTES = ROW_BYTES + MEASUREMENT_BYTES


def make_policy(spec: NetworkPolicy | str | dict[str, Any] | None, owner: str = "DeMo") -> NetworkPolicy:
    """A policy from an instance, a name (``"static"``, ``"bandwidth"``, ``"interval"``) or a
    JSON-ready dict ``{"name": "bandwidth", "target": 0.2, ...}`` whose other keys are the
    policy's arguments. ``owner`` (``"DeMo"`` or ``"SparseLoCo"``) limits it to the policies
    that optimizer can follow (:data:`POLICIES_FOR`); other NetworkPolicy subclasses pass."""
    names = POLICIES_FOR.get(owner, tuple(POLICIES))
    if spec is None:
        return StaticPolicy()
    if isinstance(spec, NetworkPolicy):
        for name, cls in POLICIES.items():
            if name not in names and isinstance(spec, cls):
                raise ValueError(
                    f"{owner}: {spec.describe()} is not a policy {owner} can follow; use one of "
                    f"{', '.join(repr(n) for n in names)}"
                )
        return spec
    if isinstance(spec, str):
        spec = {"name": spec}
    if not isinstance(spec, dict) or spec.get("name") not in names:
        raise ValueError(
            f"{owner}: policy must be a NetworkPolicy, one of {list(names)} or a dict "
            f"{{'name': ..., **arguments}}, got {spec!r}"
        )
    kwargs = {k: v for k, v in spec.items() if k != "name"}
    try:
        return POLICIES[spec["name"]](**kwargs)
    except TypeError as exc:
        raise ValueError(f"{owner}: bad arguments for policy {spec['name']!r}: {exc}") from exc


class PolicyDriver:
    """Feeds one optimizer's policy with agreed measurements and records its decisions.

    ``clock``: seconds for the step times (``time.perf_counter``; tests inject a fake clock)."""

    def __init__(self, policy: NetworkPolicy, clock: Callable[[], float] = time.perf_counter) -> None:
        self.policy = policy
        self.clock = clock
        self.log: list[dict[str, Any]] = []
        self.decision: Decision | None = None  # the last decision (None: none since start/resume)
        self._blocked_s = 0.0  # blocked in collectives during the current step
        self._last_end: float | None = None  # perf_counter at the end of the previous step
        self._measured: tuple[float, float] | None = None  # (step_s, exposed_s) of the last full step
        self._last: tuple[int, int, bool] | None = None  # (sent, dense, synced) of the last step

    @property
    def syncing(self) -> bool:
        """False when the current step's decision skips the sync."""
        return self.decision is None or not self.decision.skip_sync

    def blocked(self, seconds: float) -> None:
        """Count time spent waiting on a collective in the current step."""
        self._blocked_s += seconds

    def measurement(self, device: torch.device) -> torch.Tensor:
        """This rank's last full step as :data:`MEASUREMENT_BYTES` raw bytes (NaN before there is
        one, and whenever the policy does not observe: every status row has one size whatever
        the policy, so that ranks with different policies are told so instead of pairing
        collectives of different sizes)."""
        measured = self._measured if self.policy.observes else None
        values = measured if measured is not None else (float("nan"), float("nan"))
        return torch.tensor(values, dtype=torch.float64).view(torch.uint8).to(device)

    def decide(self, rows: torch.Tensor | None, step: int) -> Decision:
        """The decision for step ``step`` from every rank's measurement bytes ``(world, 16)``
        (None when the policy does not observe)."""
        observation = None
        if rows is not None and self._last is not None:
            values = rows.cpu().reshape(-1).clone().view(torch.float64).view(-1, 2)  # (world, 2)
            if not torch.isnan(values).any():
                step_s, exposed_s = float(values[:, 0].max()), float(values[:, 1].min())
                sent, dense, synced = self._last
                observation = Observation(step - 1, step_s, exposed_s, sent, dense, synced)
        decision = self.policy.decide(observation)
        if decision != self.decision:
            entry = {
                "step": step,
                "decision": decision.describe(),
                **decision.as_dict(),
                "observation": None if observation is None else _observation_dict(observation),
            }
            self.log.append(entry)
            logger.info("%s step %d: %s (%s)", self.policy.describe(), step, decision.describe(), entry)
        self.decision = decision
        return decision

    def sync_scale(self, rows: torch.Tensor | None, sync: int, owner: str) -> int:
        """:meth:`decide` for a front end that follows only the sync interval (SparseLoCo's):
        the decision's ``sync_scale``; any other decision raises."""
        decision = self.decide(rows, sync)
        if decision.dense or decision.skip_sync or decision.topk_scale != 1 or decision.payload is not None:
            raise ValueError(
                f"{owner}: policy {self.policy.describe()} decided {decision.describe()!r}; "
                f"{owner} follows only sync_scale decisions (IntervalPolicy)"
            )
        return decision.sync_scale

    def step_done(self, sent: int, dense: int, synced: bool) -> None:
        """Close a step: remember its bytes and, once a previous step end is known, its times."""
        now = self.clock()
        if self._last_end is not None:
            self._measured = (now - self._last_end, self._blocked_s)
        self._last_end = now
        self._blocked_s = 0.0
        self._last = (sent, dense, synced)

    def snapshot(self) -> Callable[[], None]:
        """Copy this driver's state, measurements and the policy's state included; the function
        returned puts it back as it was (undoing a step, unlike :meth:`load_state_dict`, which
        starts the measurements again)."""
        saved = {**vars(self), "log": list(self.log)}
        policy = copy.deepcopy(self.policy.state_dict())

        def undo() -> None:
            vars(self).update(saved, log=list(saved["log"]))
            self.policy.load_state_dict(copy.deepcopy(policy))

        return undo

    def state_dict(self) -> dict[str, Any]:
        return {"policy": self.policy.describe(), "state": self.policy.state_dict(), "log": list(self.log)}

    def load_state_dict(self, state: dict[str, Any], owner: str = "DeMo") -> None:
        """Resume the policy; measurements start again (the first step after has none)."""
        if state.get("policy") != self.policy.describe():
            raise ValueError(
                f"{owner}.load_state_dict: the checkpoint was saved with policy {state.get('policy')}, "
                f"this optimizer has {self.policy.describe()}; build it with the same policy"
            )
        self.policy.load_state_dict(state.get("state", {}))
        self.log = list(state.get("log", []))
        self.decision = None
        self._last_end = self._measured = self._last = None
        self._blocked_s = 0.0


def _observation_dict(obs: Observation) -> dict[str, Any]:
    return {
        **dataclasses.asdict(obs),
        "exposed_fraction": obs.exposed_fraction,
        "effective_bandwidth": obs.effective_bandwidth,
    }
