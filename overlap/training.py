"""Overlap in the training step: a model's ``nn.Linear`` layers on cokit's GEMM, with
occupancy-shaped configs that an online tuner picks while the model trains.

    tuning = apply_overlap(model, optimizer=opt)   # replaces every nn.Linear in place
    for batch in data:
        loss(model, batch).backward()
        opt.step()                                  # the tuner measures and decides here
        opt.zero_grad()
    tuning.undo()                                   # the original nn.Linear modules again

What :func:`apply_overlap` does (docs/design.md §1.2, Cui & Pericas):

- replaces every ``torch.nn.Linear`` with :class:`cokit.overlap.layers.Linear` sharing its
  parameters (the state dict's keys and values do not change; :meth:`OverlapTuning.undo` puts
  the originals back);
- groups the layers by GEMM shape class (in and out features, dtype, bias): layers of a class
  always run one config;
- gives every class an :class:`~cokit.overlap.tuner.OnlineTuner` over occupancy-shaped
  candidates (:func:`shaped_candidates`: the vendor's configs, a larger shared-memory footprint
  per block, a persistent GEMM that leaves SMs to communication), pruned by the
  :class:`~cokit.overlap.guard.StarvationGuard`;
- times each training step (CUDA events on a GPU, ``time.perf_counter`` on CPU, or an injected
  clock) and tunes the classes one at a time: one step time cannot tell apart changes made to
  several classes at once. A class locks its best config, the next class explores; when the
  locked step time drifts, every class explores again;
- makes every rank take the same decision at the same step, through the exchange core's status
  exchange (:meth:`cokit.compress.exchange.Exchange.agree`): once when applied (the classes and
  candidates: a rank that differs is refused before any layer changes), then at each decision
  point (a class's exploration plan done; every ``window`` steps while locked: between them
  the configs follow the agreed plan, whatever the times). The row carries that batch's step
  times (the slowest rank's is the step's) and a fingerprint of every tuner's state, so ranks
  whose tuners diverged are refused with the same error before the decision applies;
- writes every config in use and every decision to a :class:`cokit.telemetry.Monitor` when
  one is given, so the dashboard's kernel/occupancy and tuner panels fill.

Only exact ``nn.Linear`` modules are replaced. Subclasses are left as they are, among them
``nn.MultiheadAttention.out_proj`` (a ``NonDynamicallyQuantizableLinear``): the attention
computes its output projection inside ``F.multi_head_attention_forward`` from
``out_proj.weight`` and ``out_proj.bias`` and never calls ``out_proj``, so a replaced layer
would never run.

On CPU the GEMM runs the torch path (or the Triton interpreter): configs change no timing
there, but the records and the agreement are real. On the torch path (CPU tensors without
``TRITON_INTERPRET``) :class:`~cokit.overlap.layers.Linear` is ``F.linear`` itself, so the
replaced model costs what the original does; what remains is :meth:`OverlapTuning.step`
(microseconds per step). :attr:`OverlapTuning.note` says so, and it is logged (logger
``cokit.overlap.training``, INFO).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from cokit.compress.agreement import Report, canonical, fingerprint
from cokit.compress.comm import DEFAULT_TIMEOUT_S
from cokit.compress.exchange import Exchange
from cokit.triton_kernels._checks import check_int, check_number
from cokit.triton_kernels.backend import ArchLimits, arch_limits, cached_device_limits, kernel_path
from cokit.triton_kernels.gemm_config import (
    GemmConfig,
    config_space,
    dtype_name,
    estimate_shared_bytes,
    next_pow2,
    prune_configs,
)

from .guard import GuardViolation, StarvationGuard
from .layers import Linear
from .tuner import OnlineTuner

__all__ = ["OverlapTuning", "ShapeClass", "apply_overlap", "shaped_candidates"]

_OWNER = "apply_overlap"
_log = logging.getLogger(__name__)
#: what the overlap can do on each CPU kernel path (GPU paths: tune for real)
_PATH_NOTES = {
    "torch": (
        "the GEMM runs torch code here (CPU tensors without TRITON_INTERPRET): the replaced layers "
        "call F.linear, as nn.Linear does, so their configs change no timing and the overlap cannot "
        "speed this step up; the tuner runs for its records (telemetry, agreement), at the cost of "
        "OverlapTuning.step only"
    ),
    "interpreter": (
        "the GEMM runs in the Triton interpreter (TRITON_INTERPRET on CPU tensors), a test path many "
        "times slower than torch: the configs run but their timing means nothing"
    ),
}
#: step times one agreement carries at most (a class's candidates x trials, or the window)
MAX_BATCH = 64
#: SMs/CUs left to communication by the persistent candidates, as fractions of the device
RESERVE_FRACTIONS = (0.125, 0.25)


def shaped_candidates(
    in_features: int,
    out_features: int,
    dtype: torch.dtype,
    limits: ArchLimits,
    guard: StarvationGuard,
    *,
    comm_sms: int | None = None,
    max_candidates: int = 6,
) -> tuple[list[GemmConfig], list[str]]:
    """Occupancy-shaped GEMM configs for one shape class, and why others were left out.

    From the vendor's space (pruned to the device; the configs whose tiles exceed the class's
    N = ``out_features`` and K = ``in_features`` least come first, the vendor's order among
    equals; the batch rows are not known here), in this order: the first config as is; the
    same with twice its shared-memory footprint per block (fewer blocks per SM: room for
    communication kernels); its persistent form leaving each of :data:`RESERVE_FRACTIONS` of
    the SMs/CUs to communication; the space's next configs (other tiles, warps, stages). Each must pass ``guard`` (with ``comm_sms`` SMs
    taken by communication) and the config's own validation; the returned reasons name what
    each rejected candidate breaks.
    """
    fitting = prune_configs(config_space(limits.backend, dtype=dtype), dtype, limits)
    cap_n, cap_k = (max(16, next_pow2(d)) for d in (out_features, in_features))

    def excess(c: GemmConfig) -> float:  # how much of a tile falls outside the matrix
        return max(c.BLOCK_N / cap_n, 1.0) * max(c.BLOCK_K / cap_k, 1.0)

    space = sorted(fitting, key=excess)  # stable: the vendor's order among equals
    if not space:
        raise ValueError(f"no {limits.backend} GEMM config fits {limits.name} for {dtype_name(dtype)}")
    base = space[0]
    natural = estimate_shared_bytes(base, dtype, limits)
    shaped: list[GemmConfig] = [base]
    if 2 * natural <= limits.max_shared_per_block:
        shaped.append(dataclasses.replace(base, smem_bytes=2 * natural))
    for fraction in RESERVE_FRACTIONS:
        keep = limits.num_sms - max(1, round(fraction * limits.num_sms))
        shaped.append(dataclasses.replace(base, persistent=True, num_sms=keep))
    shaped.extend(space[1:])
    out: list[GemmConfig] = []
    rejected: list[str] = []
    for cfg in shaped:
        if cfg in out:
            continue
        bad = guard.violations(cfg, limits=limits, dtype=dtype, comm_sms=comm_sms)
        try:
            cfg.validate(limits.backend, limits, dtype=dtype)
        except ValueError as exc:
            bad.append(str(exc))
        if bad:
            rejected.append(f"{cfg.spec()}: {'; '.join(bad)}")
        elif len(out) < max_candidates:
            out.append(cfg)
    return out, rejected


@dataclasses.dataclass
class ShapeClass:
    """The layers of one GEMM shape class and the tuner that picks their config."""

    key: str
    in_features: int
    out_features: int
    dtype: torch.dtype
    names: list[str]
    modules: list[Linear]
    tuner: OnlineTuner
    held: GemmConfig  # the config while another class explores (the locked one once tuned)

    def apply(self, config: GemmConfig) -> None:
        for m in self.modules:
            if m.config != config:
                m.config = config


class _Laps:
    """Milliseconds between consecutive :meth:`lap` calls: CUDA events on a GPU (the event
    is waited for, so a lap is the device's time), else ``clock`` (milliseconds)."""

    def __init__(self, device: torch.device, clock: Callable[[], float] | None) -> None:
        self.events = clock is None and device.type == "cuda"
        self.clock = clock or (lambda: time.perf_counter() * 1e3)
        self.device = device
        self._last: Any = None

    def lap(self) -> float | None:
        if self.events:
            now: Any = torch.cuda.Event(enable_timing=True)
            now.record(torch.cuda.current_stream(self.device))
            now.synchronize()
            elapsed = None if self._last is None else float(self._last.elapsed_time(now))
        else:
            now = float(self.clock())
            elapsed = None if self._last is None else now - self._last
        self._last = now
        return elapsed

    def restart(self) -> None:
        """Forget the last mark (the next lap only marks): time outside steps is not a step."""
        self._last = None


class OverlapTuning:
    """What :func:`apply_overlap` set up: the replaced layers, one tuner per shape class, the
    step timer and the agreement. :meth:`step` (called by the optimizer's step hook, or by you
    after each training step) measures, agrees and applies the next configs."""

    def __init__(
        self,
        replaced: list[tuple[nn.Module, str, nn.Linear, Linear]],
        classes: list[ShapeClass],
        *,
        laps: _Laps,
        exchange: Exchange,
        limits: ArchLimits,
        monitor: Any,
        path: str | None = None,
    ) -> None:
        self._replaced = replaced
        #: the kernel path of the model's layers ('cuda', 'hip', 'interpreter', 'torch')
        self.kernel_path = path
        self.classes = classes
        self.limits = limits
        self.exchange = exchange
        self.monitor = monitor
        self.active = 0
        self.steps = 0
        self._laps = laps
        self._hook: Any = None
        self._undone = False
        self._recorded = False  # the monitor has every class's config
        self._times: list[float] = []  # this rank's step times since the last agreement
        self._batch = self._next_batch()
        self._apply()

    # ------------------------------------------------------------------ state
    @property
    def note(self) -> str | None:
        """Why the configs change no timing on this kernel path (CPU), or None (a GPU)."""
        return _PATH_NOTES.get(self.kernel_path or "")

    def configs(self) -> dict[str, GemmConfig]:
        """The config each shape class runs now."""
        return {c.key: c.modules[0].config for c in self.classes if c.modules[0].config is not None}

    def describe(self) -> dict[str, Any]:
        """Every tuner's decision state, the active class and the step count (JSON-ready):
        what the ranks' fingerprints cover."""
        return {
            "steps": self.steps,
            "active": self.active,
            "batch": [c.spec() for c in self._batch],
            "classes": [
                {"key": c.key, "layers": len(c.names), "tuner": c.tuner.snapshot()} for c in self.classes
            ],
        }

    @property
    def decisions(self) -> list[dict[str, Any]]:
        """Every tuner event so far, with the class it belongs to."""
        return [{"class": c.key, **e} for c in self.classes for e in c.tuner.log]

    # ------------------------------------------------------------------ the step
    def step(self, elapsed_ms: float | None = None) -> None:
        """End a training step: time it (``elapsed_ms``, or the lap since the last call; the
        first call only starts the clock) and apply the configs of the next step.

        The exploring class runs its tuner's plan, one candidate per step (the order does not
        depend on the times); the times are agreed with every rank when the plan is done (a
        locked class: every ``window`` steps), then fed to the tuner, whose decision (lock,
        drift) applies from the next step. Between agreements nothing depends on the times."""
        if self._undone:
            raise RuntimeError("apply_overlap was undone; call apply_overlap again to tune")
        if elapsed_ms is not None and (
            isinstance(elapsed_ms, bool)
            or not isinstance(elapsed_ms, (int, float))
            or not (math.isfinite(elapsed_ms) and elapsed_ms >= 0)
        ):
            raise ValueError(f"elapsed_ms={elapsed_ms!r} is invalid; allowed: a finite time >= 0")
        lap = self._laps.lap()
        if elapsed_ms is None:
            elapsed_ms = lap
        if elapsed_ms is None:  # the clock (re)started: this step ran its config unmeasured
            return
        self.steps += 1
        self._times.append(float(elapsed_ms))
        if len(self._times) == len(self._batch):
            self._decide(self._agree(self._times))
        self._apply()
        self._laps.lap()  # the agreement and the switch are not part of the next step

    def _decide(self, agreed: list[float]) -> None:
        """Feed the agreed times of the batch to the active class's tuner; move on when it
        locked, re-explore every class when the locked time drifted."""
        cls = self.classes[self.active]
        was_locked = cls.tuner.state == "locked"
        for candidate, t in zip(self._batch, agreed, strict=True):
            if cls.tuner.choose() != candidate:  # the tuner decided mid-batch (drift): the rest is stale
                break
            cls.tuner.record(candidate, t)
        if cls.tuner.state == "locked" and not was_locked:
            cls.held = cls.tuner.locked
            if self.active + 1 < len(self.classes):
                self.active += 1
        elif was_locked and cls.tuner.state == "exploring":  # the step time drifted
            for other in self.classes:
                if other is not cls:
                    other.tuner.reexplore(f"re-exploring: the step time drifted while {cls.key} was locked")
            self.active = 0
        self._times = []
        self._batch = self._next_batch()

    def _next_batch(self) -> list[GemmConfig]:
        """What the active class runs until the next agreement: its tuner's plan, or (locked)
        its config for ``window`` steps."""
        tuner = self.classes[self.active].tuner
        return tuner.plan() or [tuner.locked] * tuner.window

    def restart_clock(self) -> None:
        """Leave the time until the next :meth:`step` out of the measurements (an evaluation
        or a checkpoint ran since the last step): that call only restarts the clock, and the
        step it ends runs again with the same config."""
        self._laps.restart()

    def _agree(self, times: list[float]) -> list[float]:
        """The slowest rank's time of each step of the batch (:func:`_agree`)."""
        return _agree(self.exchange, self.describe(), times, self._laps.device)

    def _apply(self) -> None:
        """Every class's config for the next step: the active class's from its batch."""
        for i, c in enumerate(self.classes):
            config = self._batch[len(self._times)] if i == self.active else c.held
            changed = c.modules[0].config != config
            c.apply(config)
            if self.monitor is not None and (changed or not self._recorded):  # occupancy once per change
                self.monitor.add_kernel(
                    f"linear {c.key}",
                    config,
                    dtype=c.dtype,
                    target=self.limits.target_name if self.limits.source == "table" else None,
                )
        self._recorded = True

    # ------------------------------------------------------------------ lifetime
    def hook_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Call :meth:`step` after every ``optimizer.step()`` (a step post-hook)."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer (DeMo, SparseLoCo's inner optimizer, AdamW...), "
                f"got {type(optimizer).__name__}; or call tuning.step() after each training step"
            )
        if self._hook is not None:
            self._hook.remove()
        self._hook = optimizer.register_step_post_hook(lambda *_: self.step())

    def undo(self) -> None:
        """Put the original ``nn.Linear`` modules back, remove the step hook, close the tuners'
        logs and the monitor's kernel entries. Idempotent."""
        if self._undone:
            return
        for parent, name, original, _ in self._replaced:
            setattr(parent, name, original)
        if self._hook is not None:
            self._hook.remove()
        for c in self.classes:
            c.tuner.close()
            if self.monitor is not None:
                self.monitor.remove_kernel(f"linear {c.key}")
        self._undone = True

    def __repr__(self) -> str:
        parts = ", ".join(f"{c.key} x{len(c.names)} [{c.tuner.state}]" for c in self.classes)
        where = f"; {self.kernel_path} path: configs change no timing" if self.note else ""
        return f"OverlapTuning({parts}{where})"


