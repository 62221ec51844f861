"""SparseLoCo's overlapped outer sync (``sync="eager"``): the exchange runs during the next period.

With ``sync="blocking"`` (the default) every sync waits for the status round and the average
of its round before the next period starts. With ``sync="eager"`` sync ``k`` instead

1. lands round ``k - 1`` (launched one period earlier, in flight since): its status rows
   (settings fingerprint, non-finite report, skipped local steps) are agreed first, then every
   rank's bytes are checked (the exchange core's timeout and validation) and the average is
   applied to the shared state: ``theta_global`` and the outer momentum take the real averages
   only, one period late, so they stay bit-identical on every rank; the round's error buffers
   are committed. A non-finite pseudo-gradient reported in the round sends every rank back to
   ``theta_global`` and skips or raises (``nonfinite``) as the blocking sync does, one period
   later, and launches nothing;
2. measures this rank's pseudo-gradient of period ``k`` from the point the period started at,
   ``delta = start - theta_local``, encodes it (error feedback, top-k, codec: the blocking
   sync's bytes) and launches round ``k``, its status row included
   (:meth:`~cokit.compress.exchange.Exchange.agree_later`), without waiting: the payload sizes
   were agreed by the first step's waited status round and no setting that is allowed with
   ``sync="eager"`` changes them;
3. starts period ``k + 1`` from the *eager* point (Kale, Douillard, Donchev 2025, arXiv
   2502.12996): ``start = theta_global`` after a tentative outer step (the momentum is not
   stored) with this rank's own share of round ``k``, ``sent / W``, in place of the average
   that has not arrived. The paper's eager outer gradient is ``(own fresh + (W - 1) * the
   peers' delayed mean) / W`` applied to each worker's own outer parameters; those parameters
   lack the peers' last round, while ``theta_global`` here already holds it (step 1), so both
   give the same start point with the ``"average"`` outer step. With ``"nesterov"`` the shared
   momentum sees the real averages one period late instead of each worker's mixture.

Nothing of a round is applied before every rank's row and bytes are in and checked: a peer's
bad data raises on every rank when the round lands, that round is dropped everywhere and
nothing else changes. ``state_dict()`` waits for the round in flight and saves its status rows
and average (identical on every rank) with the error buffers it produced, so a loaded run goes
on bit for bit; ``finish()`` applies the last round.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from cokit.compress.agreement import PeerDataError, Report, Round
from cokit.compress.guards import nonfinite
from cokit.compress.policy import StaticPolicy
from cokit.compress.sparseloco_local import local_value, skip_bad_sync, write_weights
from cokit.compress.sparseloco_step import Mean, Received, launch_means, outer_step
from cokit.triton_kernels._checks import check_choice

if TYPE_CHECKING:
    from cokit.compress.sparseloco import SparseLoCo

__all__ = ["INFLIGHT_UNCHANGED", "SYNCS", "InFlight", "check_sync", "eager_sync", "land", "launch", "settle"]

SYNCS = ("blocking", "eager")

#: what a round that failed its checks after it was in flight had changed
INFLIGHT_UNCHANGED = (
    'the round in flight (sync="eager") was not applied and is dropped on every rank: '
    "theta_global, the outer momentum and the error buffers are as they were, every rank keeps "
    "its local weights and the next sync launches a new round"
)


@dataclass
class InFlight:
    """A launched round: its status row's *check* and its payload's *finish* (wait, check,
    decode) until called, then their results. A loaded round has only the results (its status
    already checked, its error buffers already committed: None)."""

    finish: Callable[[], Received] | None
    check: Callable[[], Round] | None = None
    status: Round | None = None
    received: Received | None = None

    def round(self) -> Round:
        """The status row of every rank (waited for and agreed the first time)."""
        if self.status is None:
            assert self.check is not None
            self.status, self.check = self.check(), None
        return self.status

    def result(self) -> Received:
        """Every rank's payload, waited for, checked and decoded (the first time)."""
        if self.received is None:
            assert self.finish is not None
            self.received, self.finish = self.finish(), None
        return self.received

    def discard(self) -> None:
        """Wait for a round that will not be applied (a rank reported a non-finite
        pseudo-gradient: its bytes may fail the checks, which no longer matter)."""
        if self.received is None and self.finish is not None:
            finish, self.finish = self.finish, None
            with contextlib.suppress(PeerDataError):
                finish()


