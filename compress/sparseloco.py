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
"""

from __future__ import annotations

import contextlib
import datetime
import math
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from cokit.compress import precision as lowp
from cokit.compress.adaptation import PolicyDriver, make_policy
from cokit.compress.buckets import Bucket, make_buckets
from cokit.compress.comm import Communicator, Pending
from cokit.compress.dtensor import is_dtensor
from cokit.compress.groups import check_process_group
from cokit.compress.guards import all_finite
from cokit.compress.payload import VALUE_DTYPES, get_codec
from cokit.compress.policy import NetworkPolicy
from cokit.compress.stats import CommStats, ring_allreduce_bytes
from cokit.triton_kernels import tiling
from cokit.triton_kernels.dct import dct_decode_multi, dct_encode_multi
from cokit.triton_kernels.topk import chunk_topk

__all__ = ["SparseLoCo"]

OUTER = ("average", "nesterov")
NONFINITE = ("error", "skip")
_FORMAT = 1
_OK, _BAD = 0, 1


class SparseLoCo(torch.optim.Optimizer):
    """H local steps of an inner optimizer, then a compressed pseudo-gradient sync.

    Args:
        params: the model's parameters (tensors, ``(name, tensor)`` pairs or param groups).
        inner: the local optimizer: None (``AdamW(lr=1e-3)``), a ``torch.optim.Optimizer``
            over exactly ``params``, or a callable ``params -> Optimizer``. ``param_groups``
            are the inner optimizer's, so LR schedulers drive the inner lr.
        sync_every: H, local steps between syncs (default 15, the paper's main setting).
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
        nonfinite: a non-finite pseudo-gradient on any rank: ``"error"`` raises on every rank
            naming the parameter and rank, nothing changed; ``"skip"`` skips the sync on every
            rank (``skipped_syncs``): error buffers, ``theta_global`` and outer momentum stay as
            they were and every rank's parameters return to ``theta_global``.
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

    Every rank must use the same settings, inner hyper-parameters and starting parameters:
    each sync compares a crc of them (4 bytes in the status exchange) and the first step
    compares the parameters; a difference raises ``ValueError`` on every rank, naming it.
    ``comm_stats`` counts each step's bytes (non-sync steps send 0); ``bytes_per_step`` is the
    amortized mean.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]] | Iterable[tuple[str, torch.Tensor]],
        inner: torch.optim.Optimizer | Callable[..., torch.optim.Optimizer] | None = None,
        *,
        sync_every: int = 15,
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
    ):
        _check_int("sync_every", sync_every, 1)
        if topk is not None:
            _check_int("topk", topk, 1, "or None for a dense pseudo-gradient (DiLoCo)")
        _check_int("chunk", chunk, 1)
        if not isinstance(dct, bool):
            raise TypeError(f"SparseLoCo: dct must be True or False, got {dct!r}")
        self.codec = get_codec(payload, owner="SparseLoCo")
        if value_dtype not in VALUE_DTYPES:
            raise TypeError(
                f"SparseLoCo: value_dtype must be torch.float16, bfloat16 or float32, got {value_dtype}"
            )
        _check_float("error_decay", error_decay, 0.0, 1.0)
        if outer not in OUTER:
            raise ValueError(f"SparseLoCo: outer must be one of {OUTER}, got {outer!r}")
        _check_float("outer_lr", outer_lr, 0.0, None, strict_low=True)
        _check_float("outer_momentum", outer_momentum, 0.0, 1.0, strict_high=True)
        if nonfinite not in NONFINITE:
            raise ValueError(f"SparseLoCo: nonfinite must be one of {NONFINITE}, got {nonfinite!r}")
        self.precision = lowp.check_precision("SparseLoCo", precision)
        _check_int("seed", seed, 0)
        _check_float("bucket_cap_mb", bucket_cap_mb, 0.0, None, strict_low=True)
        check_process_group("SparseLoCo", process_group)
        network_policy = make_policy(policy, "SparseLoCo")

        groups, names = _param_groups(params)
        model_params = [p for g in groups for p in g["params"]]
        if not model_params:
            raise ValueError("SparseLoCo: got an empty parameter list")
        if len({id(p) for p in model_params}) != len(model_params):
            raise ValueError("SparseLoCo: a parameter appears more than once")
        for p in model_params:
            if is_dtensor(p):
                raise TypeError(
                    "SparseLoCo: DTensor (FSDP) parameters are not supported; use plain data-parallel "
                    "replicas (each rank holds the whole model)"
                )
            if p.dtype not in VALUE_DTYPES:
                raise TypeError(
                    f"SparseLoCo optimizes float32, float16 and bfloat16 parameters, got {p.dtype}"
                )
        self.sync_every, self.topk, self.chunk, self.dct = sync_every, topk, chunk, dct
        self.payload = payload
        self.value_dtype = self.codec.resolve_value_dtype(value_dtype)
        self.error_decay, self.outer = float(error_decay), outer
        self.outer_lr, self.outer_momentum = float(outer_lr), float(outer_momentum)
        self.nonfinite, self.seed = nonfinite, seed
        self.bucket_cap_mb = float(bucket_cap_mb)
        self._names = names
        self._model_params = model_params
        self.comm = Communicator(process_group, owner="SparseLoCo.step", timeout=timeout)
        self.comm_stats = CommStats()
        self.policy = network_policy
        self._driver = PolicyDriver(network_policy)
        self.current_interval = sync_every
        self.syncs = 0
        self.skipped_syncs = 0
        self._steps = 0
        self._since_sync = 0
        self._checked = False
        self._buckets: list[Bucket] | None = None
        super().__init__(model_params, {})
        # masters: the inner optimizer steps fp32 copies of low-precision parameters
        self._masters: dict[int, torch.Tensor] = {}
        if self.precision == "master":
            for p in model_params:
                if p.dtype != torch.float32:
                    self._masters[id(p)] = lowp.master_copy(p.detach())
        self.inner = self._make_inner(inner, groups, model_params)
        self.param_groups = self.inner.param_groups
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
            if swap:
                if inner.state:
                    raise ValueError(
                        "SparseLoCo(precision='master'): the inner optimizer already has state; pass it "
                        "before its first step, or pass a callable params -> Optimizer"
                    )
                for g in inner.param_groups:
                    g["params"] = stepped(g["params"])
            opt = inner
        elif inner is None or callable(inner):
            inner_groups = [{**g, "params": stepped(g["params"])} for g in groups]
            if inner is None:
                opt = torch.optim.AdamW(inner_groups, lr=1e-3)
            else:
                opt = inner(inner_groups)
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError(
                    f"SparseLoCo: inner(params) must return a torch.optim.Optimizer, got {type(opt).__name__}"
                )
            held_ids = {id(p) for g in opt.param_groups for p in g["params"]}
            if held_ids != {id(p) for g in inner_groups for p in g["params"]}:
                raise ValueError(
                    "SparseLoCo: inner(params) must optimize exactly the parameters it was given"
                )
        else:
            raise TypeError(
                "SparseLoCo: inner must be None (AdamW, lr 1e-3), a torch.optim.Optimizer or a callable "
                f"params -> Optimizer, got {type(inner).__name__}"
            )
        return opt

    # ------------------------------------------------------------------ public
    @property
    def bytes_per_step(self) -> float:
        """Bytes this rank sent per step, amortized over every step so far."""
        return self.comm_stats.total_sent_bytes / max(self.comm_stats.steps, 1)

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

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One local step of the inner optimizer; every ``sync_every``-th step, a sync."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for p in self._model_params:
            if "global" not in self.state[p]:  # the first step: weights as loaded by now
                m = self._masters.get(id(p))
                if m is not None:
                    m.copy_(p)
                self.state[p]["global"] = p.detach().float().clone(memory_format=torch.contiguous_format)
        if not self._checked:
            self._check_start()
        self._inner_step()
        self._steps += 1
        self._since_sync += 1
        if self._since_sync >= self.current_interval:
            self._sync()
        sent, received, timing = self.comm.take_step()
        dense = self._dense_bytes()
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.comm_stats.record(sent, received, dense, timing, world, self.comm.world_size)
        return loss

    # ------------------------------------------------------------------ local steps
    def _inner_step(self) -> None:
        if not self._masters:
            self.inner.step()
            return
        for p in self._model_params:
            m = self._masters.get(id(p))
            if m is not None:
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

    # ------------------------------------------------------------------ sync
    def _sync(self) -> None:
        params = self._model_params
        deltas = [(self.state[p]["global"] - self._local(p)).contiguous() for p in params]
        device = params[0].device
        finite = torch.stack([all_finite(d) for d in deltas])  # one transfer, not one per tensor
        flags = torch.where(finite, _OK, _BAD).to(torch.uint8)
        crc = zlib.crc32(repr(self._settings()).encode())
        crc_bytes = torch.tensor(list(crc.to_bytes(4, "little")), dtype=torch.uint8, device=device)
        measured = self._driver.status_bytes
        parts = [flags, crc_bytes]
        if measured:  # the previous interval's times, for the policy
            parts.append(self._driver.measurement(device))
        everyone = self._wait(self.comm.all_gather(torch.cat(parts), "pseudo-gradient status exchange")).cpu()
        times, everyone = (
            everyone[:, everyone.shape[1] - measured :],
            everyone[:, : everyone.shape[1] - measured],
        )
        if bool((everyone[:, -4:] != everyone[:1, -4:]).any()):
            self._raise_mismatch()
        bad = (everyone[:, :-4] == _BAD).nonzero().tolist()
        if not bad or self.nonfinite == "skip":
            self._follow_policy(times if measured else None)
        if bad:
            if self.nonfinite == "skip":
                self._since_sync = 0
                self.skipped_syncs += 1
                self._driver.step_done(0, 0, synced=False)
                generator = None
                if self.precision == "stochastic":
                    generator = lowp.rounding_generator(self.seed, self.syncs, params[0].device)
                for p in params:
                    self._write(p, self.state[p]["global"], generator)
                return
            self.comm.reset_counts()
            r, n = bad[0]
            more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
            raise FloatingPointError(
                f"SparseLoCo: non-finite pseudo-gradient in {self._name(n)} on rank "
                f"{self.comm.global_rank(r)}{more}; the sync changed nothing (theta_global, error "
                "buffers and outer momentum as they were; the parameters hold this rank's local "
                "values). Lower the inner lr / fix the data, or pass nonfinite='skip' to skip such "
                "syncs on every rank"
            )
        means = self._exchange(deltas)
        self.syncs += 1
        generator = None
        if self.precision == "stochastic":
            generator = lowp.rounding_generator(self.seed, self.syncs, params[0].device)
        mu, lr = self.outer_momentum, self.outer_lr
        for p, mean in zip(params, means):
            g = self.state[p]["global"]
            if mean is not None:
                if self.outer == "nesterov":
                    m = self.state[p].setdefault("momentum", torch.zeros_like(g))
                    m.mul_(mu).add_(mean)
                    g.sub_(mean + mu * m, alpha=lr)
                else:
                    g.sub_(mean, alpha=lr)
            self._write(p, g, generator)
        self._since_sync = 0
        self._driver.step_done(self.comm.sent, self._dense_bytes(), synced=True)

    def _follow_policy(self, times: torch.Tensor | None) -> None:
        """The interval until the next sync, from every rank's times of the last one."""
        decision = self._driver.decide(times, self.syncs + self.skipped_syncs + 1)
        if decision.dense or decision.skip_sync or decision.topk_scale != 1 or decision.payload is not None:
            raise ValueError(
                f"SparseLoCo: policy {self.policy.describe()} decided {decision.describe()!r}; "
                "SparseLoCo follows only sync_scale decisions (IntervalPolicy)"
            )
        self.current_interval = self.sync_every * decision.sync_scale

    def _wait(self, pending: Pending) -> torch.Tensor:
        """Wait on a collective, counting the time blocked for the policy."""
        start = time.perf_counter()
        result = pending.wait()
        self._driver.blocked(time.perf_counter() - start)
        return result

    def _dense_bytes(self) -> int:
        """What a dense all-reduce of every parameter would send from this rank."""
        return ring_allreduce_bytes(
            sum(p.numel() * p.element_size() for p in self._model_params), self.comm.world_size
        )

    def _write(self, p: torch.Tensor, value: torch.Tensor, generator: torch.Generator | None) -> None:
        master = self._masters.get(id(p))
        lowp.write_update(p, value, self.precision, master=master, generator=generator)

    def _plan(self) -> list[Bucket]:
        if self._buckets is None:
            shapes = [tuple(p.shape) for p in self._model_params]
            if self.topk is None:
                self._buckets = make_buckets(
                    [0] * len(shapes),
                    shapes,
                    [{"compression_chunk": self.chunk, "compression_topk": 1}],
                    self.codec,
                    self.value_dtype,
                    int(self.bucket_cap_mb * 2**20),
                    False,
                    self.comm.world_size,
                    all_dense=True,
                )
            else:
                self._buckets = make_buckets(
                    [0] * len(shapes),
                    shapes,
                    [{"compression_chunk": self.chunk, "compression_topk": self.topk}],
                    self.codec,
                    self.value_dtype,
                    int(self.bucket_cap_mb * 2**20),
                    self.codec.dense_fallback,
                    self.comm.world_size,
                )
        return self._buckets

    def _exchange(self, deltas: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """Encode every bucket (updating the error buffers), launch all collectives, then
        decode each into the mean pseudo-gradient of its tensors (None: empty tensors)."""
        means: list[torch.Tensor | None] = [None] * len(deltas)
        finishers = [self._launch(b, deltas) for b in self._plan()]
        for bucket, finish in zip(self._plan(), finishers):
            for i, mean in zip(bucket.members, finish()):
                means[i] = mean
        return means

    def _launch(self, bucket: Bucket, deltas: list[torch.Tensor]) -> Callable[[], list[torch.Tensor]]:
        members = bucket.members
        if bucket.dense:
            flat = torch.cat([deltas[i].reshape(-1) for i in members])
            pending = self.comm.all_reduce_mean(flat, "pseudo-gradient all-reduce")

            def finish_dense() -> list[torch.Tensor]:
                mean = self._wait(pending)
                return [
                    part.view(deltas[i].shape)
                    for i, part in zip(members, mean.split([deltas[i].numel() for i in members]))
                ]

            return finish_dense

        codec, k, chunk = bucket.codec, bucket.topk, self.chunk
        assert codec is not None and k is not None and bucket.plan is not None
        plan = bucket.plan
        errors = []
        for i in members:
            e = self.state[self._model_params[i]].setdefault("error", torch.zeros_like(deltas[i]))
            errors.append(e.mul_(self.error_decay).add_(deltas[i]))
        tilings = plan.tilings
        coeffs = (
            dct_encode_multi(errors, chunk)
            if self.dct
            else [_to_tiles(e, t) for e, t in zip(errors, tilings)]
        )
        picks = [chunk_topk(c, k) for c in coeffs]
        idx = torch.cat([ix.reshape(-1).to(plan.index_dtype) for ix, _ in picks])
        vals = torch.cat([v.reshape(-1) for _, v in picks]).to(codec.encode_dtype)
        wires = codec.to_wire(idx, vals)
        pendings: list[Pending] = [
            self.comm.all_gather(w, f"{wire.name} all-gather") for wire, w in zip(codec.wire, wires)
        ]
        # what the other ranks will decode from this rank leaves the error buffer
        _, sent = codec.from_wire([w.reshape(1, -1) for w in wires])
        spans = [t.n_tiles * t.k_eff(k) for t in tilings]
        sparse = [
            torch.zeros_like(c).scatter_(1, ix.long(), part.view(ix.shape).float())
            for c, (ix, _), part in zip(coeffs, picks, sent[0].split(spans))
        ]
        for e, s in zip(errors, self._from_coeffs(sparse, errors, tilings)):
            e.sub_(s)

        def finish() -> list[torch.Tensor]:
            gathered = [self._wait(p) for p in pendings]
            indices, values = codec.from_wire(gathered)
            world = indices.shape[0]
            sums = [torch.zeros_like(c) for c in coeffs]
            for r in range(world):  # rank order, one add per position per rank: deterministic
                for s, ix_r, v_r, t in zip(sums, indices[r].split(spans), values[r].split(spans), tilings):
                    s.scatter_add_(1, ix_r.long().view(t.n_tiles, -1), v_r.float().view(t.n_tiles, -1))
            for s in sums:
                s.div_(world)
            return self._from_coeffs(sums, errors, tilings)

        return finish

    def _from_coeffs(self, mats: list[torch.Tensor], like: list[torch.Tensor], tilings) -> list[torch.Tensor]:
        """Tile matrices (DCT coefficients when ``dct``) -> tensors shaped like ``like``."""
        if self.dct:
            return dct_decode_multi(mats, [list(x.shape) for x in like], self.chunk)
        return [_from_tiles(m, t) for m, t in zip(mats, tilings)]

    # ------------------------------------------------------------------ agreement
    def _settings(self) -> dict[str, Any]:
        """Everything every rank must agree on (compared at every sync)."""
        return {
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
            "inner_groups": [
                {k: _plain(v) for k, v in g.items() if k != "params" and _comparable(v)}
                for g in self.inner.param_groups
            ],
            "layout": [(tuple(p.shape), str(p.dtype)) for p in self._model_params],
        }

    def _raise_mismatch(self) -> None:
        self.comm.reset_counts()
        everyone = self.comm.gather_objects(self._settings())
        ranks = [self.comm.global_rank(r) for r in range(len(everyone))]
        for key in everyone[0]:
            values = [s.get(key) for s in everyone]
            if len({repr(v) for v in values}) > 1:
                per = ", ".join(f"{v!r} on rank {r}" for r, v in zip(ranks, values))
                raise ValueError(
                    f"SparseLoCo: the ranks disagree: setting {key!r} is {per}; nothing changed. Every "
                    "rank must use the same settings (and step LR schedulers on every rank)"
                )
        raise ValueError("SparseLoCo: the ranks' settings fingerprints differ; nothing changed")

    def _check_start(self) -> None:
        """First step: settings and layout crc, and the parameters' values (sums in float64),
        compared over the ranks before any change: replicas must start identical."""
        params = self._model_params
        crc = zlib.crc32(repr(self._settings()).encode())
        device = params[0].device
        sums = [self._local(p).double().sum() for p in params]  # 0 for empty tensors
        head = torch.tensor([float(crc)], dtype=torch.float64, device=device)
        mine = torch.cat([head, torch.stack(sums).to(device)])
        seen = self.comm.all_gather(mine, "parameter check").wait().cpu()
        if bool((seen[:, 0] != seen[0, 0]).any()):
            self._raise_mismatch()
        differ = (seen[:, 1:] != seen[:1, 1:]).any(dim=0).nonzero().flatten().tolist()
        if differ:
            self.comm.reset_counts()
            raise ValueError(
                f"SparseLoCo: parameter {self._name(differ[0])} differs between the ranks at the first step; "
                "every rank must start from the same weights (seed the model alike or broadcast rank 0's)"
            )
        self._checked = True

    def _name(self, n: int) -> str:
        p = self._model_params[n]
        label = self._names.get(id(p), f"param {n}")
        return f"'{label}' {tuple(p.shape)}"

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Inner optimizer state, this rank's error buffers, theta_global, outer momentum,
        masters and counters, with the rank, world size and settings that loading checks."""
        state = {}
        for n, p in enumerate(self._model_params):
            s = {k: v.clone() for k, v in self.state[p].items()}
            if id(p) in self._masters:
                s["master"] = self._masters[id(p)].detach().clone()
            state[n] = s
        return {
            "format": _FORMAT,
            "type": "SparseLoCo",
            "rank": self.comm.global_rank(self.comm.rank),
            "world_size": self.comm.world_size,
            "settings": self._settings(),
            "inner": self.inner.state_dict(),
            "state": state,
            "counters": {
                "steps": self._steps,
                "since_sync": self._since_sync,
                "syncs": self.syncs,
                "skipped_syncs": self.skipped_syncs,
                "checked": self._checked,
                "interval": self.current_interval,
            },
            "policy": self._driver.state_dict(),
            "comm_stats": self.comm_stats.as_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what this rank saved; everything is checked before anything changes."""
        if not isinstance(state_dict, dict) or state_dict.get("type") != "SparseLoCo":
            raise ValueError("SparseLoCo.load_state_dict: this is not a SparseLoCo state_dict")
        if state_dict.get("format") != _FORMAT:
            raise ValueError(
                f"SparseLoCo.load_state_dict: format {state_dict.get('format')!r}, expected {_FORMAT}"
            )
        rank, world = self.comm.global_rank(self.comm.rank), self.comm.world_size
        if state_dict["rank"] != rank or state_dict["world_size"] != world:
            raise ValueError(
                f"SparseLoCo.load_state_dict: saved by rank {state_dict['rank']} of {state_dict['world_size']}, "
                f"loading on rank {rank} of {world}: error buffers are per rank; load each rank's own file"
            )
        mine, saved = self._settings(), state_dict["settings"]
        for key in mine:
            if key != "inner_groups" and repr(mine[key]) != repr(saved.get(key)):
                raise ValueError(
                    f"SparseLoCo.load_state_dict: setting {key!r} was {saved.get(key)!r}, is {mine[key]!r} now"
                )
        state = state_dict["state"]
        if len(state) != len(self._model_params):
            raise ValueError(
                f"SparseLoCo.load_state_dict: {len(state)} parameters saved, {len(self._model_params)} here"
            )
        for n, p in enumerate(self._model_params):
            for key, t in state[n].items():
                if tuple(t.shape) != tuple(p.shape) or not bool(torch.isfinite(t).all()):
                    raise ValueError(
                        f"SparseLoCo.load_state_dict: {key} of {self._name(n)} is {tuple(t.shape)} or not finite"
                    )
        interval = state_dict["counters"].get("interval", self.sync_every)
        if not (isinstance(interval, int) and interval >= 1):
            raise ValueError(
                f"SparseLoCo.load_state_dict: saved interval {interval!r} is not a positive integer"
            )
        if "policy" in state_dict:
            self._driver.load_state_dict(state_dict["policy"], owner="SparseLoCo")
        self.inner.load_state_dict(state_dict["inner"])
        self.param_groups = self.inner.param_groups
        for n, p in enumerate(self._model_params):
            entry = {k: v.to(p.device, torch.float32).clone() for k, v in state[n].items()}
            master = entry.pop("master", None)
            if master is not None and id(p) in self._masters:
                self._masters[id(p)].copy_(master)
            self.state[p] = entry
        c = state_dict["counters"]
        self._steps, self._since_sync = int(c["steps"]), int(c["since_sync"])
        self.syncs, self.skipped_syncs, self._checked = (
            int(c["syncs"]),
            int(c["skipped_syncs"]),
            bool(c["checked"]),
        )
        self.current_interval = interval
        self.comm_stats = CommStats.from_dict(state_dict["comm_stats"])


# ---------------------------------------------------------------------------- helpers


def _to_tiles(x: torch.Tensor, t: tiling.TensorTiling) -> torch.Tensor:
    """A tensor -> its ``(n_tiles, tile_numel)`` tile matrix (the DCT's tile order)."""
    m = x.reshape(t.rows // t.h, t.h, t.cols // t.w, t.w).transpose(1, 2)
    return m.reshape(t.n_tiles, t.tile_numel)


def _from_tiles(m: torch.Tensor, t: tiling.TensorTiling) -> torch.Tensor:
    """Inverse of :func:`_to_tiles`."""
    x = m.reshape(t.rows // t.h, t.cols // t.w, t.h, t.w).transpose(1, 2)
    return x.reshape(t.shape)


def _param_groups(params) -> tuple[list[dict[str, Any]], dict[int, str]]:
    """Param groups (tensors only) and a name per parameter id for ``(name, tensor)`` input."""
    if isinstance(params, torch.Tensor):
        raise TypeError("SparseLoCo: params must be an iterable of tensors or dicts, got a tensor")
    items = list(params)
    names: dict[int, str] = {}
    if items and all(isinstance(i, dict) for i in items):
        groups = []
        for g in items:
            ps = g.get("params")
            ps = [ps] if isinstance(ps, torch.Tensor) else list(ps or [])
            groups.append({**g, "params": _tensors(ps, names)})
        return groups, names
    return [{"params": _tensors(items, names)}], names


def _tensors(items: list, names: dict[int, str]) -> list[torch.Tensor]:
    out = []
    for item in items:
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor):
            names[id(item[1])] = str(item[0])
            item = item[1]
        if not isinstance(item, torch.Tensor):
            raise TypeError(
                f"SparseLoCo: params must be tensors, (name, tensor) pairs or dicts, got {type(item).__name__}"
            )
        out.append(item)
    return out


def _check_int(name: str, value: object, low: int, more: str = "") -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        extra = f" {more}" if more else ""
        raise ValueError(f"SparseLoCo: {name} must be an integer >= {low}{extra}, got {value!r}")


def _check_float(
    name: str,
    value: object,
    low: float,
    high: float | None,
    *,
    strict_low: bool = False,
    strict_high: bool = False,
) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(float(value))
    if ok:
        v = float(value)  # type: ignore[arg-type]
        ok = (v > low if strict_low else v >= low) and (
            high is None or (v < high if strict_high else v <= high)
        )
    if not ok:
        lo = f"> {low}" if strict_low else f">= {low}"
        hi = "" if high is None else (f" and < {high}" if strict_high else f" and <= {high}")
        raise ValueError(f"SparseLoCo: {name} must be a finite number {lo}{hi}, got {value!r}")


def _comparable(v: object) -> bool:
    return isinstance(v, (int, float, bool, str, tuple, torch.Tensor)) or v is None


def _plain(v: object) -> object:
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else tuple(v.flatten().tolist())
    if isinstance(v, int) and not isinstance(v, bool):
        return float(v)
    return v