def _agree(
    exchange: Exchange, state: dict[str, Any], times: list[float], device: torch.device
) -> list[float]:
    """One status row of the exchange core per rank: a fingerprint of ``state`` (every rank's
    must be the same, else ``SettingsMismatch`` on every rank) and ``times`` (at most
    :data:`MAX_BATCH`) as extra; returns the slowest rank's value of each time."""
    if not exchange.comm.distributed:
        return list(times)
    fp = fingerprint(canonical(state))
    padded = torch.full((MAX_BATCH,), math.nan, dtype=torch.float64)
    padded[: len(times)] = torch.tensor(times, dtype=torch.float64)
    with exchange.guarded():
        result = exchange.agree(
            (fp, fp), Report(), lambda _globally: state, extra=padded.view(torch.uint8), device=device
        )
        exchange.comm.reset_counts()
    every = result.extras.contiguous().view(torch.float64).reshape(-1, MAX_BATCH)[:, : len(times)]
    return every.max(dim=0).values.tolist()


def _class_key(module: nn.Linear) -> tuple[int, int, torch.dtype, bool]:
    return (module.in_features, module.out_features, module.weight.dtype, module.bias is not None)


def _linears(model: nn.Module) -> list[tuple[nn.Module, str, str, nn.Linear]]:
    """``(parent, attribute, qualified name, module)`` of every exact ``nn.Linear`` (subclasses,
    e.g. ``nn.MultiheadAttention.out_proj``, are not: module docstring)."""
    found = []
    for parent_name, parent in model.named_modules():
        for name, child in parent.named_children():
            if type(child) is nn.Linear:
                found.append((parent, name, f"{parent_name}.{name}" if parent_name else name, child))
    return found


