"""The front-end base: what DeMo, SparseLoCo, Dion and the DDP hook share on the exchange core.

Every front end opens its rounds the same way and fails the same way; this module is the one
place where that is written:

- :func:`check_gradients`: gradients exist where they should, dense and shaped like their
  parameters (raised before anything is sent);
- :meth:`FrontEnd.open_round`: the round prologue: which parameters have a gradient, which
  gradients are non-finite (a GradScaler's scale taken off in the same pass), this rank's
  ``found_inf``, and the exchange core's agreement (:meth:`Exchange.agree`) over all of it;
- :meth:`FrontEnd.skip_or_raise`: the one skip-or-raise path after a round that found a
  GradScaler's inf or non-finite values, with one message (:func:`nonfinite_message`);
- :meth:`FrontEnd.check_replicas`: the replicas start identical (float64 sums compared);
- :class:`FrontEndOptions`: the options every front end takes (process group, timeout,
  validation of peer bytes, clock, priority, non-finite mode, policy, precision, seed, bucket
  size, value dtype), checked and documented once, and the
  :class:`~cokit.compress.exchange.Exchange` they build;
- :func:`check_value_dtype` and :func:`plain`: the value-dtype check and the plain form of a
  hyper-parameter that every fingerprint and mismatch report uses.
"""

from __future__ import annotations

import dataclasses
import datetime
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from cokit.compress.agreement import FOUND_INF, Round, canonical, fingerprint
from cokit.compress.comm import DEFAULT_TIMEOUT_S, parse_timeout
from cokit.compress.exchange import Exchange, ExchangeOwner
from cokit.compress.groups import check_process_group
from cokit.compress.guards import Amp, nonfinite
from cokit.compress.named_params import param_name
from cokit.compress.payload import VALUE_DTYPES
from cokit.compress.precision import check_precision
from cokit.compress.priority import check_comm_priority, priority_group
from cokit.compress.stats import CommStats
from cokit.triton_kernels._checks import check_choice, check_flag, check_int, check_number

__all__ = [
    "NONFINITE",
    "NOTHING_CHANGED",
    "FrontEnd",
    "FrontEndOptions",
    "check_gradients",
    "check_nonfinite_mode",
    "check_value_dtype",
    "nonfinite_message",
    "plain",
    "run_closure",
]

#: what a non-finite value found by a round does: raise on every rank, or skip on every rank
NONFINITE = ("error", "skip")
#: what a round that stopped before its exchange changed
NOTHING_CHANGED = "no parameter and no buffer changed"
#: when the replicas are compared (:meth:`FrontEnd.check_replicas`)
AT_FIRST_STEP = "at the first step (or the first after a load)"

Namer = Callable[[int], str]


