"""DeMo: decoupled momentum with DCT + top-k compression (docs/design.md §1.1).

Each rank keeps an fp32 momentum / error-feedback buffer ``delta`` per parameter. A step:

    delta  = decay * delta + lr * grad
    send   = top-k(DCT(delta)) per tile;   delta -= alpha * IDCT(send)
    all-gather `send` from every rank; per position, mean over the ranks that sent it
    p      = p * (1 - lr * wd) - lr * sign(IDCT(mean))

This module is the optimizer class, in the shape of torch's ``AdamW``: it validates its
settings once, keeps the state, and hands each step to a strategy
(:mod:`cokit.compress.strategies`) that runs the functional step
(:mod:`cokit.compress.demo_step`) on the exchange core (:mod:`cokit.compress.exchange`).
Payloads are codecs of :mod:`cokit.compress.payload`; tensors whose payload would not be
smaller than a dense all-reduce go dense. Every rank decodes the same gathered bytes in rank
order, so parameters stay bit-identical across ranks.
"""

from __future__ import annotations

import datetime
import functools
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any, overload

import torch

from cokit.compress import checkpoint, rules
from cokit.compress.adaptation import PolicyDriver, make_policy
from cokit.compress.agreement import Round, canonical, fingerprint
from cokit.compress.comm import Pending
from cokit.compress.demo_plan import DemoPlan, Entry, StepContext
from cokit.compress.demo_step import split_like
from cokit.compress.dtensor import local, mesh_plan
from cokit.compress.eager import eager
from cokit.compress.frontend import (
    ExchangeOptions,
    FrontEnd,
    check_gradients,
    check_nonfinite_mode,
    check_value_dtype,
    plain,
    run_closure,
)
from cokit.compress.guards import Amp, StepGuards, sync_decay
from cokit.compress.payload import VALUE_DTYPES, get_codec
from cokit.compress.policy import Decision, NetworkPolicy
from cokit.compress.precision import check_precision, rounding_generator, warn_if_unmastered
from cokit.compress.stats import CommStats, ring_allreduce_bytes
from cokit.compress.strategies import make_strategy
from cokit.triton_kernels._checks import check_flag, check_int, check_number

__all__ = ["DeMo"]


