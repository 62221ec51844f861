"""cokit's compressed exchange on torchft: survivors keep training when a replica dies, a
restarted one heals and rejoins.

:class:`FaultTolerant` runs a :class:`~cokit.compress.sparseloco.SparseLoCo` or a
:class:`~cokit.compress.optimizer.DeMo` inside a torchft ``Manager`` (one process per replica
group, ``use_async_quorum=False``). A round is a SparseLoCo sync or a DeMo step; SparseLoCo's
local steps need nobody. Every round runs in the quorum of the moment, on torchft's
reconfigurable gloo group (:mod:`cokit.compress.ft_group`), through cokit's exchange core: the
status row (settings fingerprint, non-finite report), the timeouts and the validation of peers'
bytes hold as without torchft. What differs between the front ends is in an adapter
(:mod:`cokit.compress.ft_replica`, :mod:`cokit.compress.ft_demo`). Membership is handled on
purpose (docs/ft.md):

- the quorum is taken before the forward pass of a round's step (:meth:`FaultTolerant.zero_grad`),
  so a joining replica is healed before it computes a gradient;
- a replica that dies takes its contribution to the round in flight with it: the survivors'
  round fails (a collective error or the timeout), torchft does not commit it, and every
  survivor undoes it from a snapshot taken before it: SparseLoCo goes back to its state before
  the round and runs the sync again at its next step; DeMo keeps the step's gradient in its
  error buffers (as a skipped sync), no parameter or counter moves;
- survivors keep their error buffers and outer state; when the quorum changes, every member
  compares its replicas again at the next round;
- a (re)joining replica is healed from a live peer through torchft's checkpoint transport:
  shared state, weights, error buffers zero (:mod:`cokit.compress.ft_heal`,
  :mod:`cokit.compress.ft_demo`); after the next round every replica is bit-identical. A joiner
  whose settings or model differ gets :class:`JoinRefused`, aborts its group (the peers' round
  fails at once instead of at the timeout) and stays out; the others go on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cokit.compress.agreement import PeerDataError
from cokit.compress.comm import CollectiveTimeout, Communicator
from cokit.compress.ft_demo import DeMoReplica
from cokit.compress.ft_group import Quorum, QuorumGloo
from cokit.compress.ft_replica import Replica, SparseLoCoReplica
from cokit.compress.optimizer import DeMo
from cokit.compress.sparseloco import SparseLoCo

__all__ = ["FaultTolerant", "JoinRefused"]

WHERE = "FaultTolerant"


class JoinRefused(ValueError):
    """This replica cannot join: the live replicas' state does not load here (other settings or
    another model). Raised on the joiner only; the others go on without it."""


class FaultTolerant:
    """A SparseLoCo or DeMo whose rounds run in torchft's quorum (module docstring).

    Args:
        manager: a ``torchft.Manager`` built with ``pg=group`` and ``use_async_quorum=False``.
        optimizer: the SparseLoCo (``process_group=None``, no ``dense_warmup``) or DeMo
            (``process_group=None``, plain data parallel: no ``overlap_backward``, ``hierarchy``
            or DTensor parameters).
        group: the :class:`~cokit.compress.ft_group.QuorumGloo` the manager reconfigures.
        key: the name of this state among the manager's state dict callbacks.

    Use it as the optimizer: ``zero_grad()`` before the forward pass (a round's quorum is
    taken there), ``step()`` after the backward pass. ``rounds``: rounds committed;
    ``dropped_rounds``: rounds undone because a member failed; ``heals``: times this replica was
    healed; ``last_error``: the error of the last dropped round.
    """

    def __init__(self, manager: Any, optimizer: SparseLoCo | DeMo, group: QuorumGloo, *, key: str = "cokit"):
        if not isinstance(optimizer, SparseLoCo | DeMo):
            raise TypeError(
                f"{WHERE}: optimizer must be a cokit SparseLoCo or DeMo, got {type(optimizer).__name__}"
            )
        if not isinstance(group, QuorumGloo):
            raise TypeError(
                f"{WHERE}: group must be the cokit.compress.ft_group.QuorumGloo given to the Manager as pg=, "
                f"got {type(group).__name__}"
            )
        if getattr(manager, "_pg", group) is not group:
            raise ValueError(f"{WHERE}: the Manager reconfigures another group; build it with pg=group")
        if getattr(manager, "_use_async_quorum", False):
            raise ValueError(
                f"{WHERE}: build the Manager with use_async_quorum=False: a sync's quorum, and a "
                "joiner's healing, must be complete before its step"
            )
        self.replica: Replica = (
            SparseLoCoReplica(optimizer) if isinstance(optimizer, SparseLoCo) else DeMoReplica(optimizer)
        )
        self.manager, self.optimizer, self.group = manager, optimizer, group
        self.rounds = self.dropped_rounds = self.heals = 0
        self.last_error: BaseException | None = None
        self._quorum: Quorum | None = None  # the quorum the exchange runs on
        self._since = 0  # local steps since the last round (SparseLoCo's count; DeMo: 0)
        self._steps = 0  # step() calls
        self._quorum_for = -1  # the step a quorum was taken for
        manager.register_state_dict_fn(key, self._load_from_peer, self.replica.peer_state)

    # ------------------------------------------------------------------ public
    @property
    def sync_next(self) -> bool:
        """The next ``step()`` is a round (it runs in a quorum): SparseLoCo's sync, every DeMo step."""
        return self._since + 1 >= self.replica.interval()

    @property
    def quorum(self) -> Quorum | None:
        """The quorum the exchange runs on: its id, this replica's rank and its size."""
        return self._quorum

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients; before a round's step, take the quorum, healing this replica first
        if it is behind. Only there: a member of a quorum must run that quorum's round, so a
        replica that joined one before a local step would leave its peers' sync waiting."""
        if self.sync_next:
            self._take_quorum()
        self.optimizer.zero_grad(set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """A local step, or a round in the quorum: committed on every member, or undone here."""
        if not self.sync_next:
            loss = self.optimizer.step(closure)
            self._since += 1
            self._steps += 1
            return loss
        if self._quorum_for != self._steps:
            self._take_quorum()
        before = self.replica.snapshot()
        loss, error = None, None
        try:
            loss = self.optimizer.step(closure)
        except (CollectiveTimeout, PeerDataError) as exc:
            error = exc
            self.manager.report_error(exc)
        if self.manager.should_commit() and error is None:
            self._since = 0
            self._steps += 1
            self.rounds += 1
            return loss
        self.replica.failed(before)  # never happened here (DeMo: the gradient kept in its buffers)
        self._quorum_for = -1  # the next round runs in a new quorum
        self.dropped_rounds += 1
        self.last_error = error
        return loss

    # ------------------------------------------------------------------ quorum
    def _take_quorum(self) -> None:
        try:
            self.manager.start_quorum()
        except TimeoutError as exc:  # too few replicas alive for the quorum timeout: no way on
            need = getattr(self.manager, "_min_replica_size", "min_replica_size")
            waited = getattr(getattr(self.manager, "_quorum_timeout", None), "total_seconds", None)
            within = f"{waited():g} s" if waited is not None else "the quorum timeout"
            raise TimeoutError(
                f"{WHERE}: no quorum of {need} replicas formed within {within} ({exc}): too few "
                "replicas are alive and reachable to go on. Restart the missing ones; this "
                "replica's Manager cannot take another quorum, so restart it too (it heals from a "
                "live peer), or let a lone replica go on with min_replica_size=1 (docs/ft.md)"
            ) from exc
        self._quorum_for = self._steps
        quorum = self.group.quorum
        if quorum is None:
            raise RuntimeError(
                f"{WHERE}: torchft formed no usable quorum ({self.manager.errored()}); see the Manager's log"
            )
        if quorum is not self._quorum:  # a new membership: every member compares replicas again
            self._use(quorum)
            self.replica.recheck()

    def _use(self, quorum: Quorum) -> None:
        old = self.optimizer.comm
        self.optimizer.comm = Communicator(self.group.view(), old.owner, old.timeout, timer=old.timer)
        self._quorum = quorum

    def _load_from_peer(self, sd: dict[str, Any]) -> None:
        """torchft heals this replica: the live peer's state, made this replica's (the adapter)."""
        quorum = self.group.quorum
        try:
            if quorum is None:
                raise ValueError("torchft formed no usable quorum to join")
            joined = self.replica.for_joiner(sd, quorum)
            self._use(quorum)
            since = self.replica.load(joined)
        except ValueError as exc:
            self.group.abort()  # the peers' round fails now instead of at its timeout
            raise JoinRefused(
                f"{WHERE}: this replica cannot join the quorum: the live replicas' state does not load "
                f"here ({exc}). It is kept out and the others go on; start it with their settings and model"
            ) from exc
        self._since = since
        self.heals += 1
