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

Options that close the gap to AdamW that grows with training length, all off by default:

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

``sync="eager"`` overlaps the sync's exchange with the next period: each round is applied to
the shared state one period late and each rank starts the next period from an eager estimate
(:mod:`cokit.compress.sparseloco_overlap`); ``finish()`` applies the last round.

A hybrid Muon inner optimizer (Muon on the matrices, AdamW on the rest) is in
:mod:`cokit.compress.inner`.

Every guarantee comes from the exchange core (:mod:`cokit.compress.exchange`): each sync opens
with the fixed-size status row (settings fingerprint, non-finite report, the policy's
measurement), every collective has the timeout, peers' payloads are validated, and a sync that
raises leaves no collective behind. Nothing of a sync is applied before every rank's bytes are in
and checked (its error buffers are spare ones until then): after a peer's bad data every rank keeps
its state and a later step syncs again. The state dict has torch's layout, so
``torch.distributed.checkpoint`` saves and loads it (:mod:`cokit.compress.sparseloco_state`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import torch

from cokit.compress import precision as lowp
from cokit.compress import sparseloco_overlap as overlap
from cokit.compress import sparseloco_state
from cokit.compress.adaptation import PolicyDriver, make_policy
from cokit.compress.adaptive_topk import (
    check_adaptive_range,
    redistribute_topk,
)
from cokit.compress.eager import eager
from cokit.compress.frontend import (
    FrontEnd,
    FrontEndOptions,
    run_closure,
)
from cokit.compress.guards import Amp, nonfinite
from cokit.compress.named_params import (
    check_dense_params,
    check_replicated,
    dense_members,
    param_groups,
)
from cokit.compress.payload import VALUE_DTYPES, get_codec
from cokit.compress.sparseloco_local import (
    build_inner,
    clear_grads,
    dense_step,
    local_value,
    make_masters,
    outer_groups,
    replicated_state,
    reset_nonfinite_state,
    skip_bad_sync,
    snapshot,
    step_inner,
    swapped_in,
    write_weights,
)
from cokit.compress.sparseloco_plan import SyncPlan
from cokit.compress.sparseloco_step import SpareErrors, average_gradients, launch_means, outer_step
from cokit.compress.stats import CommStats, ring_allreduce_bytes
from cokit.triton_kernels._checks import check_choice, check_flag, check_int, check_number

__all__ = ["SparseLoCo", "redistribute_topk"]

OUTER = ("average", "nesterov")


class SparseLoCo(FrontEnd, torch.optim.Optimizer):
    """H local steps of an inner optimizer, then a compressed pseudo-gradient sync (module docstring).

    Args:
        params: the model's parameters (tensors, ``(name, tensor)`` pairs or param groups).
        inner: the local optimizer: None (``AdamW(lr=1e-3)``), an optimizer over exactly
            ``params``, or a callable ``params -> Optimizer``; ``param_groups`` are its own, so
            LR schedulers drive the inner lr.
        sync_every: H, local steps between syncs (default 5: docs/validation-study.md).
        topk: values kept per tile of the error buffer (default 64: 1.6% of a 64x64 tile, in
            the paper's 1-3%); None sends the dense pseudo-gradient (DiLoCo).
        sync (keyword, in ``options``): ``"blocking"`` (default) or ``"eager"``: the exchange runs
            during the next period, applied one period late (:mod:`~cokit.compress.sparseloco_overlap`).
        chunk: tile side target (each dimension uses its largest divisor <= chunk).
        dct: select in the DCT domain of each tile (DeMo's) instead of on the raw values.
        payload: value codec (:mod:`cokit.compress.payload`): ``"int2"`` (default), ``"sign"``, ...
        error_decay: decay of the error buffer (0.95, the paper's).
        outer: ``"average"`` (``theta -= outer_lr * mean``) or ``"nesterov"`` (DiLoCo's
            ``m = mu * m + mean; theta -= outer_lr * (mean + mu * m)``, ``mu = outer_momentum``).
        dense_warmup / dense_params / adaptive_topk: module docstring; ``adaptive_range=(low,
            high)`` bounds each k to ``[low * topk, high * topk]`` (default (0.25, 4)).
        **options: every front end's (:class:`~cokit.compress.frontend.FrontEndOptions`), the
            process group included. ``nonfinite``: a non-finite pseudo-gradient at a sync sends
            every rank back to ``theta_global`` and resets the inner state that is no longer
            finite (``inner_resets``), then ``"error"`` raises and ``"skip"`` warns
            (``skipped_syncs``); a GradScaler's ``found_inf`` skips that local step on its rank
            (``skipped_steps``). ``policy="interval"`` widens the interval while a sync blocks
            too long (``current_interval``, ``policy_log``).
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
        error_decay: float = 0.95,
        outer: str = "average",
        outer_lr: float = 1.0,
        outer_momentum: float = 0.9,
        process_group: Any = None,
        dense_warmup: int = 0,
        dense_params: tuple[str, ...] | None = None,
        adaptive_topk: bool = False,
        **options: Any,
    ):
        where = "SparseLoCo"
        adaptive_range, sync = options.pop("adaptive_range", None), options.pop("sync", "blocking")
        opts = FrontEndOptions.checked(where, options, process_group=process_group)
        self.adaptive_topk = check_flag("adaptive_topk", adaptive_topk, where=where)
        self.adaptive_range = check_adaptive_range(adaptive_range, self.adaptive_topk, topk, where)
        self.dense_warmup = check_int("dense_warmup", dense_warmup, 0, where=where, more="(0: none)")
        self.dense_params = check_dense_params(dense_params, where)
        self.sync_every = self.current_interval = check_int("sync_every", sync_every, 1, where=where)
        if topk is not None:
            check_int("topk", topk, 1, where=where, more="or None for a dense pseudo-gradient (DiLoCo)")
        self.chunk = check_int("chunk", chunk, 1, where=where)
        self.dct = check_flag("dct", dct, where=where)
        self.codec = get_codec(payload, owner=where)
        self.error_decay = check_number("error_decay", error_decay, 0.0, 1.0, where=where)
        self.outer = check_choice("outer", outer, OUTER, where=where)
        self.outer_lr = check_number("outer_lr", outer_lr, 0.0, low_open=True, where=where)
        self.outer_momentum = check_number(
            "outer_momentum", outer_momentum, 0.0, 1.0, high_open=True, where=where
        )
        self.nonfinite, self.precision, self.seed = opts.nonfinite, opts.precision, opts.seed
        self.comm_priority, self.bucket_cap_mb = opts.comm_priority, opts.bucket_cap_mb
        self.policy = make_policy(opts.policy, where)
        self.sync = overlap.check_sync(sync, self.adaptive_topk, self.policy, where)
        self._flight: overlap.InFlight | None = None  # sync="eager": the round in flight
        groups, self._names = param_groups(params, where)
        self._model_params = model_params = [p for g in groups for p in g["params"]]
        check_replicated(model_params, where, VALUE_DTYPES)
        self._forced_dense = dense_members(self.dense_params, model_params, self._names, where)
        self.topk, self.payload = topk, payload
        self.value_dtype = self.codec.resolve_value_dtype(opts.value_dtype)
        self._driver = PolicyDriver(self.policy, opts.clock)
        self.exchange = opts.exchange(where, on_blocked=self._driver.blocked)
        self.comm_stats = CommStats()
        self.syncs = self.skipped_syncs = self.skipped_steps = self.inner_resets = 0
        self._steps = self._since_sync = self._skipped = 0  # _skipped: GradScaler skips since the last sync
        self._checked, self._spares = False, SpareErrors()  # the error buffers' second set
        self.plan = SyncPlan(
            [tuple(p.shape) for p in model_params],
            chunk=chunk,
            topk=topk,
            codec=self.codec,
            value_dtype=self.value_dtype,
            bucket_cap_bytes=opts.bucket_cap_bytes,
            world=self.comm.world_size,
            forced_dense=self._forced_dense,
            adaptive_range=self.adaptive_range,
        )
        self.captured_energy: dict[int, float] | None = None  # the last sync's agreed shares
        super().__init__(model_params, {})
        self._masters = make_masters(model_params, self.precision)  # fp32, stepped by the inner optimizer
        self.inner = build_inner(inner, groups, model_params, self._masters)
        self.param_groups = outer_groups(groups, self.inner, self._masters)
        self.defaults = self.inner.defaults
        lowp.warn_if_unmastered(where, model_params, self.precision)

    @property
    def current_topk(self) -> dict[int, int]:
        """Values kept per tile at the next sync, per compressed tensor (parameter index -> k)."""
        return dict(self.plan.topks())

    @property
    def policy_log(self) -> list[dict[str, Any]]:
        """Every change of the policy's decision: the sync it was taken at, what and why."""
        return self._driver.log

    def synchronized(self) -> contextlib.AbstractContextManager[None]:
        """Inside the block the parameters hold ``theta_global`` (the weights of the last sync,
        the same on every rank): evaluate or save the model all ranks share there. On exit the
        local weights come back, bit for bit. Before the first step nothing is swapped."""
        params = self._model_params
        return swapped_in(params, [self.state.get(p, {}).get("global") for p in params])

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's gradients (and the masters' copies of them)."""
        clear_grads(self._model_params, self._masters, set_to_none)

    def recheck(self) -> None:
        """Compare the replicas (``theta_global``, outer momentum) at the next step, as after a
        load: for a group whose membership changed (:mod:`cokit.compress.ft`)."""
        self._checked = False

    def snapshot(self) -> Callable[[], None]:
        """Copy what the next ``step()`` changes; call the result (once) to undo that step, bit
        for bit (:func:`~cokit.compress.sparseloco_local.snapshot`)."""
        return snapshot(self)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if hasattr(self, "inner"):
            raise NotImplementedError("SparseLoCo: build it with every parameter; no group can come later")
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
                if (m := self._masters.get(id(p))) is not None:
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

    def _inner_step(self) -> None:
        """One inner step on the unscaled gradients (a GradScaler's inf skips it on this rank)."""
        amp = Amp.of(self)
        if amp.found_inf:
            self._skipped += 1
            return
        amp.unscale_([p.grad for p in self._model_params if p.grad is not None])
        step_inner(self.inner, self._model_params, self._masters, self.param_groups)

    def _warmup_step(self) -> None:
        """One data-parallel step (``dense_warmup``): the status round, one checked all-reduce
        (mean, fp32) of the gradients per bucket, then the inner step on every rank alike;
        ``theta_global`` follows the weights. Nothing changes before every result is in."""
        params = self._model_params
        rnd, has_grad = self.open_params_round(params, extra=self._driver.measurement(torch.device("cpu")))
        synced = self.skip_or_raise(rnd, self._name, when=f"dense warm-up step {self._steps + 1}")
        if synced:
            means = average_gradients(self.plan.warmup(), params, self.exchange)
            dense_step(self.inner, params, self._masters, self.param_groups, means, has_grad)
            for p in params:
                self.state[p]["global"].copy_(local_value(p, self._masters))
        else:
            self.skipped_steps += self.comm.world_size  # the step, skipped on every rank
        self._driver.step_done(self.comm.sent, self._dense_bytes(), synced=synced)

    def _agree(self, deltas: list[torch.Tensor] | None) -> Any:
        """The sync's status round: non-finite pseudo-gradients (``deltas``) and skipped local steps."""
        return self.exchange.agree(
            self._fingerprints(),
            self.exchange.report(nonfinite(deltas) if deltas is not None else [], skipped=self._skipped),
            self._describe,
            extra=self._driver.measurement(torch.device("cpu")),
            device=self._model_params[0].device,
        )

    def _sync(self) -> None:
        """The status round, then the exchange and the outer step (non-finite: to ``theta_global``)."""
        if self.sync == "eager":
            return overlap.eager_sync(self)
        params, states = self._model_params, [self.state[p] for p in self._model_params]
        deltas = [
            (s["global"] - local_value(p, self._masters)).contiguous()
            for p, s in zip(params, states, strict=True)
        ]
        rnd = self._agree(deltas)
        self.skipped_steps += sum(rep.skipped for rep in rnd.reports)
        self._skipped = 0  # reported now, on every rank
        if not rnd.bad or self.nonfinite == "skip":
            times = rnd.extras if self.policy.observes else None  # every rank's times of the last sync
            scale = self._driver.sync_scale(times, self.syncs + self.skipped_syncs + 1, self.owner)
            self.current_interval = self.sync_every * scale
        if rnd.bad:  # a NaN gradient or an overflow reached some rank's inner optimizer
            return skip_bad_sync(self, rnd)
        _, finish = launch_means(
            self.plan.buckets(),
            deltas,
            [s.get("error") for s in states],
            self.exchange,
            dct=self.dct,
            error_decay=self.error_decay,
            names=[self._name(i) for i in range(len(params))],
            at_positions=[self.outer == "average" and s["global"].is_contiguous() for s in states],
            adaptive=self.adaptive_topk,
            spares=self._spares.take([s.get("error") for s in states]),
        )
        means, errors, shares = finish()
        self._spares.swap_in(states, errors)  # every rank's bytes are in and checked: the sync applies
        if shares is not None:
            self.captured_energy = shares
            self.plan.set_topks(self.plan.adapt(list(shares.values()), list(shares)))  # the next sync's
        self.syncs += 1
        outer_step(states, means, nesterov=self.outer == "nesterov", lr=self.outer_lr, mu=self.outer_momentum)
        write_weights(params, [s["global"] for s in states], self._masters, self.precision, self._generator())
        self._since_sync = 0
        self._driver.step_done(self.comm.sent, self._dense_bytes(), synced=True)

    def _back_to_global(self, params: list[torch.Tensor]) -> list[str]:
        """Every rank back at theta_global, its non-finite inner state reset (those parameters' names)."""
        self._since_sync = 0
        for p in params:  # sync="eager": the next period starts at theta_global too
            self.state[p].pop("start", None)
        values = [self.state[p]["global"] for p in params]
        write_weights(params, values, self._masters, self.precision, self._generator())
        reset = reset_nonfinite_state(self.inner, params, self._masters, self._name)
        self.inner_resets += len(reset)
        return reset

    def _generator(self) -> torch.Generator | None:
        """The stochastic rounding's generator of this sync (None: round to nearest)."""
        make, device = lowp.rounding_generator, self._model_params[0].device
        return make(self.seed, self.syncs, device) if self.precision == "stochastic" else None

    def _dense_bytes(self) -> int:
        """What a dense all-reduce of every parameter would send from this rank."""
        size = sum(p.numel() * p.element_size() for p in self._model_params)
        return ring_allreduce_bytes(size, self.comm.world_size)

    def _describe(self, globally: bool = False) -> dict[str, Any]:
        return sparseloco_state.describe(self)

    def _check_start(self) -> None:
        """First step, and the first after a load: settings, layout and counters agree, then the
        replicas must hold the same ``theta_global`` and outer momentum (before any change)."""
        self._agree(None)
        nesterov = self.outer == "nesterov" and self.syncs > 0  # agreed above: every rank compares as many
        self.check_replicas(
            replicated_state(self._model_params, self.state, self._masters, self._name, nesterov)
        )
        self._checked = True

    def finish(self) -> None:
        """``sync="eager"``: apply the round still in flight to ``theta_global`` (call it after the
        last step, before evaluating or saving ``synchronized()``); no collective. Else nothing."""
        overlap.land(self)

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's layout, which ``torch.distributed.checkpoint`` saves
        (:mod:`cokit.compress.sparseloco_state`); waits for a round in flight (``sync="eager"``)."""
        return sparseloco_state.pack(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what this rank saved; everything is checked before anything changes."""
        sparseloco_state.load(self, state_dict)
