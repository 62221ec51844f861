"""Distributed training runner: the same workload, seed and data order under several methods.

A *method* turns each rank's local gradients into a parameter update across ranks and reports
the bytes this rank put on the wire. Built in:

* ``"adamw"`` -- dense: one flat all-reduce (mean) of all gradients, then ``torch.optim.AdamW``;
  bytes counted as a ring all-reduce of the fp32 gradients.
* ``"sgd"`` -- the same exchange, then ``torch.optim.SGD`` (pass ``momentum`` in ``options``).
* ``"muon"`` -- the same exchange, then :class:`cokit.compress.inner.Muon` (Muon on the matrices,
  AdamW on embeddings, heads and vectors; ``options``: its keyword arguments): the dense baseline
  of SparseLoCo with a Muon inner optimizer (:func:`inner_optimizer` builds both).
* ``"demo"`` -- ``cokit.compress.DeMo``: it does its own (compressed) communication; bytes from its
  ``comm_stats``.
* ``"sparseloco"`` -- ``cokit.compress.SparseLoCo``: local steps of an inner optimizer (``inner``:
  ``"adamw"``, ``"sgd"`` or ``"muon"`` (:class:`cokit.compress.Muon`), at ``lr`` and
  ``weight_decay``), a compressed pseudo-gradient sync every
  ``sync_every`` steps; bytes amortized per step (non-sync steps send 0).
* ``"dion"`` -- ``cokit.compress.Dion``: low-rank orthonormalized updates with error feedback
  (``rank`` or ``rank_fraction`` in ``options``), AdamW on the other parameters; bytes from its
  ``comm_stats``.

More can be added with :func:`register_method`. :func:`run_method` runs one method on every rank
of an initialised process group; :func:`run_distributed` starts that group: ``world_size``
local processes on loopback (spawn), or, under ``torchrun``, the group the environment describes.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from cokit.compress.comm import DEFAULT_TIMEOUT_S, Communicator, parse_timeout
from cokit.compress.inner import EXCLUDE, Muon
from cokit.compress.stats import CommStats, dense_allreduce_bytes
from cokit.launch import backend_for, in_torchrun, local_device, run  # noqa: F401 - re-exported

Log = Callable[[str], None]
SCHEDULES = ("constant", "cosine")


class Workload(Protocol):
    """What the runner needs from a workload (see :class:`cokit.workloads.TextWorkload`)."""

    def build_model(self, seed: int) -> nn.Module: ...
    def train_batch(self, seed: int, step: int, rank: int, world_size: int) -> Any: ...
    def heldout_batches(self) -> list[Any]: ...
    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor: ...
    def info(self) -> dict: ...


class WorkloadFactory(Protocol):
    """A picklable recipe that builds a :class:`Workload` inside each rank's process."""

    def build(self, device: torch.device | str) -> Workload: ...


# --------------------------------------------------------------------------------------------
# methods


@dataclass
class MethodSpec:
    """A method and its hyper-parameters.

    ``options`` are passed as keyword arguments to the method's optimizer (for ``"demo"``:
    ``compression_topk``, ``compression_chunk``, ``compression_decay``, ``payload``, ...; for
    ``"adamw"``: ``betas``, ``eps``). ``label`` names the run in tables and plots.
    ``schedule`` (``"constant"`` or ``"cosine"``) and ``warmup`` shape the learning rate.
    ``timeout``: seconds each collective of the method may take before ``CollectiveTimeout``
    (``inf`` or ``None``: no limit but the process group's own).
    """

    name: str
    lr: float
    weight_decay: float = 0.0
    options: dict[str, Any] = field(default_factory=dict)
    label: str | None = None
    schedule: str = "constant"
    warmup: float = 0.0
    timeout: float | None = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        parse_timeout(self.timeout, f"method {self.display!r}")

    def lr_factor(self, step: int, steps: int) -> float:
        """Multiplier of ``lr`` at ``step`` (1-based) of ``steps``: linear warm-up over the
        first ``warmup`` fraction of steps, then constant or cosine decay to 10%."""
        warm = int(self.warmup * steps)
        if step <= warm:
            return step / (warm + 1)
        if self.schedule == "constant":
            return 1.0
        progress = (step - warm) / max(1, steps - warm)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    @property
    def display(self) -> str:
        """The name shown in tables, plots and file rows."""
        return self.label or self.name


