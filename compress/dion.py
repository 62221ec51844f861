"""Dion: orthonormalized low-rank updates with error feedback, data-parallel.

Dion (Ahn et al. 2025, "Dion: Distributed Orthonormalized Updates", arXiv 2504.05295) replaces
Muon's full orthogonalization by one step of power iteration on a low-rank factorization of the
momentum, and communicates only the two factors. In the replicated data-parallel form every rank
holds the whole model and its own gradient ``G_i``; for each matrix parameter ``X`` (``m x n``,
both > 1; a conv weight counts as its ``(out, in * kh * kw)`` flattening) with this rank's fp32
momentum ``M_i`` (starts at 0) and a right factor ``Q`` (``n x r``, identical on every rank: a
seeded normal matrix, orthonormalized, at construction)::

    B_i = M_i + G_i
    P   = mean over ranks of (B_i @ Q)              # all-reduce 1: m x r
    P   = orthonormalize(P)                         # QR in float64: the same P on every rank
    R   = mean over ranks of (B_i^T @ P)            # all-reduce 2: n x r
    M_i = B_i - (1 - mu) * P @ R^T                  # error feedback: what was not sent stays
    Q   = R / column_norms(R)                       # the next power iteration's start
    X   = X * (1 - lr * weight_decay) - lr * sqrt(m / n) * P @ Q^T

The update is ``P @ Q^T`` with orthonormal ``P`` and unit columns in ``Q``, scaled by
``sqrt(m / n)`` (Dion's choice: the RMS-to-RMS operator norm of an orthonormal update, as Muon's
``max(1, m / n) ** 0.5``), so one lr suits every shape. A column of ``R`` whose norm is below
1e-8 is divided by 1e-8 instead (zero stays zero: no NaN from an all-zero momentum). The rank
``r`` is ``min(rank, m, n)``, or ``ceil(rank_fraction * min(m, n))`` (at least 1) when ``rank``
is None.

Every other parameter (biases, norms, vectors, and the named ones of ``dense_params``: embeddings
and heads, as Dion's authors advise) takes a dense all-reduce (mean, fp32) of its gradient and
the functional AdamW step of :func:`cokit.compress.inner.adamw`, at ``lr * adamw_lr_ratio``.
Its state is identical on every rank; ``M_i`` is each rank's own.

Bytes per step and rank: two ring all-reduces of fp32 ``(m + n) * r`` per matrix (the
concatenated ``P``'s, then the ``R``'s, in buckets of ``bucket_cap_mb``) plus a ring all-reduce
of the other parameters' fp32 gradients, plus the 40-byte status row (``W - 1`` times 40 bytes)
and, at the first step, the check that the replicas start alike (8 bytes per parameter, ``W - 1``
times). :func:`dion_step` is the functional step; :class:`Dion` the optimizer, on the exchange
core (:mod:`cokit.compress.exchange`): every step opens with the status row (settings
fingerprint, which parameters have a gradient, non-finite gradients, a GradScaler's inf), every
collective has the timeout, every result from the peers is checked finite, and nothing changes
before every result is in. The state dict has torch's layout (per parameter
``momentum_buffer_rank<R>``, ``Q`` or AdamW's ``step``, ``exp_avg``, ``exp_avg_sq``; JSON records
of settings and counters in ``param_groups[0]``), and a load checks everything before anything
changes.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from cokit.compress.demo_step import split_like
from cokit.compress.eager import eager
from cokit.compress.exchange import Exchange
from cokit.compress.frontend import FrontEnd, FrontEndOptions, plain, run_closure
from cokit.compress.inner import adamw_settings, adamw_step, check_adamw_settings
from cokit.compress.named_params import (
    check_dense_params,
    check_replicated,
    dense_members,
    indexed_groups,
    param_groups,
)
from cokit.compress.precision import LowPrecisionWarning
from cokit.compress.state_records import (
    RecordSpec,
    check_counts,
    check_saved_groups,
    check_tensor,
    lacks,
    load_comm_stats,
)
from cokit.compress.stats import CommStats, ring_allreduce_bytes
from cokit.triton_kernels._checks import check_int, check_number

__all__ = ["Dion", "Mean", "dion_step", "orthonormalize"]

#: ``mean(tensors, phase)``: each tensor's mean over the ranks (``phase`` is ``"P"``, then
#: ``"R"``: the last exchange of a step, after which every result is in)
Mean = Callable[[list[torch.Tensor], str], list[torch.Tensor]]
PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
NORM_EPS = 1e-8  # a column norm of R below this divides by it (a zero column stays zero)
FORMAT = 1
COMMON_KEY = "dion"
_WHERE = "Dion"
#: the options of FrontEndOptions that Dion takes
_OPTIONS = ("timeout", "nonfinite", "bucket_cap_mb", "seed", "validate_payload")
_LOAD = "Dion.load_state_dict"
#: per-group hyper-parameters: their type, and every rank must agree on them
_GROUP_KEYS = {
    "lr": float,
    "mu": float,
    "weight_decay": float,
    "adamw_lr_ratio": float,
    "adamw_betas": tuple,
    "adamw_eps": float,
}
_ADAMW_KEYS = ("step", "exp_avg", "exp_avg_sq")
_LOOSE = ("validate_payload",)  # settings that do not change what is computed
_RECORDS = RecordSpec(COMMON_KEY, "Dion", FORMAT, _LOAD, "the momentum buffers", _LOOSE)


# ---------------------------------------------------------------------------- functional step


def orthonormalize(p: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning ``p`` (``m x r``, ``r <= m``): the Q of a reduced QR in
    float64, back in ``p``'s dtype. Deterministic: the same ``p`` gives the same bits."""
    return torch.linalg.qr(p.double(), mode="reduced").Q.to(p.dtype)