def _path_of(device: torch.device) -> str | None:
    """The kernel path of ``device``, or None where no cokit kernel runs (a meta model)."""
    try:
        return kernel_path(device)
    except (ValueError, RuntimeError):
        return None


def _limits(device: torch.device, target: str | None) -> ArchLimits:
    if target is not None:
        return arch_limits(target)
    if device.type == "cuda":
        return cached_device_limits(device)
    return arch_limits("sm_90")


def apply_overlap(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    guard: StarvationGuard | None = None,
    candidates: Sequence[GemmConfig] | None = None,
    comm_sms: int | None = None,
    target: str | None = None,
    process_group: Any = None,
    timeout: float | None = DEFAULT_TIMEOUT_S,
    clock: Callable[[], float] | None = None,
    monitor: Any = None,
    trials: int = 2,
    drift_threshold: float = 0.2,
    window: int = 5,
    cooldown: int = 10,
    log_path: str | None = None,
) -> OverlapTuning:
    """Put the overlap on ``model`` in one call (module docstring); returns the handle.

    Args:
        model: any module with ``torch.nn.Linear`` layers (exact type; subclasses are left, e.g.
            ``nn.MultiheadAttention.out_proj``, which the attention never calls).
        optimizer: its ``step()`` ends each training step (a post-hook calls
            :meth:`OverlapTuning.step`); None: call ``tuning.step()`` yourself.
        guard: the starvation guard pruning the candidates (default ``StarvationGuard()``).
        candidates: GemmConfigs for every class instead of :func:`shaped_candidates`.
        comm_sms: SMs/CUs communication kernels occupy, counted against the guard.
        target: limits of a named chip ('sm_90', 'gfx942'...) instead of the live GPU's (on
            CPU the default is 'sm_90': the configs are recorded against that chip).
        process_group: the ranks that agree on each step's time and decisions (default: the
            world when torch.distributed is initialized).
        timeout: seconds the agreement may take (a dead peer raises instead of hanging).
        clock: milliseconds, for step times (tests inject one; default CUDA events on a GPU,
            ``time.perf_counter`` on CPU).
        monitor: a :class:`cokit.telemetry.Monitor`: configs in use and decisions go there.
        trials, drift_threshold, window, cooldown, log_path: each class's
            :class:`~cokit.overlap.tuner.OnlineTuner` (``log_path``: one JSONL per class,
            ``<log_path>.<i>.jsonl``).

    Raises ``ValueError`` (before anything changes) when the model has no ``nn.Linear``,
    when its layers sit on different devices, or when the guard rejects every candidate of
    a class (:class:`~cokit.overlap.guard.GuardViolation`, listing the limits and why each
    candidate broke them).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    found = _linears(model)
    if not found:
        left = sorted(
            {
                type(m).__name__
                for m in model.modules()
                if isinstance(m, nn.Linear) and type(m) is not nn.Linear
            }
        )
        why = (
            f" (its {', '.join(left)} layers are nn.Linear subclasses, left as they are: "
            "MultiheadAttention's out_proj, for one, is never called, its weight is used directly)"
            if left
            else ""
        )
        raise ValueError(
            f"{type(model).__name__} has no torch.nn.Linear layer{why}: apply_overlap replaces nn.Linear "
            "layers with cokit.overlap.Linear and tunes their GEMMs, so there is nothing to apply it to"
        )
    devices = {m.weight.device for *_, m in found}
    if len(devices) > 1:
        raise ValueError(f"the model's nn.Linear layers are on several devices ({sorted(map(str, devices))})")
    device = devices.pop()
    guard = guard if guard is not None else StarvationGuard()
    if not isinstance(guard, StarvationGuard):
        raise TypeError(f"guard must be a cokit.overlap.StarvationGuard, got {type(guard).__name__}")
    limits = _limits(device, target)
    for name, value, lo in (("trials", trials, 1), ("window", window, 1), ("cooldown", cooldown, 0)):
        check_int(name, value, lo, where=_OWNER)
    if window > MAX_BATCH:
        raise ValueError(
            f"{_OWNER}: window={window} is above {MAX_BATCH}, the step times one agreement carries"
        )
    check_number("drift_threshold", drift_threshold, low=0.0, low_open=True, where=_OWNER)
    if candidates is not None:
        candidates = list(candidates)
        if not candidates or not all(isinstance(c, GemmConfig) for c in candidates):
            raise ValueError("candidates must be a non-empty sequence of GemmConfig")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}; "
            "or pass none and call tuning.step() after each training step"
        )
    groups: dict[tuple[int, int, torch.dtype, bool], list[tuple[nn.Module, str, str, nn.Linear]]] = {}
    for entry in found:
        groups.setdefault(_class_key(entry[3]), []).append(entry)
    plans = []
    for (k, n, dtype, bias), members in groups.items():
        key = f"K{k}xN{n} {dtype_name(dtype)}{' +bias' if bias else ''}"
        if candidates is not None:
            cands, rejected = [], []
            for c in candidates:
                bad = guard.violations(c, limits=limits, dtype=dtype, comm_sms=comm_sms)
                (rejected.append(f"{c.spec()}: {'; '.join(bad)}") if bad else cands.append(c))
        else:
            cands, rejected = shaped_candidates(k, n, dtype, limits, guard, comm_sms=comm_sms)
        if len(cands) * trials > MAX_BATCH:
            raise ValueError(
                f"{_OWNER}: {len(cands)} candidates x trials={trials} for shape class {key} is above "
                f"{MAX_BATCH}, the step times one agreement carries; pass fewer candidates or trials"
            )
        if not cands:
            raise GuardViolation(
                f"apply_overlap: the starvation guard rejects every candidate of shape class {key} on "
                f"{limits.name} (limits: {guard.to_dict()}; communication occupies {comm_sms or 0} SMs): "
                + " | ".join(rejected)
            )
        plans.append((key, k, n, dtype, members, cands))
    exchange = Exchange(_OWNER, process_group, timeout)
    settings = {"trials": trials, "drift_threshold": drift_threshold, "window": window, "cooldown": cooldown}
    _agree(  # every rank must tune the same classes over the same candidates: refused before any change
        exchange,
        {
            "settings": settings,
            "classes": [{"key": p[0], "candidates": [c.spec() for c in p[5]]} for p in plans],
        },
        [],
        device,
    )
    # everything checked and agreed: from here on the model changes
    replaced = []
    classes = []
    for i, (key, k, n, dtype, members, cands) in enumerate(plans):
        tuner = OnlineTuner(
            cands,
            trials=trials,
            drift_threshold=drift_threshold,
            window=window,
            cooldown=cooldown,
            log_path=f"{log_path}.{i}.jsonl" if log_path is not None else None,
        )
        modules = []
        for parent, attr, _, original in members:
            new = Linear.from_linear(original, config=cands[0])
            setattr(parent, attr, new)
            replaced.append((parent, attr, original, new))
            modules.append(new)
        classes.append(ShapeClass(key, k, n, dtype, [m[2] for m in members], modules, tuner, cands[0]))
        if monitor is not None:
            monitor.attach_tuner(tuner)
    tuning = OverlapTuning(
        replaced,
        classes,
        laps=_Laps(device, clock),
        exchange=exchange,
        limits=limits,
        monitor=monitor,
        path=_path_of(device),
    )
    if tuning.note is not None:
        _log.info("apply_overlap: %s", tuning.note)
    if optimizer is not None:
        tuning.hook_optimizer(optimizer)
    return tuning
