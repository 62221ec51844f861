"""DeMo's step as functions over tensors (docs/design.md §1.1), as torch's ``adamw`` is to ``AdamW``.

:func:`demo_step` takes the buckets of one step, each as a :class:`BucketInput` (its
parameters, gradients, fp32 error buffers, per-parameter state and param group), and an
:class:`~cokit.compress.exchange.Exchange`. It runs in three phases so that nothing changes
unless every rank's bytes are good:

1. :func:`launch`: per bucket, the error-feedback encode (``delta = decay*delta + lr*grad``,
   top-k DCT selection, ``delta -= alpha*IDCT(selection)``) and its collectives, all launched
   before any is waited on, so that encoding bucket i+1 overlaps bucket i's transfer;
2. :func:`receive`: wait for each bucket and validate what every peer sent;
3. :func:`apply`: decode (mean over the ranks that sent each position, inverse DCT) and update
   ``p = p*(1 - lr*wd) - lr*rule(u)``, in the parameters' precision.

The exchange strategies (:mod:`cokit.compress.strategies`) call these phases in their own
order: flat and sharded steps through :func:`demo_step`, the hierarchical one on the buckets a
rank owns, the overlapped one from backward's hooks (launch) and from ``step()`` (the rest).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch

from cokit.compress import rules
from cokit.compress.buckets import Bucket
from cokit.compress.comm import Pending
from cokit.compress.dtensor import local
from cokit.compress.exchange import Exchange
from cokit.compress.precision import master_copy, write_update
from cokit.compress.timing import StepTimer
from cokit.triton_kernels.error_feedback import ef_decode, ef_encode

__all__ = [
    "STEP_UNCHANGED",
    "BucketInput",
    "Launched",
    "apply",
    "demo_step",
    "full_sync",
    "launch",
    "receive",
    "split_like",
]

#: what a step that stopped at a peer's bad data had changed: the encode runs before the
#: exchange, so the error-feedback buffers hold the step's gradient, less what was sent
STEP_UNCHANGED = (
    "no parameter changed; each rank's error-feedback buffers already took this step's gradient, "
    "less what it sent (that part of the update is lost), so training can go on"
)

GeneratorFor = Callable[[torch.device], torch.Generator]


@dataclasses.dataclass
class BucketInput:
    """One bucket of a step: its tensors (local shards for DTensor parameters) and hyper-parameters."""

    index: int  # the bucket's number in the step (named in errors)
    bucket: Bucket
    group: dict[str, Any]  # its param group: lr, weight_decay, compression_decay, alpha, rules
    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    deltas: list[torch.Tensor]  # fp32 error buffers, updated in place by the encode
    states: list[dict[str, Any]]  # per-parameter state (rule state, fp32 master)
    names: list[str]

    @property
    def label(self) -> str:
        n = len(self.params)
        return f"bucket {self.index} ({'dense' if self.bucket.dense else 'compressed'}, {n} tensor{'s' * (n != 1)})"


@dataclasses.dataclass
class Launched:
    """A bucket whose collectives are in flight; ``received`` is set by :func:`receive`."""

    input: BucketInput
    pending: list[Pending]
    timer: StepTimer
    received: tuple[torch.Tensor, ...] = ()


def demo_step(
    inputs: list[BucketInput],
    exchange: Exchange,
    *,
    precision: str = "nearest",
    generator: GeneratorFor | None = None,
) -> None:
    """One synchronized DeMo update of every bucket in ``inputs`` (module docstring)."""
    launched = [launch(i, exchange) for i in inputs]
    for item in launched:
        receive(item, exchange)
    for item in launched:
        apply(item, precision=precision, generator=generator)


def accumulate(inputs: list[BucketInput]) -> None:
    """A skipped sync: the gradients only enter the error buffers (``delta = decay*delta + lr*g``)."""
    for i in inputs:
        for d, g in zip(i.deltas, i.grads, strict=True):
            d.mul_(i.group["compression_decay"]).add_(g.float(), alpha=i.group["lr"])


def launch(i: BucketInput, exchange: Exchange) -> Launched:
    """Encode a bucket into its error buffers and start its collectives."""
    g = i.group
    lr, beta, alpha = g["lr"], g["compression_decay"], g["alpha"]
    timer, device = exchange.timer, i.params[0].device
    if i.bucket.dense:  # sent in the parameters' dtype, like a DDP of the same model
        wire = functools.reduce(torch.promote_types, (p.dtype for p in i.params))
        with timer.span("encode", device):
            parts = []
            for d, grad in zip(i.deltas, i.grads, strict=True):
                d.mul_(beta).add_(grad.float(), alpha=lr)
                parts.append(d.reshape(-1).clone())
                d.mul_(1.0 - alpha)
            send = torch.cat(parts).to(wire)
        return Launched(i, [exchange.comm.all_reduce_mean(send, "dense all-reduce")], timer)
    codec, k = i.bucket.codec, i.bucket.topk
    if codec is None or k is None:
        raise RuntimeError("DeMo: internal error: a compressed bucket has no payload codec or k")
    with timer.span("encode", device):
        idx, vals = ef_encode(
            i.deltas,
            i.grads,
            beta=beta,
            lr=lr,
            chunk=g["compression_chunk"],
            k=k,
            alpha=alpha,
            value_dtype=codec.encode_dtype,
        )
        wires = codec.to_wire(idx, vals)
    return Launched(i, exchange.gather(codec, wires), timer)


def receive(item: Launched, exchange: Exchange) -> None:
    """Wait for a bucket's collectives and check what every rank sent (nothing is applied)."""
    i = item.input
    if i.bucket.dense:
        item.received = (exchange.dense(item.pending[0], i.label, STEP_UNCHANGED),)
    else:
        assert i.bucket.codec is not None
        item.received = exchange.selection(i.bucket.codec, item.pending, i.label, i.names, STEP_UNCHANGED)


