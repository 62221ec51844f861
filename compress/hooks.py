"""A DDP communication hook: DCT + top-k compressed gradients with error feedback.

    from cokit.compress.hooks import DCTTopKState, dct_topk_hook
    state = DCTTopKState(topk=32, chunk=64, warmup_steps=10)
    ddp_model.register_comm_hook(state, dct_topk_hook)

Per DDP bucket and rank: ``e = decay * e + grad``; the top-k DCT coefficients per tile of
``e`` are sent and subtracted from ``e``: one all-gather per wire tensor of the bucket's
payload codec (:mod:`cokit.compress.payload`: ``compact``, ``sign`` or any registered codec
that is ``bucketed``). Every rank then sums the gathered coefficients in rank order, divides
by the world size and inverse-transforms: the gradient DDP hands to the optimizer is the average of the
ranks' decompressed gradients, bit-identical on every rank. Tensors whose payload would not
be smaller than a dense all-reduce (biases, norms) are all-reduced dense alongside.
``warmup_steps`` dense iterations come first (like PowerSGD's ``start_powerSGD_iter``);
the error buffers live in the state, keyed by bucket, and are rebuilt when DDP rebuilds its
buckets (after its first iteration).
"""

# No `from __future__ import annotations`: DDP compares the hook's annotations to the real
# types. Forward references below are strings.

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from cokit.compress.buckets import sends_dense
from cokit.compress.payload import PayloadCodec, codec_names, get_codec
from cokit.compress.stats import CommStats, ring_allgather_bytes, ring_allreduce_bytes
from cokit.triton_kernels.dct import dct_decode_multi
from cokit.triton_kernels.error_feedback import ef_encode, payload_layout

__all__ = ["DCTTopKState", "dct_topk_hook"]


@dataclasses.dataclass
class DCTTopKState:
    """Settings and error-feedback buffers of :func:`dct_topk_hook`.

    ``comm_stats`` counts this rank's bytes per iteration (ring volumes) and the dense
    all-reduce bytes of the same gradients.
    """

    process_group: Any = None
    topk: int = 32
    chunk: int = 64
    payload: str = "compact"
    value_dtype: torch.dtype = torch.bfloat16
    decay: float = 1.0
    warmup_steps: int = 0
    iteration: int = 0
    comm_stats: CommStats = dataclasses.field(default_factory=CommStats)
    _layouts: dict = dataclasses.field(default_factory=dict, repr=False)  # bucket index -> _BucketLayout
    _sent: int = dataclasses.field(default=0, repr=False)  # this iteration, so far
    _dense: int = dataclasses.field(default=0, repr=False)

    def __post_init__(self):
        for name in ("topk", "chunk"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"DCTTopKState: {name} must be a positive integer, got {v!r}")
        codec = get_codec(self.payload, owner="DCTTopKState")
        if not codec.bucketed:
            bucketed = tuple(n for n in codec_names() if get_codec(n).bucketed)
            raise ValueError(
                f"DCTTopKState: payload must be a bucketed codec, one of {bucketed}, got "
                f"{self.payload!r} (it sends one tensor per collective)"
            )
        if self.value_dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise TypeError(
                f"DCTTopKState: value_dtype must be float16, bfloat16 or float32, got {self.value_dtype}"
            )
        if not (isinstance(self.decay, (int, float)) and 0.0 <= self.decay <= 1.0):
            raise ValueError(f"DCTTopKState: decay must be in [0, 1], got {self.decay!r}")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"DCTTopKState: warmup_steps must be an integer >= 0, got {self.warmup_steps!r}")

    def _count(self, sent: int, dense: int, last: bool) -> None:
        self._sent += sent
        self._dense += dense
        if last:
            self.comm_stats.record(self._sent, self._sent, self._dense)
            self._sent = self._dense = 0
            self.iteration += 1

    def _layout(self, index: int, shapes: list[tuple[int, ...]], world: int, device) -> "_BucketLayout":
        """The bucket's split and error buffers, made on first use and again when DDP rebuilds
        its buckets (the error then restarts at zero)."""
        layout = self._layouts.get(index)
        if layout is None or layout.shapes != shapes:
            layout = _BucketLayout.build(self, shapes, world, device)
            self._layouts[index] = layout
        return layout


