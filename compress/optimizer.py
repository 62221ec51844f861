"""DeMo: decoupled momentum with DCT + top-k compression (docs/design.md §1.1).

Each rank keeps an fp32 momentum / error-feedback buffer ``delta`` per parameter. A step:

    delta  = decay * delta + lr * grad
    send   = top-k(DCT(delta)) per tile;   delta -= alpha * IDCT(send)
    all-gather `send` from every rank; per position, mean over the ranks that sent it
    p      = p * (1 - lr * wd) - lr * sign(IDCT(mean))

The class is in the shape of torch's ``AdamW``: it checks its settings once
(:mod:`cokit.compress.demo_settings`, the shared ones in
:class:`~cokit.compress.frontend.FrontEndOptions`), keeps the state, opens each round through
the front-end base (:mod:`cokit.compress.frontend`) and hands the step to a strategy
(:mod:`cokit.compress.strategies`: plain, DTensor shards, hierarchy, overlapped with backward)
with a :class:`~cokit.compress.demo_plan.StepContext`; the strategy runs the functional step
(:mod:`cokit.compress.demo_step`) on the exchange core (:mod:`cokit.compress.exchange`).
Payloads are codecs of :mod:`cokit.compress.payload`; tensors whose payload would not be
smaller than a dense all-reduce go dense. Every rank decodes the same gathered bytes in rank
order, so parameters stay bit-identical across ranks.

**Agreement.** Every step opens with a fixed-size status all-gather carrying a 64-bit
fingerprint of every setting that changes what is sent or how the update is computed
(:func:`~cokit.compress.demo_settings.fingerprinted`, ``comm_priority`` added by the exchange),
of the parameters' shapes and dtypes, of the payload sizes and of the step counters, so that
e.g. an LR scheduler stepped on one rank only is caught at the next step. A difference raises
``ValueError`` on every rank, naming the setting, the group and each rank's value, before
anything changed. Parameters with no elements have nothing to send and are left alone.

**DTensor parameters** (FSDP2 ``fully_shard``, :mod:`cokit.compress.dtensor`): each rank steps
its local shards, with tiles over each local shard. Over the mesh nothing is exchanged (FSDP
reduce-scatters the gradients), but the ranks agree each step on the settings and on which
gradients are finite. ``process_group`` is then the group DeMo exchanges over: None for pure
FSDP (no replicas), or for HSDP the replicate group of a 2-D mesh whose shard dimension FSDP was
given (``fully_shard(m, mesh=mesh["shard"])``, ``process_group=mesh.get_group("replicate")``).
``overlap_backward`` is not supported there (FSDP overlaps its own reduce-scatter).

**State.** ``state_dict()`` holds a copy of each parameter's ``delta`` buffer under a key
naming the rank, with records of the rank, world sizes and settings that ``load_state_dict``
checks before anything changes, plus the adam rule's ``v`` / ``rule_step`` and the fp32
``master`` under plain keys (identical on every rank; :mod:`cokit.compress.checkpoint`); it
works with ``torch.save`` per rank and with ``torch.distributed.checkpoint``. Each param group
also exposes ``compression_decay`` as ``momentum`` (an alias that momentum-cycling schedulers
such as ``OneCycleLR`` write; whichever of the two was written since the last step wins). DeMo
on a ``DistributedDataParallel`` model warns once (``DoubleSyncWarning``): the gradients would
be synchronized twice.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch

from cokit.compress import checkpoint
from cokit.compress.adaptation import PolicyDriver, make_policy
from cokit.compress.agreement import Round
from cokit.compress.demo_plan import DemoPlan, Entry, StepContext
from cokit.compress.demo_settings import (
    RULE_OPTIONS,
    check_group,
    check_plain_parallel,
)
from cokit.compress.demo_step import full_sync
from cokit.compress.dtensor import check_same_mesh, local, mesh_plan
from cokit.compress.eager import eager
from cokit.compress.frontend import FrontEnd, FrontEndOptions, check_gradients, run_closure
from cokit.compress.guards import Amp, StepGuards, sync_decay
from cokit.compress.payload import get_codec
from cokit.compress.policy import Decision
from cokit.compress.precision import rounding_generator, warn_if_unmastered
from cokit.compress.stats import CommStats, ring_allreduce_bytes
from cokit.compress.strategies import make_strategy
from cokit.triton_kernels._checks import check_flag, check_int

__all__ = ["DeMo"]


class DeMo(FrontEnd, torch.optim.Optimizer):
    """Decoupled-momentum optimizer that sends only a top-k DCT selection per tile (module docstring).

    Args:
        params: parameters, named parameters or param groups (per-group ``lr``,
            ``weight_decay``, ``compression_decay``, ``compression_topk``,
            ``compression_chunk``, ``alpha`` and the update-rule settings).
        lr: learning rate of ``lr * rule(decoded)``; each rule's lr from a tuned AdamW lr is in
            :mod:`cokit.compress.rules` (``sign``/``rms`` about 4x AdamW's, ``adam`` 3x,
            ``newton_schulz`` 1x; measured in docs/optimizers.md).
        compression_decay: momentum decay ``beta`` of the error-feedback buffer, in [0, 1].
        compression_topk: coefficients kept per tile (clamped to the tile size).
        compression_chunk: tile side target; each dimension uses its largest divisor <= chunk.
        weight_decay: decoupled weight decay.
        process_group: the group synchronized over (:class:`~cokit.compress.frontend.FrontEndOptions`).
        alpha: fraction of the sent part removed from the buffer (1.0 = DeMo; DeMo v2: ~0.2).
        payload: a payload codec (:mod:`cokit.compress.payload`): ``"compact"`` (default),
            ``"sign"``, ``"reference"`` or one added with ``register_codec``.
        dense_fallback: send a tensor dense when compression would not save bytes (default: the
            codec's; off for reference, which follows DeMo's reference).
        full_sync_every: every N steps, average parameters with a dense all-reduce.
        overlap_backward: encode and launch each bucket from post-accumulate-grad hooks as soon
            as its gradients exist, overlapping the rest of backward; ``step()`` waits and
            decodes. One backward per step, a gradient for every parameter, and no edit of the
            gradients before ``step()`` (detected: raises on every rank, nothing changed).
        hierarchy: :class:`~cokit.compress.groups.NodeGroups` (``node_groups()``) for a
            two-level exchange: dense averages inside each node, bucket ``b`` encoded and sent
            across nodes by local rank ``b % ranks per node`` alone, then broadcast in the node
            (``comm_stats``' ``step_intra_*`` count the node level). Needs ``process_group=None``.
        update_rule: what the decoded direction ``u`` becomes (:mod:`cokit.compress.rules`):
            ``"sign"`` (DeMo), ``"rms"``, ``"adam"`` or ``"newton_schulz"``; tuned by
            :data:`~cokit.compress.demo_settings.RULE_OPTIONS` given as options.
        **options: the options of every front end (:class:`~cokit.compress.frontend.FrontEndOptions`).
            Here a ``policy`` decides each step, from the last step's times agreed over the
            ranks, whether to scale k, switch payload, go dense or skip the sync (counted in
            ``skipped_syncs``, changes in ``policy_log``); the rules and the ``master`` and
            ``stochastic`` precisions need plain data parallel.
    """

    _step_supports_amp_scaling = True  # GradScaler calls step() on every rank (guards.Amp)
    owner = "DeMo"

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]] | Iterable[tuple[str, torch.Tensor]],
        lr: float = 1e-3,
        compression_decay: float = 0.999,
        compression_topk: int = 32,
        compression_chunk: int = 64,
        weight_decay: float = 0.0,
        process_group: Any = None,
        *,
        alpha: float = 1.0,
        payload: str = "compact",
        dense_fallback: bool | None = None,
        full_sync_every: int | None = None,
        overlap_backward: bool = False,
        hierarchy: Any = None,
        update_rule: str = "sign",
        **options: Any,
    ):
        where = "DeMo"
        rule_options = {k: options.pop(k, v) for k, v in RULE_OPTIONS.items()}
        opts = FrontEndOptions.checked(where, options, process_group=process_group)
        self.codec = get_codec(payload, owner=where)
        self.policy = make_policy(opts.policy)
        self.overlap_backward = check_flag("overlap_backward", overlap_backward, where=where)
        if overlap_backward and self.policy.observes:
            raise ValueError(
                f"DeMo: policy {self.policy.describe()} decides each step before its buckets are "
                "sent, but overlap_backward=True sends them during backward; use one or the other"
            )
        if dense_fallback is not None:
            check_flag("dense_fallback", dense_fallback, where=where)
        if full_sync_every is not None:
            check_int("full_sync_every", full_sync_every, 1, where=where, more="or None")
        self.nonfinite, self.precision = opts.nonfinite, opts.precision
        self.seed, self.clock = opts.seed, opts.clock
        self.comm_priority, self.validate_payload = opts.comm_priority, opts.validate_payload
        self.bucket_cap_mb, self.bucket_cap_bytes = opts.bucket_cap_mb, opts.bucket_cap_bytes
        self.payload, self.requested_value_dtype = payload, opts.value_dtype
        self.value_dtype = self.codec.resolve_value_dtype(opts.value_dtype)
        self.dense_fallback = self.codec.dense_fallback if dense_fallback is None else dense_fallback
        self.full_sync_every = full_sync_every
        self.comm_stats = CommStats()
        self.skipped_steps = self.skipped_syncs = self._steps = 0
        self._driver = PolicyDriver(self.policy, opts.clock)
        self._precision_checked = False  # warn_if_unmastered runs at the first step
        self._checked = True  # False after a load: its first round compares the replicas
        self._generators: dict[torch.device, torch.Generator] = {}  # this step's rounding draws
        self.plan = DemoPlan(self)  # entries, names, buckets, inputs and layout
        self._guards = StepGuards()  # momentum alias sync, DDP double-sync warning
        self.strategy: Any = None
        defaults = dict(
            lr=lr,
            compression_decay=compression_decay,
            compression_topk=compression_topk,
            compression_chunk=compression_chunk,
            weight_decay=weight_decay,
            alpha=alpha,
            momentum=compression_decay,  # an alias that momentum-cycling LR schedulers drive
            update_rule=update_rule,
            **rule_options,
        )
        super().__init__(params, defaults)
        sync_decay(self.param_groups, compression_decay)  # a group that set only one of the two
        self._mesh = mesh_plan([p for g in self.param_groups for p in g["params"]])
        self.strategy = make_strategy(
            self.plan,
            opts,
            hierarchy,
            self._mesh,
            on_blocked=self._driver.blocked,
            policy=self.policy,
            overlap_backward=self.overlap_backward,
            open_round=self._open_backward_round,
        )
        self.exchange = self.strategy.exchange
        for gi, group in enumerate(self.param_groups):
            self._check_plain_parallel(group, gi)
        self.strategy.install([p for g in self.param_groups for p in g["params"]])

    # ------------------------------------------------------------------ param groups
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group after checking its settings; a bad group raises and is not added. Every
        rank must add the same groups: the next step's agreement compares every rank's layout."""
        if isinstance(param_group, dict) and "params" in param_group:
            params = param_group["params"]  # a list once, so a generator is not consumed twice
            params = [params] if isinstance(params, torch.Tensor) else params
            params = params if isinstance(params, set) else list(params)  # torch rejects sets
            param_group = {**param_group, "params": params}
            check_group({**self.defaults, **param_group}, len(self.param_groups))
            if hasattr(self, "_mesh"):  # (during __init__ the strategy checks every group)
                existing = [p for g in self.param_groups for p in g["params"]][:1]
                check_same_mesh(self._mesh, existing, param_group["params"], "DeMo.add_param_group")
            self._check_plain_parallel({**self.defaults, **param_group}, len(self.param_groups))
        super().add_param_group(param_group)
        self._changed_layout()
        if self.strategy is not None:
            self.strategy.install(self.param_groups[-1]["params"])

    def _check_plain_parallel(self, group: dict[str, Any], index: int) -> None:
        if self.strategy is not None and self.exchange.agree_comms:  # DTensor shards or hierarchy=
            check_plain_parallel(group, index, self.precision)

    def _changed_layout(self) -> None:
        if hasattr(self, "plan"):  # (torch's __init__ adds the first groups before the plan exists)
            self.plan.forget()
        if self.strategy is not None:
            self.strategy.forget_layout()

    @property
    def policy_log(self) -> list[dict[str, Any]]:
        """Every change of the policy's decision: step, decision and the observation behind it."""
        return self._driver.log

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The torch.optim state in DeMo's checkpoint format (:mod:`cokit.compress.checkpoint`):
        this rank's fp32 error buffers and the records of rank, world, settings, counters and
        policy. Works with ``torch.save`` (a file per rank) and DCP's ``get_optimizer_state_dict``."""
        return checkpoint.pack(self, super().state_dict())

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> None:
        """Load a state this rank saved, all checked before anything changes (another rank,
        world size, settings, payload, policy, type, shapes, missing parameters, non-finite
        buffers raise ``ValueError`` saying what differs). ``strict=False`` (or
        :func:`cokit.compress.checkpoint.relaxed_loading` around DCP) loads what it can and
        warns about what it drops (:func:`cokit.compress.checkpoint.check_load`)."""
        strict = bool(strict) and not getattr(self, "_relaxed_load", False)
        plan = checkpoint.check_load(self, state_dict, strict)
        super().load_state_dict({"state": {}, "param_groups": plan.groups})
        checkpoint.apply_load(self, plan)
        self._changed_layout()  # the loaded groups may tile or select differently

    # ------------------------------------------------------------------ step
    # Eager even inside torch.compile (docs/design.md §3): collectives, the status agreement and
    # the timing cannot be traced, and the per-tensor math already runs in cokit's kernels.
    @eager
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One synchronized step over every parameter that has a gradient."""
        loss = run_closure(closure)
        self._guards.before_step(self.param_groups, self.defaults["compression_decay"])
        entries = self.plan.entries()
        if not self._precision_checked:
            warn_if_unmastered("DeMo", [p for _, _, p in entries], self.precision)
            self._precision_checked = True
        self._generators = {}
        amp = Amp.of(self)
        active = self.strategy.step(
            StepContext(
                entries=entries,
                amp=amp,
                agree=lambda: self._agree(entries, amp),
                status=self._status_round,
                go_on=lambda rnd: self._skip_or_raise(rnd, entries),
                decision=lambda: self._driver.decision or Decision(),
                skipped_sync=self._skipped_sync,
                precision=self.precision,
                generator=self._generator,
            )
        )
        if active is None:  # skipped consistently on every rank
            self._record(dense=0, synced=False)
            return loss
        grads = [local(p.grad) for _, _, p in active]
        dense_bytes = ring_allreduce_bytes(
            sum(g.numel() * g.element_size() for g in grads), self.strategy.dense_world
        )
        self._steps += 1
        if self.full_sync_every is not None and self._steps % self.full_sync_every == 0:
            full_sync([p for _, _, p in entries], self.exchange)
        self._record(dense=dense_bytes, synced=self._driver.syncing)
        return loss

    def _record(self, dense: int, synced: bool) -> None:
        sent = self.exchange.record(self.comm_stats, dense)
        self._driver.step_done(sent, dense, synced)

    def _skipped_sync(self) -> None:
        self.skipped_syncs += 1

    def _generator(self, device: torch.device) -> torch.Generator:
        """This step's stochastic-rounding generator on ``device`` (seeded by seed and step,
        drawn in bucket order: the same draws on every rank)."""
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = rounding_generator(self.seed, self._steps, device)
        return gen

    # ------------------------------------------------------------------ rounds (the front-end base)
    def _agree(self, entries: list[Entry], amp: Amp) -> list[Entry] | None:
        """Agree with every rank on which parameters step: the active entries; None when the
        step is skipped on every rank; an error raised on every rank otherwise."""
        name = functools.partial(self.plan.entry_name, entries=entries)
        has_grad = check_gradients("DeMo", [p for _, _, p in entries], name)
        rnd = self.open_round(
            [local(p.grad) if has else None for (_, _, p), has in zip(entries, has_grad, strict=True)],
            amp,
            fingerprints=self._fingerprints(),
            describe=self._describe,
            name=self.plan.entry_name,
            device=self.plan.device(),
            extra=self._driver.measurement(torch.device("cpu")),
        )
        self._check_loaded(entries)
        if not self._skip_or_raise(rnd, entries):
            return None
        self._driver.decide(rnd.extras if self.policy.observes else None, self._steps + 1)
        return [e for e, has in zip(entries, has_grad, strict=True) if has]

    def _status_round(self, events: int = 0, bad: list[int] | None = None) -> Round:
        """The status round of the overlapped strategy, whose buckets left during backward."""
        return self.exchange.agree(
            self._fingerprints(),
            self.exchange.report(bad or [], events=events),
            self._describe,
            extra=self._driver.measurement(torch.device("cpu")),
            device=self.plan.device(),
            names=self.plan.entry_name,
        )

    def _open_backward_round(self) -> None:
        """The overlapped strategy's round at a step's first hook (buckets use the decay, so
        its two aliases are reconciled first)."""
        sync_decay(self.param_groups, self.defaults["compression_decay"])
        self._status_round()
        self._check_loaded(self.plan.entries())

    def _check_loaded(self, entries: list[Entry]) -> None:
        """The first round after a load, its status row agreed: every rank must hold the same
        parameters and shared state (:func:`~cokit.compress.checkpoint.replicated`)."""
        if not self._checked:
            self.check_replicas(checkpoint.replicated(self, entries))
            self._checked = True

    def _skip_or_raise(self, rnd: Round, entries: list[Entry]) -> bool:
        """True to go on; False when every rank skips (counted in ``skipped_steps``)."""
        name = functools.partial(self.plan.entry_name, entries=entries)
        if self.skip_or_raise(rnd, name, when=f"step {self._steps + 1}"):
            return True
        self.skipped_steps += 1
        return False

    def _counters(self) -> dict[str, int]:
        return {
            "steps": self._steps,
            "skipped_steps": self.skipped_steps,
            "skipped_syncs": self.skipped_syncs,
        }

    def _fingerprints(self) -> tuple[int, int]:
        return self.plan.fingerprints(self._counters(), agreement=bool(self.exchange.agree_comms))

    def _describe(self, globally: bool) -> dict[str, Any]:
        return self.plan.describe(globally, self._counters())
