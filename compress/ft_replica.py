"""What :class:`~cokit.compress.ft.FaultTolerant` needs of a front end, and SparseLoCo's answer.

FaultTolerant runs the quorum, the commit and the healing the same way for every front end; a
:class:`Replica` adapter says what differs: how many steps make a round, what to keep so that a
failed round can be undone, what a failed round leaves behind, how a new membership compares
its replicas, what a live peer sends a joiner and how the joiner loads it. Each check that can
refuse a joiner raises ``ValueError`` before anything changes (FaultTolerant turns it into
:class:`~cokit.compress.ft.JoinRefused`). DeMo's adapter is in :mod:`cokit.compress.ft_demo`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from cokit.compress.ft_group import Quorum
from cokit.compress.ft_heal import check_layout, for_joiner
from cokit.compress.sparseloco import SparseLoCo
from cokit.compress.sparseloco_state import records

__all__ = ["Replica", "SparseLoCoReplica"]

WHERE = "FaultTolerant"


class Replica(Protocol):
    """One front end as FaultTolerant drives it (module docstring)."""

    optimizer: Any

    def interval(self) -> int:
        """Steps per round: the round is every ``interval()``-th step."""
        ...

    def snapshot(self) -> Any:
        """What :meth:`failed` needs to undo the round about to run."""
        ...

    def failed(self, before: Any) -> None:
        """The round was not committed here: leave this replica as every survivor is (consistent)."""
        ...

    def recheck(self) -> None:
        """A new membership: the next round compares the replicated state of every member."""
        ...

    def peer_state(self) -> dict[str, Any]:
        """What this live replica sends a joiner (copies: it goes on training meanwhile)."""
        ...

    def for_joiner(self, sd: Mapping[str, Any], quorum: Quorum) -> Any:
        """A live peer's ``sd`` made this replica's at ``quorum`` (checked; nothing changes here)."""
        ...

    def load(self, joined: Any) -> int:
        """Load :meth:`for_joiner`'s result (checked before anything changes); the local steps
        since the last round."""
        ...


class SparseLoCoReplica:
    """SparseLoCo: a round is a sync; a failed sync is undone bit for bit from SparseLoCo's own
    snapshot of what the step changes (the next step runs it again)."""

    def __init__(self, optimizer: SparseLoCo) -> None:
        if optimizer.dense_warmup:
            raise ValueError(
                f"{WHERE}: dense_warmup={optimizer.dense_warmup} is not supported (every warm-up step "
                "is a collective); use dense_warmup=0"
            )
        if optimizer.sync != "blocking":
            raise ValueError(
                f"{WHERE}: sync={optimizer.sync!r} is not supported (its round spans two periods, and a "
                "member that fails between them leaves nothing to undo to); use sync='blocking'"
            )
        if optimizer.comm.world_size != 1:
            raise ValueError(
                f"{WHERE}: build the SparseLoCo with process_group=None and one process per replica "
                f"group (its group has {optimizer.comm.world_size} ranks); the quorum is its group"
            )
        self.optimizer = optimizer

    def interval(self) -> int:
        return int(self.optimizer.current_interval)

    def snapshot(self) -> Callable[[], None]:
        return self.optimizer.snapshot()

    def failed(self, before: Callable[[], None]) -> None:
        before()  # the round never happened here

    def recheck(self) -> None:
        self.optimizer.recheck()

    def peer_state(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def for_joiner(self, sd: Mapping[str, Any], quorum: Quorum) -> dict[str, Any]:
        check_layout(sd, [p for g in self.optimizer.param_groups for p in g["params"]], WHERE)
        return for_joiner(sd, quorum.rank, quorum.world_size)

    def load(self, joined: dict[str, Any]) -> int:
        self.optimizer.load_state_dict(joined)
        return int(records(joined)["common"]["counters"]["since_sync"])