def _local_mean(tensors: list[torch.Tensor], phase: str) -> list[torch.Tensor]:
    """One process: the mean over ranks is the tensor itself."""
    return tensors


def _per_tensor(name: str, value: float | Sequence[float], n: int) -> list[float]:
    if isinstance(value, (int, float)):
        return [float(value)] * n
    values = [float(v) for v in value]
    if len(values) != n:
        raise ValueError(f"dion_step: {name} has {len(values)} values for {n} parameters")
    return values


def dion_step(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    momenta: list[torch.Tensor],
    qs: list[torch.Tensor],
    *,
    lr: float | Sequence[float],
    mu: float | Sequence[float],
    weight_decay: float | Sequence[float] = 0.0,
    mean: Mean = _local_mean,
) -> None:
    """Dion's step of matrix parameters (module docstring), in place.

    Args:
        params: parameters, each ``m x n`` once flattened to ``(shape[0], -1)``.
        grads: their gradients (any float dtype; used in fp32).
        momenta: fp32 momentum buffers shaped like the parameters (this rank's ``M_i``).
        qs: fp32 right factors ``Q`` (``n x r``), the same on every rank.
        lr, mu, weight_decay: one value for all, or one per parameter.
        mean: each tensor's mean over the ranks, called twice (``"P"`` then ``"R"``); the
            default is one process. Nothing is written before the second call returns.
    """
    n = len(params)
    lrs, mus, wds = (
        _per_tensor(k, v, n) for k, v in (("lr", lr), ("mu", mu), ("weight_decay", weight_decay))
    )
    if n == 0:
        return
    bs = [
        m.reshape(m.shape[0], -1) + g.reshape(g.shape[0], -1).float()
        for m, g in zip(momenta, grads, strict=True)
    ]
    ps = [orthonormalize(p) for p in mean([b @ q for b, q in zip(bs, qs, strict=True)], "P")]
    rs = mean([b.T @ p for b, p in zip(bs, ps, strict=True)], "R")
    # every result is in: write
    for x, m, q, b, p, r, lr_, mu_, wd in zip(params, momenta, qs, bs, ps, rs, lrs, mus, wds, strict=True):
        m.copy_(b.sub_(p @ r.T, alpha=1.0 - mu_).view(m.shape))
        q.copy_(r / r.norm(dim=0, keepdim=True).clamp_min(NORM_EPS))
        rows, cols = b.shape
        if wd != 0:
            x.mul_(1.0 - lr_ * wd)
        x.add_((p @ q.T).view(x.shape), alpha=-lr_ * math.sqrt(rows / cols))


# ---------------------------------------------------------------------------- optimizer