class Method(ABC):
    """Exchange gradients across ranks and update the parameters with ``self.optimizer``."""

    optimizer: torch.optim.Optimizer

    def set_lr_factor(self, factor: float) -> None:
        """Scale every param group's initial learning rate by ``factor`` for the next step."""
        for group in self.optimizer.param_groups:
            group["lr"] = group.setdefault("initial_lr", group["lr"]) * factor

    @abstractmethod
    def step(self) -> tuple[int, int]:
        """Communicate and update; return (bytes this rank sent, bytes a dense ring all-reduce
        of the same gradients would have sent)."""

    @abstractmethod
    def zero_grad(self) -> None:
        """Clear the gradients."""

    def evaluation(self) -> contextlib.AbstractContextManager[None]:
        """Where held-out loss is measured: the weights every rank shares. Methods that step
        locally between syncs swap in the last sync's weights here; the others change nothing."""
        return contextlib.nullcontext()


MethodBuilder = Callable[[MethodSpec, nn.Module, "dist.ProcessGroup | None"], Method]
METHODS: dict[str, MethodBuilder] = {}


def register_method(name: str) -> Callable[[MethodBuilder], MethodBuilder]:
    """Decorator: make ``builder(spec, model, group) -> Method`` available as ``name``."""

    def deco(builder: MethodBuilder) -> MethodBuilder:
        METHODS[name] = builder
        return builder

    return deco


def build_method(spec: MethodSpec, model: nn.Module, group: dist.ProcessGroup | None = None) -> Method:
    """The :class:`Method` named by ``spec`` for ``model``'s parameters."""
    if spec.name not in METHODS:
        raise ValueError(f"unknown method {spec.name!r}; known: {', '.join(sorted(METHODS))}")
    return METHODS[spec.name](spec, model, group)


class DenseAllReduce(Method):
    """Average gradients with one flat all-reduce (a buffer reused across steps), then step a
    local torch optimizer. ``comm_stats`` holds the all-reduce's bytes and timing per step
    (what telemetry reads)."""

    def __init__(
        self,
        params: list[nn.Parameter],
        optimizer: torch.optim.Optimizer,
        group: dist.ProcessGroup | None = None,
        timeout: float | None = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.optimizer = optimizer
        owner = f"{type(optimizer).__name__} (dense all-reduce)"
        self.comm = Communicator(group, owner=owner, timeout=timeout)
        self.bytes_per_step = dense_allreduce_bytes(self.params, self.comm.world_size)
        self.comm_stats = CommStats()
        self._flat: torch.Tensor | None = None

    def step(self) -> tuple[int, int]:
        if self.comm.distributed:
            if self._flat is None:
                p0 = self.params[0]
                self._flat = torch.empty(
                    sum(p.numel() for p in self.params), dtype=p0.dtype, device=p0.device
                )
            views = self._flat.split([p.numel() for p in self.params])
            for p, v in zip(self.params, views, strict=True):
                if p.grad is None:
                    v.zero_()
                else:
                    v.copy_(p.grad.reshape(-1))
            self.comm.all_reduce_mean(self._flat, "gradient all-reduce").wait()
            for p, v in zip(self.params, views, strict=True):
                p.grad = v.view_as(p)
            sent, received, timing = self.comm.take_step()
            world = dist.get_world_size()
            self.comm_stats.record(sent, received, self.bytes_per_step, timing, world, self.comm.world_size)
        self.optimizer.step()
        return self.bytes_per_step, self.bytes_per_step

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)


@register_method("adamw")
def _build_adamw(spec: MethodSpec, model: nn.Module, group: dist.ProcessGroup | None) -> Method:
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=spec.lr, weight_decay=spec.weight_decay, **spec.options)
    return DenseAllReduce(params, opt, group, timeout=spec.timeout)


@register_method("sgd")
def _build_sgd(spec: MethodSpec, model: nn.Module, group: dist.ProcessGroup | None) -> Method:
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=spec.lr, weight_decay=spec.weight_decay, **spec.options)
    return DenseAllReduce(params, opt, group, timeout=spec.timeout)


@register_method("muon")
def _build_muon(spec: MethodSpec, model: nn.Module, group: dist.ProcessGroup | None) -> Method:
    named = list(model.named_parameters())
    build = inner_optimizer("muon", named, spec, dict(spec.options))
    opt = build([{"params": [p for _, p in named]}])
    return DenseAllReduce([p for _, p in named], opt, group, timeout=spec.timeout)


