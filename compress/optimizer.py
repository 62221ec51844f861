"""DeMo: decoupled momentum with DCT + top-k compression (docs/design.md §1.1).

Each rank keeps an fp32 momentum / error-feedback buffer ``delta`` per parameter. A step:

    delta  = decay * delta + lr * grad
    send   = top-k(DCT(delta)) per tile;   delta -= alpha * IDCT(send)
    all-gather `send` from every rank; per position, mean over the ranks that sent it
    p      = p * (1 - lr * wd) - lr * sign(IDCT(mean))

Payloads are codecs of :mod:`cokit.compress.payload`: ``reference`` (int64 indices + fp32
values, two all-gathers per tensor: DeMo's reference), ``compact`` (int16 indices + fp16/bf16
values) or ``sign`` (int16 indices, 1 bit per value and one scale per tile), or any registered
codec. Bucketed payloads (compact, sign) of many tensors travel together, one all-gather per
wire tensor of the bucket, launched asynchronously so that encoding bucket i+1 overlaps the
collective of bucket i. Tensors whose payload would not be smaller than a dense all-reduce go
dense. Every rank decodes the same gathered bytes in rank order, so parameters stay
bit-identical across ranks.

Kernels: Triton on cuda/hip tensors, torch references on CPU tensors (the Triton interpreter
when ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import math
import time
import warnings
import zlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any, overload

import torch
import torch.distributed as dist

from cokit.compress import checkpoint, rules
from cokit.compress.adaptation import PolicyDriver, make_policy
from cokit.compress.buckets import Bucket, make_buckets
from cokit.compress.comm import Communicator, Pending
from cokit.compress.dtensor import check_exchange_group, local, mesh_plan
from cokit.compress.groups import NodeGroups, check_process_group
from cokit.compress.guards import GradMarks, StepGuards, all_finite, edited_message, sync_decay
from cokit.compress.payload import VALUE_DTYPES, get_codec
from cokit.compress.policy import Decision, NetworkPolicy
from cokit.compress.precision import (
    check_precision,
    master_copy,
    rounding_generator,
    warn_if_unmastered,
    write_update,
)
from cokit.compress.stats import CommStats, ring_allreduce_bytes
from cokit.triton_kernels.error_feedback import ef_decode, ef_encode

__all__ = ["DeMo"]

_NONFINITE = ("error", "skip")
# Per-group settings that change what is sent or how the update is computed (checked across ranks).
_GROUP_SETTINGS = {
    "lr": float,
    "weight_decay": float,
    "compression_decay": float,
    "compression_topk": int,
    "compression_chunk": int,
    "alpha": float,
    "update_rule": str,
    "rule_beta2": float,
    "rule_eps": float,
    "ns_steps": int,
    "rule_fallback": str,
}
# Per-parameter status travelling in the step's flag exchange (the low 2 bits of a byte; the
# other 6 carry part of the settings fingerprint: _add_fingerprint).
_OK, _BAD, _NO_GRAD = 0, 1, 2
_STATUS_MASK = 3


class DeMo(torch.optim.Optimizer):
    """Decoupled-momentum optimizer that sends only a top-k DCT selection per tile.

    Args:
        params: parameters, named parameters or param groups (per-group ``lr``,
            ``weight_decay``, ``compression_decay``, ``compression_topk``,
            ``compression_chunk``, ``alpha`` and the update-rule settings below).
        lr: learning rate (the update is ``lr * rule(decoded)``). Each rule has an lr rule
            from a tuned AdamW lr (:mod:`cokit.compress.rules`, measured in the README):
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
            ``skipped_steps``).
        timeout: seconds (or timedelta) to wait for a collective before raising an error that
            names this optimizer (default None or ``inf``: the process group's timeout). After
            a timeout the process group is aborted: restart every rank from its checkpoint.
        validate_payload: check every received index against its tile before decoding.
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
        hierarchy: :class:`~cokit.compress.groups.NodeGroups` (e.g. ``node_groups()``, from
            ``LOCAL_WORLD_SIZE``) for a two-level exchange: gradients are averaged densely
            inside each node (fast links); bucket ``b`` is then encoded by local rank
            ``b % ranks per node`` alone, exchanged across nodes between the ranks with that
            local rank, decoded, and its updated parameters broadcast inside the node, so each
            rank sends 1/L of the payload across nodes and holds 1/L of the error buffers.
            ``comm_stats`` counts the two levels
            (``step_intra_*`` fields). Needs ``process_group=None`` and
            ``overlap_backward=False``.

    **DTensor parameters** (FSDP2 ``fully_shard``, :mod:`cokit.compress.dtensor`): each rank
    steps its local shards, with tiles over each local shard. Over the mesh nothing is
    exchanged (FSDP reduce-scatters the gradients), but the ranks agree each step on the
    settings and on which gradients are finite. ``process_group`` is then the group DeMo
    exchanges over: None for pure FSDP (no replicas), or for HSDP the replicate group of a 2-D
    mesh whose shard dimension FSDP was given (``fully_shard(m, mesh=mesh["shard"])``,
    ``process_group=mesh.get_group("replicate")``). ``overlap_backward`` is not supported
    (FSDP overlaps its own reduce-scatter).

    Every rank must use the same settings: the first step (and the first after
    ``add_param_group``) compares every rank's parameters and every setting that changes what
    is sent or how the update is computed (the per-group ones above; payload, value_dtype,
    dense_fallback, bucket_cap_mb, full_sync_every, overlap_backward, nonfinite,
    validate_payload, policy) before any other collective, and every step compares a crc of the
    settings carried in the spare bits of its status bytes (no extra byte; all 32 bits from 6
    parameters on), so that e.g. an LR scheduler stepped on one rank only is caught at the next
    step. A difference raises ``ValueError`` on every rank, naming the setting, the group and
    each rank's value, before anything changed. (With ``overlap_backward``, change
    compression_topk / compression_chunk on every rank or on none: buckets are sent before the
    step's check.) Parameters with no elements have nothing to send and are left alone.

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
        validate_payload: bool = False,
        overlap_backward: bool = False,
        policy: NetworkPolicy | str | dict[str, Any] | None = None,
        hierarchy: NodeGroups | None = None,
        update_rule: str = "sign",
        rule_beta2: float = 0.999,
        rule_eps: float = 1e-8,
        ns_steps: int = 5,
        rule_fallback: str = "adam",
        precision: str = "nearest",
        seed: int = 0,
    ):
        codec = get_codec(payload, owner="DeMo")
        precision = check_precision("DeMo", precision)
        if not (isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed < 2**63):
            raise ValueError(f"DeMo: seed must be an integer in [0, 2**63), got {seed!r}")
        network_policy = make_policy(policy)
        if overlap_backward and network_policy.observes:
            raise ValueError(
                f"DeMo: policy {network_policy.describe()} decides each step before its buckets are "
                "sent, but overlap_backward=True sends them during backward; use one or the other"
            )
        if value_dtype not in VALUE_DTYPES:
            raise TypeError(
                f"DeMo: value_dtype must be torch.float16, bfloat16 or float32, got {value_dtype}"
            )
        if not (
            isinstance(bucket_cap_mb, (int, float))
            and not isinstance(bucket_cap_mb, bool)
            and math.isfinite(bucket_cap_mb)
            and bucket_cap_mb > 0
        ):
            raise ValueError(f"DeMo: bucket_cap_mb must be a positive number, got {bucket_cap_mb!r}")
        for name, flag in (("validate_payload", validate_payload), ("overlap_backward", overlap_backward)):
            if not isinstance(flag, bool):
                raise TypeError(f"DeMo: {name} must be True or False, got {flag!r}")
        if dense_fallback is not None and not isinstance(dense_fallback, bool):
            raise TypeError(f"DeMo: dense_fallback must be True, False or None, got {dense_fallback!r}")
        check_process_group("DeMo", process_group)
        if full_sync_every is not None and not _positive_int(full_sync_every):
            raise ValueError(
                f"DeMo: full_sync_every must be a positive integer or None, got {full_sync_every!r}"
            )
        if nonfinite not in _NONFINITE:
            raise ValueError(f"DeMo: nonfinite must be 'error' or 'skip', got {nonfinite!r}")
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
        self.precision = precision
        self.seed = seed
        self._precision_checked = False  # warn_if_unmastered runs at the first step
        self._generators: dict[torch.device, torch.Generator] = {}  # this step's rounding draws
        self.payload = payload
        self.codec = codec
        self.requested_value_dtype = value_dtype
        self.value_dtype = codec.resolve_value_dtype(value_dtype)
        self.bucket_cap_mb = float(bucket_cap_mb)
        self.bucket_cap_bytes = int(bucket_cap_mb * 2**20)
        self.dense_fallback = codec.dense_fallback if dense_fallback is None else bool(dense_fallback)
        self.full_sync_every = full_sync_every
        self.nonfinite = nonfinite
        self.validate_payload = bool(validate_payload)
        self.comm = Communicator(process_group, owner="DeMo.step", timeout=timeout)
        self.comm_stats = CommStats()
        self.skipped_steps = 0
        self.policy = network_policy
        self._driver = PolicyDriver(network_policy)
        self.skipped_syncs = 0
        self._steps = 0
        self._checked_layout: tuple | None = None
        self._bucket_cache: dict[tuple, list[Bucket]] = {}
        self.overlap_backward = bool(overlap_backward)
        self._inflight: dict[int, _Inflight] = {}
        self._ready: set[int] = set()
        # overlap_backward: every bucket's parameters and each parameter's bucket (made once)
        self._hook_plan: tuple[list[Bucket], list[list[torch.Tensor]], dict[int, int]] | None = None
        self._hooks: list = []  # overlap_backward: one post-accumulate-grad hook per parameter
        self._guards = StepGuards()  # momentum alias sync, DDP double-sync warning
        super().__init__(params, defaults)
        sync_decay(self.param_groups, compression_decay)  # a group that set only one of the two
        self._setup_groups(process_group, timeout, hierarchy)

    def _setup_groups(self, process_group, timeout, hierarchy) -> None:
        """The exchange group (``self.comm``) and the groups that only agree each step
        (``self._agree``: a DTensor mesh's sharded dimensions, or the node of a hierarchy)."""
        self._mesh = mesh_plan([p for g in self.param_groups for p in g["params"]])
        self._hierarchy = hierarchy
        agree: list = []
        if hierarchy is not None:
            if not isinstance(hierarchy, NodeGroups):
                raise TypeError(
                    "DeMo: hierarchy must be a cokit.compress.groups.NodeGroups (e.g. node_groups()), "
                    f"got {type(hierarchy).__name__}"
                )
            if self._mesh is not None:
                raise ValueError(
                    "DeMo: hierarchy= is for plain data parallel; with DTensor (FSDP2) parameters, "
                    "FSDP's mesh is the node level: pass the replicate group as process_group"
                )
            if process_group is not None:
                raise ValueError("DeMo: pass either process_group= or hierarchy=, not both")
            self.comm = Communicator(hierarchy.inter, owner="DeMo.step", timeout=timeout)
            agree = [hierarchy.intra]
        elif self._mesh is not None:
            check_exchange_group(self._mesh, process_group)
            self.comm = Communicator(
                process_group, owner="DeMo.step", timeout=timeout, local=process_group is None
            )
            agree = list(self._mesh.agree)
            if process_group is not None and len(agree) == 1:  # HSDP: checked to tile the world
                self._hierarchy = NodeGroups(intra=agree[0], inter=process_group)
        if agree and self.policy.observes:
            raise ValueError(
                f"DeMo: policy {self.policy.describe()} measures the exchange group only; with DTensor "
                "parameters or hierarchy= the ranks of a node could decide differently: use the "
                "static policy"
            )
        if agree and self.overlap_backward:
            raise ValueError(
                "DeMo: overlap_backward=True works with plain data parallel only (not with DTensor "
                "parameters or hierarchy=); FSDP overlaps its own reduce-scatter"
            )
        self._agree = [
            Communicator(g, owner="DeMo.step", timeout=timeout, timer=self.comm.timer) for g in agree
        ]
        # hierarchy: the node's dense average runs on the (only) agreement group
        self._intra = self._agree[0] if hierarchy is not None else None
        for gi, group in enumerate(self.param_groups):
            self._check_plain_parallel(group, gi)

    def _check_plain_parallel(self, group: dict[str, Any], index: int) -> None:
        """The update rules and precision modes keep state that must be identical on every
        rank and see whole tensors: plain data parallel only."""
        if not hasattr(self, "_agree") or not self._agree:
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
        and is not added. Every rank must add the same groups: the next step checks again that
        all ranks agree (a collective)."""
        if isinstance(param_group, dict) and "params" in param_group:
            params = param_group["params"]  # a list once, so a generator is not consumed twice
            params = [params] if isinstance(params, torch.Tensor) else params
            params = params if isinstance(params, set) else list(params)  # torch rejects sets
            param_group = {**param_group, "params": params}
            self._check_group({**self.defaults, **param_group}, len(self.param_groups))
            self._check_same_mesh(param_group["params"])
            self._check_plain_parallel({**self.defaults, **param_group}, len(self.param_groups))
        super().add_param_group(param_group)
        self._hook_plan = None
        self._bucket_cache.clear()
        self._checked_layout = None  # the next step checks every rank's settings and layout again
        if self.overlap_backward:
            new = self.param_groups[-1]["params"]
            self._hooks += [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in new]

    @staticmethod
    def _check_group(group: dict[str, Any], index: int) -> None:
        """Raise unless ``group`` (defaults filled in) holds valid settings and parameters."""
        where = f"DeMo param group {index}"
        _check_number(where, "lr", group["lr"], 0.0)
        _check_number(where, "weight_decay", group["weight_decay"], 0.0)
        _check_number(where, "compression_decay", group["compression_decay"], 0.0, 1.0)
        if "momentum" in group:  # the alias of compression_decay (guards.sync_decay)
            _check_number(where, "momentum", group["momentum"], 0.0, 1.0)
        _check_number(where, "alpha", group["alpha"], 0.0, 1.0)
        if group["alpha"] == 0:
            raise ValueError(f"{where}: alpha must be in (0, 1]; 0 would never drain the buffer")
        for key in ("compression_topk", "compression_chunk"):
            if not _positive_int(group[key]):
                raise ValueError(f"{where}: {key} must be a positive integer, got {group[key]!r}")
        rules.check_rule_settings(where, group)
        for p in group["params"]:
            p = p[1] if isinstance(p, tuple) and len(p) == 2 else p  # (name, parameter)
            if isinstance(p, torch.Tensor) and p.dtype not in VALUE_DTYPES:
                raise TypeError(
                    f"{where}: DeMo optimizes float32, float16 and bfloat16 parameters, got {p.dtype}"
                )

    def _check_same_mesh(self, params: list) -> None:
        """A group added after construction must live on the optimizer's mesh (or none)."""
        if not hasattr(self, "_mesh"):  # during __init__: _setup_groups checks all groups
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
        self._bucket_cache.clear()  # the loaded groups may tile or select differently
        self._hook_plan = None

    # ------------------------------------------------------------------ step
    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One synchronized step over every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._guards.before_step(self.param_groups, self.defaults["compression_decay"])
        entries = self._entries()
        if not self._precision_checked:
            warn_if_unmastered("DeMo", [p for _, _, p in entries], self.precision)
            self._precision_checked = True
        self._generators = {}
        if self._checked_layout is None:
            self._check_layout(entries)
        if self.overlap_backward:
            active = self._finish_overlapped(entries)
        else:
            active = self._step_now(entries)
        if active is None:  # skipped consistently on every rank
            self._record(dense=0, synced=False)
            return loss
        dense_bytes = ring_allreduce_bytes(
            sum(_grad(p).numel() * _grad(p).element_size() for _, _, p in active), self._dense_world()
        )
        self._steps += 1
        if self.full_sync_every is not None and self._steps % self.full_sync_every == 0:
            self._full_sync([p for _, _, p in entries])
        self._record(dense=dense_bytes, synced=self._driver.syncing)
        return loss

    def _dense_world(self) -> int:
        """Ranks a dense all-reduce of the same gradients would span (``step_dense_bytes``):
        the exchange group, times the node for a hierarchy."""
        return self.comm.world_size * (self._intra.world_size if self._intra is not None else 1)

    def _entries(self) -> list[tuple[int, int, torch.Tensor]]:
        return [(gi, i, p) for gi, g in enumerate(self.param_groups) for i, p in enumerate(g["params"])]

    def _step_now(self, entries):
        """Agree on the gradients, then encode, send and decode every bucket."""
        status = self._exchange_status(entries)
        if status is None:
            return None
        active = [e for e, has_grad in zip(entries, status) if has_grad]
        decision = self._driver.decision or Decision()
        buckets = self._buckets(active, decision) if active else []
        averages = self._node_averages(buckets, active)
        finishers = []
        for b, bucket in enumerate(buckets):
            params = [active[i][2] for i in bucket.members]
            grads = None
            if averages is not None:
                mean = self._wait(averages[b])
                if not self._owns(b):  # another rank of the node encodes and sends this bucket
                    continue
                grads = _split_like(mean, [local(p) for p in params])
            if decision.skip_sync:
                self._accumulate(bucket.group, params, grads)
            else:
                finishers.append(self._launch(bucket, params, grads=grads))
        for finish in finishers:
            finish()
        if self._intra is not None and not decision.skip_sync:
            self._share_updates(buckets, active)
        if decision.skip_sync:
            self.skipped_syncs += 1
        return active

    def _owns(self, b: int) -> bool:
        """hierarchy: bucket ``b`` is encoded, sent and decoded by local rank ``b % ranks per
        node`` only (its cross-node group holds the owners of the same buckets on every node)."""
        return self._intra is None or b % self._intra.world_size == self._intra.rank

    def _share_updates(self, buckets: list[Bucket], active) -> None:
        """hierarchy: every bucket's owner broadcasts its updated parameters inside the node."""
        intra = self._intra
        assert intra is not None
        pending = []
        for b, bucket in enumerate(buckets):
            params = [local(active[i][2]) for i in bucket.members]
            flat = torch.cat([p.reshape(-1) for p in params])
            owner = b % intra.world_size
            pending.append((params, intra.broadcast(flat, owner, "intra-node parameter broadcast"), owner))
        for params, pend, owner in pending:
            flat = self._wait(pend)
            if owner != intra.rank:
                for p, new in zip(params, _split_like(flat, params)):
                    p.copy_(new)

    def _node_averages(self, buckets: list[Bucket], active) -> list[Pending] | None:
        """hierarchy: start the dense average of every bucket's gradients inside the node
        (all launched first, so bucket i+1's average runs while bucket i is encoded)."""
        if self._intra is None:
            return None
        return [
            self._intra.all_reduce_mean(
                torch.cat([_grad(active[i][2]).reshape(-1) for i in b.members]), "intra-node gradient average"
            )
            for b in buckets
        ]

    def _accumulate(self, gi: int, params: list[torch.Tensor], grads: list[torch.Tensor] | None) -> None:
        """A skipped sync: the gradient only enters the error buffers."""
        group = self.param_groups[gi]
        grads = [_grad(p) for p in params] if grads is None else grads
        for p, g in zip(params, grads):
            self._delta(p).mul_(group["compression_decay"]).add_(g.float(), alpha=group["lr"])

    def _wait(self, pending: Pending) -> torch.Tensor:
        """Wait on a collective, counting the time blocked for the network policy."""
        start = time.perf_counter()
        result = pending.wait()
        self._driver.blocked(time.perf_counter() - start)
        return result

    # ------------------------------------------------------------------ overlap with backward
    @torch.no_grad()
    def _on_grad_ready(self, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook: launch the bucket of ``p`` once all of it is ready."""
        if not self._ready and not self._inflight:  # the step's first hook: buckets use the decay
            sync_decay(self.param_groups, self.defaults["compression_decay"])
        if self._hook_plan is None:
            entries = self._entries()
            if self._checked_layout is None:
                self._check_layout(entries)
            buckets = self._buckets(entries)
            members = [[entries[i][2] for i in b.members] for b in buckets]
            self._hook_plan = (buckets, members, {id(q): b for b, ps in enumerate(members) for q in ps})
        buckets, members, bucket_of = self._hook_plan
        where = bucket_of.get(id(p))
        if where is None:  # an empty parameter: in no bucket, nothing to send
            return
        if where in self._inflight:
            raise RuntimeError(
                "DeMo(overlap_backward=True): a second backward reached a bucket that is already being "
                "sent; call step() after every backward (gradient accumulation needs overlap_backward=False)"
            )
        self._ready.add(id(p))
        if all(id(q) in self._ready for q in members[where]):
            self._inflight[where] = self._launch_copy(buckets[where], members[where])

    def _launch_copy(self, bucket: Bucket, params: list[torch.Tensor]) -> _Inflight:
        """Encode into copies of the buffers and send the bucket with its finite flags; mark the
        gradients so that step() can tell whether they changed after the launch."""
        for p in params:
            if p.grad is None or p.grad.is_sparse:
                raise RuntimeError(
                    "DeMo(overlap_backward=True): every parameter needs a dense gradient each step"
                )
        marks = GradMarks(params)
        flags = torch.stack([~all_finite(_grad(p)) for p in params]).to(torch.uint8)
        _add_fingerprint(flags, self._settings_crc(), bucket.members)
        work = [self._delta(p).clone() for p in params]
        finish = self._launch(bucket, params, work)
        return _Inflight(finish, self.comm.all_gather(flags, "gradient status exchange"), work, params, marks)

    def _finish_overlapped(self, entries):
        buckets = self._buckets(entries)
        for b, bucket in enumerate(buckets):  # buckets whose hooks did not fire (grads set by hand)
            if b not in self._inflight:
                self._inflight[b] = self._launch_copy(bucket, [entries[i][2] for i in bucket.members])
        inflight, self._inflight, self._ready = self._inflight, {}, set()
        # Gradients changed after their launch (clipping, unscaling, edits) would be ignored:
        # one byte per rank at step time makes every rank raise together.
        changed = {b: run.marks.changed() for b, run in sorted(inflight.items())}
        edits = None
        if changed:  # every rank has the same buckets: all or none take part
            mine = torch.stack([c.any() for c in changed.values()]).any().to(torch.uint8).reshape(1)
            edits = self.comm.all_gather(mine, "gradient edit check")
        gathered = {b: run.flags.wait() for b, run in sorted(inflight.items())}
        if any(_fingerprints_differ(flags) for flags in gathered.values()):
            self._raise_settings_mismatch()
        edited = [] if edits is None else self._wait(edits).flatten().nonzero().flatten().tolist()
        if edited:
            self._reset_counts()
            local_edits = [
                buckets[b].members[n] for b, c in changed.items() for n in c.nonzero().flatten().tolist()
            ]
            name = self._name(*entries[min(local_edits)]) if local_edits else None
            ranks = [self.comm.global_rank(r) for r in edited]
            raise RuntimeError(edited_message(ranks, self.comm.global_rank(self.comm.rank), name))
        bad = []
        for b, flags in gathered.items():
            status = flags & _STATUS_MASK
            bad += [(r, buckets[b].members[n]) for r, n in (status != _OK).nonzero().tolist()]
        if bad:
            self.comm.reset_counts()
            if self.nonfinite == "skip":
                self.skipped_steps += 1
                return None
            r, n = min(bad)
            raise FloatingPointError(self._nonfinite_message(entries[n], r, len(bad)))
        for _, run in sorted(inflight.items()):
            run.finish()
            for p, delta in zip(run.params, run.work):
                self.state[p]["delta"] = delta
        return entries

    def _record(self, dense: int, synced: bool) -> None:
        sent, received, timing = self.comm.take_step()
        intra_sent = intra_received = 0
        for comm in self._agree:
            s_, r_ = comm.take_counts()
            intra_sent, intra_received = intra_sent + s_, intra_received + r_
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.comm_stats.record(
            sent + intra_sent,
            received + intra_received,
            dense,
            timing,
            world,
            self.comm.world_size,
            intra=(intra_sent, intra_received),
            intra_group_size=math.prod(c.world_size for c in self._agree),
        )
        self._driver.step_done(sent, dense, synced)

    def _name(self, gi: int, i: int, p: torch.Tensor) -> str:
        names = self.param_groups[gi].get("param_names")
        label = f"'{names[i]}'" if names else f"group {gi} param {i}"
        return f"{label} {tuple(p.shape)}"

    def _settings(self) -> dict[str, Any]:
        """Every setting that changes what is sent or how the update is computed (all ranks
        must agree: :meth:`_check_layout` and every step's status exchange compare them)."""
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
                {k: _plain(g[k], kind) for k, kind in _GROUP_SETTINGS.items()} for g in self.param_groups
            ],
        }

    def _settings_crc(self) -> int:
        return zlib.crc32(repr(self._settings()).encode())

    def _check_layout(self, entries) -> None:
        """First step (and the first after ``add_param_group``), before any other collective:
        every rank must hold the same parameters and settings (over the exchange group with
        local shard shapes; over each agreement group with the global shapes and placements).
        A difference raises on every rank, naming it, before anything changed."""
        if self._hierarchy is not None and self._checked_layout is None:
            self._hierarchy.check_tiling("DeMo")
        seen: list[int] = []
        for comm in [self.comm, *self._agree]:
            seen += self._check_layout_on(comm, entries, globally=comm is not self.comm)
        self._checked_layout = tuple(seen)

    def _check_layout_on(self, comm: Communicator, entries, globally: bool) -> list[int]:
        settings = self._settings()
        # ranks of a sharded dimension hold different local shards: compare the global shapes
        desc = [
            (gi, tuple(p.shape), str(p.dtype), str(getattr(p, "placements", "")))
            if globally
            else (gi, tuple(local(p).shape), str(p.dtype))
            for gi, _, p in entries
        ]
        key = repr((settings, desc)).encode()
        # On the parameters' device: NCCL/RCCL groups only move GPU tensors.
        mine = torch.tensor([zlib.crc32(key)], dtype=torch.int64, device=entries[0][2].device)
        seen = comm.all_gather(mine, "parameter layout check").wait().flatten().tolist()
        if len(set(seen)) > 1:
            self._reset_counts()
            everyone = comm.gather_objects((settings, desc))
            for r, (_, other) in enumerate(everyone):
                for (gi, i, p), mine_d, theirs in zip(entries, desc, other):
                    if mine_d != theirs:
                        raise ValueError(
                            f"DeMo: parameter {self._name(gi, i, p)} is {mine_d[1:]} on rank "
                            f"{comm.global_rank(comm.rank)} but {theirs[1:]} on rank {comm.global_rank(r)}: "
                            "every rank must build the same model"
                        )
                if len(other) != len(desc):
                    raise ValueError(
                        f"DeMo: rank {comm.global_rank(r)} has {len(other)} parameters, rank "
                        f"{comm.global_rank(comm.rank)} has {len(desc)}: every rank must build the same model"
                    )
            raise ValueError(_settings_message([s for s, _ in everyone], comm))
        return seen

    def _reset_counts(self) -> None:
        """A step that raised: drop its byte counts and timing marks on every group."""
        self.comm.reset_counts()
        for comm in self._agree:
            comm.take_counts()

    def _raise_settings_mismatch(self, comm: Communicator | None = None) -> None:
        """The step's settings fingerprints differ: gather every rank's settings and raise."""
        comm = comm or self.comm
        self._reset_counts()
        raise ValueError(_settings_message(comm.gather_objects(self._settings()), comm))

    def _exchange_status(self, entries) -> list[bool] | None:
        """Agree with every rank on which parameters step; None when the step is skipped."""
        with_grad = []
        for n, (gi, i, p) in enumerate(entries):
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise TypeError(
                    f"DeMo: parameter {self._name(gi, i, p)} has a sparse gradient; "
                    "DeMo needs dense gradients"
                )
            if p.grad.shape != p.shape:
                raise ValueError(f"DeMo: gradient of {self._name(gi, i, p)} has shape {tuple(p.grad.shape)}")
            with_grad.append(n)
        # One small tensor on the parameters' device (NCCL/RCCL groups only move GPU tensors).
        flags = torch.full((len(entries),), _NO_GRAD, dtype=torch.uint8, device=entries[0][2].device)
        if with_grad:
            finite = torch.stack([all_finite(_grad(entries[n][2])) for n in with_grad])
            flags[with_grad] = torch.where(finite, _OK, _BAD).to(torch.uint8)
        _add_fingerprint(flags, self._settings_crc(), range(len(entries)))
        culprits: dict[int, int] = {}  # entry -> global rank of a non-finite shard found by agreement
        for comm in self._agree:
            flags = self._agree_status(comm, flags, entries, culprits)
        n_flags = len(entries)
        if self._driver.status_bytes:  # the previous step's times, for the network policy
            flags = torch.cat([flags, self._driver.measurement(flags.device)])
        gathered = self._wait(self.comm.all_gather(flags, "gradient status exchange")).cpu()
        everyone, measured = gathered[:, :n_flags], gathered[:, n_flags:]
        if _fingerprints_differ(everyone):
            self._raise_settings_mismatch()
        everyone = everyone & _STATUS_MASK
        has_grad = everyone != _NO_GRAD
        mixed = (has_grad.any(0) & ~has_grad.all(0)).nonzero().flatten().tolist()
        if mixed:
            self._reset_counts()
            ranks = has_grad[:, mixed[0]].nonzero().flatten().tolist()
            raise RuntimeError(
                self._mixed_message(entries[mixed[0]], [self.comm.global_rank(r) for r in ranks])
            )
        bad = (everyone == _BAD).nonzero().tolist()
        if bad:
            if self.nonfinite == "skip":
                self.skipped_steps += 1
                return None
            self._reset_counts()
            r, n = bad[0]
            rank = culprits[n] if r == self.comm.rank and n in culprits else self.comm.global_rank(r)
            raise FloatingPointError(self._nonfinite_message(entries[n], rank, len(bad)))
        self._driver.decide(measured if self._driver.status_bytes else None, self._steps + 1)
        return has_grad[0].tolist()

    def _agree_status(self, comm: Communicator, flags: torch.Tensor, entries, culprits: dict[int, int]):
        """Combine the status bytes over an agreement group (a mesh's sharded dimension, or a
        node): a parameter is non-finite if any rank's shard is, so that the exchange group
        then takes the same decision everywhere. Settings must agree here too."""
        gathered = self._wait(comm.all_gather(flags, "gradient status agreement")).cpu()
        if _fingerprints_differ(gathered):
            self._raise_settings_mismatch(comm)
        status = gathered & _STATUS_MASK
        has_grad = status != _NO_GRAD
        mixed = (has_grad.any(0) & ~has_grad.all(0)).nonzero().flatten().tolist()
        if mixed:
            self._reset_counts()
            ranks = has_grad[:, mixed[0]].nonzero().flatten().tolist()
            raise RuntimeError(self._mixed_message(entries[mixed[0]], [comm.global_rank(r) for r in ranks]))
        bad = status == _BAD
        for r, n in bad.nonzero().tolist():
            culprits.setdefault(n, comm.global_rank(r))
        combined = torch.where(bad.any(0), _BAD, status[0]).to(torch.uint8).to(flags.device)
        return combined | (flags & ~_STATUS_MASK)

    def _mixed_message(self, entry, ranks: list[int]) -> str:
        return (
            f"DeMo: parameter {self._name(*entry)} has a gradient on ranks {ranks} only; every rank "
            "must produce the same set of gradients (use zero_grad(set_to_none=False) or make "
            "unused parameters take part in the loss)"
        )

    def _nonfinite_message(self, entry, rank: int, n_bad: int) -> str:
        more = f" (and {n_bad - 1} more)" if n_bad > 1 else ""
        return (
            f"DeMo: non-finite gradient in {self._name(*entry)} on rank {rank}{more}; no parameter "
            "and no buffer changed. Fix the loss scale / data, or pass nonfinite='skip' to skip "
            "such steps on every rank"
        )

    def _buckets(self, active, decision: Decision | None = None) -> list[Bucket]:
        """The buckets of ``active`` under ``decision`` (default: the optimizer's settings)."""
        decision = decision or Decision()
        key = (tuple((gi, i) for gi, i, _ in active), decision)
        buckets = self._bucket_cache.get(key)
        if buckets is None:
            codec, value_dtype = self.codec, self.value_dtype
            if decision.payload is not None:
                codec = get_codec(decision.payload, owner="DeMo policy")
                value_dtype = codec.resolve_value_dtype(self.requested_value_dtype)
            settings = [
                {
                    "compression_chunk": g["compression_chunk"],
                    "compression_topk": max(1, round(g["compression_topk"] * decision.topk_scale)),
                }
                for g in self.param_groups
            ]
            buckets = make_buckets(
                [gi for gi, _, _ in active],
                [tuple(local(p).shape) for _, _, p in active],
                settings,
                codec,
                value_dtype,
                self.bucket_cap_bytes,
                self.dense_fallback,
                self.comm.world_size,
                all_dense=decision.dense,
                dense_itemsizes=[local(p).element_size() for _, _, p in active],
            )
            self._bucket_cache[key] = buckets
        return buckets

    def _delta(self, p: torch.Tensor) -> torch.Tensor:
        state = self.state[p]
        if "delta" not in state:
            state["delta"] = torch.zeros_like(
                local(p), dtype=torch.float32, memory_format=torch.contiguous_format
            )
        return state["delta"]

    def _launch(
        self,
        bucket: Bucket,
        params: list[torch.Tensor],
        deltas: list[torch.Tensor] | None = None,
        *,
        grads: list[torch.Tensor] | None = None,
    ) -> Callable[[], None]:
        """Encode a bucket (updating ``deltas``; ``grads`` default: the parameters') and start
        its collective; returns its decode."""
        group = self.param_groups[bucket.group]
        lr, wd = group["lr"], group["weight_decay"]
        beta, alpha = group["compression_decay"], group["alpha"]
        chunk, k = group["compression_chunk"], bucket.topk
        deltas = [self._delta(p) for p in params] if deltas is None else deltas
        grads = [_grad(p) for p in params] if grads is None else grads
        states = [self.state[p] for p in params]
        params = [local(p) for p in params]  # DTensor parameters are updated through their shard
        timer, device = self.comm.timer, params[0].device
        fused = group["update_rule"] == "sign" and self.precision == "nearest"  # DeMo's fused decode

        if bucket.dense:  # sent in the parameters' dtype, like a DDP of the same model
            wire = functools.reduce(torch.promote_types, (p.dtype for p in params))
            with timer.span("encode", device):
                send = torch.cat([_dense_encode(d, g, beta, lr, alpha) for d, g in zip(deltas, grads)]).to(
                    wire
                )
            pending = self.comm.all_reduce_mean(send, "dense all-reduce")

            def finish_dense() -> None:
                mean = self._wait(pending)
                with timer.span("decode", device):
                    if fused:
                        _dense_decode(params, mean, lr, wd)
                    else:
                        directions = [u.float() for u in _split_like(mean, params)]
                        self._apply_rule(group, params, states, directions)

            return finish_dense

        codec = bucket.codec
        if codec is None or k is None:
            raise RuntimeError("DeMo: internal error: a compressed bucket has no payload codec or k")
        with timer.span("encode", device):
            idx, vals = ef_encode(
                deltas, grads, beta=beta, lr=lr, chunk=chunk, k=k, alpha=alpha, value_dtype=codec.encode_dtype
            )
            wires = codec.to_wire(idx, vals)
        gathers = [
            self.comm.all_gather(tensor, f"{wire.name} all-gather") for wire, tensor in zip(codec.wire, wires)
        ]

        def finish() -> None:
            gathered = [self._wait(g) for g in gathers]
            with timer.span("decode", device):
                indices, values = codec.from_wire(gathered)
                if fused:
                    ef_decode(
                        params,
                        indices,
                        values,
                        lr=lr,
                        chunk=chunk,
                        k=k,
                        weight_decay=wd,
                        use_sign=True,
                        validate=self.validate_payload,
                    )
                    return
                # the decoded direction: 0 - 1 * IDCT(mean) into zeroed fp32 scratch, then -1
                scratch = [torch.zeros(p.shape, dtype=torch.float32, device=p.device) for p in params]
                ef_decode(
                    scratch,
                    indices,
                    values,
                    lr=1.0,
                    chunk=chunk,
                    k=k,
                    weight_decay=0.0,
                    use_sign=False,
                    validate=self.validate_payload,
                )
                self._apply_rule(group, params, states, [s.neg_() for s in scratch])

        return finish

    def _apply_rule(
        self,
        group: dict[str, Any],
        params: list[torch.Tensor],
        states: list[dict[str, Any]],
        directions: list[torch.Tensor],
    ) -> None:
        """``p = p * (1 - lr * wd) - lr * rule(u)`` for decoded directions ``u`` (fp32),
        computed from the fp32 master when there is one and written with this precision."""
        lr, wd = float(group["lr"]), float(group["weight_decay"])
        for p, state, u in zip(params, states, directions):
            update = rules.apply_rule(u, state, group)
            master = None
            if self.precision == "master" and p.dtype != torch.float32:
                if "master" not in state:
                    state["master"] = master_copy(p)
                master = state["master"]
            base = master if master is not None else p.float()
            new = base * (1.0 - lr * wd) - lr * update
            low = p.dtype != torch.float32
            generator = self._generator(p.device) if low and self.precision == "stochastic" else None
            write_update(p, new, self.precision, master=master, generator=generator)

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
        pending: list[tuple[list[torch.Tensor], Pending]] = []
        for ps in by_dtype.values():
            flat = torch.cat([p.reshape(-1) for p in ps])
            pending.append((ps, self.comm.all_reduce_mean(flat, "full parameter sync")))
        for ps, pend in pending:
            for p, avg in zip(ps, _split_like(self._wait(pend), ps)):
                p.copy_(avg)