@dataclasses.dataclass(frozen=True)
class FrontEndOptions:
    """The options every front end takes, checked once (:meth:`checked`), documented here once.

    Args:
        process_group: the group exchanged over (None: the world; none initialized or world
            size 1: local steps without communication).
        timeout: seconds (or a timedelta) each collective may take before an error naming the
            front end (default :data:`~cokit.compress.comm.DEFAULT_TIMEOUT_S`, 300 s; None or
            inf: only the process group's own, gloo's 30 min by default). After a timeout the
            group is aborted: restart every rank from its checkpoint.
        validate_payload: check what every peer sent before it is used (positions inside their
            tiles and in order, finite values and dense results; :mod:`cokit.compress.peer_check`):
            a malformed payload raises on every rank, naming the sender. False skips the check for
            a fleet you trust.
        clock: seconds for the timing a network policy measures (``time.perf_counter``; tests
            inject a fake clock).
        comm_priority: priority of the exchange's collectives: ``"normal"``, ``"high"`` or an
            integer stream priority (negative = high; :mod:`cokit.compress.priority`). On NCCL/RCCL
            a high priority makes one new process group over the exchange group's ranks, with
            high-priority streams, at construction (collective over the default group: every rank
            must pass the same value); on gloo it has no effect. ``comm_priority_info`` says what it
            achieved. It is agreed every round and is not part of ``state_dict()``.
        comm_guard: None, or a guard with ``violations(config=None, *, priority=...)`` (e.g.
            :class:`cokit.overlap.guard.StarvationGuard`): a ``comm_priority`` it refuses raises
            ``GuardViolation`` (a ``ValueError``) naming the limit, before anything is built.
        nonfinite: what a non-finite value found by a round does: ``"error"`` raises on every
            rank, naming the tensor and rank; ``"skip"`` skips it on every rank with a warning
            (counted by the front end). A GradScaler's ``found_inf`` skips the step silently.
        policy: a network policy (:mod:`cokit.compress.policy`), its name or
            ``{"name": ..., **arguments}``; None: static. Each front end follows the decisions it
            can (DeMo: k, payload, dense, skip; SparseLoCo: the sync interval).
        precision: how fp32 updates reach fp16/bf16 parameters (:mod:`cokit.compress.precision`):
            ``"nearest"`` (warns once when such parameters exist), ``"master"`` (fp32 masters) or
            ``"stochastic"`` (unbiased rounding drawn from ``seed``, alike on every rank).
        seed: the seed of every draw that must be alike on every rank, in [0, 2**63).
        bucket_cap_mb: fp32 megabytes per bucket (one collective each), > 0.
        value_dtype: dtype of payload values or scales (bf16, fp16 or fp32); the codec decides
            how it applies.
    """

    process_group: Any = None
    timeout: float | datetime.timedelta | None = DEFAULT_TIMEOUT_S
    validate_payload: bool = True
    clock: Callable[[], float] = time.perf_counter
    comm_priority: str | int = "normal"
    comm_guard: Any = dataclasses.field(default=None, compare=False)
    nonfinite: str = "error"
    policy: Any = None
    precision: str = "nearest"
    seed: int = 0
    bucket_cap_mb: float = 25.0
    value_dtype: torch.dtype = torch.bfloat16

    @classmethod
    def checked(
        cls, where: str, options: Mapping[str, Any], *, process_group: Any = None, takes: Iterable[str] = ()
    ) -> FrontEndOptions:
        """The options of front end ``where`` (keyword arguments ``options``), each checked, or an
        error naming the option. ``takes`` limits them to what ``where`` supports (default: all)."""
        allowed = set(takes) or {f.name for f in dataclasses.fields(cls)} - {"process_group"}
        unknown = sorted(set(options) - allowed)
        if unknown:
            raise TypeError(
                f"{where}() got an unexpected keyword argument {unknown[0]!r} (its options are "
                f"{', '.join(sorted(allowed))})"
            )
        out = cls(process_group=process_group, **options)
        check_process_group(where, out.process_group)
        parse_timeout(out.timeout, f"{where}.step")  # named as the exchange names its collectives
        check_flag("validate_payload", out.validate_payload, where=where)
        if not callable(out.clock):
            raise TypeError(f"{where}: clock must be a callable returning seconds, got {out.clock!r}")
        check_comm_priority(where, out.comm_priority, out.comm_guard)
        check_nonfinite_mode(where, out.nonfinite)
        check_precision(where, out.precision)
        check_int("seed", out.seed, 0, where=where)
        if out.seed >= 2**63:
            raise ValueError(f"{where}: seed must be an integer in [0, 2**63), got {out.seed!r}")
        check_number("bucket_cap_mb", out.bucket_cap_mb, 0.0, low_open=True, where=where)
        check_value_dtype(where, out.value_dtype)
        return out

    @property
    def bucket_cap_bytes(self) -> int:
        return int(self.bucket_cap_mb * 2**20)

    def exchange(
        self,
        where: str,
        *,
        group: Any = None,
        agree_groups: Sequence[Any] = (),
        local: bool = False,
        on_blocked: Callable[[float], None] | None = None,
    ) -> Exchange:
        """The exchange core over ``group`` (default: ``process_group``) for the front end
        ``where``, its collectives on the group made for ``comm_priority``."""
        group = self.process_group if group is None else group
        return Exchange(
            f"{where}.step",
            group,
            self.timeout,
            agree_groups=agree_groups,
            local=local,
            validate=self.validate_payload,
            clock=self.clock,
            on_blocked=on_blocked,
            priority=priority_group(group, self.comm_priority, local=local, where=where),
        )