class DeMoMethod(Method):
    """``cokit.compress.DeMo``: compressed momentum exchange inside ``step()``."""

    def __init__(self, spec: MethodSpec, model: nn.Module, group: dist.ProcessGroup | None) -> None:
        from cokit.compress import DeMo  # lazy: the runner works without the optimizer module

        self.optimizer = DeMo(
            model.parameters(),
            lr=spec.lr,
            weight_decay=spec.weight_decay,
            process_group=group,
            **{"timeout": spec.timeout, **spec.options},  # an explicit options["timeout"] wins
        )

    @property
    def comm_stats(self) -> CommStats:
        """The optimizer's own byte and timing counts (SparseLoCo: 0 bytes between syncs)."""
        return self.optimizer.comm_stats  # type: ignore[attr-defined]  # a DeMo or SparseLoCo

    def step(self) -> tuple[int, int]:
        self.optimizer.step()
        stats = self.comm_stats
        return int(stats.step_sent_bytes), int(stats.step_dense_bytes)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)


register_method("demo")(DeMoMethod)

INNER_OPTIMIZERS = ("adamw", "sgd", "muon")
#: name substrings of the matrices Muon leaves to AdamW here: Muon's own (``embed``, ``head``, ...)
#: and ``emb`` (the text workloads' ``tok_emb`` and ``pos_emb``), so embeddings and heads take
#: AdamW as Muon's authors advise
MUON_ADAMW_NAMES = (*EXCLUDE, "emb")


def inner_optimizer(
    inner: str, named: Sequence[tuple[str, torch.Tensor]], spec: MethodSpec, options: dict[str, Any]
) -> Callable[[Any], torch.optim.Optimizer]:
    """``groups -> optimizer`` for the inner optimizer named ``inner`` (:data:`INNER_OPTIMIZERS`)
    at the spec's lr and weight decay, with ``options`` its keyword arguments. The groups list
    the parameters (or masters) of ``named`` in model order; Muon gets them as ``(name, tensor)``
    pairs, with :data:`MUON_ADAMW_NAMES` on AdamW unless ``options`` sets ``exclude``. The one
    builder of both SparseLoCo's inner optimizer and the dense ``"muon"`` method."""
    if inner not in INNER_OPTIMIZERS:
        raise ValueError(f"method {spec.display!r}: inner must be one of {INNER_OPTIMIZERS}, got {inner!r}")
    kind: Any = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD, "muon": Muon}[inner]
    if kind is Muon:
        options = {"exclude": MUON_ADAMW_NAMES, **options}

    def build(params: Any) -> torch.optim.Optimizer:
        if kind is Muon:
            names = iter(n for n, _ in named)
            params = [{**g, "params": [(next(names), p) for p in g["params"]]} for g in params]
        return kind(params, lr=spec.lr, weight_decay=spec.weight_decay, **options)

    return build


#: payload value dtypes by name (``options["value_dtype"]`` of ``"sparseloco"`` may be one)
VALUE_DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def value_dtype_named(name: str, owner: str) -> torch.dtype:
    """The payload value dtype called ``name`` (:data:`VALUE_DTYPE_NAMES`); ValueError otherwise."""
    if name not in VALUE_DTYPE_NAMES:
        raise ValueError(
            f"method {owner!r}: value_dtype must be one of {', '.join(VALUE_DTYPE_NAMES)}, got {name!r}"
        )
    return VALUE_DTYPE_NAMES[name]