def apply(item: Launched, *, precision: str = "nearest", generator: GeneratorFor | None = None) -> None:
    """Decode a received bucket and update its parameters (timed as decode work)."""
    with item.timer.span("decode", item.input.params[0].device):
        _apply(item, precision, generator)


def _apply(item: Launched, precision: str, generator: GeneratorFor | None) -> None:
    i, g = item.input, item.input.group
    lr, wd = g["lr"], g["weight_decay"]
    fused = g["update_rule"] == "sign" and precision == "nearest"  # DeMo's fused decode
    if i.bucket.dense:
        mean = item.received[0]
        if fused:
            for p, update in zip(i.params, split_like(mean, i.params), strict=True):
                p.copy_(p.float() * (1.0 - lr * wd) - lr * update.sign())
        else:
            directions = [u.float() for u in split_like(mean, i.params)]
            apply_rule(i.params, i.states, directions, g, precision, generator)
        return
    indices, values = item.received
    chunk, k = g["compression_chunk"], i.bucket.topk
    if fused:
        ef_decode(
            i.params, indices, values, lr=lr, chunk=chunk, k=k, weight_decay=wd, use_sign=True, validate=False
        )
        return
    # the decoded direction: 0 - 1 * IDCT(mean) into zeroed fp32 scratch, then -1
    scratch = [torch.zeros(p.shape, dtype=torch.float32, device=p.device) for p in i.params]
    ef_decode(
        scratch, indices, values, lr=1.0, chunk=chunk, k=k, weight_decay=0.0, use_sign=False, validate=False
    )
    apply_rule(i.params, i.states, [s.neg_() for s in scratch], g, precision, generator)


def apply_rule(
    params: list[torch.Tensor],
    states: list[dict[str, Any]],
    directions: list[torch.Tensor],
    group: dict[str, Any],
    precision: str,
    generator: GeneratorFor | None,
) -> None:
    """``p = p * (1 - lr * wd) - lr * rule(u)`` for decoded directions ``u`` (fp32), computed
    from the fp32 master when there is one and written with ``precision``."""
    lr, wd = float(group["lr"]), float(group["weight_decay"])
    for p, state, u in zip(params, states, directions, strict=True):
        update = rules.apply_rule(u, state, group)
        master = None
        if precision == "master" and p.dtype != torch.float32:
            if "master" not in state:
                state["master"] = master_copy(p)
            master = state["master"]
        base = master if master is not None else p.float()
        new = base * (1.0 - lr * wd) - lr * update
        low = p.dtype != torch.float32
        gen = generator(p.device) if low and precision == "stochastic" and generator is not None else None
        write_update(p, new, precision, master=master, generator=gen)


def split_like(flat: torch.Tensor, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like each of ``params``, in order."""
    return [
        part.view(p.shape) for p, part in zip(params, flat.split([p.numel() for p in params]), strict=True)
    ]


def full_sync(params: list[torch.Tensor], exchange: Exchange) -> None:
    """Average parameters (local shards of DTensors) with a dense all-reduce, one per dtype
    (DeMo's ``full_sync_every``)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in map(local, params):
        by_dtype.setdefault(p.dtype, []).append(p)
    with exchange.guarded():
        pending: list[tuple[list[torch.Tensor], Pending]] = []
        for ps in by_dtype.values():
            flat = torch.cat([p.reshape(-1) for p in ps])
            pending.append((ps, exchange.comm.all_reduce_mean(flat, "full parameter sync")))
        for ps, pend in pending:
            for p, avg in zip(
                ps, split_like(exchange.dense(pend, "the full parameter sync"), ps), strict=True
            ):
                p.copy_(avg)
