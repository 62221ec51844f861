"""torchft's reconfigurable gloo group, as cokit's exchange sees it: one process group per quorum.

torchft's :class:`~torchft.process_group.ProcessGroupGloo` is one Python object whose gloo group
is rebuilt by the :class:`~torchft.Manager` whenever the quorum changes (``configure``). cokit's
exchange marks a group unusable after a failed collective and keys its in-flight work by group,
so it needs one object per quorum: :class:`QuorumGloo` records each configuration, and
:meth:`QuorumGloo.view` gives a :class:`QuorumGroup` for the current one, with that quorum's
rank and size, whose collectives run on torchft's group. A view of a quorum that is gone
refuses collectives, and aborting it never aborts a newer quorum's group.
:func:`replica_manager` builds the torchft ``Manager`` for one replica group run as one process.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import TCPStore
from torchft import Manager
from torchft.process_group import ProcessGroup, ProcessGroupGloo

__all__ = ["Quorum", "QuorumGloo", "QuorumGroup", "replica_manager"]


@dataclasses.dataclass(frozen=True)
class Quorum:
    """One configuration of the group: torchft's quorum id, this replica's rank in it, its size."""

    quorum_id: int
    rank: int
    world_size: int


class QuorumGloo(ProcessGroupGloo):
    """torchft's reconfigurable gloo group that remembers its current quorum (``quorum``; None
    until the Manager configured it). Pass it to the ``Manager`` and to :class:`cokit.compress.ft.FaultTolerant`."""

    def __init__(self, timeout: datetime.timedelta = datetime.timedelta(seconds=60)) -> None:
        super().__init__(timeout=timeout)
        self.quorum: Quorum | None = None

    def configure(
        self,
        store_addr: str,
        replica_id: str,
        rank: int,
        world_size: int,
        quorum_id: int | None = None,
        group_rank: int | None = None,
        group_world_size: int | None = None,
        global_ranks: list[int] | None = None,
    ) -> None:
        self.quorum = None  # the old quorum's views stop here, whatever happens next
        super().configure(
            store_addr, replica_id, rank, world_size, quorum_id, group_rank, group_world_size, global_ranks
        )
        self.quorum = Quorum(-1 if quorum_id is None else int(quorum_id), int(rank), int(world_size))

    def view(self) -> QuorumGroup:
        """The process group of the current quorum (raises before the Manager formed one)."""
        if self.quorum is None:
            raise RuntimeError(
                "QuorumGloo: no live quorum: none was formed yet, or the last one's group was aborted "
                "after a failed round and the Manager has not formed a new one; call "
                "manager.start_quorum() (FaultTolerant does) first"
            )
        return QuorumGroup(self, self.quorum)


class QuorumGroup(dist.ProcessGroup):
    """One quorum of a :class:`QuorumGloo`: its rank and size, its collectives on torchft's group.

    ``standalone``: it is not registered with torch.distributed (:func:`cokit.compress.comm.standalone`).
    """

    standalone = True

    def __init__(self, source: QuorumGloo, quorum: Quorum) -> None:
        super().__init__(quorum.rank, quorum.world_size)  # type: ignore[call-arg]
        self.source, self.quorum = source, quorum

    def _live(self, what: str) -> QuorumGloo:
        if self.source.quorum is not self.quorum:
            raise RuntimeError(
                f"QuorumGroup: cannot start a {what} on quorum {self.quorum.quorum_id}: the Manager "
                "has reconfigured the group since (a round belongs to the quorum it started in)"
            )
        return self.source

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:  # type: ignore[override]
        return self._live("all-reduce").allreduce(tensors, opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Any:  # type: ignore[override]
        return self._live("broadcast").broadcast(tensors, opts)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        """All-gather one flat tensor into ``output`` (``world_size * numel``), as cokit's
        communicator launches it."""
        opts = dist.distributed_c10d.AllgatherOptions() if opts is None else opts
        return self._live("all-gather").allgather_into_tensor_coalesced([output], [input], opts)

    def abort(self) -> None:
        """Abort torchft's group if it still serves this quorum (a newer one is left alone)."""
        if self.source.quorum is self.quorum:
            self.source.quorum = None
            self.source.abort()

    def getBackendName(self) -> str:
        return "gloo"

    def __repr__(self) -> str:
        q = self.quorum
        return f"QuorumGroup(quorum {q.quorum_id}, rank {q.rank} of {q.world_size})"


def replica_manager(
    group: ProcessGroup,
    lighthouse: str,
    replica_id: str,
    *,
    timeout: datetime.timedelta,
    quorum_timeout: datetime.timedelta = datetime.timedelta(seconds=60),
    min_replicas: int = 2,
    host: str = "127.0.0.1",
    load_state_dict: Any = None,
    state_dict: Any = None,
) -> tuple[Manager, TCPStore]:
    """A torchft ``Manager`` over ``group`` for a replica group that is one process, and the
    TCPStore it uses: (manager, store).

    This is the setup :class:`cokit.compress.ft.FaultTolerant` needs (it supports one process per
    replica group): the replica group hosts its own TCPStore on ``host`` (a free port) and is
    rank 0 of a world of 1 in it; the quorum is synchronous (``use_async_quorum=False``: a sync
    step's quorum is known before its round starts) and there is no initial sync
    (``init_sync=False``: every replica builds the same model from the same seed; a replica that
    is behind is healed anyway). ``timeout`` is the Manager's and its connect timeout,
    ``quorum_timeout`` how long a quorum may take to form, ``min_replicas`` its minimum size (the
    lighthouse's ``--min_replicas`` should match), ``host`` the address the store and the
    Manager's server are reached at, ``load_state_dict``/``state_dict`` torchft's healing
    callbacks (None: FaultTolerant heals the optimizer's state itself). Keep the returned store
    alive as long as the manager: its server lives as long as the object. Bad arguments raise
    ``ValueError`` before anything is created.
    """
    if min_replicas < 1:
        raise ValueError(f"replica_manager: min_replicas must be >= 1, got {min_replicas}")
    for name, value in (("timeout", timeout), ("quorum_timeout", quorum_timeout)):
        if value <= datetime.timedelta(0):
            raise ValueError(f"replica_manager: {name} must be positive, got {value}")
    for name, text in (("lighthouse", lighthouse), ("replica_id", replica_id), ("host", host)):
        if not text:
            raise ValueError(f"replica_manager: {name} must be a non-empty string")
    store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=group,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=min_replicas,
        use_async_quorum=False,
        timeout=timeout,
        quorum_timeout=quorum_timeout,
        connect_timeout=timeout,
        rank=0,
        world_size=1,
        store_addr=host,
        store_port=store.port,
        lighthouse_addr=lighthouse,
        replica_id=replica_id,
        hostname=host,
        init_sync=False,
    )
    return manager, store