class DeMo(FrontEnd, torch.optim.Optimizer):
    """Decoupled-momentum optimizer that sends only a top-k DCT selection per tile.

    Args:
        params: parameters, named parameters or param groups (per-group ``lr``,
            ``weight_decay``, ``compression_decay``, ``compression_topk``,
            ``compression_chunk``, ``alpha`` and the update-rule settings below).
        lr: learning rate (the update is ``lr * rule(decoded)``). Each rule has an lr rule
            from a tuned AdamW lr (:mod:`cokit.compress.rules`, measured in docs/optimizers.md):
            ``sign`` and ``rms`` update with RMS 1 per element, about 4x AdamW's, ``adam``
            about 3x, ``newton_schulz`` about AdamW's.
        compression_decay: momentum decay ``beta`` of the error-feedback buffer, in [0, 1].
        compression_topk: coefficients kept per tile (clamped to the tile size).
        compression_chunk: tile side target; each dimension uses its largest divisor <= chunk.
        weight_decay: decoupled weight decay.
        process_group: the group to synchronize over (default: the world; none initialized or
            world size 1 means local steps without communication).
        alpha: fraction of the transmitted part removed from the buffer (1.0 = DeMo; DeMo v2
            reports ~0.2 best).
        payload: name of a payload codec (:mod:`cokit.compress.payload`): ``"compact"``
            (default), ``"sign"``, ``"reference"`` or one added with ``register_codec``.
        value_dtype: value dtype of compact payloads and of sign-payload scales
            (bf16 default, fp16 or fp32); the codec decides how it applies (the reference
            codec always sends fp32).
        bucket_cap_mb: fp32 buffer megabytes per compressed bucket (one collective each).
        dense_fallback: send a tensor dense when compression would not save bytes (default:
            the codec's ``dense_fallback``: on for compact/sign, off for reference, which
            follows DeMo's reference exactly).
        full_sync_every: every N steps, average parameters with a dense all-reduce.
        nonfinite: ``"error"`` raises on every rank, naming the parameter and rank, before
            anything is sent; ``"skip"`` skips the step on every rank (counted in
            ``skipped_steps``). A GradScaler's ``found_inf`` on any rank always skips the step on
            every rank (DeMo unscales the gradients itself: ``_step_supports_amp_scaling``).
        timeout: seconds (or timedelta) to wait for a collective before raising an error that
            names this optimizer (default None or ``inf``: the process group's timeout). After
            a timeout the process group is aborted: restart every rank from its checkpoint.
        validate_payload: check what every peer sent before anything is decoded (positions
            inside their tiles, in order, finite values, finite dense results; default True,
            :mod:`cokit.compress.peer_check`): a malformed payload raises on every rank, naming
            the sender and the bucket. False skips the check for a fleet you trust.
        overlap_backward: encode each bucket and launch its collective from post-accumulate-grad
            hooks, as soon as backward has produced all of its gradients, so communication
            overlaps the rest of backward; ``step()`` then waits and decodes. Every parameter
            must get a gradient every step, with one backward per step (no accumulation).
            Encoding works on copies of the buffers so that a non-finite gradient found late
            can still leave every rank unchanged (one extra buffer copy per step). Gradients
            must not change between backward and ``step()`` (clipping, unscaling, edits):
            ``step()`` detects a change and raises on every rank before anything changed.
        policy: a network policy (:mod:`cokit.compress.policy`), its name (``"static"``,
            ``"bandwidth"``) or ``{"name": ..., **arguments}``. Each step it decides, from
            the previous step's wall time and time blocked in collectives (agreed over
            ranks, so every rank decides the same), whether to scale k, switch payload, go dense
            or skip the sync (the gradient then only enters the error buffers:
            ``delta = decay * delta + lr * grad``, parameters unchanged, counted in
            ``skipped_syncs``). Decision changes are in ``policy_log``. Default: static.
            Policies that measure need ``overlap_backward=False``.
        update_rule: what the decoded direction ``u`` becomes (:mod:`cokit.compress.rules`):
            ``"sign"`` (DeMo, default), ``"rms"`` (``u / rms(u)``), ``"adam"`` (a second moment
            of ``u`` in the state, identical on every rank) or ``"newton_schulz"`` (Muon's
            orthogonalization for >= 2-D weights; ``rule_fallback`` for the others).
        rule_beta2, rule_eps: the adam rule's second-moment decay and epsilon.
        ns_steps: Newton-Schulz iterations of the newton_schulz rule.
        rule_fallback: ``"adam"`` (default) or ``"sign"``: the rule of < 2-D parameters under
            newton_schulz.
        precision: how updates reach fp16/bf16 parameters (:mod:`cokit.compress.precision`):
            ``"nearest"`` (default: round to nearest; warns once at the first step when such
            parameters exist, since small updates are lost), ``"master"`` (an fp32 master per
            such parameter in ``state[p]["master"]`` is updated and rounded into it) or
            ``"stochastic"`` (unbiased stochastic rounding, drawn from ``seed`` and the step so
            that every rank rounds alike). The rules, master and stochastic rounding need plain
            data parallel (not DTensor parameters or hierarchy=).
        seed: the stochastic rounding seed (the same on every rank).
        clock: seconds for the network policy's step and wait times (``time.perf_counter``;
            tests inject a fake clock).
        hierarchy: :class:`~cokit.compress.groups.NodeGroups` (e.g. ``node_groups()``, from
            ``LOCAL_WORLD_SIZE``) for a two-level exchange: gradients are averaged densely
            inside each node (fast links); bucket ``b`` is then encoded by local rank
            ``b % ranks per node`` alone, exchanged across nodes between the ranks with that
            local rank, decoded, and its updated parameters broadcast inside the node, so each
            rank sends 1/L of the payload across nodes and holds 1/L of the error buffers.
            ``comm_stats`` counts the two levels
            (``step_intra_*`` fields). Needs ``process_group=None`` and
            ``overlap_backward=False``.
        comm_priority: priority of the exchange collectives: ``"normal"`` (default),
            ``"high"`` or an integer stream priority (negative = high;
            :mod:`cokit.compress.priority`). On NCCL/RCCL a high priority makes one new
            process group over the exchange group's ranks, with high-priority streams, at
            construction (collective over the default group: every rank must construct DeMo
            with the same value); on gloo it has no effect. ``comm_priority_info`` says what it
            achieved (``requested``, ``high_priority``, ``note``). It is agreed every step
            like the settings below, and is not part of ``state_dict()``.
        comm_guard: None, or a guard with ``violations(config=None, *, priority=...)`` (e.g.
            :class:`cokit.overlap.guard.StarvationGuard`): a ``comm_priority`` it refuses
            raises ``GuardViolation`` (a ``ValueError``) naming the limit, before anything is
            built.

    **DTensor parameters** (FSDP2 ``fully_shard``, :mod:`cokit.compress.dtensor`): each rank
    steps its local shards, with tiles over each local shard. Over the mesh nothing is
    exchanged (FSDP reduce-scatters the gradients), but the ranks agree each step on the
    settings and on which gradients are finite. ``process_group`` is then the group DeMo
    exchanges over: None for pure FSDP (no replicas), or for HSDP the replicate group of a 2-D
    mesh whose shard dimension FSDP was given (``fully_shard(m, mesh=mesh["shard"])``,
    ``process_group=mesh.get_group("replicate")``). ``overlap_backward`` is not supported
    (FSDP overlaps its own reduce-scatter).

    How a step is exchanged (plain, DTensor shards, hierarchy, overlapped with backward) is a
    strategy chosen once here (:mod:`cokit.compress.strategies`); the update itself is the
    functional :func:`cokit.compress.demo_step.demo_step`, and every guarantee (agreement,
    timeouts, validation of peer bytes, work lifetimes) lives in the exchange core
    (:mod:`cokit.compress.exchange`). Every rank must use the same settings: every step opens
    with a fixed-size status all-gather carrying a 64-bit fingerprint of every setting that
    changes what is sent or how the update is computed (the per-group ones above; payload,
    value_dtype, dense_fallback, bucket_cap_mb, full_sync_every, overlap_backward, nonfinite,
    validate_payload, policy, precision, seed, comm_priority), of the parameters' shapes and dtypes, of the
    payload sizes and of the step counters, so that e.g. an LR scheduler stepped on one rank
    only is caught at the next step. A difference raises ``ValueError`` on every rank, naming
    the setting, the group and each rank's value, before anything changed. Parameters with no
    elements have nothing to send and are left alone.

    ``state_dict()`` holds a copy of each parameter's ``delta`` buffer under a key naming the
    rank, with records of the rank, world sizes and settings that ``load_state_dict`` checks
    before anything changes, plus the adam rule's ``v`` / ``rule_step`` and the fp32
    ``master`` under plain keys (identical on every rank; :mod:`cokit.compress.checkpoint`); it
    works with ``torch.save`` per rank and with ``torch.distributed.checkpoint``. Each param group also exposes
    ``compression_decay`` as ``momentum`` (an alias that momentum-cycling schedulers such as
    ``OneCycleLR`` write; whichever of the two was written since the last step wins). DeMo on a
    ``DistributedDataParallel`` model warns once (``DoubleSyncWarning``): the gradients would
    be synchronized twice.
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
        process_group=None,
        *,
        alpha: float = 1.0,
        payload: str = "compact",
        value_dtype: torch.dtype = torch.bfloat16,
        bucket_cap_mb: float = 25.0,
        dense_fallback: bool | None = None,
        full_sync_every: int | None = None,
        nonfinite: str = "error",
        timeout: float | datetime.timedelta | None = None,
        validate_payload: bool = True,
        overlap_backward: bool = False,
        policy: NetworkPolicy | str | dict[str, Any] | None = None,
        hierarchy: Any = None,
        update_rule: str = "sign",
        rule_beta2: float = 0.999,
        rule_eps: float = 1e-8,
        ns_steps: int = 5,
        rule_fallback: str = "adam",
        precision: str = "nearest",
        seed: int = 0,
        clock: Callable[[], float] = time.perf_counter,
        comm_priority: str | int = "normal",
        comm_guard: Any = None,
    ):
        where = "DeMo"
        options = ExchangeOptions.checked(
            where,
            process_group=process_group,
            timeout=timeout,
            validate=validate_payload,
            clock=clock,
            comm_priority=comm_priority,
            comm_guard=comm_guard,
        )
        self.comm_priority, self.validate_payload = comm_priority, validate_payload
        self.codec = get_codec(payload, owner=where)
        self.precision = check_precision(where, precision)
        check_int("seed", seed, 0, where=where)
        if seed >= 2**63:
            raise ValueError(f"DeMo: seed must be an integer in [0, 2**63), got {seed!r}")
        self.policy = make_policy(policy)
        if overlap_backward and self.policy.observes:
            raise ValueError(
                f"DeMo: policy {self.policy.describe()} decides each step before its buckets are "
                "sent, but overlap_backward=True sends them during backward; use one or the other"
            )
        check_value_dtype(where, value_dtype)
        self.bucket_cap_mb = check_number("bucket_cap_mb", bucket_cap_mb, 0.0, low_open=True, where=where)
        self.overlap_backward = check_flag("overlap_backward", overlap_backward, where=where)
        if dense_fallback is not None:
            check_flag("dense_fallback", dense_fallback, where=where)
        if full_sync_every is not None:
            check_int("full_sync_every", full_sync_every, 1, where=where, more="or None")
        self.nonfinite = check_nonfinite_mode(where, nonfinite)
        defaults = dict(
            lr=lr,
            compression_decay=compression_decay,
            compression_topk=compression_topk,
            compression_chunk=compression_chunk,
            weight_decay=weight_decay,
            alpha=alpha,
            momentum=compression_decay,  # an alias that momentum-cycling LR schedulers drive
            update_rule=update_rule,
            rule_beta2=rule_beta2,
            rule_eps=rule_eps,
            ns_steps=ns_steps,
            rule_fallback=rule_fallback,
        )
        self.seed, self.clock = seed, clock
        self.payload = payload
        self.requested_value_dtype = value_dtype
        self.value_dtype = self.codec.resolve_value_dtype(value_dtype)
        self.bucket_cap_bytes = int(self.bucket_cap_mb * 2**20)
        self.dense_fallback = self.codec.dense_fallback if dense_fallback is None else dense_fallback
        self.full_sync_every = full_sync_every
        self.comm_stats = CommStats()
        self.skipped_steps = self.skipped_syncs = self._steps = 0
        self._driver = PolicyDriver(self.policy, clock)
        self._precision_checked = False  # warn_if_unmastered runs at the first step
        self._generators: dict[torch.device, torch.Generator] = {}  # this step's rounding draws
        self.plan = DemoPlan(self)  # entries, names, buckets, inputs and layout
        self._guards = StepGuards()  # momentum alias sync, DDP double-sync warning
        self.strategy: Any = None
        super().__init__(params, defaults)
        sync_decay(self.param_groups, compression_decay)  # a group that set only one of the two
        self._mesh = mesh_plan([p for g in self.param_groups for p in g["params"]])
        self.strategy = make_strategy(
            self.plan,
            options,
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

    def _check_plain_parallel(self, group: dict[str, Any], index: int) -> None:
        """The update rules and precision modes keep state that must be identical on every
        rank and see whole tensors: plain data parallel only."""
        if self.strategy is None or not self.exchange.agree_comms:
            return
        if group["update_rule"] != "sign" or self.precision != "nearest":
            raise ValueError(
                f"DeMo param group {index}: update_rule={group['update_rule']!r} with precision="
                f"{self.precision!r} needs plain data parallel; with DTensor (FSDP2) parameters or "
                "hierarchy= use update_rule='sign' and precision='nearest'"
            )

    # ------------------------------------------------------------------ param groups
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group after checking its settings (see the class docstring); a bad group raises
        and is not added. Every rank must add the same groups: the next step's agreement
        compares every rank's layout."""
        if isinstance(param_group, dict) and "params" in param_group:
            params = param_group["params"]  # a list once, so a generator is not consumed twice
            params = [params] if isinstance(params, torch.Tensor) else params
            params = params if isinstance(params, set) else list(params)  # torch rejects sets
            param_group = {**param_group, "params": params}
            self._check_group({**self.defaults, **param_group}, len(self.param_groups))
            self._check_same_mesh(param_group["params"])
            self._check_plain_parallel({**self.defaults, **param_group}, len(self.param_groups))
        super().add_param_group(param_group)
        self._changed_layout()
        if self.strategy is not None:
            self.strategy.install(self.param_groups[-1]["params"])

    def _changed_layout(self) -> None:
        if hasattr(self, "plan"):  # (torch's __init__ adds the first groups before the plan exists)
            self.plan.forget()
        if self.strategy is not None:
            self.strategy.forget_layout()

    @staticmethod
    def _check_group(group: dict[str, Any], index: int) -> None:
        """Raise unless ``group`` (defaults filled in) holds valid settings and parameters."""
        where = f"DeMo param group {index}"
        check_number("lr", group["lr"], 0.0, where=where)
        check_number("weight_decay", group["weight_decay"], 0.0, where=where)
        check_number("compression_decay", group["compression_decay"], 0.0, 1.0, where=where)
        if "momentum" in group:  # the alias of compression_decay (guards.sync_decay)
            check_number("momentum", group["momentum"], 0.0, 1.0, where=where)
        check_number("alpha", group["alpha"], 0.0, 1.0, low_open=True, where=where)
        check_int("compression_topk", group["compression_topk"], 1, where=where)
        check_int("compression_chunk", group["compression_chunk"], 1, where=where)
        rules.check_rule_settings(where, group)
        for p in group["params"]:
            p = p[1] if isinstance(p, tuple) and len(p) == 2 else p  # (name, parameter)
            if isinstance(p, torch.Tensor) and p.dtype not in VALUE_DTYPES:
                raise TypeError(
                    f"{where}: DeMo optimizes float32, float16 and bfloat16 parameters, got {p.dtype}"
                )

    def _check_same_mesh(self, params: list) -> None:
        """A group added after construction must live on the optimizer's mesh (or none)."""
        if not hasattr(self, "_mesh"):  # during __init__: the strategy checks all groups
            return
        tensors = [p[1] if isinstance(p, tuple) else p for p in params]
        existing = [p for g in self.param_groups for p in g["params"]][:1]
        if mesh_plan(existing + tensors, owner="DeMo.add_param_group") != self._mesh:
            raise ValueError(
                "DeMo.add_param_group: the new parameters are not on the optimizer's device mesh "
                f"({self._mesh.layout if self._mesh else 'plain tensors'})"
            )

    @property
    def policy_log(self) -> list[dict[str, Any]]:
        """Every change of the policy's decision: step, decision and the observation behind it."""
        return self._driver.log

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The torch.optim state in DeMo's checkpoint format (:mod:`cokit.compress.checkpoint`):
        each parameter's fp32 error buffer under a key naming this rank, and records of the rank,
        world sizes, settings, optimizer type, step counters, comm_stats and policy state. Works
        with ``torch.save`` (one file per rank) and with DCP's ``get_optimizer_state_dict``."""
        return checkpoint.pack(self, super().state_dict())

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> None:
        """Load a state this rank saved. Everything is checked before anything changes: another
        rank, world size, settings, payload, policy or optimizer type, wrong shapes, missing
        parameters and non-finite buffers raise ``ValueError`` saying what differs.
        ``strict=False`` (or :func:`cokit.compress.checkpoint.relaxed_loading` around DCP's
        ``set_optimizer_state_dict``) loads what it can and warns about what it drops: another
        rank or world size keeps settings, counters and policy and zeroes the error buffers;
        non-finite buffers start from zero; other settings keep this optimizer's; an old
        checkpoint without records loads unchecked. Buffers stay fp32 whatever the dtype."""
        strict = bool(strict) and not getattr(self, "_relaxed_load", False)
        plan = checkpoint.check_load(self, state_dict, strict)
        for message in plan.warnings:
            warnings.warn(message, stacklevel=2)
        super().load_state_dict({"state": {}, "param_groups": plan.groups})
        for p, delta in plan.deltas:
            self.state[p]["delta"] = delta
        for p, shared in plan.shared:
            self.state[p].update(shared)
        self._steps = plan.counters["steps"]
        self.skipped_steps = plan.counters["skipped_steps"]
        self.skipped_syncs = plan.counters["skipped_syncs"]
        if plan.policy is not None:
            self._driver.load_state_dict(plan.policy)
        if plan.comm_stats is not None:
            self.comm_stats = plan.comm_stats
        self._changed_layout()  # the loaded groups may tile or select differently

    # ------------------------------------------------------------------ step
    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

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
            self._full_sync([p for _, _, p in entries])
        self._record(dense=dense_bytes, synced=self._driver.syncing)
        return loss

    def _record(self, dense: int, synced: bool) -> None:
        sent = self.exchange.record(self.comm_stats, dense)
        self._driver.step_done(sent, dense, synced)

    def _skipped_sync(self) -> None:
        self.skipped_syncs += 1

    # ------------------------------------------------------------------ agreement (the core's rows)
    def _agree(self, entries: list, amp: Amp) -> list | None:
        """Agree with every rank on which parameters step: the active entries; None when the
        step is skipped on every rank; an error raised on every rank otherwise."""
        name = functools.partial(self.plan.entry_name, entries=entries)
        has_grad = check_gradients("DeMo", [p for _, _, p in entries], name)
        active = [e for e, has in zip(entries, has_grad) if has]
        rnd = self.open_round(
            [local(p.grad) if has else None for (_, _, p), has in zip(entries, has_grad)],
            amp,
            fingerprints=self._fingerprints(),
            describe=self._describe,
            name=self.plan.entry_name,
            device=self.plan.device(),
            extra=self._driver.measurement(torch.device("cpu")),
        )
        if not self._skip_or_raise(rnd, entries):
            return None
        self._driver.decide(rnd.extras if self.policy.observes else None, self._steps + 1)
        return active

    def _status_round(self, events: int = 0, bad: list[int] | None = None) -> Round:
        """The status round of the overlapped strategy, whose buckets left during backward:
        fingerprints, non-finite report, events and the policy's measurement (raises on every
        rank when anything disagrees)."""
        return self.exchange.agree(
            self._fingerprints(),
            self.exchange.report(bad or [], events=events),
            self._describe,
            extra=self._driver.measurement(torch.device("cpu")),
            device=self.plan.device(),
            names=self.plan.entry_name,
        )

    def _open_backward_round(self) -> None:
        """The overlapped strategy's round at the first hook of a step: buckets use the decay,
        so the two aliases are reconciled first."""
        sync_decay(self.param_groups, self.defaults["compression_decay"])
        self._status_round()

    def _skip_or_raise(self, rnd: Round, entries: list[Entry]) -> bool:
        """True to go on; False when every rank skips (counted in ``skipped_steps``); raises on
        every rank otherwise (:meth:`FrontEnd.skip_or_raise`)."""
        name = functools.partial(self.plan.entry_name, entries=entries)
        if self.skip_or_raise(rnd, name, when=f"step {self._steps + 1}"):
            return True
        self.skipped_steps += 1
        return False

    def _fingerprints(self) -> tuple[int, int]:
        """(exchange group, agreement groups) fingerprints of settings, layout and counters."""
        settings, counters = canonical(self._settings()), canonical(self._counters())
        local_fp = fingerprint(settings, self.plan.layout(False)[1], counters)
        if not self.exchange.agree_comms:  # no agreement group: no global layout to compare
            return local_fp, local_fp
        return local_fp, fingerprint(settings, self.plan.layout(True)[1], counters)

    def _describe(self, globally: bool) -> dict[str, Any]:
        """What the fingerprint covers, as JSON (the mismatch report)."""
        settings = self._settings()
        layout = self.plan.layout(globally)[0]
        return {
            "settings": {k: v for k, v in settings.items() if k != "groups"},
            "groups": settings["groups"],
            "layout": layout["params"],
            "derived": {"payload wire sizes": layout["wire"]},
            "counters": self._counters(),
        }

    def _counters(self) -> dict[str, int]:
        return {
            "steps": self._steps,
            "skipped_steps": self.skipped_steps,
            "skipped_syncs": self.skipped_syncs,
        }

    def _settings(self) -> dict[str, Any]:
        """Every setting that changes what is sent or how the update is computed (all ranks
        must agree: every round's fingerprint covers them)."""
        return {
            "payload": self.payload,
            "value_dtype": str(self.value_dtype),
            "dense_fallback": self.dense_fallback,
            "bucket_cap_mb": self.bucket_cap_mb,
            "full_sync_every": self.full_sync_every,
            "overlap_backward": self.overlap_backward,
            "nonfinite": self.nonfinite,
            "validate_payload": self.validate_payload,
            "policy": self.policy.describe(),
            "precision": self.precision,
            "seed": self.seed,
            "groups": [
                {k: _plain(g[k], kind) for k, kind in checkpoint.GROUP_SETTINGS.items()}
                for g in self.param_groups
            ],
        }

    def _generator(self, device: torch.device) -> torch.Generator:
        """This step's stochastic-rounding generator on ``device`` (seeded by seed and step,
        drawn in bucket order: the same draws on every rank)."""
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = rounding_generator(self.seed, self._steps, device)
        return gen

    def _full_sync(self, params: list[torch.Tensor]) -> None:
        """Average parameters with a dense all-reduce (one per dtype)."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in map(local, params):
            by_dtype.setdefault(p.dtype, []).append(p)
        with self.exchange.guarded():
            pending: list[tuple[list[torch.Tensor], Pending]] = []
            for ps in by_dtype.values():
                flat = torch.cat([p.reshape(-1) for p in ps])
                pending.append((ps, self.comm.all_reduce_mean(flat, "full parameter sync")))
            for ps, pend in pending:
                for p, avg in zip(ps, split_like(self.exchange.dense(pend, "the full parameter sync"), ps)):
                    p.copy_(avg)


def _plain(value: object, kind: type) -> object:
    """A group setting as a plain ``kind`` (:func:`~cokit.compress.frontend.plain`, then cast:
    ``compression_topk`` stays an int)."""
    value = plain(value)
    return kind(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value
