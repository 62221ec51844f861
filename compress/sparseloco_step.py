"""SparseLoCo's sync as functions over tensors and an exchange, as ``dion_step`` is to Dion.

:func:`launch_means` makes each compressed tensor's next error buffer (``e = error_decay *
e + delta``, in a second buffer: the live one is kept until the sync succeeds, and
:class:`SpareErrors` swaps the two then, so that a sync allocates no error buffer); :func:`launch_bucket`
picks the top-k per tile of ``e`` (raw or in the DCT domain; what the codec sends leaves
``e``) and starts its collectives; it returns the bucket's *receive*, which waits for every
rank's bytes and checks them, and which returns its *decode*: the mean over the ranks of what
they sent, per tensor (:data:`Mean`). Launching every bucket before the first
receive lets encoding bucket i+1 overlap bucket i's transfer; decoding after every receive
means nothing changes unless every rank's bytes are good.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from cokit.compress.adaptive_topk import average_shares, captured_share
from cokit.compress.buckets import Bucket
from cokit.compress.demo_step import split_like
from cokit.compress.exchange import Exchange
from cokit.triton_kernels import tiling
from cokit.triton_kernels.dct import dct_decode_multi, dct_encode_multi
from cokit.triton_kernels.topk import chunk_topk

__all__ = [
    "SYNC_UNCHANGED",
    "Mean",
    "Receive",
    "Received",
    "SpareErrors",
    "average_gradients",
    "from_coeffs",
    "launch_bucket",
    "launch_means",
    "mean_at_positions",
    "outer_step",
]

#: what a sync that stopped at a peer's bad data had changed (the error buffers it updated were
#: spare ones, the outer step comes after every check)
SYNC_UNCHANGED = (
    "the sync was not applied: theta_global, the outer momentum and the error buffers are as they "
    "were, every rank keeps its local weights (this step's inner step included) and a later "
    "step() syncs again"
)
#: a bucket's mean pseudo-gradient of one tensor: ``(mean, None)``, or ``(values, positions)``:
#: its values at those flat positions (row-major; repeats hold equal values), zero elsewhere
Mean = tuple[torch.Tensor, "torch.Tensor | None"]
#: a launched bucket's receive (wait and check), which returns its decode
Receive = Callable[[], Callable[[], list[Mean]]]
#: a sync's result: each tensor's mean (:data:`Mean`; None: empty), each compressed tensor's next
#: error buffer (None: dense), and with ``adaptive_topk`` the agreed captured-energy shares
Received = tuple[list["Mean | None"], list["torch.Tensor | None"], "dict[int, float] | None"]


def launch_means(
    buckets: list[Bucket],
    deltas: list[torch.Tensor],
    errors: list[torch.Tensor | None],
    exchange: Exchange,
    *,
    dct: bool,
    error_decay: float,
    names: list[str],
    at_positions: list[bool],
    adaptive: bool = False,
    changed: str = SYNC_UNCHANGED,
    spares: list[torch.Tensor | None] | None = None,
) -> tuple[list[torch.Tensor | None], Callable[[], Received]]:
    """One sync's exchange in two halves: encode every bucket and launch all collectives now;
    returns the next error buffers and the *finish*, which waits for every rank's bytes, checks
    them (a fault's error says ``changed``) and decodes each bucket into the mean pseudo-gradient
    of its tensors (:data:`Mean`; None: empty tensors): :data:`Received`. The blocking sync
    calls the finish at once; the overlapped one runs the next inner steps in between
    (``deltas`` are dead by then). ``errors`` are left as they are: each compressed tensor's next
    error buffer (``error_decay * e + delta``, less what was sent; ``e`` None: zeros) comes back
    (None for the dense ones), so a sync that raises changes no buffer. ``at_positions[i]``:
    tensor ``i``'s mean is needed only where some rank sent a value (the average outer step).
    With ``adaptive`` also every compressed tensor's captured-energy share, agreed over the
    ranks (checked, averaged in rank order; tensor index -> share), else None. ``spares[i]``: a
    buffer like ``errors[i]`` (:meth:`SpareErrors.take`) that tensor ``i``'s next error buffer
    is written into instead of a new one."""
    means: list[Mean | None] = [None] * len(deltas)
    compressed = {i for bucket in buckets if not bucket.dense for i in bucket.members}
    spare = spares or [None] * len(deltas)
    fresh = [
        _next_error(errors[i], d, error_decay, spare[i]) if i in compressed else None
        for i, d in enumerate(deltas)
    ]
    captured: dict[int, torch.Tensor] | None = {} if adaptive else None
    launched = []
    for b, bucket in enumerate(buckets):
        members = bucket.members
        launched.append(
            launch_bucket(
                b,
                bucket,
                deltas,
                [] if bucket.dense else [e for i in members if (e := fresh[i]) is not None],
                exchange,
                dct=dct,
                names=[names[i] for i in members],
                at_positions=all(at_positions[i] for i in members),
                captured=captured,
                changed=changed,
            )
        )
    pending, order = None, sorted(captured or ())
    if order:  # adaptive_topk: every rank's captured-energy shares, one fp32 each
        assert captured is not None
        vector = torch.stack([captured[i] for i in order]).float().to(deltas[0].device)
        pending = exchange.comm.all_gather(vector, "captured-energy all-gather")

    def finish() -> Received:
        received = [receive() for receive in launched]
        shares = None
        if pending is not None:  # checked before any bucket is decoded
            agreed = average_shares(exchange.wait(pending), exchange.owner, exchange.comm.global_rank)
            shares = dict(zip(order, agreed, strict=True))
        for bucket, decode in zip(buckets, received, strict=True):
            for i, mean in zip(bucket.members, decode(), strict=True):
                means[i] = mean
        return means, fresh, shares

    return fresh, finish


def _next_error(
    e: torch.Tensor | None, delta: torch.Tensor, decay: float, out: torch.Tensor | None
) -> torch.Tensor:
    """``decay * e + delta`` (``e`` None: zeros) in ``out`` when given, else in a new tensor."""
    if e is None:
        return torch.zeros_like(delta).add_(delta)
    return (e.mul(decay) if out is None else torch.mul(e, decay, out=out)).add_(delta)


class SpareErrors:
    """The second set of error buffers: a sync writes the next buffers into these
    (:meth:`take`), and :meth:`swap_in` makes them live only once every rank's bytes are in and
    checked, keeping the buffers they replace as the next sync's spares. A sync that raises
    leaves the live buffers as they were, and a sync allocates no error buffer. The spares are
    scratch: never in the optimizer's state or its checkpoints."""

    def __init__(self) -> None:
        self._held: dict[int, torch.Tensor] = {}  # by tensor index

    def take(self, errors: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """A spare for each live error buffer in ``errors`` (None where there is none yet, or
        where the held one no longer matches its shape, dtype, device or strides)."""
        out: list[torch.Tensor | None] = []
        for i, e in enumerate(errors):
            s = self._held.get(i)
            fits = (
                e is not None
                and s is not None
                and s is not e
                and (s.shape, s.dtype, s.device, s.stride()) == (e.shape, e.dtype, e.device, e.stride())
            )
            out.append(s if fits else None)
        return out

    def swap_in(self, states: list[dict[str, Any]], fresh: list[torch.Tensor | None]) -> None:
        """After a checked sync: ``fresh[i]`` becomes tensor ``i``'s error buffer (None: it has
        none, e.g. a dense tensor) and the buffer it replaces becomes a spare."""
        for i, (s, e) in enumerate(zip(states, fresh, strict=True)):
            if e is None:
                continue
            old = s.get("error")
            s["error"] = e
            if old is not None and old is not e:
                self._held[i] = old
            else:
                self._held.pop(i, None)


def launch_bucket(
    b: int,
    bucket: Bucket,
    deltas: list[torch.Tensor],
    errors: list[torch.Tensor],
    exchange: Exchange,
    *,
    dct: bool,
    names: list[str],
    at_positions: bool,
    captured: dict[int, torch.Tensor] | None = None,
    changed: str = SYNC_UNCHANGED,
) -> Receive:
    """Start bucket ``b``'s collectives; returns its receive (wait and check), which returns
    its decode. ``errors``: the compressed members' error buffers, the pseudo-gradient already
    added; what is sent leaves them. ``captured`` (``adaptive_topk``) receives, per compressed
    tensor, the share of its error buffer's energy that its selection captured (a 0-d float64
    tensor)."""
    members = bucket.members
    label = f"bucket {b}"
    if bucket.dense:
        flat = torch.cat([deltas[i].reshape(-1) for i in members])
        pending = exchange.comm.all_reduce_mean(flat, "pseudo-gradient all-reduce")

        def receive_dense() -> Callable[[], list[Mean]]:
            mean = exchange.dense(pending, f"{label} (dense)", changed)
            return lambda: [(m, None) for m in split_like(mean, [deltas[i] for i in members])]

        return receive_dense

    codec, k = bucket.codec, bucket.topk
    assert codec is not None and k is not None and bucket.plan is not None
    plan = bucket.plan
    tilings = plan.tilings
    # in place: the tile matrices of contiguous error buffers go into the pseudo-gradients'
    # buffers (dead once added to the error buffers)
    in_place = not dct and all(e.is_contiguous() for e in errors)
    if dct:
        coeffs = dct_encode_multi(errors, plan.chunk)
    elif in_place:
        coeffs = [
            tiling.tiles_into(deltas[i], e, t) for i, e, t in zip(members, errors, tilings, strict=True)
        ]
    else:
        coeffs = [tiling.to_tiles(e, t) for e, t in zip(errors, tilings, strict=True)]
    picks = [chunk_topk(c, k) for c in coeffs]
    if captured is not None:  # before the coefficient matrices are reused below
        for i, c, (_, v) in zip(members, coeffs, picks, strict=True):
            captured[i] = captured_share(c, v)
    idx = torch.cat([ix.reshape(-1).to(plan.index_dtype) for ix, _ in picks])
    vals = torch.cat([v.reshape(-1) for _, v in picks]).to(codec.encode_dtype)
    wires = codec.to_wire(idx, vals)
    pendings = exchange.gather(codec, wires)
    # what the other ranks will decode from this rank leaves the error buffer
    _, sent = codec.from_wire([w.reshape(1, -1) for w in wires])
    spans = [t.n_tiles * t.k_eff(k) for t in tilings]
    if in_place:
        # ``e -= sparse(sent)`` at the picked positions only: everywhere else it subtracts
        # zero, which leaves every value (and the sign of a zero) as it was
        for e, (ix, _), part, t in zip(errors, picks, sent[0].split(spans), tilings, strict=True):
            flat, pos = e.view(-1), tiling.flat_positions(ix, t)
            flat.index_put_((pos,), flat[pos] - part.view(ix.shape).float().view(-1))
        sparse = coeffs  # dead once picked: the decode's sums
    else:
        # the coefficient matrices are dead once picked: they hold the sparse matrices (a
        # fresh buffer only where a tile matrix is a view of its error buffer)
        sparse = [
            (torch.zeros_like(c) if aliases(c, e) else c.zero_()).scatter_(
                1, ix.long(), part.view(ix.shape).float()
            )
            for c, e, (ix, _), part in zip(coeffs, errors, picks, sent[0].split(spans), strict=True)
        ]
        for e, s in zip(errors, from_coeffs(sparse, errors, plan, dct=dct), strict=True):
            e.sub_(s)
    # the "average" outer step needs the mean only where some rank sent a value
    at_positions = in_place and at_positions

    def receive() -> Callable[[], list[Mean]]:
        indices, values = exchange.selection(codec, pendings, label, names, changed)

        def decode() -> list[Mean]:
            world = indices.shape[0]
            if at_positions:
                return [
                    mean_at_positions(s, ix, v, t, world)
                    for s, ix, v, t in zip(
                        sparse, indices.split(spans, 1), values.split(spans, 1), tilings, strict=True
                    )
                ]
            sums = [s.zero_() for s in sparse]  # dead since the launch: reused
            for r in range(world):  # rank order, one add per position per rank: deterministic
                for s, ix_r, v_r, t in zip(
                    sums, indices[r].split(spans), values[r].split(spans), tilings, strict=True
                ):
                    s.scatter_add_(1, ix_r.long().view(t.n_tiles, -1), v_r.float().view(t.n_tiles, -1))
            if world > 1:  # x / 1 == x
                for s in sums:
                    s.div_(world)
            return [(m, None) for m in from_coeffs(sums, errors, plan, dct=dct)]

        return decode

    return receive


def from_coeffs(
    mats: list[torch.Tensor], like: list[torch.Tensor], plan: tiling.TilePlan, *, dct: bool
) -> list[torch.Tensor]:
    """Tile matrices (DCT coefficients when ``dct``) of ``plan``'s tensors -> tensors shaped like
    ``like``."""
    if dct:
        return dct_decode_multi(mats, [list(x.shape) for x in like], plan.chunk)
    return [tiling.from_tiles(m, t) for m, t in zip(mats, plan.tilings, strict=True)]


def mean_at_positions(
    s: torch.Tensor, ix: torch.Tensor, v: torch.Tensor, t: tiling.TensorTiling, world: int
) -> Mean:
    """Every rank's selection ``ix``, ``v`` ``(world, n_tiles * k)`` of one tensor -> the mean
    over ranks (zeros elsewhere) at the flat positions the ranks sent, with those positions.

    The values are the dense decode's: the tile matrix ``s`` (scratch) is zeroed where any
    rank sent, each rank's values are added in rank order (``scatter_add_``), then divided
    by ``world``; the rest of ``s`` is neither written nor read.
    """
    ix = ix.long().view(world, t.n_tiles, -1)
    slots = (ix + torch.arange(t.n_tiles, device=ix.device).unsqueeze(1) * t.tile_numel).view(-1)
    flat = s.view(-1)
    flat.index_fill_(0, slots, 0.0)
    for r in range(world):  # rank order, one add per position per rank: deterministic
        s.scatter_add_(1, ix[r], v[r].float().view(t.n_tiles, -1))
    mean = flat[slots]
    if world > 1:  # x / 1 == x
        mean.div_(world)
    return mean, tiling.flat_positions(ix, t)


def aliases(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def outer_step(
    states: list[dict[str, torch.Tensor]], means: list[Mean | None], *, nesterov: bool, lr: float, mu: float
) -> None:
    """The outer step on every parameter's ``theta_global`` (``state["global"]``, fp32, in
    place) from its mean pseudo-gradient: ``"average"`` (``g -= lr * mean``; only at the
    positions some rank sent when the mean comes with them: elsewhere ``g - lr * 0 == g``) or
    Nesterov (``m = mu * m + mean; g -= lr * (mean + mu * m)``, ``m`` in ``state["momentum"]``)."""
    for state, received in zip(states, means, strict=True):
        if received is None:
            continue
        g, (mean, positions) = state["global"], received
        if positions is not None:
            flat = g.view(-1)
            flat.index_put_((positions,), flat[positions].sub_(mean, alpha=lr))
        elif nesterov:
            if "momentum" not in state:
                state["momentum"] = torch.zeros_like(g)
            m = state["momentum"]
            m.mul_(mu).add_(mean)
            g.sub_(mean + mu * m, alpha=lr)
        else:
            g.sub_(mean, alpha=lr)


def average_gradients(
    buckets: list[Bucket], params: list[torch.Tensor], exchange: Exchange
) -> list[torch.Tensor]:
    """Every parameter's gradient averaged over the ranks (fp32; zeros stand in for a missing
    gradient), one all-reduce per dense bucket, all launched before the first wait and each
    result checked: the dense warm-up's step."""
    pending = [
        exchange.comm.all_reduce_mean(
            torch.cat([_grad32(params[i]).reshape(-1) for i in bucket.members]), "gradient all-reduce"
        )
        for bucket in buckets
    ]
    means: list[torch.Tensor | None] = [None] * len(params)
    for b, (bucket, pend) in enumerate(zip(buckets, pending, strict=True)):
        members = [params[i] for i in bucket.members]
        mean = exchange.dense(pend, f"bucket {b} (dense warm-up)")
        for i, m in zip(bucket.members, split_like(mean, members), strict=True):
            means[i] = m
    return [
        m if m is not None else torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        for p, m in zip(params, means, strict=True)
    ]


def _grad32(p: torch.Tensor) -> torch.Tensor:
    """``p``'s gradient in fp32 (zeros where it has none)."""
    if p.grad is None:
        return torch.zeros(p.shape, dtype=torch.float32, device=p.device)
    return p.grad.float()