def check_sync(sync: object, adaptive_topk: bool, policy: object, where: str) -> str:
    """``sync`` checked against the other settings (before anything is built)."""
    mode = check_choice("sync", sync, SYNCS, where=where)
    if mode == "eager" and adaptive_topk:
        raise ValueError(
            f"{where}: sync='eager' does not combine with adaptive_topk=True (the k's of a sync "
            "would depend on a round still in flight); use one of them"
        )
    if mode == "eager" and not isinstance(policy, StaticPolicy):
        raise ValueError(
            f"{where}: sync='eager' needs the static policy (policy=None): an overlapped sync "
            "does not block, so there is no blocked time for policy='interval' to act on"
        )
    return mode


def settle(opt: SparseLoCo) -> None:
    """Wait for the round in flight and check it, keeping what it brought for the next sync
    (``state_dict()``); a fault drops the round (:data:`INFLIGHT_UNCHANGED`) and raises."""
    flight, opt._flight = opt._flight, None
    if flight is not None:
        if flight.round().bad:
            flight.discard()
        else:
            flight.result()
        opt._flight = flight


def eager_sync(opt: SparseLoCo) -> None:
    """Sync ``k`` with ``sync="eager"`` (module docstring): land round ``k - 1``, then launch
    round ``k`` (its status row included) and start the next period at the eager point."""
    if not land(opt):
        return
    params, states = opt._model_params, [opt.state[p] for p in opt._model_params]
    deltas = [  # from where this period started on this rank
        (s.get("start", s["global"]) - local_value(p, opt._masters)).contiguous()
        for p, s in zip(params, states, strict=True)
    ]
    report = opt.exchange.report(nonfinite(deltas), skipped=opt._skipped)
    opt._skipped = 0  # reported in this round's row
    device = params[0].device
    check = opt.exchange.agree_later(
        opt._fingerprints(),
        report,
        opt._describe,
        extra=opt._driver.measurement(torch.device("cpu")),
        device=device,
    )
    launch(opt, deltas, check)


def land(opt: SparseLoCo) -> bool:
    """Round ``k - 1`` into the shared state: its status rows first (settings that differ raise
    on every rank; a non-finite pseudo-gradient on some rank sends every rank back to
    ``theta_global`` and skips or raises, as a blocking sync does: False), then every rank's
    bytes (a fault drops the round and raises, nothing changed), its error buffers committed and
    the outer step with its average. True when the sync goes on."""
    flight, opt._flight = opt._flight, None  # dropped if anything below raises
    if flight is None:
        return True
    rnd = flight.round()
    opt.skipped_steps += sum(rep.skipped for rep in rnd.reports)
    if rnd.bad:
        flight.discard()
        skip_bad_sync(opt, rnd)
        return False
    means, errors, _ = flight.result()
    states = [opt.state[p] for p in opt._model_params]
    for s, e in zip(states, errors, strict=True):
        if e is not None:
            s["error"] = e
    opt.syncs += 1
    outer_step(states, means, nesterov=opt.outer == "nesterov", lr=opt.outer_lr, mu=opt.outer_momentum)
    return True


