"""The exchange core: every guarantee DeMo, SparseLoCo and the DDP hook give, in one place.

An :class:`Exchange` is one front end's view of its process groups: the *exchange* group the
payloads travel over and the *agreement* groups whose ranks only agree (a DTensor mesh's sharded
dimensions, the ranks of a node). It owns

- **agreement** (:meth:`Exchange.agree`): each round opens with one fixed-size status row per
  rank (:mod:`cokit.compress.agreement`): a 64-bit fingerprint of the settings (the exchange's
  own ``comm_priority`` included), layout and counters, which gradients exist, which are
  non-finite and where, and event bits (a GradScaler's ``found_inf``); a mismatch raises the
  same error on every rank, naming it;
- **timeouts** on every collective it issues, reports included (:mod:`cokit.compress.comm`);
- **work lifetimes** (:meth:`Exchange.guarded`): a round that raises waits for the collectives
  it launched (its peers launched them too) or, if its group failed, keeps them referenced until
  exit, so no error path ends in SIGABRT;
- **validation of peer bytes** (:meth:`Exchange.selection`, :meth:`Exchange.dense`), on by
  default (:mod:`cokit.compress.peer_check`);
- **priority** (``priority=``, :mod:`cokit.compress.priority`): the exchange collectives run on
  the group made for the front end's ``comm_priority`` (NCCL: high-priority streams);
- **accounting**: bytes and timing per round (:meth:`Exchange.record`), and the time blocked in
  waits on an injected clock (what a network policy measures; tests pass a fake clock).
"""

from __future__ import annotations

import contextlib
import datetime
import math
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist

from cokit.compress.agreement import Report, Round, canonical, fingerprint, run_round
from cokit.compress.comm import DEFAULT_TIMEOUT_S, Communicator, Pending
from cokit.compress.payload import PayloadCodec
from cokit.compress.peer_check import UNCHANGED, check_dense, check_selection
from cokit.compress.priority import PriorityGroup
from cokit.compress.stats import CommStats
from cokit.compress.timing import StepTimer

__all__ = ["Exchange", "ExchangeOwner"]