class SparseLoCoMethod(DeMoMethod):
    """``cokit.compress.SparseLoCo``: ``options`` are its keyword arguments, with ``inner`` a name
    (``"adamw"``, the default, ``"sgd"`` or ``"muon"``: :class:`cokit.compress.inner.Muon`, Muon on
    the matrices and AdamW on the rest, its lr Muon's; :func:`inner_optimizer`), the inner lr /
    weight decay from the spec and ``value_dtype`` a dtype or its name
    (:data:`VALUE_DTYPE_NAMES`). The model's parameters go in by name (``dense_params`` selects by
    name; Muon keeps embeddings and heads on AdamW by name); ``dense_ends=True`` sends the input
    and output layers dense (:func:`end_layers`). Steps, zeroes and counts bytes as
    :class:`DeMoMethod` does (both communicate themselves)."""

    def __init__(self, spec: MethodSpec, model: nn.Module, group: dist.ProcessGroup | None) -> None:
        from cokit.compress import SparseLoCo  # lazy, like DeMo

        options = dict(spec.options)
        if isinstance(options.get("value_dtype"), str):  # a name keeps the spec JSON-ready
            options["value_dtype"] = value_dtype_named(options["value_dtype"], spec.display)
        named = list(model.named_parameters())
        build = inner_optimizer(
            options.pop("inner", "adamw"), named, spec, dict(options.pop("inner_options", {}))
        )
        if options.pop("dense_ends", False):
            options["dense_params"] = end_layers(named)
        self.optimizer = SparseLoCo(
            named,
            build,
            process_group=group,
            **{"timeout": spec.timeout, **options},
        )

    def evaluation(self) -> contextlib.AbstractContextManager[None]:
        """The last sync's weights (``theta_global``), the same on every rank. With
        ``sync="eager"`` the round in flight is applied first (``finish()``): landing it now
        rather than at the next sync changes nothing the run computes later."""
        self.optimizer.finish()  # type: ignore[attr-defined]
        return self.optimizer.synchronized()  # type: ignore[attr-defined]  # a SparseLoCo


register_method("sparseloco")(SparseLoCoMethod)


class DionMethod(DeMoMethod):
    """``cokit.compress.Dion``: ``options`` are its keyword arguments (``rank``,
    ``rank_fraction``, ``mu``, ``dense_params``, ...), lr and weight decay from the spec. The
    model's parameters go in by name (``dense_params`` selects by name); ``dense_ends=True``
    steps the input and output layers with AdamW on their averaged gradients
    (:func:`end_layers`). Steps, zeroes and counts bytes as :class:`DeMoMethod` does."""

    def __init__(self, spec: MethodSpec, model: nn.Module, group: dist.ProcessGroup | None) -> None:
        from cokit.compress import Dion  # lazy, like DeMo

        options = dict(spec.options)
        named = list(model.named_parameters())
        if options.pop("dense_ends", False):
            options["dense_params"] = end_layers(named)
        self.optimizer = Dion(
            named,
            lr=spec.lr,
            weight_decay=spec.weight_decay,
            process_group=group,
            **{"timeout": spec.timeout, **options},
        )


register_method("dion")(DionMethod)


def end_layers(named: Sequence[tuple[str, torch.Tensor]]) -> tuple[str, ...]:
    """The names of a model's input and output layers, for SparseLoCo's and Dion's ``dense_params``
    (the study's ``dense_ends`` option, which fits any model): its embeddings (matrices named
    ``*emb*``), or its first matrix when it has none, and its last matrix (the head)."""
    mats = [n for n, p in named if p.dim() >= 2]
    if not mats:
        raise ValueError("dense_ends: the model has no parameter of 2 or more dimensions")
    inputs = [n for n in mats if "emb" in n] or mats[:1]
    return tuple(dict.fromkeys([*inputs, mats[-1]]))


# --------------------------------------------------------------------------------------------
# one run


