"""SparseLoCo / DiLoCo: infrequent sync of compressed pseudo-gradients around a local optimizer.

Every rank runs ``sync_every`` (H) local steps of an inner optimizer (AdamW by default); then
the ranks synchronize (Sarfi et al. 2025, arXiv 2508.15706; DiLoCo, Douillard et al. 2023)::

    delta = theta_global - theta_local              # this rank's pseudo-gradient (fp32)
    e     = error_decay * e + delta                 # local error feedback (SparseLoCo)
    sent  = codec(top-k per tile of [DCT] e)        # what the wire carries (e.g. 2-bit values)
    e    -= sent                                    # after quantization: only what was sent
    mean  = (1 / W) * sum over ranks of sent        # one bucketed all-gather, rank order
    theta_global -= outer_lr * mean                 # "average"; "nesterov": DiLoCo's momentum
    theta_local   = theta_global                    # every rank bit-identical

``topk=None`` is DiLoCo: the dense pseudo-gradient is averaged with an all-reduce (fp32), no
error feedback. Inner optimizer state and error buffers never leave the rank; ``theta_global``
(fp32), the outer momentum and the counters are the same on every rank. Tensors whose
compressed payload would not be smaller than a dense all-reduce (biases, norms) send their
pseudo-gradient dense, without error feedback (:mod:`cokit.compress.buckets`).

Two options close the gap that grows with training length (issue 35), both off by default:

* ``dense_warmup=N``: the first N steps are data-parallel: every step opens with the status row,
  all-reduces the gradients (mean, fp32, through the same exchange core) and the inner optimizer
  steps them on every rank alike, so the replicas stay bit-identical and ``theta_global``
  follows them; then the H-step schedule starts (the first sync H steps after the warm-up);
* ``dense_params=("embed", "head")``: parameters whose name contains one of the substrings send
  their pseudo-gradient dense (averaged, without top-k or error feedback), like the small
  tensors above; it needs named parameters (``model.named_parameters()``);
* ``adaptive_topk=True``: the same budget of values per sync (the sum over compressed tensors of
  tiles x k), redistributed among the tensors after every sync by the share of each tensor's
  error-buffer energy its selection captured, averaged over the ranks (:func:`redistribute_topk`:
  a tensor whose selection misses more energy, for its k, gets a larger k, within
  ``adaptive_range``).

A hybrid Muon inner optimizer (Muon on the matrices, AdamW on the rest) is in
:mod:`cokit.compress.inner`.

Every guarantee comes from the exchange core (:mod:`cokit.compress.exchange`): each sync opens
with the fixed-size status row (settings fingerprint, non-finite report, the policy's
measurement), every collective has the timeout, peers' payloads are validated, and a sync that
raises leaves no collective behind. The state dict has torch's layout, so
``torch.distributed.checkpoint`` saves and loads it (:mod:`cokit.compress.sparseloco_state`).
"""

from __future__ import annotations

import contextlib
import datetime
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from cokit.compress import precision as lowp
from cokit.compress import sparseloco_state
from cokit.compress.adaptation import PolicyDriver, make_policy
from cokit.compress.adaptive_topk import (
    average_shares,
    check_adaptive_range,
    redistribute_topk,
)
from cokit.compress.buckets import Bucket, make_buckets
from cokit.compress.demo_step import split_like
from cokit.compress.eager import eager
from cokit.compress.exchange import Exchange
from cokit.compress.frontend import (
    FrontEnd,
    check_gradients,
    check_nonfinite_mode,
    check_value_dtype,
    plain,
    run_closure,
)
from cokit.compress.groups import check_process_group
from cokit.compress.guards import Amp, all_finite, nonfinite
from cokit.compress.named_params import (
    check_dense_params,
    check_replicated,
    dense_members,
    param_groups,
    param_name,
)
from cokit.compress.payload import VALUE_DTYPES, get_codec, wire_sizes
from cokit.compress.policy import NetworkPolicy
from cokit.compress.priority import check_comm_priority, priority_group
from cokit.compress.sparseloco_step import Mean, Receive, launch_bucket
from cokit.compress.stats import CommStats, ring_allreduce_bytes
from cokit.triton_kernels import tiling
from cokit.triton_kernels._checks import check_choice, check_flag, check_int, check_number

__all__ = ["SparseLoCo", "redistribute_topk"]

OUTER = ("average", "nesterov")