def check_nonfinite_mode(where: str, value: object) -> str:
    """``nonfinite=`` as one of :data:`NONFINITE`."""
    return check_choice("nonfinite", value, NONFINITE, where=where)


def check_value_dtype(where: str, value_dtype: object) -> torch.dtype:
    """``value_dtype=`` as one of the payload value dtypes (fp16, bf16, fp32)."""
    if value_dtype not in VALUE_DTYPES:
        raise TypeError(f"{where}: value_dtype must be torch.float16, bfloat16 or float32, got {value_dtype}")
    assert isinstance(value_dtype, torch.dtype)
    return value_dtype


def plain(value: object) -> object:
    """A hyper-parameter as plain JSON-able Python, so equal values compare and print equal on
    every rank: tensors as their number (or a tuple of numbers), ints as floats (lr=1 and
    lr=1.0 agree), sequences element-wise; bools and strings as they are."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else tuple(value.flatten().tolist())
    if isinstance(value, (tuple, list)):
        return [plain(v) for v in value]
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def nonfinite_message(
    owner: str, where: str, *, what: str = "gradient", changed: str = NOTHING_CHANGED
) -> str:
    """The error of a round that found a non-finite value: where it is (tensor, rank, step),
    what changed, and what to do."""
    return (
        f"{owner}: non-finite {what} in {where}; {changed}. Lower the lr, fix the data or the loss "
        "scale, or pass nonfinite='skip' to skip such steps on every rank"
    )


def run_closure(closure: Callable[[], Any] | None) -> Any:
    """An optimizer step's closure, run with gradients on (its loss; None without one)."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def check_gradients(owner: str, params: Sequence[torch.Tensor], name: Namer) -> list[bool]:
    """Which of ``params`` have a gradient; raises unless each gradient is dense (``TypeError``)
    and shaped like its parameter (``ValueError``); ``params`` may be DTensor parameters."""
    has_grad = []
    for n, p in enumerate(params):
        g = p.grad
        if g is not None and g.is_sparse:
            raise TypeError(f"{owner}: {name(n)} has a sparse gradient; {owner} needs dense gradients")
        if g is not None and g.shape != p.shape:
            raise ValueError(
                f"{owner}: the gradient of {name(n)} has shape {tuple(g.shape)}; {owner} needs "
                "gradients shaped like their parameters"
            )
        has_grad.append(g is not None)
    return has_grad