@dataclasses.dataclass
class _BucketLayout:
    """Which tensors of a DDP bucket go dense, and the codec and buffers of the others."""

    shapes: list[tuple[int, ...]]
    dense_idx: list[int]
    sparse_idx: list[int]
    codec: PayloadCodec | None
    deltas: list[torch.Tensor]

    @classmethod
    def build(cls, state: DCTTopKState, shapes: list[tuple[int, ...]], world: int, device) -> "_BucketLayout":
        codec_cls = get_codec(state.payload, owner="DCTTopKState")
        dense_idx = [
            i
            for i, s in enumerate(shapes)
            if sends_dense(s, state.chunk, state.topk, codec_cls, state.value_dtype, world)
        ]
        sparse_idx = [i for i in range(len(shapes)) if i not in dense_idx]
        codec = None
        if sparse_idx:
            plan = payload_layout([shapes[i] for i in sparse_idx], state.chunk, state.topk)
            codec = codec_cls(plan, state.value_dtype)
        deltas = [torch.zeros(shapes[i], dtype=torch.float32, device=device) for i in sparse_idx]
        return cls(shapes, dense_idx, sparse_idx, codec, deltas)


def _world(state: DCTTopKState) -> int:
    return dist.get_world_size(state.process_group)


def _dense_mean(state: DCTTopKState, tensor: torch.Tensor) -> torch.futures.Future:
    work = dist.all_reduce(tensor, group=state.process_group, async_op=True)
    world = _world(state)
    return work.get_future().then(lambda fut: fut.value()[0].div_(world))


def dct_topk_hook(state: DCTTopKState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the average of every rank's DCT/top-k-compressed gradient (module doc)."""
    buffer = bucket.buffer()
    world = _world(state)
    dense_bytes = ring_allreduce_bytes(buffer.numel() * buffer.element_size(), world)
    if state.iteration < state.warmup_steps:
        state._count(dense_bytes, dense_bytes, bucket.is_last())
        return _dense_mean(state, buffer)

    grads = bucket.gradients()
    layout = state._layout(bucket.index(), [tuple(g.shape) for g in grads], world, buffer.device)
    dense_idx, sparse_idx, codec = layout.dense_idx, layout.sparse_idx, layout.codec
    futures: list[torch.futures.Future] = []
    sent = 0

    if dense_idx:
        flat = torch.cat([grads[i].reshape(-1) for i in dense_idx])
        sent += ring_allreduce_bytes(flat.numel() * flat.element_size(), world)
        futures.append(_dense_mean(state, flat))

    if codec is not None:
        idx, vals = ef_encode(
            layout.deltas,
            [grads[i] for i in sparse_idx],
            beta=state.decay,
            lr=1.0,
            chunk=state.chunk,
            k=state.topk,
            value_dtype=codec.encode_dtype,
        )
        for wire in codec.to_wire(idx, vals):
            futures.append(_all_gather(state, wire.reshape(-1), world))
            sent += ring_allgather_bytes(wire.numel() * wire.element_size(), world)
    state._count(sent, dense_bytes, bucket.is_last())

    def assemble(fut: torch.futures.Future) -> torch.Tensor:
        results = [f.value() for f in fut.value()]
        if dense_idx:
            flat = results.pop(0)
            for i, part in zip(dense_idx, flat.split([grads[i].numel() for i in dense_idx])):
                grads[i].copy_(part.view(grads[i].shape))
        if codec is not None:
            decoded = _average_decoded(codec, results, [layout.shapes[i] for i in sparse_idx], state.chunk)
            for i, d in zip(sparse_idx, decoded):
                grads[i].copy_(d)
        return buffer

    return torch.futures.collect_all(futures).then(assemble)


def _all_gather(state: DCTTopKState, tensor: torch.Tensor, world: int) -> torch.futures.Future:
    gathered = tensor.new_empty(world * tensor.numel())
    work = dist.all_gather_single(gathered, tensor, group=state.process_group, async_op=True)
    return work.get_future().then(lambda _: gathered.view(world, -1))


def _average_decoded(
    codec: PayloadCodec, gathered: list[torch.Tensor], shapes: list[tuple[int, ...]], chunk: int
) -> list[torch.Tensor]:
    """Sum every rank's coefficients in rank order, divide by the world size, inverse DCT."""
    indices, values = codec.from_wire(gathered)
    world = indices.shape[0]
    plan = codec.plan
    coeffs = []
    for t, off in zip(plan.tilings, plan.payload_offsets):
        ke = t.k_eff(plan.k)
        span = slice(off, off + t.n_tiles * ke)
        dense = torch.zeros(t.n_tiles, t.tile_numel, dtype=torch.float32, device=values.device)
        for r in range(world):  # positions are unique within one rank's tile: deterministic
            dense.scatter_add_(
                1, indices[r, span].long().view(t.n_tiles, ke), values[r, span].float().view(t.n_tiles, ke)
            )
        coeffs.append(dense.div_(world))
    return dct_decode_multi(coeffs, shapes, chunk, torch.float32)