@dataclasses.dataclass
class _Inflight:
    """A bucket launched during backward: its decode, flags, buffer copies and params."""

    finish: Callable[[], None]
    flags: Pending
    work: list[torch.Tensor]
    params: list[torch.Tensor]
    marks: GradMarks  # the gradients at launch (a later change raises at step)


def _dense_encode(
    delta: torch.Tensor, grad: torch.Tensor, beta: float, lr: float, alpha: float
) -> torch.Tensor:
    """Dense version of the encode: everything is transmitted."""
    delta.mul_(beta).add_(grad.float(), alpha=lr)
    send = delta.reshape(-1).clone()
    delta.mul_(1.0 - alpha)
    return send


def _split_like(flat: torch.Tensor, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like each of ``params``, in order."""
    return [part.view(p.shape) for p, part in zip(params, flat.split([p.numel() for p in params]))]


def _dense_decode(params: list[torch.Tensor], mean: torch.Tensor, lr: float, wd: float) -> None:
    for p, update in zip(params, _split_like(mean, params)):
        p.copy_(p.float() * (1.0 - lr * wd) - lr * update.sign())


def _add_fingerprint(flags: torch.Tensor, crc: int, positions: Iterable[int]) -> None:
    """OR the settings crc into the spare high 6 bits of the status bytes: the byte of entry
    ``n`` (``flags[j]`` for ``positions[j] == n``) carries crc bits ``6n .. 6n+5``, so a step of
    6 or more parameters carries all 32 bits at no extra byte (fewer parameters: ``6 * n``)."""
    carry = [(j, n) for j, n in enumerate(positions) if 6 * n < 32]
    if carry:
        chunks = torch.tensor([((crc >> (6 * n)) & 63) << 2 for _, n in carry], dtype=torch.uint8)
        chunks = chunks.to(flags.device, non_blocking=True)
        where = [j for j, _ in carry]
        if where == list(range(len(where))):  # the usual case: the first entries, a slice
            flags[: len(where)].bitwise_or_(chunks)
        else:
            flags[where] |= chunks


def _fingerprints_differ(gathered: torch.Tensor) -> bool:
    """True when the ranks' rows of gathered status bytes carry different settings fingerprints."""
    bits = gathered >> 2
    return bool((bits != bits[:1]).any())


def _plain(value: object, kind: type) -> object:
    """A group setting as a plain ``kind`` (tensor learning rates included), so equal values
    compare and print equal on every rank (lr=1 and lr=1.0 agree)."""
    if isinstance(value, torch.Tensor):
        value = value.item()
    return kind(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value


def _settings_message(everyone: list[dict[str, Any]], comm: Communicator) -> str:
    """The first setting the ranks of ``comm`` disagree on, with each rank's value (global
    ranks; the same text on every rank of the group)."""
    ranks = [comm.global_rank(r) for r in range(len(everyone))]
    diff = _first_difference(everyone, ranks) or "their settings fingerprints differ"
    return (
        f"DeMo: the ranks disagree: {diff}; nothing changed. Every rank must use the same "
        "settings and change them the same way (e.g. step an LR scheduler on every rank)"
    )


def _first_difference(everyone: list[dict[str, Any]], ranks: list[int]) -> str | None:
    def differ(values: Sequence[object]) -> bool:
        return len({repr(v) for v in values}) > 1

    for key in everyone[0]:
        if key != "groups" and differ(values := [s[key] for s in everyone]):
            return f"setting {key!r} is " + _per_rank(values, ranks)
    if differ(counts := [len(s["groups"]) for s in everyone]):
        return "the number of param groups is " + _per_rank(counts, ranks)
    for gi in range(len(everyone[0]["groups"])):
        for key in _GROUP_SETTINGS:
            if differ(values := [s["groups"][gi][key] for s in everyone]):
                return f"param group {gi} setting {key!r} is " + _per_rank(values, ranks)
    return None


def _per_rank(values: Sequence[object], ranks: list[int]) -> str:
    """``0.01 on ranks [0, 2], 0.02 on rank [1]`` (``values[j]`` is rank ``ranks[j]``'s; at
    most 8 ranks listed per value)."""
    by_value: dict[str, list[int]] = {}
    for r, v in zip(ranks, values):
        by_value.setdefault(repr(v), []).append(r)
    parts = []
    for v, rs in by_value.items():
        listed = ", ".join(map(str, rs[:8])) + (f", ... ({len(rs)} ranks)" if len(rs) > 8 else "")
        parts.append(f"{v} on rank{'s' if len(rs) > 1 else ''} [{listed}]")
    return ", ".join(parts)


def _grad(p: torch.Tensor) -> torch.Tensor:
    """The gradient of ``p`` (its local shard for a DTensor)."""
    if p.grad is None:
        raise RuntimeError(f"DeMo: parameter {tuple(p.shape)} lost its gradient during the step")
    return local(p.grad)


def _positive_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _check_number(where: str, name: str, value: object, low: float, high: float | None = None) -> None:
    if isinstance(value, torch.Tensor):
        value = value.item()
    number = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
    if not math.isfinite(number) or number < low or (high is not None and number > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{where}: {name} must be a finite number {bound}, got {value!r}")