class FrontEnd(ExchangeOwner):
    """A front end on the exchange core (module docstring). Subclasses set ``owner`` (the name
    in messages) and ``nonfinite``."""

    owner: str
    nonfinite: str
    comm_stats: CommStats

    @property
    def bytes_per_step(self) -> float:
        """Bytes this rank sent per step, the mean over every step so far."""
        return self.comm_stats.total_sent_bytes / max(self.comm_stats.steps, 1)

    def _describe(self, globally: bool = False) -> dict[str, Any]:
        """What every rank must agree on, as JSON (the fingerprint's input, the mismatch report)."""
        raise NotImplementedError

    def _fingerprints(self) -> tuple[int, int]:
        """(exchange group, agreement groups) fingerprints: one, of :meth:`_describe`, for a
        front end whose ranks hold whole tensors."""
        fp = fingerprint(canonical(self._describe()))
        return fp, fp

    def open_round(
        self,
        grads: Sequence[torch.Tensor | None],
        amp: Amp,
        *,
        fingerprints: tuple[int, int],
        describe: Callable[[bool], dict[str, Any]],
        name: Namer,
        device: torch.device,
        extra: torch.Tensor | None = None,
        events: int = 0,
    ) -> Round:
        """The round prologue over ``grads`` (None where a parameter has no gradient, already
        checked by :func:`check_gradients`): the non-finite ones are found (and unscaled by the
        GradScaler's scale in the same pass), then every rank agrees on settings, the set of
        gradients, non-finite reports and events (``found_inf`` added). Raises on every rank
        when anything disagrees; nothing has changed by then."""
        has_grad = [g is not None for g in grads]
        where = [n for n, has in enumerate(has_grad) if has]
        present = [g for g in grads if g is not None]
        bad = [where[j] for j in nonfinite(present, amp.inv_scale)]
        report = self.exchange.report(
            bad, grads=fingerprint(bytes(has_grad)), events=events | (FOUND_INF if amp.found_inf else 0)
        )
        return self.exchange.agree(
            fingerprints,
            report,
            describe,
            extra=extra,
            device=device,
            has_grad=lambda: has_grad,
            names=name,
        )

    def open_params_round(
        self, params: Sequence[torch.Tensor], *, extra: torch.Tensor | None = None
    ) -> tuple[Round, list[bool]]:
        """:meth:`open_round` over a flat list of parameters named by ``self._name`` (Dion, the
        dense warm-up of SparseLoCo), after :func:`check_gradients`; also which have a gradient."""
        name: Namer = self._name
        has_grad = check_gradients(self.owner, params, name)
        rnd = self.open_round(
            [p.grad for p in params],
            Amp.of(self),
            fingerprints=self._fingerprints(),
            describe=self._describe,
            name=name,
            device=params[0].device,
            extra=extra,
        )
        return rnd, has_grad

    def skip_or_raise(
        self,
        rnd: Round,
        name: Namer,
        *,
        when: str,
        what: str = "gradient",
        changed: str = NOTHING_CHANGED,
        unit: str = "step",
    ) -> bool:
        """True to go on with the round; False when every rank skips it (the caller counts it):
        a GradScaler found inf on some rank (silently: the scaler lowers its scale), or some rank
        found a non-finite ``what`` under ``nonfinite='skip'`` (with a warning). Raises
        ``FloatingPointError`` on every rank under ``nonfinite='error'``. ``when`` says which
        step, ``changed`` what changed by now, ``unit`` what is skipped."""
        if rnd.any_event(FOUND_INF):
            return False
        if not rnd.bad:
            return True
        where = f"{rnd.where_bad(name)} at {when}"
        if self.nonfinite == "error":
            raise FloatingPointError(nonfinite_message(self.owner, where, what=what, changed=changed))
        warnings.warn(
            f"{self.owner}: skipped a {unit} on every rank: non-finite {what} in {where}; {changed}",
            stacklevel=4,
        )
        return False

    def _name(self, n: int) -> str:
        """Parameter ``n`` of a front end over a flat parameter list (``_model_params``, their
        names in ``_names``), as messages name it."""
        return param_name(self._model_params, self._names, n)

    def check_replicas(self, named: Sequence[tuple[str, torch.Tensor]], *, when: str = AT_FIRST_STEP) -> None:
        """Raise ``ValueError`` on every rank unless every rank holds the same tensors (``(name,
        tensor)`` pairs; their float64 sums compared, 0 for empty ones), naming the first that
        differs and the ranks that hold other values than the group's first. Every rank must
        pass as many tensors (decide them from agreed settings and counters)."""
        if not named:
            return
        tensors = [t for _, t in named]
        device = tensors[0].device  # (a step count may sit on the CPU beside CUDA tensors)
        sums = torch.stack([t.detach().double().sum().to(device) for t in tensors])
        seen = self.exchange.wait(self.comm.all_gather(sums, "parameter check")).cpu()
        differ = (seen != seen[:1]).any(dim=0).nonzero().flatten().tolist()
        if differ:
            first = differ[0]
            others = [
                self.exchange.global_rank(r) for r in range(len(seen)) if seen[r, first] != seen[0, first]
            ]
            raise ValueError(
                f"{self.owner}: {named[first][0]} differs between the ranks {when}: rank(s) {others} hold "
                f"other values than rank {self.exchange.global_rank(0)}; every rank must start from the same "
                "weights and state (seed the model alike or broadcast rank 0's; load each rank's own "
                "checkpoint of one run)"
            )
