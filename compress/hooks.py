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
be smaller than a dense all-reduce (biases, norms) are all-reduced dense alongside; empty
tensors send nothing. ``warmup_steps`` dense iterations come first (like PowerSGD's
``start_powerSGD_iter``); the error buffers live in the state, one per compressed parameter
(keyed by the parameter, so they follow it when DDP rebuilds its buckets after its first
iteration).

Checkpoints (like PowerSGD's state): the state pickles, without its process group (the loaded
state uses the default group: set ``state.process_group = g`` if it ran on another), and
``state_dict()`` / ``load_state_dict()`` give a plain dict for ``torch.save``. Both name the
error buffers after the model's parameters, so attach the state to the DDP model::

    ddp_model.register_comm_hook(state.attach(ddp_model), dct_topk_hook)
    torch.save(state.state_dict(), f"hook.rank{rank}.pt")          # one file per rank
    # later, in a new process, on a new DDP model:
    state = DCTTopKState(topk=32, chunk=64, warmup_steps=10).attach(new_ddp)
    state.load_state_dict(torch.load(f"hook.rank{rank}.pt", weights_only=True))
    new_ddp.register_comm_hook(state, dct_topk_hook)

A resumed run computes bit-identical parameters to an uninterrupted one, whether the checkpoint
was taken before or after DDP rebuilt its buckets (:mod:`cokit.compress.hook_checkpoint`).