class Exchange:
    """Collectives, agreement, validation and accounting for one front end (module docstring).

    Args:
        owner: names the front end in every error (``"DeMo.step"``).
        process_group: the exchange group (None: the default group).
        timeout: seconds (or a timedelta) each collective may take (default
            :data:`~cokit.compress.comm.DEFAULT_TIMEOUT_S`); None/inf: the group's own.
        agree_groups: groups whose ranks agree each round but exchange nothing.
        local: the exchange group is this rank alone (DTensor parameters sharded on every
            mesh dimension).
        validate: check every payload and dense result from peers before using it.
        clock: seconds, for the time blocked in waits (``time.perf_counter``; tests inject one).
        on_blocked: called with the seconds of each wait (a network policy's exposed time).
        priority: what :func:`cokit.compress.priority.priority_group` made of ``process_group``:
            its group carries the exchange collectives (agreement groups keep theirs) and its
            requested priority is agreed every round (``comm_priority``).
    """

    def __init__(
        self,
        owner: str,
        process_group: Any = None,
        timeout: float | datetime.timedelta | None = DEFAULT_TIMEOUT_S,
        *,
        agree_groups: Sequence[Any] = (),
        local: bool = False,
        validate: bool = True,
        clock: Callable[[], float] = time.perf_counter,
        on_blocked: Callable[[float], None] | None = None,
        priority: PriorityGroup | None = None,
    ):
        if priority is not None and priority.source is not process_group:
            raise ValueError(f"{owner}: priority= was made for another process group")
        self.owner = owner
        self.priority = priority
        group = priority.group if priority is not None else process_group
        self.comm = Communicator(group, owner, timeout, local=local, timer=StepTimer(clock))
        self.agree_comms = [Communicator(g, owner, timeout, timer=self.comm.timer) for g in agree_groups]
        self.validate = validate
        self.clock = clock
        self.on_blocked = on_blocked

    @property
    def timer(self) -> StepTimer:
        return self.comm.timer

    def global_rank(self, rank: int | None = None) -> int:
        """The global rank of the exchange group's ``rank`` (default: this rank)."""
        return self.comm.global_rank(self.comm.rank if rank is None else rank)

    # ------------------------------------------------------------------ waits
    def wait(self, pending: Pending) -> torch.Tensor:
        """Wait on a collective (its own timeout applies), counting the time blocked."""
        start = self.clock()
        result = pending.wait()
        if self.on_blocked is not None:
            self.on_blocked(self.clock() - start)
        return result

    @contextlib.contextmanager
    def guarded(self) -> Iterator[None]:
        """Run a round: if it raises, wait for what it launched (or keep it alive when its group
        failed) and drop its counts, then let the error through."""
        try:
            yield
        except BaseException:
            for comm in (self.comm, *self.agree_comms):
                comm.drain()
            self.reset_counts()
            raise

    def reset_counts(self) -> None:
        """Drop the open round's byte counts and timing marks on every group."""
        self.comm.reset_counts()
        for comm in self.agree_comms:
            comm.take_counts()

    # ------------------------------------------------------------------ agreement
    def report(self, bad: Sequence[int] = (), **fields: int) -> Report:
        """This rank's status: the non-finite entries ``bad`` (ascending) it found, under its
        global rank, and the other :class:`Report` fields (``grads``, ``events``, ``skipped``)."""
        if not bad:
            return Report(**fields)
        return Report(n_bad=len(bad), first_bad=bad[0], culprit=self.global_rank(), **fields)

    def agree(
        self,
        fingerprints: tuple[int, int],
        report: Report,
        describe: Callable[[bool], dict[str, Any]],
        *,
        extra: torch.Tensor | None = None,
        device: torch.device | None = None,
        has_grad: Callable[[], list[bool]] | None = None,
        names: Callable[[int], str] | None = None,
    ) -> Round:
        """One agreement round over the agreement groups, then the exchange group.

        ``fingerprints = (exchange, agreement)``: the exchange group compares local layouts,
        agreement groups (whose ranks hold different shards) global ones; ``describe(globally)``
        is the matching JSON description for a mismatch report. The exchange's own settings
        (``comm_priority``) are added to both.
        """
        (exchange_fp, agree_fp), described = self._own_settings(fingerprints, describe)
        stages = [(c, agree_fp) for c in self.agree_comms] + [(self.comm, exchange_fp)]
        return run_round(
            stages,
            report,
            described,
            self.wait,
            extra=extra,
            device=device,
            has_grad=has_grad,
            names=names,
        )

    def agree_later(
        self,
        fingerprints: tuple[int, int],
        report: Report,
        describe: Callable[[bool], dict[str, Any]],
        *,
        extra: torch.Tensor | None = None,
        device: torch.device | None = None,
    ) -> Callable[[], Round]:
        """:meth:`agree` with the status row launched now and checked by the returned call: an
        overlapped round (SparseLoCo's ``sync="eager"``) whose payload sizes an earlier, waited
        round already agreed. The call raises what :meth:`agree` would; exchange group only."""
        if self.agree_comms:
            raise ValueError(f"{self.owner}: a status round checked later needs a single group")
        (exchange_fp, _), described = self._own_settings(fingerprints, describe)
        row = torch.frombuffer(bytearray(report.pack(exchange_fp)), dtype=torch.uint8)
        if extra is not None:
            row = torch.cat([row, extra.cpu()])
        launched = _Launched(
            self.comm, self.comm.all_gather(row.to(device or torch.device("cpu")), "status exchange")
        )

        def check() -> Round:
            stages = [(cast(Communicator, launched), exchange_fp)]
            return run_round(stages, report, described, self.wait, extra=extra, device=device)

        return check

    def _own_settings(
        self, fingerprints: tuple[int, int], describe: Callable[[bool], dict[str, Any]]
    ) -> tuple[tuple[int, int], Callable[[Communicator], dict[str, Any]]]:
        """The fingerprints and description with the exchange's own settings (``comm_priority``)."""
        own = {"comm_priority": self.priority.requested} if self.priority is not None else {}
        if own:
            text = canonical(own)
            fingerprints = (fingerprint(str(fingerprints[0]), text), fingerprint(str(fingerprints[1]), text))

        def described(comm: Communicator) -> dict[str, Any]:
            out = describe(comm is not self.comm and not isinstance(comm, _Launched))
            return {**out, "settings": {**(out.get("settings") or {}), **own}} if own else out

        return fingerprints, described

    # ------------------------------------------------------------------ payloads
    def gather(self, codec: PayloadCodec, wires: Sequence[torch.Tensor]) -> list[Pending]:
        """Start one all-gather per wire tensor of ``codec``."""
        return [
            self.comm.all_gather(t, f"{w.name} all-gather") for w, t in zip(codec.wire, wires, strict=True)
        ]

    def selection(
        self,
        codec: PayloadCodec,
        pending: Sequence[Pending],
        bucket: str,
        names: Sequence[str] | None = None,
        changed: str = UNCHANGED,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Wait for a payload's all-gathers; every rank's ``(indices, values)``, checked (a
        fault's error says ``changed``: what the round had changed by then)."""
        return self.checked(codec, [self.wait(p) for p in pending], bucket, names, changed)

    def checked(
        self,
        codec: PayloadCodec,
        gathered: Sequence[torch.Tensor],
        bucket: str,
        names: Sequence[str] | None = None,
        changed: str = UNCHANGED,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gathered wire tensors -> every rank's ``(indices, values)``, validated unless
        ``validate`` is off."""
        with self.timer.span("decode", gathered[0].device):  # unpacking and checking are decode work
            indices, values = codec.from_wire(gathered)
            if self.validate:
                check_selection(
                    codec,
                    indices,
                    values,
                    owner=self.owner,
                    bucket=bucket,
                    rank_of=self.comm.global_rank,
                    names=names,
                    changed=changed,
                )
        return indices, values

    def dense(self, pending: Pending, bucket: str, changed: str = UNCHANGED) -> torch.Tensor:
        """Wait for a dense all-reduce; its result, checked finite unless ``validate`` is off."""
        mean = self.wait(pending)
        self.check_dense(mean, bucket, changed)
        return mean

    def check_dense(self, mean: torch.Tensor, bucket: str, changed: str = UNCHANGED) -> None:
        """Check a dense result from peers finite, unless ``validate`` is off."""
        if self.validate:
            with self.timer.span("decode", mean.device):
                check_dense(mean, owner=self.owner, bucket=bucket, changed=changed)

    # ------------------------------------------------------------------ accounting
    def record(self, stats: CommStats, dense_bytes: int) -> int:
        """Close the round in ``stats`` (both levels); returns the exchange group's bytes sent."""
        sent, received, timing = self.comm.take_step()
        intra_sent = intra_received = 0
        for comm in self.agree_comms:
            s_, r_ = comm.take_counts()
            intra_sent, intra_received = intra_sent + s_, intra_received + r_
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        stats.record(
            sent + intra_sent,
            received + intra_received,
            dense_bytes,
            timing,
            world,
            self.comm.world_size,
            intra=(intra_sent, intra_received),
            intra_group_size=math.prod(c.world_size for c in self.agree_comms),
        )
        return sent


class ExchangeOwner:
    """A front end that holds its :class:`Exchange` in ``self.exchange``."""

    exchange: Exchange

    @property
    def comm(self) -> Communicator:
        """The exchange group's communicator (settable: ``simulate_latency`` wraps it)."""
        return self.exchange.comm

    @comm.setter
    def comm(self, value: Communicator) -> None:
        self.exchange.comm = value

    @property
    def comm_priority_info(self) -> PriorityGroup | None:
        """What ``comm_priority`` achieved: the group used, ``requested``, ``high_priority``
        (effective) and a ``note`` saying why (:func:`cokit.compress.priority.priority_group`)."""
        return self.exchange.priority


class _Launched:
    """``comm`` whose first ``all_gather`` is the status row launched earlier (``pending``),
    for :func:`~cokit.compress.agreement.run_round` to check it; everything else is ``comm``'s."""

    def __init__(self, comm: Communicator, pending: Pending):
        self._comm, self._pending = comm, pending

    def all_gather(self, tensor: torch.Tensor, what: str) -> Pending:
        pending, self._pending = self._pending, None
        return pending if pending is not None else self._comm.all_gather(tensor, what)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._comm, name)