def launch(opt: SparseLoCo, deltas: list[torch.Tensor], check: Callable[[], Round]) -> None:
    """Encode and launch round ``k`` (not waited), then start the next period at the eager
    point (module docstring)."""
    params, states = opt._model_params, [opt.state[p] for p in opt._model_params]
    buckets = opt.plan.buckets()
    kind = {i: b.dense for b in buckets for i in b.members}
    errors = [s.get("error") for s in states]
    # what this rank adds to the round's sum, taken before the launch reuses the deltas' buffers:
    # the dense ones whole, the compressed ones as e + delta, less (below) what stays in e
    before = [
        None
        if i not in kind
        else d.clone()
        if kind[i]
        else (torch.zeros_like(d) if (e := errors[i]) is None else e.mul(opt.error_decay)).add_(d)
        for i, d in enumerate(deltas)
    ]
    fresh, finish = launch_means(
        buckets,
        deltas,
        errors,
        opt.exchange,
        dct=opt.dct,
        error_decay=opt.error_decay,
        names=[opt._name(i) for i in range(len(params))],
        at_positions=[False] * len(params),  # dense means: what a checkpoint stores is what is applied
        changed=INFLIGHT_UNCHANGED,
    )
    opt._flight = InFlight(finish, check)
    own = [b if b is None or f is None else b.sub_(f) for b, f in zip(before, fresh, strict=True)]
    starts = eager_starts(opt, states, own)
    write_weights(params, starts, opt._masters, opt.precision, opt._generator())
    for s, x in zip(states, starts, strict=True):
        s["start"] = x
    opt._since_sync = 0
    opt._driver.step_done(opt.comm.sent, opt._dense_bytes(), synced=True)


def eager_starts(
    opt: SparseLoCo, states: list[dict[str, torch.Tensor]], own: list[torch.Tensor | None]
) -> list[torch.Tensor]:
    """``theta_global`` after a tentative outer step with ``own / W`` as the mean (nothing in
    ``states`` changes): the next period's start point on this rank."""
    world, lr, mu = opt.comm.world_size, opt.outer_lr, opt.outer_momentum
    starts = []
    for s, mine in zip(states, own, strict=True):
        g = s["global"]
        if mine is None:
            starts.append(g.clone())
            continue
        share = mine.div_(world) if world > 1 else mine
        if opt.outer == "nesterov":
            m = share.clone() if "momentum" not in s else s["momentum"].mul(mu).add_(share)
            starts.append(g.sub(share + mu * m, alpha=lr))
        else:
            starts.append(g.sub(share, alpha=lr))
    return starts


def pending_means(opt: SparseLoCo) -> list[torch.Tensor | None]:
    """The settled round's average per parameter (dense fp32), None where none is pending."""
    if opt._flight is None or opt._flight.received is None:
        return [None] * len(opt._model_params)
    means, _, _ = opt._flight.received
    return [None if m is None else _dense(m) for m in means]


def pending_errors(opt: SparseLoCo) -> list[torch.Tensor | None]:
    """The error buffers of the settled round (committed when it lands), None where none."""
    if opt._flight is None or opt._flight.received is None:
        return [None] * len(opt._model_params)
    return list(opt._flight.received[1])


def loaded_flight(means: list[torch.Tensor | None], status: object, world: int, where: str) -> InFlight:
    """A saved round as a received one: its status rows (``status``: one dict of
    :class:`~cokit.compress.agreement.Report` fields per rank, checked here) and, when no rank
    reported a non-finite pseudo-gradient, its average (its error buffers were saved committed)."""
    fields = {f.name for f in dataclasses.fields(Report)}
    rows: list[Any] = status if isinstance(status, list) else []
    ok = isinstance(status, list) and len(rows) == world
    ok = ok and all(
        isinstance(d, dict)
        and set(d) == fields
        and all(isinstance(v, int) and not isinstance(v, bool) for v in d.values())
        for d in rows
    )
    if not ok:
        raise ValueError(f"{where}: the saved status of the round in flight {status!r} is damaged")
    rnd = Round([Report(**d) for d in rows], torch.zeros((world, 0), dtype=torch.uint8))
    received: list[Mean | None] = [None if m is None else (m, None) for m in means]
    return InFlight(None, None, rnd, None if rnd.bad else (received, [None] * len(means), None))


def saved_status(opt: SparseLoCo) -> list[dict[str, int]] | None:
    """The settled round's status rows as JSON (None: nothing in flight)."""
    if opt._flight is None:
        return None
    return [dataclasses.asdict(rep) for rep in opt._flight.round().reports]


def _dense(mean: Mean) -> torch.Tensor:
    values, positions = mean
    assert positions is None, "eager rounds decode dense means"
    return values


def state_keys(rank: int) -> tuple[str, str]:
    """The state keys of ``sync="eager"``: the round's average (shared), the start point (this rank's)."""
    return "pending", f"start_rank{rank}"