Non-finite gradients: each rank's "my bucket is not finite" flag travels in the bucket's
dense all-reduce (``world_size`` extra elements; a bucket without dense tensors gets an
all-reduce of just the flags), so every rank learns about every rank's bucket. Encoding
works on copies of the error buffers, committed only once every bucket of the iteration is
known finite on every rank (one extra copy of the buffers during backward, one tiny
device-to-host copy per iteration). Otherwise no buffer changes on any rank and the
bucket's gradient is NaN on every rank, as with plain DDP (GradScaler then skips the step on
every rank); ``nonfinite="error"`` also raises (DDP reports the ``FloatingPointError`` from
``backward()`` as a ``RuntimeError`` quoting it), ``"skip"`` counts it in ``skipped_steps``.
"""

# No `from __future__ import annotations`: DDP compares the hook's annotations to the real
# types. Forward references below are strings.

import dataclasses
import math
import threading
import weakref
from typing import Any

import torch
import torch.distributed as dist

from cokit.compress import hook_checkpoint
from cokit.compress.buckets import sends_dense
from cokit.compress.groups import check_process_group
from cokit.compress.guards import all_finite
from cokit.compress.payload import PayloadCodec, codec_names, get_codec
from cokit.compress.stats import CommStats, ring_allgather_bytes, ring_allreduce_bytes
from cokit.compress.timing import CollectiveTiming, StepTimer
from cokit.triton_kernels.dct import dct_decode_multi
from cokit.triton_kernels.error_feedback import ef_encode, payload_layout

__all__ = ["DCTTopKState", "dct_topk_hook"]


@dataclasses.dataclass
class DCTTopKState:
    """Settings and error-feedback buffers of :func:`dct_topk_hook`.

    ``comm_stats`` counts this rank's bytes per iteration (ring volumes, the non-finite flags
    included) and the dense all-reduce bytes of the same gradients, and times it
    (:mod:`cokit.compress.timing`): encode and decode of every bucket, each collective, and
    as exposed time the wait from the last bucket's launch (backward's end) to the last
    bucket's assembly, which DDP blocks on. It is recorded when an iteration's last bucket
    is assembled. ``nonfinite``: what a
    non-finite gradient on any rank does (module docstring): ``"error"`` raises on every rank,
    ``"skip"`` hands NaN gradients so that GradScaler skips the step; in both no error buffer
    changes. ``skipped_steps`` counts the iterations skipped so.

    Checkpoints (module docstring): :meth:`attach` names the error buffers after the model's
    parameters; then :meth:`state_dict` / :meth:`load_state_dict` and pickling keep settings,
    ``iteration``, ``skipped_steps``, ``comm_stats`` and the buffers of this rank.
    """

    process_group: Any = None
    topk: int = 32
    chunk: int = 64
    payload: str = "compact"
    value_dtype: torch.dtype = torch.bfloat16
    decay: float = 1.0
    warmup_steps: int = 0
    nonfinite: str = "error"
    iteration: int = 0
    skipped_steps: int = 0
    comm_stats: CommStats = dataclasses.field(default_factory=CommStats)
    # bucket index -> _BucketLayout; id(parameter) -> its fp32 error buffer, and the parameter
    _layouts: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)
    _errors: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)
    _params: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)
    # from attach(): id(parameter) -> (name, the parameter); from unpickling: a Restored
    _attached: "dict | None" = dataclasses.field(default=None, repr=False, compare=False)
    _restored: "hook_checkpoint.Restored | None" = dataclasses.field(default=None, repr=False, compare=False)
    _timer: StepTimer = dataclasses.field(default_factory=StepTimer, repr=False, compare=False)
    _round: "_Round | None" = dataclasses.field(default=None, repr=False, compare=False)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False, compare=False)

    def __post_init__(self):
        check_process_group("DCTTopKState", self.process_group)
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
        decay = self.decay
        if isinstance(decay, bool) or not (isinstance(decay, (int, float)) and 0.0 <= decay <= 1.0):
            raise ValueError(f"DCTTopKState: decay must be a number in [0, 1], got {decay!r}")
        for name in ("warmup_steps", "iteration"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"DCTTopKState: {name} must be an integer >= 0, got {v!r}")
        if self.nonfinite not in ("error", "skip"):
            raise ValueError(f"DCTTopKState: nonfinite must be 'error' or 'skip', got {self.nonfinite!r}")

    def _count(self, rnd: "_Round", sent: int, dense: int, last: bool, device) -> None:
        """Count a launched bucket's bytes; the iteration's last bucket ends backward."""
        with self._lock:
            rnd.sent += sent
            rnd.dense += dense
            if last:
                rnd.launch_end = self._timer.mark(device)
                self.iteration += 1

    def attach(self, model: torch.nn.Module) -> "DCTTopKState":
        """Name the error buffers after ``model``'s parameters (the DDP model, or its module:
        ``named_parameters()`` of the module either way) and return the state.

        Needed before :meth:`state_dict` or pickling once the state holds buffers, and before
        :meth:`load_state_dict` or training with an unpickled state: that is when the saved
        buffers find their parameters (whatever DDP bucket those are in). Raises, changing
        nothing, if the state's buffers do not fit the model or belong to another rank.
        """
        hook_checkpoint.attach(self, model)
        return self

    def state_dict(self) -> dict[str, Any]:
        """This rank's state as a plain dict (tensors, numbers, strings; ``torch.save``-able
        and readable with ``torch.load(weights_only=True)``): format, rank, world size,
        settings, ``iteration``, ``skipped_steps``, ``comm_stats`` totals and the error buffers
        by parameter name. The tensors are the state's own (the hook replaces, never writes
        into, a committed buffer). Call it between iterations."""
        return hook_checkpoint.state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (call :meth:`attach` first when it holds buffers).

        Everything is checked before anything changes: the rank and world size must be this
        process's, the settings that change what is computed (topk, chunk, payload,
        value_dtype, decay, warmup_steps) must match (``nonfinite`` stays this state's), and
        the buffers must be finite fp32 tensors of the parameters' shapes covering every
        compressed parameter (or none). Buffers are copied onto the parameters' devices.
        """
        hook_checkpoint.load_state_dict(self, state_dict)

    def __getstate__(self) -> dict[str, Any]:
        """Pickle without the process group, lock, timer or an iteration in flight (logged, as
        torch's ``PowerSGDState`` does); the buffers go by parameter name (needs :meth:`attach`)."""
        return hook_checkpoint.getstate(self)

    def __setstate__(self, saved: dict[str, Any]) -> None:
        """Unpickle onto the default process group (set ``state.process_group = g`` for another);
        call :meth:`attach` with the new DDP model before training."""
        hook_checkpoint.setstate(self, saved)

    def _check_restored(self) -> None:
        """An unpickled state's first bucket: it must be this rank's, and attached if it has buffers."""
        restored = self._restored
        assert restored is not None
        if restored.origin is not None:
            here = hook_checkpoint.rank_world(self, "dct_topk_hook")
            hook_checkpoint.check_origin("dct_topk_hook", restored.origin, here)
        if restored.buffers:
            raise RuntimeError(
                f"dct_topk_hook: this DCTTopKState was unpickled with the error buffers of "
                f"{len(restored.buffers)} parameters: call state.attach(ddp_model) before training "
                "so that they find their parameters"
            )
        self._restored = None

    def _layout(
        self, bucket: dist.GradBucket, grads: list[torch.Tensor], world: int, device
    ) -> "_BucketLayout":
        """The bucket's split and its parameters' error buffers, made on first use and again when
        DDP rebuilds its buckets (the buffers follow their parameters)."""
        params = bucket.parameters()
        ids = tuple(map(id, params))
        layout = self._layouts.get(bucket.index())
        if layout is None or layout.ids != ids:
            layout = _BucketLayout.build(self, params, [tuple(g.shape) for g in grads], world, device)
            self._layouts[bucket.index()] = layout
        return layout

    def _join_round(self, last: bool) -> "_Round":
        """The iteration this bucket belongs to (a new one after the previous last bucket)."""
        with self._lock:
            if self._round is None or self._round.closed:
                self._round = _Round()
            self._round.launched += 1
            self._round.closed = last
            return self._round

    def _bucket_done(self, rnd: "_Round", done: "_Done") -> None:
        """Record an assembled bucket; the iteration's last one commits or drops the copies."""
        with self._lock:
            rnd.done.append(done)
            complete = rnd.closed and len(rnd.done) == rnd.launched
        if not complete:
            return
        if rnd.launch_end is not None:
            self._timer.blocked(rnd.launch_end, self._timer.mark(done.flags.device))
        world = dist.get_world_size() if dist.is_initialized() else 1
        group = _world(self)
        self.comm_stats.record(rnd.sent, rnd.sent, rnd.dense, self._timer.take(), world, group)
        flags = torch.stack([d.flags for d in rnd.done]).cpu()  # one small copy per iteration
        bad = [(rnd.done[b].index, r) for b, r in flags.nonzero().tolist()]
        if not bad:
            for d in rnd.done:
                if d.layout is not None:
                    self._errors.update(zip(d.layout.keys, d.work))
            return
        if self.nonfinite == "skip":
            self.skipped_steps += 1
            return
        (index, rank), more = min(bad), f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise FloatingPointError(
            f"DCTTopKState: non-finite gradient in DDP bucket {index} on rank {rank}{more}; no error "
            "buffer changed and the gradients are NaN. Fix the loss scale / data, or pass "
            "nonfinite='skip' (with GradScaler) to skip such steps on every rank"
        )