class Dion(FrontEnd, torch.optim.Optimizer):
    """Data-parallel Dion: low-rank orthonormalized updates with error feedback (module docstring).

    Args:
        params: the model's parameters: tensors, ``(name, tensor)`` pairs
            (``model.named_parameters()``: ``dense_params`` selects by name) or param groups of
            either (per-group ``lr``, ``mu``, ``weight_decay`` and the ``adamw_*`` settings).
        lr: Dion's learning rate (default 0.01, the paper's); LR schedulers drive it.
        rank: the rank ``r`` of every matrix's update (clamped to ``min(m, n)``); None: from
            ``rank_fraction``.
        rank_fraction: ``r = ceil(rank_fraction * min(m, n))`` (at least 1) when ``rank`` is
            None; in (0, 1], default 0.25 (1.0 is full rank: Muon's direction, sent as factors).
        mu: momentum decay, in [0, 1) (default 0.95): the part ``(1 - mu)`` of what was sent
            leaves the momentum.
        weight_decay: decoupled weight decay of every parameter (``p *= 1 - lr * weight_decay``,
            with each part's lr).
        adamw_lr_ratio: AdamW's lr as a fraction of ``lr`` (default 0.1: AdamW at 1e-3 beside
            Dion at 0.01), so that a scheduler scales both.
        adamw_betas / adamw_eps: AdamW's betas (0.9, 0.95) and epsilon (1e-8).
        dense_params: None, or a tuple of name substrings (``("embed", "head")``): matrices
            whose name contains one of them take AdamW on the averaged gradient. Needs named
            parameters; every substring must match some name.
        process_group: the group averaged over (:class:`~cokit.compress.frontend.FrontEndOptions`).
        **options: of :class:`~cokit.compress.frontend.FrontEndOptions`, Dion takes ``timeout``,
            ``nonfinite`` (skipped steps counted in ``skipped_steps``), ``bucket_cap_mb`` (per
            all-reduce bucket), ``seed`` (of each matrix's initial ``Q``, with its position) and
            ``validate_payload`` (every averaged result checked finite before use).

    Parameters may be fp32, bf16 or fp16; the state and the update are fp32, and low-precision
    parameters take the rounded update (a ``LowPrecisionWarning`` says so).
    """

    _step_supports_amp_scaling = True  # GradScaler calls step() on every rank
    owner = _WHERE

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]] | Iterable[tuple[str, torch.Tensor]],
        lr: float = 0.01,
        *,
        rank: int | None = None,
        rank_fraction: float = 0.25,
        mu: float = 0.95,
        weight_decay: float = 0.0,
        adamw_lr_ratio: float = 0.1,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        dense_params: tuple[str, ...] | None = None,
        process_group: Any = None,
        **options: Any,
    ):
        opts = FrontEndOptions.checked(_WHERE, options, process_group=process_group, takes=_OPTIONS)
        if rank is not None:
            check_int("rank", rank, 1, where=_WHERE, more="or None (rank_fraction decides)")
        self.rank = rank
        self.rank_fraction = check_number(
            "rank_fraction", rank_fraction, 0.0, 1.0, low_open=True, where=_WHERE
        )
        self.dense_params = check_dense_params(dense_params, _WHERE)
        self.nonfinite, self.bucket_cap_mb, self.seed = opts.nonfinite, opts.bucket_cap_mb, opts.seed
        self._cap = opts.bucket_cap_bytes
        defaults = dict(lr=lr, mu=mu, **adamw_settings(weight_decay, adamw_lr_ratio, adamw_betas, adamw_eps))
        _check_group(defaults)
        groups, names = param_groups(params, _WHERE)
        model_params = [p for g in groups for p in g["params"]]
        check_replicated(model_params, _WHERE, PARAM_DTYPES)
        forced = dense_members(self.dense_params, model_params, names, _WHERE)
        self._names = names
        self._model_params = model_params
        #: per parameter: Dion's rank r, or 0 for AdamW's parameters
        self._ranks = [
            0 if n in forced else _rank_of(p, self.rank, self.rank_fraction)
            for n, p in enumerate(model_params)
        ]
        self.exchange = Exchange(
            _WHERE + ".step", process_group, opts.timeout, validate=opts.validate_payload
        )
        self.comm_stats = CommStats()
        self._steps = self.skipped_steps = 0
        self._checked = False
        self._built = False
        super().__init__(groups, defaults)
        self._built = True
        for n, p in enumerate(model_params):
            self.state[p] = self._fresh_state(n, p)
        low = [p for p in model_params if p.dtype != torch.float32]
        if low:
            warnings.warn(
                f"Dion: {len(low)} of {len(model_params)} parameters are bfloat16/float16: the update is "
                "computed in fp32 but each new weight is rounded to the nearest representable value, so "
                "an update below half the spacing there is lost (bf16: about |w| * 2**-9). Dion keeps no "
                "fp32 master weights: keep the parameters in fp32 (autocast for the compute) to avoid it",
                LowPrecisionWarning,
                stacklevel=2,
            )

    # ------------------------------------------------------------------ construction
    def _fresh_state(self, n: int, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """Parameter ``n``'s state before its first step (a zero momentum and the seeded Q, or
        AdamW's zeros): the same on every rank, and the same after a load."""
        r = self._ranks[n]
        if r == 0:
            return {
                "step": torch.zeros((), dtype=torch.float32),
                "exp_avg": torch.zeros(p.shape, dtype=torch.float32, device=p.device),
                "exp_avg_sq": torch.zeros(p.shape, dtype=torch.float32, device=p.device),
            }
        cols = p.numel() // p.shape[0]
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + n)
        q = orthonormalize(torch.randn(cols, r, generator=generator, dtype=torch.float64))
        return {
            "momentum_buffer": torch.zeros(p.shape, dtype=torch.float32, device=p.device),
            "Q": q.to(p.device, torch.float32),
        }

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if self._built:
            raise NotImplementedError("Dion: build it with every parameter; groups cannot be added later")
        super().add_param_group(param_group)
        _check_group(self.param_groups[-1], len(self.param_groups) - 1)

    # ------------------------------------------------------------------ public
    @property
    def ranks(self) -> list[int]:
        """Per parameter (in order), Dion's rank ``r``, or 0 for the parameters AdamW steps."""
        return list(self._ranks)

    # Eager even inside torch.compile (docs/design.md §3): collectives and the status agreement
    # cannot be traced.
    @eager
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One synchronized step over every parameter that has a gradient."""
        loss = run_closure(closure)
        for index, group in enumerate(self.param_groups):
            _check_group(group, index)  # a scheduler may have written a bad value
        dense = 0
        with self.exchange.guarded():
            active = self._agree()
            if not self._checked:
                self._check_start()
            if active is not None:
                dense = self._step(active)
                self._steps += 1
        self.exchange.record(self.comm_stats, dense)
        return loss

    # ------------------------------------------------------------------ the step
    def _agree(self) -> list[int] | None:
        """The status round; the parameters that step (positions), or None when every rank
        skips; raises on every rank otherwise."""
        rnd, has_grad = self.open_params_round(self._model_params)
        if not self.skip_or_raise(rnd, self._name, when=f"step {self._steps + 1}"):
            self.skipped_steps += 1
            return None
        return [n for n, has in enumerate(has_grad) if has]

    def _step(self, active: list[int]) -> int:
        """Exchange and update the ``active`` parameters; returns what a dense all-reduce of
        their gradients would have sent."""
        params = self._model_params
        group_of = {id(p): g for g in self.param_groups for p in g["params"]}
        grads: dict[int, torch.Tensor] = {}
        for n in active:
            g = params[n].grad
            assert g is not None  # active: it has one
            grads[n] = g
        mats = [n for n in active if self._ranks[n]]
        rest = [n for n in active if not self._ranks[n]]
        rest_grads = [grads[n] for n in rest]
        # the dense gradients first: their all-reduce runs while the factors are computed
        dense_pending = _launch(self.exchange, rest_grads, self._cap, "gradient all-reduce")
        dense_means: list[torch.Tensor] = []

        def mean(tensors: list[torch.Tensor], phase: str) -> list[torch.Tensor]:
            out = _finish(
                self.exchange,
                _launch(self.exchange, tensors, self._cap, f"Dion {phase} all-reduce"),
                tensors,
                f"Dion {phase}",
            )
            if phase == "R":  # the last exchange: collect the dense results before anything changes
                dense_means.extend(_finish(self.exchange, dense_pending, rest_grads, "gradients"))
            return out

        if mats:
            hyper = [group_of[id(params[n])] for n in mats]
            dion_step(
                [params[n] for n in mats],
                [grads[n] for n in mats],
                [self.state[params[n]]["momentum_buffer"] for n in mats],
                [self.state[params[n]]["Q"] for n in mats],
                lr=[float(g["lr"]) for g in hyper],
                mu=[float(g["mu"]) for g in hyper],
                weight_decay=[float(g["weight_decay"]) for g in hyper],
                mean=mean,
            )
        else:
            dense_means.extend(_finish(self.exchange, dense_pending, rest_grads, "gradients"))
        for n, m in zip(rest, dense_means, strict=True):
            p = params[n]
            adamw_step([p], [m], [self.state[p]], group_of[id(p)])
        nbytes = sum(g.numel() * g.element_size() for g in grads.values())
        return ring_allreduce_bytes(nbytes, self.comm.world_size)

    # ------------------------------------------------------------------ agreement
    def _settings(self) -> dict[str, Any]:
        """Everything every rank must agree on (compared at every step)."""
        return {
            "rank": self.rank,
            "rank_fraction": self.rank_fraction,
            "dense_params": list(self.dense_params) if self.dense_params is not None else None,
            "nonfinite": self.nonfinite,
            "bucket_cap_mb": self.bucket_cap_mb,
            "seed": self.seed,
            "validate_payload": self.exchange.validate,
        }

    def _counters(self) -> dict[str, Any]:
        return {"steps": self._steps, "skipped_steps": self.skipped_steps, "checked": self._checked}

    def _describe(self, globally: bool = False) -> dict[str, Any]:
        return {
            "settings": self._settings(),
            "groups": [{k: plain(g[k]) for k in _GROUP_KEYS} for g in self.param_groups],
            "layout": [
                [self._name(n), f"{tuple(p.shape)} {p.dtype} " + (f"r={r}" if r else "adamw")]
                for n, (p, r) in enumerate(zip(self._model_params, self._ranks, strict=True))
            ],
            "counters": self._counters(),
        }

    def _check_start(self) -> None:
        """First step, and the first after a load: the replicas must hold the same weights and,
        after a load, the same replicated state (each matrix's ``Q``, the AdamW moments and
        steps of the others), compared before any change."""
        params = self._model_params
        named = [(f"parameter {self._name(n)}", p) for n, p in enumerate(params)]
        if self._steps:  # a load (agreed in the counters): every rank compares as many
            for n, p in enumerate(params):
                named += [(f"{k} of {self._name(n)}", self.state[p][k]) for k in ("Q",) if self._ranks[n]]
                named += [
                    (f"{k} of {self._name(n)}", self.state[p][k]) for k in _ADAMW_KEYS if not self._ranks[n]
                ]
        self.check_replicas(named)
        self._checked = True

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """torch.optim's layout (so ``torch.distributed.checkpoint`` saves it): per parameter
        ``momentum_buffer_rank<R>`` (this rank's momentum, under a key naming the global rank) and
        ``Q`` (the same on every rank), or AdamW's ``step``, ``exp_avg`` and ``exp_avg_sq``
        (the same on every rank); the groups' hyper-parameters; in ``param_groups[0]`` JSON
        records ``dion`` (format, world size, settings, ranks, counters) and ``dion_rank<R>``
        (this rank's ``comm_stats``)."""
        return _pack(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what this rank saved. Everything is checked before anything changes: another
        rank or world size, other settings, another model, wrong shapes and non-finite buffers
        raise ``ValueError`` saying what differs."""
        _load(self, state_dict)


# ---------------------------------------------------------------------------- bucketed means


def _rank_of(p: torch.Tensor, rank: int | None, fraction: float) -> int:
    """Dion's rank of ``p`` (``rank``, or ``fraction`` of its smaller side), or 0 where ``p``
    is no matrix (AdamW)."""
    if p.dim() < 2:
        return 0
    m, n = p.shape[0], p.numel() // p.shape[0] if p.shape[0] else 0
    if m < 2 or n < 2:
        return 0
    if rank is not None:
        return min(rank, m, n)
    # a hair below the product, so that 0.1 * 30 (3.0000000000000004) is 3
    return max(1, min(math.ceil(fraction * min(m, n) - 1e-9), m, n))


def _buckets(sizes: list[int], cap: int) -> list[list[int]]:
    """Consecutive positions packed into buckets of at most ``bucket_cap_mb`` of fp32 (a
    larger tensor alone; ``cap`` in bytes); empty tensors travel in no bucket."""
    out: list[list[int]] = []
    used = cap
    for i, numel in enumerate(sizes):
        if numel == 0:
            continue
        if used + 4 * numel > cap or not out:
            out.append([])
            used = 0
        out[-1].append(i)
        used += 4 * numel
    return out


def _launch(
    exchange: Exchange, tensors: list[torch.Tensor], cap: int, what: str
) -> list[tuple[list[int], Any]]:
    """Start one all-reduce (mean, fp32) per bucket of at most ``cap`` bytes of ``tensors``."""
    launched = []
    for members in _buckets([t.numel() for t in tensors], cap):
        flat = torch.cat([tensors[i].reshape(-1).float() for i in members])
        launched.append((members, exchange.comm.all_reduce_mean(flat, what)))
    return launched


def _finish(
    exchange: Exchange, launched: list[tuple[list[int], Any]], like: Sequence[Any], label: str
) -> list[torch.Tensor]:
    """Wait for :func:`_launch`'s buckets; each tensor's mean (fp32, checked), shaped like ``like``."""
    out = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in like]
    for b, (members, pending) in enumerate(launched):
        mean = exchange.dense(pending, f"{label} bucket {b}")
        for i, part in zip(members, split_like(mean, [like[i] for i in members]), strict=True):
            out[i] = part.view(like[i].shape)
    return out


# ---------------------------------------------------------------------------- state loading


def _pack(opt: Dion) -> dict[str, Any]:
    """The state dict of :meth:`Dion.state_dict`."""
    rank = opt.exchange.global_rank()
    state: dict[int, dict[str, Any]] = {}
    for n, p in enumerate(opt._model_params):
        s = opt.state[p]
        if opt._ranks[n]:
            state[n] = {f"momentum_buffer_rank{rank}": s["momentum_buffer"].clone(), "Q": s["Q"].clone()}
        else:
            state[n] = {k: s[k].clone() for k in _ADAMW_KEYS}
    groups = indexed_groups(opt.param_groups)
    _RECORDS.write(groups, opt, _saved_settings(opt), ranks=list(opt._ranks), counters=opt._counters())
    return {"state": state, "param_groups": groups}


def _saved_settings(opt: Dion) -> dict[str, Any]:
    """``opt``'s settings as its records keep them (through JSON)."""
    return json.loads(json.dumps(opt._settings()))


def _load(opt: Dion, sd: object) -> None:
    """Check ``sd`` against ``opt``, then load it (see :meth:`Dion.load_state_dict`)."""
    rank = opt.exchange.global_rank()
    rec = _RECORDS.read(sd, opt, _saved_settings(opt))
    common, mine, hyper = rec.common, rec.mine, rec.hyper
    if common.get("ranks") != opt._ranks:
        raise ValueError(
            f"{_LOAD}: the saved per-parameter ranks are {common.get('ranks')!r}, this optimizer's "
            f"{opt._ranks!r}: build the same model"
        )
    for h in hyper:
        if isinstance(h.get("adamw_betas"), list):
            h["adamw_betas"] = tuple(h["adamw_betas"])
    check_saved_groups(_LOAD, hyper, _GROUP_KEYS, _check_group)
    loaded: list[dict[str, torch.Tensor]] = []
    for n, (p, key_n) in enumerate(zip(opt._model_params, rec.keys, strict=True)):
        entry = rec.state.get(key_n)
        if not isinstance(entry, Mapping):
            raise lacks(_LOAD, f"the entry of {opt._name(n)}")
        r = opt._ranks[n]
        if r:
            cols = p.numel() // p.shape[0]
            want = {f"momentum_buffer_rank{rank}": ("momentum_buffer", tuple(p.shape)), "Q": ("Q", (cols, r))}
        else:
            want = {
                "step": ("step", ()),
                "exp_avg": ("exp_avg", tuple(p.shape)),
                "exp_avg_sq": ("exp_avg_sq", tuple(p.shape)),
            }
        ours: dict[str, torch.Tensor] = {}
        for key, (name, shape) in want.items():
            value = check_tensor(_LOAD, f"{key} of {opt._name(n)}", entry.get(key), shape)
            device = torch.device("cpu") if name == "step" else p.device
            ours[name] = value.detach().to(device, torch.float32).clone()
        loaded.append(ours)
    counters = common.get("counters") or {}
    check_counts(_LOAD, counters, ("steps", "skipped_steps"), default=None)
    stats = load_comm_stats(_LOAD, mine.get("comm_stats", {}))
    # everything checked: load
    for g, h in zip(opt.param_groups, hyper, strict=True):
        g.update(h)
    for p, ours in zip(opt._model_params, loaded, strict=True):
        opt.state[p] = ours
    opt._steps, opt.skipped_steps = counters["steps"], counters["skipped_steps"]
    opt._checked = False  # the first step after a load compares the replicas again
    opt.comm_stats = stats


# ---------------------------------------------------------------------------- helpers


def _check_group(group: Mapping[str, Any], index: int | None = None) -> None:
    """Raise naming the value unless ``group``'s hyper-parameters are valid."""
    where = _WHERE if index is None else f"{_WHERE} param group {index}"
    check_number("lr", group["lr"], 0.0, low_open=True, where=where)
    check_number("mu", group["mu"], 0.0, 1.0, high_open=True, where=where)
    check_adamw_settings(group, where)