@dataclass
class RunResult:
    """Per-step records and a summary of one method's run (as seen from rank 0).

    ``train_loss[i]`` is the mean over ranks of step ``i+1``'s loss; ``bytes_sent`` is what
    rank 0 sent at that step; ``step_s`` the wall time of the whole step (batch, forward,
    backward, exchange, update), ``opt_s`` that of the exchange and update, ``wall_s`` the
    time since the run started (evaluations included). ``evals`` holds
    ``(step, held-out loss)`` at step 0, every ``eval_every`` steps and at the last step.
    """

    spec: MethodSpec
    world_size: int
    seed: int
    train_loss: list[float] = field(default_factory=list)
    bytes_sent: list[int] = field(default_factory=list)
    dense_bytes: list[int] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    opt_s: list[float] = field(default_factory=list)
    wall_s: list[float] = field(default_factory=list)
    evals: list[tuple[int, float]] = field(default_factory=list)
    max_replica_diff: float = 0.0
    num_params: int = 0
    environment: dict[str, Any] = field(default_factory=dict)

    @property
    def steps(self) -> int:
        """Number of steps taken."""
        return len(self.train_loss)

    def summary(self, tail: int | None = None) -> dict[str, Any]:
        """Final losses and per-step costs. ``final_train_loss`` is the mean over the last
        ``tail`` steps (default: a tenth of the run, at least one step); times are medians
        over the steps after the first (which pays one-off costs)."""
        n = self.steps
        tail = max(1, tail or n // 10)
        sent = sum(self.bytes_sent)
        dense = sum(self.dense_bytes)
        return {
            "method": self.spec.display,
            "steps": n,
            "final_train_loss": sum(self.train_loss[-tail:]) / len(self.train_loss[-tail:])
            if n
            else math.nan,
            "final_heldout_loss": self.evals[-1][1] if self.evals else math.nan,
            "bytes_per_step": sent / n if n else 0.0,
            "dense_bytes_per_step": dense / n if n else 0.0,
            "total_bytes_sent": sent,
            "compression_ratio": dense / sent if sent else math.inf,
            "time_per_step_s": median(self.step_s[1:] or self.step_s),
            "opt_time_per_step_s": median(self.opt_s[1:] or self.opt_s),
            "total_time_s": self.wall_s[-1] if self.wall_s else 0.0,
            "max_replica_diff": self.max_replica_diff,
        }

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: spec, summary and every per-step series."""
        return {
            "spec": asdict(self.spec),
            "world_size": self.world_size,
            "seed": self.seed,
            "num_params": self.num_params,
            "environment": self.environment,
            "summary": self.summary(),
            "evals": [{"step": s, "heldout_loss": v} for s, v in self.evals],
            "series": {
                "train_loss": self.train_loss,
                "bytes_sent": self.bytes_sent,
                "dense_bytes": self.dense_bytes,
                "step_s": self.step_s,
                "opt_s": self.opt_s,
                "wall_s": self.wall_s,
            },
        }


def median(xs: Sequence[float]) -> float:
    """The upper median of ``xs`` (NaN when empty)."""
    return sorted(xs)[len(xs) // 2] if xs else math.nan


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def _heldout_sum(
    workload: Workload, model: nn.Module, batches: list[Any], rank: int, world_size: int
) -> torch.Tensor:
    """Sum of this rank's share (batches ``rank::world_size``) of the held-out batch losses:
    a float64 tensor of shape ``(1,)`` on the model's device (no host sync)."""
    model.eval()
    losses = [workload.loss(model, b).double() for b in batches[rank::world_size]]
    model.train()
    if not losses:
        return torch.zeros(1, dtype=torch.float64, device=_device_of(model))
    return torch.stack(losses).sum().reshape(1)


def _max_replica_diff(model: nn.Module, group: dist.ProcessGroup | None) -> float:
    """Largest |p - p_rank0| over all parameters and ranks (0.0 when replicas agree)."""
    flat = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
    ref = flat.clone()
    dist.broadcast(ref, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    diff = (flat - ref).abs().max().reshape(1)
    dist.all_reduce(diff, op=dist.ReduceOp.MAX, group=group)
    return float(diff)


def run_environment(device: torch.device, group: dist.ProcessGroup | None = None) -> dict[str, Any]:
    """Where a run executes: device, collective backend, kernel path, threads, versions."""
    from cokit.triton_kernels.backend import kernel_path

    return {
        "device": str(device),
        "backend": dist.get_backend(group),
        "kernel_path": kernel_path(device),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
    }


def run_method(
    spec: MethodSpec,
    workload: Workload,
    steps: int,
    seed: int,
    *,
    eval_every: int = 25,
    group: dist.ProcessGroup | None = None,
    log: Log | None = None,
    time_budget_s: float | None = None,
    on_start: Callable[[Method], None] | None = None,
    on_end: Callable[[nn.Module], None] | None = None,
    telemetry_dir: str | os.PathLike | None = None,
    telemetry_run: str | None = None,
    overlap: bool = False,
    telemetry_sinks: Sequence[str] | None = None,
) -> RunResult:
    """Train a fresh model (init from ``seed``) for ``steps`` steps with ``spec`` on every rank.

    Call on every rank of an initialised process group. Each rank draws its batches from
    ``workload.train_batch(seed, step, rank, world_size)``; held-out loss is computed over
    ``workload.heldout_batches()`` (split across ranks, summed) at step 0, every ``eval_every``
    steps and at the end. ``log`` (used on rank 0 only) receives one progress line per
    evaluation. ``time_budget_s`` ends the run at the first evaluation after that much wall
    time (the ranks' mean, so all stop together). ``on_start(method)`` runs on every rank
    once the method is built, just before the clock starts (e.g. to wrap its communicator);
    ``on_end(model)`` on every rank after the last step, with the weights that evaluations see
    (:meth:`Method.evaluation`: for SparseLoCo/DiLoCo the last sync's).
    ``telemetry_dir``: each rank writes a :class:`cokit.telemetry.Monitor` stream there (run
    ``telemetry_run``, default the method's display name; evaluations are left out of its
    step times) to ``telemetry_sinks`` (sink names, default ``["jsonl"]``). ``overlap``: the
    model's linear layers run on cokit's GEMM with the configs an online tuner picks while
    training (:func:`cokit.overlap.training.apply_overlap`; its configs and decisions go to the telemetry).
    The result is complete on every rank.
    """
    if steps < 1 or eval_every < 1:
        raise ValueError("steps and eval_every must be >= 1")
    if time_budget_s is not None and not (math.isfinite(time_budget_s) and time_budget_s > 0):
        raise ValueError(f"time_budget_s must be a positive number of seconds, got {time_budget_s!r}")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    torch.manual_seed(seed)
    model = workload.build_model(seed)
    model.train()
    device = _device_of(model)
    method = build_method(spec, model, group)
    heldout = workload.heldout_batches()
    result = RunResult(
        spec=spec,
        world_size=world,
        seed=seed,
        num_params=sum(p.numel() for p in model.parameters()),
        environment=run_environment(device, group),
    )
    pending: list[float] = []  # local train losses not yet averaged over ranks
    say = log if (log is not None and rank == 0) else None

    def held_out_sum() -> torch.Tensor:
        with method.evaluation():
            return _heldout_sum(workload, model, heldout, rank, world)

    def checkpoint(step: int) -> bool:
        """Average pending train losses over ranks and evaluate held-out loss (one collective);
        True when the time budget is spent."""
        clock = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
        buf = torch.cat(
            [
                torch.tensor(pending, dtype=torch.float64, device=device),
                held_out_sum(),
                clock,
            ]
        )
        dist.all_reduce(buf, group=group)
        buf = buf.cpu() / world
        result.train_loss.extend(buf[:-2].tolist())
        heldout_loss = float(buf[-2]) * world / len(heldout)
        result.evals.append((step, heldout_loss))
        pending.clear()
        if say is not None:
            recent = result.train_loss[-eval_every:]
            train = f"{sum(recent) / len(recent):.3f}" if recent else "  -  "
            elapsed = time.perf_counter() - start
            say(
                f"[{spec.display}] step {step:>{len(str(steps))}}/{steps}  train {train}  "
                f"held-out {heldout_loss:.3f}  {elapsed:6.1f} s"
            )
        return time_budget_s is not None and float(buf[-1]) >= time_budget_s

    if on_start is not None:
        on_start(method)
    monitor = None
    if telemetry_dir is not None:
        monitor = _monitor(
            telemetry_dir, telemetry_run or spec.display, spec, method, result, group, telemetry_sinks
        )
    tuning = None
    if overlap:
        from cokit.overlap.training import apply_overlap

        tuning = apply_overlap(model, process_group=group, monitor=monitor, timeout=spec.timeout)
    try:
        start = time.perf_counter()
        with _paused(monitor):
            checkpoint(0)
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            method.set_lr_factor(spec.lr_factor(step, steps))
            batch = workload.train_batch(seed, step, rank, world)
            loss = workload.loss(model, batch)
            loss.backward()
            _sync(device)
            t1 = time.perf_counter()
            sent, dense = method.step()
            method.zero_grad()
            _sync(device)
            t2 = time.perf_counter()
            local_loss = float(loss.detach())
            pending.append(local_loss)
            result.bytes_sent.append(sent)
            result.dense_bytes.append(dense)
            result.step_s.append(t2 - t0)
            result.opt_s.append(t2 - t1)
            result.wall_s.append(t2 - start)
            spent, heldout_loss = False, None
            if step % eval_every == 0 or step == steps:
                with _paused(monitor):
                    spent = checkpoint(step)
                heldout_loss = result.evals[-1][1]
                result.wall_s[-1] = time.perf_counter() - start
            if monitor is not None:
                lr = method.optimizer.param_groups[0]["lr"]
                monitor.step(step, loss=local_loss, lr=lr, held_out_loss=heldout_loss, opt_s=t2 - t1)
            if tuning is not None:  # after the monitor: the configs it applies are the next step's
                if heldout_loss is not None:
                    tuning.restart_clock()  # this step's time includes an evaluation: not measured
                tuning.step()
            if spent:
                break
    except BaseException as exc:
        if monitor is not None:
            monitor.close(exc)
        raise
    finally:
        if tuning is not None:
            tuning.undo()
    if monitor is not None:
        monitor.close()
    with method.evaluation():
        result.max_replica_diff = _max_replica_diff(model, group)
        if on_end is not None:
            on_end(model)
    return result


def _monitor(
    out_dir: str | os.PathLike,
    run: str,
    spec: MethodSpec,
    method: Method,
    result: RunResult,
    group: dist.ProcessGroup | None,
    sinks: Sequence[str] | None = None,
) -> Any:
    """This rank's telemetry Monitor for one run, writing to ``sinks`` (names; default
    JSONL): it reads the method's ``comm_stats`` (bytes and timing) when it has them, else
    the optimizer (``comm`` null)."""
    from cokit.telemetry import Monitor

    source = method if getattr(method, "comm_stats", None) is not None else method.optimizer
    config = {
        "spec": asdict(spec),
        "seed": result.seed,
        "world_size": result.world_size,
        "num_params": result.num_params,
        "environment": result.environment,
    }
    return Monitor(
        out_dir, run, optimizer=source, group=group, config=config, method=spec.display, sinks=sinks
    )


def _paused(monitor: Any) -> contextlib.AbstractContextManager[None]:
    return monitor.paused() if monitor is not None else contextlib.nullcontext()


def run_methods(
    rank: int,
    world_size: int,
    specs: list[MethodSpec],
    factory: WorkloadFactory,
    steps: int,
    seed: int,
    eval_every: int,
    device: str,
    log: bool = True,
    telemetry_dir: str | None = None,
    telemetry_runs: Sequence[str] | None = None,
    overlap: bool = False,
    telemetry_sinks: Sequence[str] | None = None,
) -> list[RunResult]:
    """Worker body: build the workload on this rank's device and run each spec in turn
    (with telemetry in ``telemetry_dir``, runs named ``telemetry_runs``, one per spec, to
    ``telemetry_sinks``; with ``overlap``, on tuned cokit.overlap.Linear layers)."""
    if telemetry_runs is not None and len(telemetry_runs) != len(specs):
        raise ValueError(f"telemetry_runs names {len(telemetry_runs)} runs for {len(specs)} specs")
    workload = factory.build(local_device(device))
    printer: Log | None = (lambda line: print(line, flush=True)) if log else None
    return [
        run_method(
            s,
            workload,
            steps,
            seed,
            eval_every=eval_every,
            log=printer,
            telemetry_dir=telemetry_dir,
            telemetry_run=telemetry_runs[i] if telemetry_runs is not None else None,
            overlap=overlap,
            telemetry_sinks=telemetry_sinks,
        )
        for i, s in enumerate(specs)
    ]


# --------------------------------------------------------------------------------------------
# launching


def run_distributed(
    fn: Callable,
    *args: Any,
    world_size: int,
    device: str = "cpu",
    interpret: bool = False,
    timeout: float = 3600.0,
) -> Any:
    """Run ``fn(rank, world_size, *args)`` on every rank; return rank 0's result.

    Under ``torchrun`` this process is one rank of the group the environment describes
    (``world_size`` is ignored): it joins that group (or uses the one already initialised;
    a group it created is destroyed at the end) and returns its result on rank 0 and
    ``None`` elsewhere. Otherwise ``world_size`` processes are spawned on
    loopback (gloo for ``cpu``, NCCL for ``cuda`` with one GPU per rank) and rank 0's result
    comes back here. Spawned workers run Triton kernels on CPU tensors through the torch
    path unless ``interpret`` is set (the interpreter is slow; under torchrun, where the
    ranks are already started, ``interpret=True`` raises ``ValueError``).
    """
    if interpret and in_torchrun():
        raise ValueError(
            "interpret=True cannot apply under torchrun (the ranks are already started); "
            "set TRITON_INTERPRET=1 in the torchrun environment instead"
        )
    interpreter = {"TRITON_INTERPRET": "1" if interpret else None}
    results = run(world_size, fn, *args, device=device, timeout=timeout, env=interpreter)
    return results[0] if results is not None else None