@dataclasses.dataclass
class _Done:
    """An assembled bucket: its layout (None in warmup), the buffer copies it encoded into and
    its all-reduced per-rank non-finite flags."""

    index: int
    layout: "_BucketLayout | None"
    work: list
    flags: torch.Tensor


@dataclasses.dataclass
class _Round:
    """One DDP iteration's buckets, so far (guarded by ``DCTTopKState._lock``: callbacks run on
    the communication threads)."""

    launched: int = 0
    closed: bool = False  # its last bucket was launched
    done: list = dataclasses.field(default_factory=list)
    sent: int = 0  # bytes of its buckets, so far
    dense: int = 0  # what a dense all-reduce of them would send
    launch_end: Any = None  # a timing mark: its last bucket was launched (backward ended)


@dataclasses.dataclass
class _BucketLayout:
    """Which tensors of a DDP bucket go dense, and the codec and buffer keys of the others."""

    ids: tuple[int, ...]  # id() of the bucket's parameters: a rebuilt bucket has others
    shapes: list[tuple[int, ...]]
    dense_idx: list[int]
    sparse_idx: list[int]
    codec: PayloadCodec | None
    keys: list[int]  # the sparse tensors' keys in DCTTopKState._errors
    errors: dict  # DCTTopKState._errors (the same dict)

    @property
    def deltas(self) -> list[torch.Tensor]:
        """The sparse tensors' error buffers, in bucket order."""
        return [self.errors[k] for k in self.keys]

    @classmethod
    def build(
        cls,
        state: DCTTopKState,
        params: list[torch.Tensor],
        shapes: list[tuple[int, ...]],
        world: int,
        device,
    ) -> "_BucketLayout":
        codec_cls = get_codec(state.payload, owner="DCTTopKState")
        live = [i for i, s in enumerate(shapes) if math.prod(s) > 0]  # empty tensors send nothing
        dense_idx = [
            i
            for i in live
            if sends_dense(
                shapes[i],
                state.chunk,
                state.topk,
                codec_cls,
                state.value_dtype,
                world,
                dense_itemsize=params[i].element_size(),  # dense parts travel in the gradient dtype
            )
        ]
        sparse_idx = [i for i in live if i not in dense_idx]
        codec = None
        if sparse_idx:
            plan = payload_layout([shapes[i] for i in sparse_idx], state.chunk, state.topk)
            codec = codec_cls(plan, state.value_dtype)
        keys = [id(params[i]) for i in sparse_idx]
        for i, key in zip(sparse_idx, keys):
            ref = state._params.get(key)
            if ref is None or ref() is not params[i]:  # new (or an id reused after its parameter died)
                state._errors[key] = torch.zeros(shapes[i], dtype=torch.float32, device=device)
                state._params[key] = weakref.ref(params[i])
        return cls(tuple(map(id, params)), shapes, dense_idx, sparse_idx, codec, keys, state._errors)


