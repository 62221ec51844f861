"""How DeMo exchanges a step: one strategy per training layout, chosen once at construction.

The exchange group (``process_group``, or a hierarchy's inter-node group) is used through the
group made for ``comm_priority`` (:func:`cokit.compress.priority.priority_group`, once, here).

Every strategy runs the same round (docs/design.md §8): the agreement of the exchange core
(:mod:`cokit.compress.exchange`), then the buckets through the functional step
(:mod:`cokit.compress.demo_step`). They differ in where the work happens:

- :class:`Flat` (plain data parallel): every rank holds whole tensors and exchanges every
  bucket over one group;
- :class:`ShardLocal` (DTensor parameters, FSDP2/HSDP): each rank steps its local shards; the
  mesh dimensions are agreement groups and the exchange group is the HSDP replicate group, or
  this rank alone;
- :class:`Hierarchical` (``hierarchy=NodeGroups``): gradients are averaged inside the node; bucket
  ``b`` is exchanged across nodes by local rank ``b % L`` alone, which then broadcasts the
  updated parameters inside the node;
- :class:`Overlapped` (``overlap_backward=True``): buckets are encoded into copies of their
  buffers and launched from post-accumulate-grad hooks during backward; ``step()`` agrees on
  what happened since (edits, non-finite gradients, a GradScaler), then receives and applies.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
from collections.abc import Callable, Iterator
from typing import Any

import torch

from cokit.compress.agreement import EDITED, FOUND_INF, SCALED
from cokit.compress.buckets import Bucket
from cokit.compress.comm import Communicator
from cokit.compress.demo_plan import DemoPlan, Entry, StepContext
from cokit.compress.demo_step import (
    BucketInput,
    Launched,
    accumulate,
    apply,
    demo_step,
    launch,
    receive,
    split_like,
)
from cokit.compress.dtensor import MeshPlan, check_exchange_group, local
from cokit.compress.frontend import FrontEndOptions
from cokit.compress.groups import NodeGroups
from cokit.compress.guards import GradMarks, all_finite, edited_message

__all__ = ["Basis", "Flat", "Hierarchical", "Overlapped", "ShardLocal", "Strategy", "make_strategy"]

Timeout = float | datetime.timedelta | None


@dataclasses.dataclass(frozen=True)
class Basis:
    """What every strategy is built from: DeMo's plan, its options (the exchange's settings)
    and where the exchange reports time blocked on collectives (the policy's clock)."""

    plan: DemoPlan
    options: FrontEndOptions
    on_blocked: Callable[[float], None]


class Strategy:
    """The base round; on its own, :class:`Flat`'s."""

    name = "flat"

    def __init__(self, basis: Basis, *, group: Any = None, agree: tuple = (), local: bool = False):
        self.plan = basis.plan
        self.exchange = basis.options.exchange(
            "DeMo", group=group, agree_groups=agree, local=local, on_blocked=basis.on_blocked
        )
        self.timeout = basis.options.timeout
        self.checked = False  # first_round ran

    @property
    def dense_world(self) -> int:
        """Ranks a dense all-reduce of the same gradients would span (``step_dense_bytes``)."""
        return self.exchange.comm.world_size

    def first_round(self) -> None:
        """Checks that need every rank once, before the first round (node tiling)."""

    def _first_round_once(self) -> None:
        if not self.checked:
            self.first_round()
            self.checked = True

    def forget_layout(self) -> None:
        """The param groups changed (added, loaded): drop what was planned from them."""

    def install(self, params: list[torch.Tensor]) -> None:
        """Called for every parameter the optimizer gets (the overlapped strategy hooks them)."""

    def step(self, ctx: StepContext) -> list[Entry] | None:
        """One round: agree, then exchange every bucket; the active entries, None if skipped."""
        self._first_round_once()
        with self.exchange.guarded():
            active = ctx.agree()
            if active is None:
                return None
            decision = ctx.decision()
            buckets = self.plan.buckets(active, decision)
            inputs = self.prepare(buckets, active)
            if decision.skip_sync:
                accumulate(inputs)
                ctx.skipped_sync()
                return active
            demo_step(inputs, self.exchange, precision=ctx.precision, generator=ctx.generator)
            self.share(buckets, active)
        return active

    def prepare(self, buckets: list[Bucket], active: list[Entry]) -> list[BucketInput]:
        """The buckets this rank encodes, with their gradients."""
        return [self.plan.bucket_input(b, bucket, active) for b, bucket in enumerate(buckets)]

    def share(self, buckets: list[Bucket], active: list[Entry]) -> None:
        """After the update: what other ranks of the node need (hierarchical)."""


class Flat(Strategy):
    """Plain data parallel (module docstring)."""


class ShardLocal(Strategy):
    """DTensor parameters: local shards, mesh dimensions as agreement groups (module docstring)."""

    name = "shard-local"

    def __init__(self, basis: Basis, mesh: MeshPlan):
        process_group = basis.options.process_group
        check_exchange_group(mesh, process_group)
        super().__init__(basis, group=process_group, agree=mesh.agree, local=process_group is None)
        # HSDP: the replicate group and the (one) sharded dimension must tile the world
        self.tiling = None
        if process_group is not None and len(mesh.agree) == 1:
            self.tiling = NodeGroups(intra=mesh.agree[0], inter=process_group)

    def first_round(self) -> None:
        if self.tiling is not None:
            self.tiling.check_tiling("DeMo", self.timeout)


class Hierarchical(Strategy):
    """Two levels: node averages, owner-encoded buckets, in-node broadcasts (module docstring)."""

    name = "hierarchical"

    def __init__(self, basis: Basis, hierarchy: NodeGroups):
        super().__init__(basis, group=hierarchy.inter, agree=(hierarchy.intra,))
        self.hierarchy = hierarchy
        self.intra: Communicator = self.exchange.agree_comms[0]

    @property
    def dense_world(self) -> int:
        return self.exchange.comm.world_size * self.intra.world_size

    def first_round(self) -> None:
        self.hierarchy.check_tiling("DeMo", self.timeout)

    def _owner(self, b: int) -> int:
        return b % self.intra.world_size

    def prepare(self, buckets: list[Bucket], active: list[Entry]) -> list[BucketInput]:
        """Average every bucket's gradients inside the node (all launched before the first wait,
        so bucket i+1's average runs while bucket i is encoded); keep the buckets this rank owns."""
        averages = [
            self.intra.all_reduce_mean(
                torch.cat([local(active[i][2].grad).reshape(-1) for i in b.members]),
                "intra-node gradient average",
            )
            for b in buckets
        ]
        owned = []
        for b, (bucket, pending) in enumerate(zip(buckets, averages, strict=True)):
            mean = self.exchange.dense(pending, f"the node average of bucket {b}")
            if self._owner(b) == self.intra.rank:
                params = [local(active[i][2]) for i in bucket.members]
                owned.append(self.plan.bucket_input(b, bucket, active, grads=split_like(mean, params)))
        return owned

    def share(self, buckets: list[Bucket], active: list[Entry]) -> None:
        """Every bucket's owner broadcasts its updated parameters inside the node."""
        pending = []
        for b, bucket in enumerate(buckets):
            params = [local(active[i][2]) for i in bucket.members]
            flat = torch.cat([p.reshape(-1) for p in params])
            owner = self._owner(b)
            pending.append(
                (params, self.intra.broadcast(flat, owner, "intra-node parameter broadcast"), owner)
            )
        for params, pend, owner in pending:
            flat = self.exchange.wait(pend)
            if owner != self.intra.rank:
                for p, new in zip(params, split_like(flat, params), strict=True):
                    p.copy_(new)


@dataclasses.dataclass
class _Inflight:
    """A bucket launched during backward: its collectives, buffer copies and gradient marks."""

    launched: Launched
    members: list[int]  # its parameters' entry numbers
    work: list[torch.Tensor]  # the copies of the error buffers it encoded into
    params: list[torch.Tensor]
    marks: GradMarks  # the gradients at launch (a later change raises at step)
    finite: torch.Tensor  # per parameter, whether its gradient was finite at launch


class Overlapped(Strategy):
    """Buckets launched from backward's hooks, finished by ``step()`` (module docstring)."""

    name = "overlapped"

    def __init__(self, basis: Basis, open_round: Callable[[], Any]):
        super().__init__(basis, group=basis.options.process_group)
        self.open_round = open_round  # the step's status round, at its first hook
        self.hooks: list = []
        # entries, buckets and the bucket of each id(p), planned at the first hook of a layout
        self.planned: tuple[list[Entry], list[Bucket], dict[int, int]] | None = None
        self.inflight: dict[int, _Inflight] = {}  # by bucket
        self._reset()

    def _reset(self) -> dict[int, _Inflight]:
        """Start a new step: nothing launched, no gradient ready; returns what was in flight."""
        inflight, self.inflight = self.inflight, {}
        self.ready: set[int] = set()
        self.next = 0  # buckets launch in order: this one is next
        self.opened = False  # this step's opening agreement ran
        return inflight

    def install(self, params: list[torch.Tensor]) -> None:
        self.hooks += [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]
        self.forget_layout()

    def forget_layout(self) -> None:
        self.planned = None

    def _open(self) -> None:
        """The step's first collective: agree on settings, layout and counters before any bucket
        (whose sizes follow from them) is sent."""
        if self.opened:
            return
        self._first_round_once()
        self.open_round()
        self.opened = True

    @torch.no_grad()
    def _on_grad_ready(self, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook: launch the buckets whose gradients are all ready, in order
        (every rank launches them in the same order)."""
        with self.exchange.guarded(), self._resets_on_error():
            self._open()
            if self.planned is None:
                entries = self.plan.entries()
                buckets = self.plan.buckets(entries)
                where = {id(entries[i][2]): b for b, bucket in enumerate(buckets) for i in bucket.members}
                self.planned = (entries, buckets, where)
            entries, buckets, bucket_of = self.planned
            b = bucket_of.get(id(p))
            if b is None:  # an empty parameter: in no bucket, nothing to send
                return
            if b in self.inflight:
                raise RuntimeError(
                    "DeMo(overlap_backward=True): a second backward reached a bucket that is already "
                    "being sent; call step() after every backward (gradient accumulation needs "
                    "overlap_backward=False)"
                )
            self.ready.add(id(p))
            while self.next < len(buckets) and all(
                id(entries[i][2]) in self.ready for i in buckets[self.next].members
            ):
                self._launch(self.next, buckets[self.next], entries)
                self.next += 1

    def _launch(self, b: int, bucket: Bucket, entries: list[Entry]) -> None:
        """Encode into copies of the buffers and send; mark the gradients so that step() can
        tell whether they changed after the launch."""
        params = [entries[i][2] for i in bucket.members]
        marks = GradMarks(params)
        finite = torch.stack([all_finite(local(p.grad)) for p in params])
        work = [self.plan.error_buffer(p).clone() for p in params]
        item = self.plan.bucket_input(b, bucket, entries, deltas=work)
        self.inflight[b] = _Inflight(
            launch(item, self.exchange), list(bucket.members), work, params, marks, finite
        )

    @contextlib.contextmanager
    def _resets_on_error(self) -> Iterator[None]:
        """A hook or step that raised leaves no bucket in flight for the next step to trip on
        (the exchange core drained what was launched)."""
        try:
            yield
        except BaseException:
            self._reset()
            raise

    def step(self, ctx: StepContext) -> list[Entry] | None:
        with self.exchange.guarded(), self._resets_on_error():
            runs = self._close(ctx)
            if runs is None:
                return None
            for run in runs:
                receive(run.launched, self.exchange)
            for run in runs:
                apply(run.launched, precision=ctx.precision, generator=ctx.generator)
                for p, delta in zip(run.params, run.work, strict=True):
                    self.plan.set_error_buffer(p, delta)
        return ctx.entries

    def _close(self, ctx: StepContext) -> list[_Inflight] | None:
        """Agree on what happened since the buckets were sent (edits, non-finite gradients, a
        GradScaler); then launch the buckets whose hooks did not fire (gradients set by hand).
        The buckets to finish, in order; None when the step is skipped on every rank."""
        self._open()
        entries, amp = ctx.entries, ctx.amp
        buckets = self.plan.buckets(entries)
        inflight = self._reset()
        missing = [b for b in range(len(buckets)) if b not in inflight]
        for b in missing:
            for i in buckets[b].members:
                grad = entries[i][2].grad
                if grad is None or grad.is_sparse:
                    raise RuntimeError(
                        "DeMo(overlap_backward=True): every parameter needs a dense gradient each step; "
                        f"{self.plan.entry_name(i, entries)} has {'none' if grad is None else 'a sparse one'}"
                    )
        edited = [
            run.members[j]
            for run in inflight.values()
            for j in run.marks.changed().cpu().nonzero().flatten().tolist()
        ]
        members = [m for run in inflight.values() for m in run.members]
        finite = [run.finite for run in inflight.values()]
        for b in missing:
            members += buckets[b].members
            finite.append(torch.stack([all_finite(local(entries[i][2].grad)) for i in buckets[b].members]))
        ok = torch.cat(finite).cpu().tolist() if finite else []
        bad = sorted(m for m, fine in zip(members, ok, strict=True) if not fine)
        events = (EDITED if edited else 0) | (SCALED if amp.scale is not None else 0)
        rnd = ctx.status(events | (FOUND_INF if amp.found_inf else 0), bad)
        if rnd.any_event(SCALED):
            raise RuntimeError(
                "DeMo(overlap_backward=True): the gradients carry a GradScaler's scale. Buckets are "
                "encoded during backward, before a GradScaler could unscale them; use "
                "overlap_backward=False with GradScaler (or bf16 autocast, which needs no scaler). "
                "No parameter and no buffer changed"
            )
        if rnd.any_event(EDITED):
            ranks = [self.exchange.global_rank(r) for r in rnd.any_event(EDITED)]
            name = self.plan.entry_name(min(edited), entries) if edited else None
            raise RuntimeError(edited_message(ranks, self.exchange.global_rank(), name))
        if not ctx.go_on(rnd):
            return None
        for b in missing:
            self._launch(b, buckets[b], entries)
        runs, self.inflight = {**inflight, **self.inflight}, {}
        return [runs[b] for b in sorted(runs)]


def make_strategy(
    plan: DemoPlan,
    options: FrontEndOptions,
    hierarchy: Any,
    mesh: MeshPlan | None,
    *,
    on_blocked: Callable[[float], None],
    policy: Any,
    overlap_backward: bool,
    open_round: Callable[[], Any],
) -> Strategy:
    """The strategy for DeMo's layout (DTensor parameters, hierarchy=, overlap_backward=);
    ``open_round`` is the overlapped strategy's status round at the first hook of a step."""
    if hierarchy is not None:
        if not isinstance(hierarchy, NodeGroups):
            raise TypeError(
                "DeMo: hierarchy must be a cokit.compress.groups.NodeGroups (e.g. node_groups()), "
                f"got {type(hierarchy).__name__}"
            )
        if mesh is not None:
            raise ValueError(
                "DeMo: hierarchy= is for plain data parallel; with DTensor (FSDP2) parameters, "
                "FSDP's mesh is the node level: pass the replicate group as process_group"
            )
        if options.process_group is not None:
            raise ValueError("DeMo: pass either process_group= or hierarchy=, not both")
    layered = hierarchy is not None or mesh is not None
    if layered and policy.observes:
        raise ValueError(
            f"DeMo: policy {policy.describe()} measures the exchange group only; with DTensor "
            "parameters or hierarchy= the ranks of a node could decide differently: use the static policy"
        )
    if layered and overlap_backward:
        raise ValueError(
            "DeMo: overlap_backward=True works with plain data parallel only (not with DTensor "
            "parameters or hierarchy=); FSDP overlaps its own reduce-scatter"
        )
    basis = Basis(plan, options, on_blocked)
    if hierarchy is not None:
        return Hierarchical(basis, hierarchy)
    if mesh is not None:
        return ShardLocal(basis, mesh)
    if overlap_backward:
        return Overlapped(basis, open_round)
    return Flat(basis, group=options.process_group)