class SparseLoCo(FrontEnd, torch.optim.Optimizer):
    """H local steps of an inner optimizer, then a compressed pseudo-gradient sync.

    Args:
        params: the model's parameters (tensors, ``(name, tensor)`` pairs or param groups).
        inner: the local optimizer: None (``AdamW(lr=1e-3)``), a ``torch.optim.Optimizer``
            over exactly ``params``, or a callable ``params -> Optimizer``. ``param_groups``
            are the inner optimizer's, so LR schedulers drive the inner lr (with
            ``precision="master"``: copies over the model's parameters, whose values reach
            the inner optimizer at its next step).
        sync_every: H, local steps between syncs (default 5: on the held-out protocol's
            selection workloads H=5 closed two thirds of H=15's gap to AdamW, the paper's
            main setting, for 3x the bytes; see docs/validation-study.md).
        topk: values kept per tile of the error buffer (default 64: 1.6% of a 64x64 tile, in
            the paper's 1-3% range); None sends the dense pseudo-gradient (DiLoCo).
        chunk: tile side target (each dimension uses its largest divisor <= chunk).
        dct: select in the DCT domain of each tile (DeMo's) instead of on the raw values
            (SparseLoCo's default).
        payload: value codec of :mod:`cokit.compress.payload`: ``"int2"`` (default, 2 bits per
            value), ``"sign"`` (1 bit + a scale per tile), ``"compact"`` (bf16 values), ...
        value_dtype: dtype of the codec's values or scales (bf16 default).
        error_decay: decay of the error buffer (0.95, the paper's); it plays the part of
            DiLoCo's outer momentum.
        outer: ``"average"`` (``theta -= outer_lr * mean``, SparseLoCo) or ``"nesterov"``
            (DiLoCo: ``m = mu * m + mean; theta -= outer_lr * (mean + mu * m)``).
        outer_lr / outer_momentum: the outer step's lr and Nesterov momentum ``mu``.
        process_group, timeout: the group synced over, and seconds a collective may take.
        nonfinite: what a non-finite pseudo-gradient at a sync does (a NaN gradient or an
            overflow reached some rank's inner optimizer): the sync is not applied on any rank,
            every rank returns to ``theta_global`` and the inner optimizer's state of the
            parameters whose state is no longer finite is reset (``inner_resets``; the message
            names them), so training goes on; ``"error"`` then raises on every rank, naming the
            parameter and rank, ``"skip"`` warns and counts it in ``skipped_syncs``. A
            GradScaler's ``found_inf`` skips that local step on its rank (``skipped_steps``
            counts them over every rank), in either mode.
        precision: how fp32 values are written into bf16/fp16 parameters
            (:mod:`cokit.compress.precision`): ``"nearest"``, ``"master"`` (the inner optimizer
            steps fp32 masters; parameters hold their rounding) or ``"stochastic"``
            (rounding seeded by ``seed`` and the sync count, alike on every rank).
        bucket_cap_mb: fp32 megabytes per bucket (one collective each).
        policy: when to sync (:mod:`cokit.compress.policy`): None / ``"static"`` (every
            ``sync_every`` steps), ``"interval"`` or an
            :class:`~cokit.compress.policy.IntervalPolicy` (widen the interval, up to
            ``max_scale`` x ``sync_every``, while a sync blocks more than ``target`` of its
            interval), or ``{"name": "interval", **arguments}``. Each sync carries every rank's
            times of the interval before it (16 bytes), so every rank decides alike;
            ``policy_log`` lists the changes and ``current_interval`` the interval in force.
        validate_payload: check what every peer sent before it is used (default True).
        clock: seconds for the policy's times (``time.perf_counter``; tests inject a fake clock).
        comm_priority: priority of the sync's collectives: ``"normal"`` (default), ``"high"``
            or an integer stream priority (negative = high; :mod:`cokit.compress.priority`). On
            NCCL/RCCL a high priority makes one new process group over ``process_group``'s
            ranks, with high-priority streams, at construction (collective over the default
            group: every rank must pass the same value); on gloo it has no effect.
            ``comm_priority_info`` says what it achieved. Agreed at every sync, not part of
            ``state_dict()``.
        dense_warmup: data-parallel steps before the local schedule starts (default 0). Each
            all-reduces the gradients (mean, fp32: ``comm_stats`` counts the ring all-reduce)
            before the inner optimizer steps, so every rank stays bit-identical and
            ``theta_global`` follows; the first sync comes ``sync_every`` steps after the last.
            A non-finite gradient raises (``nonfinite="error"``) or skips the step on every
            rank (``"skip"``), and a GradScaler's inf on any rank skips it on every rank:
            ``skipped_steps`` counts such a step once per rank.
        dense_params: None, or a tuple of name substrings (``("embed", "head")``): parameters
            whose name contains one of them send their pseudo-gradient dense (averaged,
            without top-k or error feedback). Needs ``(name, tensor)`` pairs
            (``model.named_parameters()``); every substring must match some name.
        adaptive_topk: redistribute the top-k budget among the compressed tensors (default
            False). Each sync measures, per compressed tensor, the share of its error buffer's
            energy (sum of squares, of the DCT coefficients with ``dct``) that its top-k
            selection captured; one small all-gather (fp32, one value per compressed tensor,
            through the exchange core: timeout, checked, counted in ``comm_stats``) averages the
            shares over the ranks in rank order, and :func:`redistribute_topk` turns them into
            the k of each tensor for the next sync, the same on every rank: k proportional to
            the missed share, within ``adaptive_range``, the total (tiles x k) at most the
            static one. Which tensors are compressed stays as with the static ``topk``; tensors
            with the same k share buckets. ``current_topk`` holds the k's and
            ``captured_energy`` the shares agreed at this process's last sync (parameter index
            -> each); the k's are in the fingerprint of every sync and in ``state_dict()``.
            Needs ``topk``.
        adaptive_range: ``(low, high)`` with ``0 < low <= 1 <= high``: each tensor's k stays in
            ``[ceil(low * topk), floor(high * topk)]``, and within ``[1, tile size]`` (default
            ``(0.25, 4.0)``; only with ``adaptive_topk``).
        comm_guard: None, or a guard with ``violations(config=None, *, priority=...)`` (e.g.
            :class:`cokit.overlap.guard.StarvationGuard`): a ``comm_priority`` it refuses
            raises ``GuardViolation`` (a ``ValueError``) naming the limit, before anything is
            built.

    Every rank must use the same settings, inner hyper-parameters and starting parameters: each
    sync opens with a 64-bit fingerprint of them (the exchange core's status row) and the first
    step compares the parameters; a difference raises ``ValueError`` on every rank, naming it.
    ``comm_stats`` counts each step's bytes (non-sync steps send 0); ``bytes_per_step`` is the
    amortized mean.
    """

    _step_supports_amp_scaling = True  # GradScaler calls step() on every rank
    owner = "SparseLoCo"

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]] | Iterable[tuple[str, torch.Tensor]],
        inner: torch.optim.Optimizer | Callable[..., torch.optim.Optimizer] | None = None,
        *,
        sync_every: int = 5,
        topk: int | None = 64,
        chunk: int = 64,
        dct: bool = False,
        payload: str = "int2",
        value_dtype: torch.dtype = torch.bfloat16,
        error_decay: float = 0.95,
        outer: str = "average",
        outer_lr: float = 1.0,
        outer_momentum: float = 0.9,
        process_group=None,
        timeout: float | datetime.timedelta | None = None,
        nonfinite: str = "error",
        precision: str = "nearest",
        seed: int = 0,
        bucket_cap_mb: float = 25.0,
        policy: NetworkPolicy | str | dict[str, Any] | None = None,
        validate_payload: bool = True,
        clock: Callable[[], float] = time.perf_counter,
        comm_priority: str | int = "normal",
        comm_guard: Any = None,
        dense_warmup: int = 0,
        dense_params: tuple[str, ...] | None = None,
        adaptive_topk: bool = False,
        adaptive_range: tuple[float, float] | None = None,
    ):
        where = "SparseLoCo"
        self.adaptive_topk = check_flag("adaptive_topk", adaptive_topk, where=where)
        self.adaptive_range = check_adaptive_range(adaptive_range, self.adaptive_topk, topk, where)
        self.dense_warmup = check_int(
            "dense_warmup", dense_warmup, 0, where=where, more="(steps of data-parallel warm-up; 0: none)"
        )
        self.dense_params = check_dense_params(dense_params, where)
        self.comm_priority = check_comm_priority(where, comm_priority, comm_guard)
        self.sync_every = check_int("sync_every", sync_every, 1, where=where)
        if topk is not None:
            check_int("topk", topk, 1, where=where, more="or None for a dense pseudo-gradient (DiLoCo)")
        self.chunk = check_int("chunk", chunk, 1, where=where)
        self.dct = check_flag("dct", dct, where=where)
        self.codec = get_codec(payload, owner=where)
        check_value_dtype(where, value_dtype)
        self.error_decay = check_number("error_decay", error_decay, 0.0, 1.0, where=where)
        self.outer = check_choice("outer", outer, OUTER, where=where)
        self.outer_lr = check_number("outer_lr", outer_lr, 0.0, low_open=True, where=where)
        self.outer_momentum = check_number(
            "outer_momentum", outer_momentum, 0.0, 1.0, high_open=True, where=where
        )
        self.nonfinite = check_nonfinite_mode(where, nonfinite)
        self.precision = lowp.check_precision(where, precision)
        self.seed = check_int("seed", seed, 0, where=where)
        self.bucket_cap_mb = check_number("bucket_cap_mb", bucket_cap_mb, 0.0, low_open=True, where=where)
        check_flag("validate_payload", validate_payload, where=where)
        check_process_group(where, process_group)
        self.policy = make_policy(policy, where)

        groups, names = param_groups(params, where)
        model_params = [p for g in groups for p in g["params"]]
        check_replicated(model_params, where, VALUE_DTYPES)
        self._forced_dense = dense_members(self.dense_params, model_params, names, where)
        self.topk, self.payload = topk, payload
        self.value_dtype = self.codec.resolve_value_dtype(value_dtype)
        self._names = names
        self._model_params = model_params
        self._driver = PolicyDriver(self.policy, clock)
        self.exchange = Exchange(
            "SparseLoCo.step",
            process_group,
            timeout,
            validate=validate_payload,
            clock=clock,
            on_blocked=self._driver.blocked,
            priority=priority_group(process_group, self.comm_priority, where=where),
        )
        self.comm_stats = CommStats()
        self.current_interval = sync_every
        self.syncs = self.skipped_syncs = self.skipped_steps = self.inner_resets = 0
        self._steps = self._since_sync = 0
        self._checked = False
        self._skipped = 0  # local steps skipped since the last sync (a GradScaler's inf)
        self._buckets: list[Bucket] | None = None
        self._static_buckets: list[Bucket] | None = None
        self._k: dict[int, int] | None = None  # adaptive_topk: parameter index -> k (next sync)
        self.captured_energy: dict[int, float] | None = None  # the last sync's agreed shares
        self._warmup_buckets: list[Bucket] | None = None
        super().__init__(model_params, {})
        # masters: the inner optimizer steps fp32 copies of low-precision parameters
        self._masters: dict[int, torch.Tensor] = {}
        if self.precision == "master":
            for p in model_params:
                if p.dtype != torch.float32:
                    self._masters[id(p)] = lowp.master_copy(p.detach())
        self.inner = self._make_inner(inner, groups, model_params)
        if len(groups) != len(self.inner.param_groups):
            raise ValueError("SparseLoCo: inner(params) must keep the param groups it was given")
        # param_groups are the inner optimizer's (schedulers drive it); with fp32 masters they
        # are copies holding the model's parameters (what DCP maps to names), whose values are
        # copied into the inner groups before every inner step
        self.param_groups = self.inner.param_groups
        if self._masters:
            self.param_groups = [
                {**_hyper(ig), "params": g["params"]} for g, ig in zip(groups, self.inner.param_groups)
            ]
        self.defaults = self.inner.defaults
        lowp.warn_if_unmastered("SparseLoCo", model_params, self.precision)

    # ------------------------------------------------------------------ construction
    def _make_inner(
        self, inner, groups: list[dict[str, Any]], params: list[torch.Tensor]
    ) -> torch.optim.Optimizer:
        swap = self._masters

        def stepped(ps: list[torch.Tensor]) -> list[torch.Tensor]:
            return [swap.get(id(p), p) for p in ps]

        if isinstance(inner, torch.optim.Optimizer):
            held = [p for g in inner.param_groups for p in g["params"]]
            if {id(p) for p in held} != {id(p) for p in params} or len(held) != len(params):
                raise ValueError(
                    "SparseLoCo: the inner optimizer must optimize exactly the parameters given to "
                    "SparseLoCo (build it over the same model.parameters())"
                )
            if [id(p) for p in held] != [id(p) for p in params] or len(inner.param_groups) != len(groups):
                raise ValueError(
                    "SparseLoCo: the inner optimizer's param groups must list the parameters in the order "
                    "given to SparseLoCo (build both from the same groups)"
                )
            if swap:
                if inner.state:
                    raise ValueError(
                        "SparseLoCo(precision='master'): the inner optimizer already has state; pass it "
                        "before its first step, or pass a callable params -> Optimizer"
                    )
                for g in inner.param_groups:
                    g["params"] = stepped(g["params"])
            return inner
        if inner is not None and not callable(inner):
            raise TypeError(
                "SparseLoCo: inner must be None (AdamW, lr 1e-3), a torch.optim.Optimizer or a callable "
                f"params -> Optimizer, got {type(inner).__name__}"
            )
        inner_groups = [{**g, "params": stepped(g["params"])} for g in groups]
        if inner is None:
            # foreach on CPU too (torch defaults to it on GPUs only): the same per-tensor kernels
            # in the same order, bit for bit, without AdamW's per-tensor Python loop
            plain_cpu = all(p.device.type == "cpu" and not hasattr(p, "placements") for p in params)
            opt: Any = torch.optim.AdamW(inner_groups, lr=1e-3, foreach=True if plain_cpu else None)
        else:
            opt = inner(inner_groups)
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(
                f"SparseLoCo: inner(params) must return a torch.optim.Optimizer, got {type(opt).__name__}"
            )
        held_ids = [id(p) for g in opt.param_groups for p in g["params"]]
        if held_ids != [id(p) for g in inner_groups for p in g["params"]]:
            raise ValueError("SparseLoCo: inner(params) must optimize exactly the parameters it was given")
        return opt

    # ------------------------------------------------------------------ public
    @property
    def bytes_per_step(self) -> float:
        """Bytes this rank sent per step, amortized over every step so far."""
        return self.comm_stats.total_sent_bytes / max(self.comm_stats.steps, 1)

    @property
    def current_topk(self) -> dict[int, int]:
        """Values kept per tile at the next sync, per compressed tensor (index in the parameter
        list -> k): ``min(topk, tile size)`` each, unless ``adaptive_topk`` changed them."""
        return dict(self._topks())

    @property
    def policy_log(self) -> list[dict[str, Any]]:
        """Every change of the policy's decision: the sync it was taken at, what and why."""
        return self._driver.log

    @contextlib.contextmanager
    def synchronized(self) -> Iterator[None]:
        """Inside the block the parameters hold ``theta_global`` (the weights of the last sync,
        the same on every rank): evaluate or save the model all ranks share there. On exit the
        local weights come back, bit for bit. Before the first step nothing is swapped."""
        swapped = []
        with torch.no_grad():
            for p in self._model_params:
                g = self.state[p].get("global") if p in self.state else None
                if g is not None:
                    swapped.append((p, p.detach().clone()))
                    p.copy_(g)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, local_value in swapped:
                    p.copy_(local_value)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's gradients (and the masters' copies of them)."""
        for p in self._model_params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()
        for m in self._masters.values():
            m.grad = None

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if hasattr(self, "inner"):
            raise NotImplementedError(
                "SparseLoCo: build it with every parameter; groups cannot be added later"
            )
        super().add_param_group(param_group)

    # Eager even inside torch.compile (docs/design.md §3): collectives, the status agreement and
    # the timing cannot be traced, and the per-tensor math already runs in cokit's kernels.
    @eager
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One local step of the inner optimizer; every ``current_interval``-th step, a sync."""
        loss = run_closure(closure)
        for p in self._model_params:
            if "global" not in self.state[p]:  # the first step: weights as loaded by now
                m = self._masters.get(id(p))
                if m is not None:
                    m.copy_(p)
                self.state[p]["global"] = p.detach().float().clone(memory_format=torch.contiguous_format)
        with self.exchange.guarded():
            if not self._checked:
                self._check_start()
            if self._steps < self.dense_warmup:
                self._warmup_step()
                self._steps += 1
            else:
                self._inner_step()
                self._steps += 1
                self._since_sync += 1
                if self._since_sync >= self.current_interval:
                    self._sync()
        self.exchange.record(self.comm_stats, self._dense_bytes())
        return loss

    # ------------------------------------------------------------------ local steps
    def _inner_step(self) -> None:
        """One step of the inner optimizer, unless a GradScaler found inf on this rank: then
        that local step is skipped here (and counted at the next sync). GradScaler's scale is
        taken off the gradients first."""
        amp = Amp.of(self)
        if amp.found_inf:
            self._skipped += 1
            return
        amp.unscale_([p.grad for p in self._model_params if p.grad is not None])
        self._step_inner()

    def _step_inner(self, master_grads: dict[int, torch.Tensor] | None = None) -> None:
        """The inner optimizer's step on the (unscaled) gradients; ``master_grads``: the fp32
        gradients of the masters (by parameter id) instead of their parameters' gradients."""
        if self.param_groups is not self.inner.param_groups:
            for outer, inner in zip(self.param_groups, self.inner.param_groups):
                inner.update(_hyper(outer))
        for p in self._model_params:
            m = self._masters.get(id(p))
            if m is not None:
                if master_grads is not None and id(p) in master_grads:
                    m.grad = master_grads[id(p)]
                else:
                    m.grad = None if p.grad is None else p.grad.float()
        self.inner.step()
        for p in self._model_params:
            m = self._masters.get(id(p))
            if m is not None:
                p.copy_(m)

    def _local(self, p: torch.Tensor) -> torch.Tensor:
        """This rank's fp32 value of ``p`` (its master when there is one)."""
        m = self._masters.get(id(p))
        return m if m is not None else p.float()

    # ------------------------------------------------------------------ dense warm-up
    def _warmup_step(self) -> None:
        """One data-parallel step (``dense_warmup``): the status round (settings, which
        parameters have a gradient, non-finite gradients, a GradScaler's inf), one all-reduce
        (mean, fp32) of the gradients per bucket, each checked, then the inner step on every
        rank alike; ``theta_global`` follows the weights. Nothing changes before every result
        is in."""
        params = self._model_params
        has_grad = check_gradients("SparseLoCo", params, self._name)
        rnd = self.open_round(
            [p.grad for p in params],
            Amp.of(self),
            fingerprints=self._fingerprints(),
            describe=self._describe,
            name=self._name,
            device=params[0].device,
            extra=self._driver.measurement(torch.device("cpu")),
        )
        if not self.skip_or_raise(rnd, self._name, when=f"dense warm-up step {self._steps + 1}"):
            self.skipped_steps += self.comm.world_size  # the step, skipped on every rank
            self._driver.step_done(self.comm.sent, self._dense_bytes(), synced=False)
            return
        plan = self._warmup_plan()
        pending = [
            self.comm.all_reduce_mean(
                torch.cat([_grad32(params[i]).reshape(-1) for i in bucket.members]), "gradient all-reduce"
            )
            for bucket in plan
        ]
        means = [self.exchange.dense(p_, f"bucket {b} (dense warm-up)") for b, p_ in enumerate(pending)]
        master_grads: dict[int, torch.Tensor] = {}
        for bucket, mean in zip(plan, means):
            members = [params[i] for i in bucket.members]
            for i, p, m in zip(bucket.members, members, split_like(mean, members)):
                if not has_grad[i]:
                    continue
                grad = p.grad
                assert grad is not None
                grad.copy_(m)
                if id(p) in self._masters:
                    master_grads[id(p)] = m
        self._step_inner(master_grads)
        for p in params:
            self.state[p]["global"].copy_(self._local(p))
        self._driver.step_done(self.comm.sent, self._dense_bytes(), synced=True)

    def _warmup_plan(self) -> list[Bucket]:
        """Dense buckets of every parameter (``bucket_cap_mb`` of fp32 each) for the warm-up."""
        if self._warmup_buckets is None:
            self._warmup_buckets = self._make_buckets([self.topk or 1], fallback=False, all_dense=True)
        return self._warmup_buckets

    # ------------------------------------------------------------------ sync
    def _agree(self, deltas: list[torch.Tensor] | None) -> Any:
        """The sync's status round: non-finite pseudo-gradients (``deltas``) and skipped local steps."""
        bad = nonfinite(deltas) if deltas is not None else []
        return self.exchange.agree(
            self._fingerprints(),
            self.exchange.report(bad, skipped=self._skipped),
            self._describe,
            extra=self._driver.measurement(torch.device("cpu")),
            device=self._model_params[0].device,
        )

    def _sync(self) -> None:
        params = self._model_params
        # fp32 pseudo-gradients; once in the error buffers, their buffers hold the tile
        # matrices that are picked and decoded in (_launch)
        deltas = [(self.state[p]["global"] - self._local(p)).contiguous() for p in params]
        rnd = self._agree(deltas)
        self.skipped_steps += sum(rep.skipped for rep in rnd.reports)
        self._skipped = 0  # reported now, on every rank
        bad = rnd.bad
        if not bad or self.nonfinite == "skip":
            self._follow_policy(rnd.extras if self.policy.observes else None)
        if bad:  # a NaN gradient or an overflow reached some rank's inner optimizer
            reset = self._recover(params)
            recovered = (
                "the sync was not applied (theta_global, error buffers and outer momentum as they were); "
                "every rank's weights are back at the last sync's"
                + (f", and this rank reset the inner optimizer's state of {_listing(reset)}" if reset else "")
                + ", so training can go on"
            )
            self.skip_or_raise(
                rnd,
                self._name,
                when=f"sync {self.syncs + 1}",
                what="pseudo-gradient",
                changed=recovered,
                unit="sync",
            )
            self.skipped_syncs += 1
            self._driver.step_done(0, 0, synced=False)
            return
        means = self._exchange(deltas)
        self.syncs += 1
        generator = self._generator(params[0].device)
        mu, lr = self.outer_momentum, self.outer_lr
        for p, received in zip(params, means):
            g = self.state[p]["global"]
            if received is not None:
                mean, positions = received
                if positions is not None:
                    # "average" where the mean is not zero; elsewhere g - lr * 0 == g
                    flat = g.view(-1)
                    flat.index_put_((positions,), flat[positions].sub_(mean, alpha=lr))
                elif self.outer == "nesterov":
                    if "momentum" not in self.state[p]:
                        self.state[p]["momentum"] = torch.zeros_like(g)
                    m = self.state[p]["momentum"]
                    m.mul_(mu).add_(mean)
                    g.sub_(mean + mu * m, alpha=lr)
                else:
                    g.sub_(mean, alpha=lr)
            self._write(p, g, generator)
        self._since_sync = 0
        self._driver.step_done(self.comm.sent, self._dense_bytes(), synced=True)

    def _recover(self, params: list[torch.Tensor]) -> list[str]:
        """After a sync that could not be applied: every rank back at theta_global, and the
        inner optimizer's state reset where it is not finite (the names of those parameters)."""
        self._since_sync = 0
        generator = self._generator(params[0].device)
        for p in params:
            self._write(p, self.state[p]["global"], generator)
        reset = []
        for n, p in enumerate(params):
            held = self._masters.get(id(p), p)
            state = self.inner.state.get(held, {})
            if any(isinstance(v, torch.Tensor) and not bool(all_finite(v)) for v in state.values()):
                del self.inner.state[held]
                reset.append(self._name(n))
        self.inner_resets += len(reset)
        return reset

    def _generator(self, device: torch.device) -> torch.Generator | None:
        if self.precision != "stochastic":
            return None
        return lowp.rounding_generator(self.seed, self.syncs, device)

    def _follow_policy(self, times: torch.Tensor | None) -> None:
        """The interval until the next sync, from every rank's times of the last one."""
        decision = self._driver.decide(times, self.syncs + self.skipped_syncs + 1)
        if decision.dense or decision.skip_sync or decision.topk_scale != 1 or decision.payload is not None:
            raise ValueError(
                f"SparseLoCo: policy {self.policy.describe()} decided {decision.describe()!r}; "
                "SparseLoCo follows only sync_scale decisions (IntervalPolicy)"
            )
        self.current_interval = self.sync_every * decision.sync_scale

    def _dense_bytes(self) -> int:
        """What a dense all-reduce of every parameter would send from this rank."""
        return ring_allreduce_bytes(
            sum(p.numel() * p.element_size() for p in self._model_params), self.comm.world_size
        )

    def _write(self, p: torch.Tensor, value: torch.Tensor, generator: torch.Generator | None) -> None:
        master = self._masters.get(id(p))
        lowp.write_update(p, value, self.precision, master=master, generator=generator)

    def _plan(self) -> list[Bucket]:
        """The sync's buckets: the static plan, or with ``adaptive_topk`` the same split into
        dense and compressed tensors, the compressed ones bucketed by their current k."""
        if self._buckets is None:
            self._buckets = self._adaptive_plan() if self.adaptive_topk else self._static_plan()
        return self._buckets

    def _static_plan(self) -> list[Bucket]:
        if self._static_buckets is None:
            self._static_buckets = self._make_buckets(
                [self.topk or 1],
                fallback=self.topk is not None and self.codec.dense_fallback,
                all_dense=self.topk is None,
                dense=self._forced_dense,
            )
        return self._static_buckets

    def _adaptive_plan(self) -> list[Bucket]:
        ks = self._topks()
        distinct = sorted(set(ks.values())) or [self.topk or 1]
        group_of = {k: g for g, k in enumerate(distinct)}
        n = len(self._model_params)
        return self._make_buckets(
            distinct,
            groups=[group_of[ks[i]] if i in ks else 0 for i in range(n)],
            fallback=False,  # the static plan decided which tensors go dense
            dense=[i for i in range(n) if i not in ks],
        )

    def _make_buckets(
        self,
        topks: list[int],
        *,
        fallback: bool,
        groups: list[int] | None = None,
        all_dense: bool = False,
        dense: Any = (),
    ) -> list[Bucket]:
        """Buckets of every parameter: parameter ``i`` in group ``groups[i]`` (default 0) of
        k ``topks[group]``; ``fallback``: dense where compression would not save bytes."""
        shapes = [tuple(p.shape) for p in self._model_params]
        return make_buckets(
            groups if groups is not None else [0] * len(shapes),
            shapes,
            [{"compression_chunk": self.chunk, "compression_topk": k} for k in topks],
            self.codec,
            self.value_dtype,
            int(self.bucket_cap_mb * 2**20),
            fallback,
            self.comm.world_size,
            all_dense=all_dense,
            dense=dense,
        )

    def _tilings(self) -> dict[int, tiling.TensorTiling]:
        """The tiling of every tensor the static plan compresses (parameter index -> tiling)."""
        shapes = [tuple(p.shape) for p in self._model_params]
        members = sorted(i for b in self._static_plan() if not b.dense for i in b.members)
        return {i: tiling.TensorTiling.of(shapes[i], self.chunk) for i in members}

    def _topks(self) -> dict[int, int]:
        if self._k is None:
            topk = self.topk or 1
            self._k = {i: t.k_eff(topk) for i, t in self._tilings().items()}
        return self._k

    def _adapted(self, pending: Any, order: list[int]) -> tuple[dict[int, float], dict[int, int]]:
        """Every rank's captured-energy shares (checked: finite, in [0, 1]), averaged in rank
        order, and the k's they give for the next sync (parameter index -> each)."""
        shares = average_shares(self.exchange.wait(pending), self.exchange.owner, self.comm.global_rank)
        tilings = self._tilings()
        assert self.topk is not None and self.adaptive_range is not None
        in_force = self._topks()
        ks = redistribute_topk(
            shares,
            [tilings[i].n_tiles for i in order],
            [tilings[i].tile_numel for i in order],
            self.topk,
            self.adaptive_range,
            [in_force[i] for i in order],
        )
        return dict(zip(order, shares)), dict(zip(order, ks))

    def _launch(
        self, b: int, bucket: Bucket, deltas: list[torch.Tensor], captured: dict[int, torch.Tensor] | None
    ) -> Receive:
        """Start bucket ``b`` (:func:`~cokit.compress.sparseloco_step.launch_bucket`) with its
        compressed tensors' error buffers (made at their first sync)."""
        errors = []  # dense buckets have none (no error feedback)
        for i in [] if bucket.dense else bucket.members:
            state = self.state[self._model_params[i]]
            if "error" not in state:  # (not setdefault: that would zero a fresh buffer every sync)
                state["error"] = torch.zeros_like(deltas[i])
            errors.append(state["error"])
        at_positions = self.outer == "average" and all(
            self.state[self._model_params[i]]["global"].is_contiguous() for i in bucket.members
        )
        return launch_bucket(
            b,
            bucket,
            deltas,
            errors,
            self.exchange,
            chunk=self.chunk,
            dct=self.dct,
            error_decay=self.error_decay,
            names=[self._name(i) for i in bucket.members],
            at_positions=at_positions,
            captured=captured,
        )

    def _exchange(self, deltas: list[torch.Tensor]) -> list[Mean | None]:
        """Encode every bucket (updating the error buffers), launch all collectives, check every
        rank's bytes, then decode each into the mean pseudo-gradient of its tensors (:data:`Mean`:
        dense, or its values where some rank sent one; None: empty tensors)."""
        means: list[Mean | None] = [None] * len(deltas)
        captured: dict[int, torch.Tensor] | None = {} if self.adaptive_topk else None
        launched = [self._launch(b, bucket, deltas, captured) for b, bucket in enumerate(self._plan())]
        shares, order = None, sorted(captured or ())
        if order:  # adaptive_topk: every rank's captured-energy shares, one fp32 each
            assert captured is not None
            vector = torch.stack([captured[i] for i in order]).float().to(self._model_params[0].device)
            shares = self.comm.all_gather(vector, "captured-energy all-gather")
        received = [receive() for receive in launched]
        adapted = self._adapted(shares, order) if shares is not None else None
        for bucket, finish in zip(self._plan(), received):
            for i, mean in zip(bucket.members, finish()):
                means[i] = mean
        if adapted is not None:
            self.captured_energy, topks = adapted
            if topks != self._k:
                self._k, self._buckets = topks, None  # the next sync's buckets
        return means

    # ------------------------------------------------------------------ agreement
    def _settings(self) -> dict[str, Any]:
        """Everything every rank must agree on (compared at every sync)."""
        settings: dict[str, Any] = {
            "sync_every": self.sync_every,
            "topk": self.topk,
            "chunk": self.chunk,
            "dct": self.dct,
            "payload": self.payload,
            "value_dtype": str(self.value_dtype),
            "error_decay": self.error_decay,
            "outer": self.outer,
            "outer_lr": self.outer_lr,
            "outer_momentum": self.outer_momentum,
            "nonfinite": self.nonfinite,
            "precision": self.precision,
            "seed": self.seed,
            "bucket_cap_mb": self.bucket_cap_mb,
            "policy": self.policy.describe(),
            "inner": type(self.inner).__name__,
            "validate_payload": self.exchange.validate,
        }
        # the issue-35 options only when on: the fingerprint and saved settings of a run
        # without them are what they were
        if self.dense_warmup:
            settings["dense_warmup"] = self.dense_warmup
        if self.dense_params is not None:
            settings["dense_params"] = list(self.dense_params)
        if self.adaptive_topk:
            assert self.adaptive_range is not None
            settings["adaptive_topk"] = True
            settings["adaptive_range"] = list(self.adaptive_range)
        return settings

    def _describe(self, globally: bool = False) -> dict[str, Any]:
        settings = self._settings()
        if self.adaptive_topk:
            # the k's of the next sync (state, not a setting: a load does not compare them), named
            # first when a rank's diverged
            settings["topk_per_tensor"] = [[i, k] for i, k in sorted(self._topks().items())]
        return {
            "settings": settings,
            "groups": [
                {k: plain(v) for k, v in _hyper(g).items() if _comparable(v)} for g in self.param_groups
            ],
            "layout": [
                [self._name(n), f"{tuple(p.shape)} {p.dtype}"] for n, p in enumerate(self._model_params)
            ],
            "derived": {"payload wire sizes": wire_sizes(b.codec for b in self._plan())},
            "counters": {"steps": self._steps, "syncs": self.syncs, "skipped_syncs": self.skipped_syncs},
        }

    def _check_start(self) -> None:
        """First step: settings, layout and counters agree, then the replicas must start
        identical (checked before any change)."""
        self._agree(None)
        self.check_replicas(
            [self._local(p) for p in self._model_params], self._name, when="at the first step"
        )
        self._checked = True

    def _name(self, n: int) -> str:
        return param_name(self._model_params, self._names, n)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """torch.optim's layout (so ``torch.distributed.checkpoint`` saves it): per parameter
        ``theta_global`` and the outer momentum (identical on every rank) and this rank's error
        buffer, fp32 master and inner optimizer state under keys naming the rank; JSON records of
        settings, counters, policy and comm stats in ``param_groups[0]``
        (:mod:`cokit.compress.sparseloco_state`)."""
        return sparseloco_state.pack(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what this rank saved; everything is checked before anything changes."""
        sparseloco_state.load(self, state_dict)


# ---------------------------------------------------------------------------- helpers


def _listing(names: list[str], shown: int = 4) -> str:
    more = f" (and {len(names) - shown} more)" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    """A param group's hyper-parameters (everything but its parameters)."""
    return {k: v for k, v in group.items() if k != "params"}


def _grad32(p: torch.Tensor) -> torch.Tensor:
    """``p``'s gradient in fp32 (zeros where it has none)."""
    if p.grad is None:
        return torch.zeros(p.shape, dtype=torch.float32, device=p.device)
    return p.grad.float()


def _comparable(v: object) -> bool:
    return isinstance(v, (int, float, bool, str, tuple, torch.Tensor)) or v is None