def _world(state: DCTTopKState) -> int:
    return dist.get_world_size(state.process_group)


def dct_topk_hook(state: DCTTopKState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the average of every rank's DCT/top-k-compressed gradient (module doc)."""
    if state._restored is not None:
        state._check_restored()
    buffer = bucket.buffer()
    world = _world(state)
    dense_bytes = ring_allreduce_bytes(buffer.numel() * buffer.element_size(), world)
    rnd = state._join_round(bucket.is_last())
    # This rank's flag, without a host sync: every rank's arrives summed with the dense part.
    flags = torch.zeros(world, dtype=buffer.dtype, device=buffer.device)
    flags[dist.get_rank(state.process_group)] = ~all_finite(buffer)
    grads = bucket.gradients()
    warmup = state.iteration < state.warmup_steps
    layout = None if warmup else state._layout(bucket, grads, world, buffer.device)
    dense_idx = [] if layout is None else layout.dense_idx
    codec = None if layout is None else layout.codec
    dense_parts = [buffer] if layout is None else [grads[i].reshape(-1) for i in dense_idx]
    flat = torch.cat([*dense_parts, flags])
    timer, device = state._timer, buffer.device
    records = [_all_reduce_sum(state, flat)]

    work: list[torch.Tensor] = []
    if layout is not None and codec is not None:
        with timer.span("encode", device):
            work = [state._errors[k].clone() for k in layout.keys]  # committed once all is finite
            idx, vals = ef_encode(
                work,
                [grads[i] for i in layout.sparse_idx],
                beta=state.decay,
                lr=1.0,
                chunk=state.chunk,
                k=state.topk,
                value_dtype=codec.encode_dtype,
            )
            wires = codec.to_wire(idx, vals)
        records += [_all_gather(state, wire.reshape(-1), world) for wire in wires]
    state._count(rnd, sum(r.sent_bytes for r, _ in records), dense_bytes, bucket.is_last(), device)

    def assemble(fut: torch.futures.Future) -> torch.Tensor:
        if device.type == "cuda":  # the stream got here once they completed (CPU: callbacks)
            arrived = timer.mark(device)
            for record, _ in records:
                timer.completed_at(record, arrived)
        with timer.span("decode", device):
            results = [f.value() for f in fut.value()]
            reduced = results.pop(0)
            mean, summed_flags = reduced[:-world].div_(world), reduced[-world:]
            if layout is None:
                buffer.copy_(mean)
            else:
                for i, part in zip(dense_idx, mean.split([grads[i].numel() for i in dense_idx])):
                    grads[i].copy_(part.view(grads[i].shape))
                if codec is not None:
                    shapes = [layout.shapes[i] for i in layout.sparse_idx]
                    for i, d in zip(layout.sparse_idx, _average_decoded(codec, results, shapes, state.chunk)):
                        grads[i].copy_(d)
            buffer.masked_fill_(summed_flags.ne(0).any(), float("nan"))  # non-finite on every rank
        state._bucket_done(rnd, _Done(bucket.index(), layout, work, summed_flags.ne(0)))
        return buffer

    return torch.futures.collect_all([f for _, f in records]).then(assemble)


def _all_reduce_sum(
    state: DCTTopKState, tensor: torch.Tensor
) -> tuple[CollectiveTiming, torch.futures.Future]:
    """Start a sum all-reduce: its timing record and the future of the sum."""
    nbytes = ring_allreduce_bytes(tensor.numel() * tensor.element_size(), _world(state))
    start = state._timer.mark(tensor.device)
    work = dist.all_reduce(tensor, group=state.process_group, async_op=True)
    record = state._timer.launched("dense all-reduce", nbytes, nbytes, start)
    state._timer.watch(record, work)
    return record, work.get_future().then(lambda fut: fut.value()[0])


def _all_gather(
    state: DCTTopKState, tensor: torch.Tensor, world: int
) -> tuple[CollectiveTiming, torch.futures.Future]:
    """Start an all-gather: its timing record and the future of the ``(world, n)`` result."""
    gathered = tensor.new_empty(world * tensor.numel())
    nbytes = ring_allgather_bytes(tensor.numel() * tensor.element_size(), world)
    start = state._timer.mark(tensor.device)
    work = dist.all_gather_single(gathered, tensor, group=state.process_group, async_op=True)
    record = state._timer.launched("payload all-gather", nbytes, nbytes, start)
    state._timer.watch(record, work)
    return record, work.get_future().then(lambda _: gathered.view(world, -1))


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
