"""A DDP communication hook: DCT + top-k compressed gradients with error feedback.

    from cokit.compress.hooks import DCTTopKState, dct_topk_hook
    state = DCTTopKState(topk=32, chunk=64, warmup_steps=10)  # timeout: 300 s per collective
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

The guarantees come from the exchange core (:mod:`cokit.compress.exchange`): every iteration
opens, in its first bucket, with the fixed-size status all-gather whose 64-bit fingerprint
covers the settings, the iteration and the payload format, waited before any payload is sent
(ranks with other settings raise the same error instead of pairing collectives of different
sizes); every collective carries ``timeout`` (default
:data:`~cokit.compress.comm.DEFAULT_TIMEOUT_S`, 300 s: a frozen peer makes ``backward()`` raise
:class:`~cokit.compress.comm.CollectiveTimeout` in minutes, not at the process group's own
30 min); every peer's payload is validated before it is decoded; and failed collectives are
kept alive until exit.

A failed hook stops its DDP model: when the hook raises while DDP runs it (the DDP reducer is
then left mid-iteration) or a collective of its fails (the process group is then unusable),
the state records it, and the model's next forward, or the hook's next call, raises
:class:`CommHookFailed` naming the first failure and what to do, instead of the error torch's
reducer would give (an internal assert). A non-finite gradient under ``nonfinite="error"``
is no such failure: every bucket completes, and training can go on.

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
known finite on every rank. Otherwise no buffer changes on any rank and the bucket's gradient
is NaN on every rank, as with plain DDP (GradScaler then skips the step on every rank);
``nonfinite="error"`` also raises (DDP reports the ``FloatingPointError`` from
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
from torch.nn.parallel import DistributedDataParallel

from cokit.compress import hook_checkpoint
from cokit.compress.agreement import Report, canonical, fingerprint
from cokit.compress.buckets import sends_dense
from cokit.compress.comm import DEFAULT_TIMEOUT_S, Pending, parse_timeout
from cokit.compress.exchange import Exchange
from cokit.compress.frontend import check_nonfinite_mode, check_value_dtype, nonfinite_message
from cokit.compress.groups import check_process_group
from cokit.compress.guards import all_finite
from cokit.compress.payload import PayloadCodec, codec_names, get_codec, wire_sizes
from cokit.compress.priority import PriorityGroup, check_comm_priority, priority_group
from cokit.compress.stats import CommStats, ring_allreduce_bytes
from cokit.triton_kernels._checks import check_flag, check_int, check_number
from cokit.triton_kernels.dct import dct_decode_multi
from cokit.triton_kernels.error_feedback import ef_encode, payload_layout

__all__ = ["CommHookFailed", "DCTTopKState", "dct_topk_hook"]

# shapes whose payload layout goes into the fingerprint: a codec that lays out bytes differently
# (another cokit version on one rank) is caught before any payload is sent
_PROBE = [(64, 64), (96, 40), (130,)]


class CommHookFailed(RuntimeError):
    """A DDP model whose :func:`dct_topk_hook` failed was asked for another step (module
    docstring); the message names the first failure and what to do."""


@dataclasses.dataclass(frozen=True)
class _Failure:
    """The first failure of a state's hook: when, what, and whether its process group died."""

    iteration: int
    what: str  # "<exception type>: <first sentence of its message>"
    group_dead: bool

    def error(self) -> CommHookFailed:
        if self.group_dead:
            fate = "its process group is unusable"
            todo = (
                "Restart every rank from the last checkpoint (model, optimizer and "
                "DCTTopKState.state_dict()), e.g. under torchrun --max-restarts; a process that goes "
                "on must call torch.distributed.destroy_process_group() and build a new process "
                "group, DDP model and DCTTopKState"
            )
        else:
            fate = "DDP's reducer stopped mid-iteration"
            todo = (
                "Build a new DDP model on every rank (e.g. DDP(ddp_model.module): its parameters are "
                "those of the last completed step) with a new DCTTopKState loaded from the last "
                "checkpoint, or restart every rank from the last checkpoint"
            )
        return CommHookFailed(
            f"dct_topk_hook: this DDP model cannot take another step: its comm hook failed at "
            f"iteration {self.iteration} ({self.what}): {fate}. {todo}."
        )


def _first_sentence(exc: BaseException, limit: int = 400) -> str:
    """``"Type: first sentence"`` of an exception, at most ``limit`` characters of message."""
    text = str(exc).strip().split("\n", 1)[0].split(". ", 1)[0]
    return f"{type(exc).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"


_STOPPER: Any = None  # the handle of the global forward pre-hook below, once a hook failed
_STOPPER_LOCK = threading.Lock()


def _stop_failed_models(module: torch.nn.Module, args: Any) -> None:
    """A global forward pre-hook: a DDP model whose DCTTopKState recorded a failure raises
    :class:`CommHookFailed` before DDP's forward reaches its reducer (which would assert)."""
    if not isinstance(module, DistributedDataParallel):
        return
    for _, state in getattr(module, "_comm_hooks", ()):  # what register_comm_hook registered
        if isinstance(state, DCTTopKState) and state._failure is not None:
            raise state._failure.error()


def _install_stopper() -> None:
    """Install :func:`_stop_failed_models` once, at the first failure: the hook is not told its
    DDP model, and a DDP model lists its hooks' states. Every module call pays an
    ``isinstance`` from then on; none does before."""
    global _STOPPER
    with _STOPPER_LOCK:
        if _STOPPER is None:
            _STOPPER = torch.nn.modules.module.register_module_forward_pre_hook(_stop_failed_models)


@dataclasses.dataclass
class DCTTopKState:
    """Settings and error-feedback buffers of :func:`dct_topk_hook`.

    ``timeout``: seconds each collective may take (default
    :data:`~cokit.compress.comm.DEFAULT_TIMEOUT_S`, 300 s; None or inf: only the process
    group's own, gloo's 30 min by default); after a timeout ``backward()`` raises, the group is
    unusable and the DDP model's next step raises :class:`CommHookFailed`: restart every rank
    from its checkpoint. On NCCL only the status exchange (waited in the hook) ends at
    ``timeout``: the bucket's collectives, which DDP waits on as futures, do not carry it (NCCL's
    watchdog would end the process) and end at the process group's own. ``validate_payload``: check every peer's payload before decoding (default
    True). ``comm_stats`` counts this rank's bytes per iteration (ring volumes, the status row
    and non-finite flags included) and the dense all-reduce bytes of the same gradients, and
    times it (:mod:`cokit.compress.timing`): encode and decode of every bucket, each
    collective, and as exposed time the wait from the last bucket's launch (backward's end) to
    the last bucket's assembly, which DDP blocks on. It is recorded when an iteration's last
    bucket is assembled. ``nonfinite``: what a non-finite gradient on any rank does (module
    docstring): ``"error"`` raises on every rank, ``"skip"`` hands NaN gradients so that
    GradScaler skips the step; in both no error buffer changes. ``skipped_steps`` counts the
    iterations skipped so.

    ``comm_priority``: priority of the hook's collectives, ``"normal"`` (default), ``"high"`` or
    an integer stream priority (negative = high; :mod:`cokit.compress.priority`). On NCCL/RCCL a
    high priority makes one new process group over ``process_group``'s ranks, with
    high-priority streams, when the state is built (collective over the default group: every
    rank must build it with the same value); on gloo it has no effect.
    ``comm_priority_info`` says what it achieved. It is agreed every iteration, and is a
    runtime setting: not in :meth:`state_dict`, and an unpickled state has the normal one.
    ``comm_guard``: None, or a guard with ``violations(config=None, *, priority=...)`` (e.g.
    :class:`cokit.overlap.guard.StarvationGuard`): a ``comm_priority`` it refuses raises
    ``GuardViolation`` (a ``ValueError``) naming the limit, before the state is built.

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
    timeout: "float | None" = DEFAULT_TIMEOUT_S
    validate_payload: bool = True
    comm_priority: "str | int" = "normal"
    comm_guard: Any = dataclasses.field(default=None, repr=False, compare=False)
    # what comm_priority achieved (the group the exchange uses), made in __post_init__
    comm_priority_info: "PriorityGroup | None" = dataclasses.field(
        default=None, init=False, repr=False, compare=False
    )
    # bucket index -> _BucketLayout; id(parameter) -> its fp32 error buffer, and the parameter
    _layouts: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)
    _errors: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)
    _params: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)
    # from attach(): id(parameter) -> (name, the parameter); from unpickling: a Restored
    _attached: "dict | None" = dataclasses.field(default=None, repr=False, compare=False)
    _restored: "hook_checkpoint.Restored | None" = dataclasses.field(default=None, repr=False, compare=False)
    _exchange: "Exchange | None" = dataclasses.field(default=None, repr=False, compare=False)
    _round: "_Round | None" = dataclasses.field(default=None, repr=False, compare=False)
    _device: Any = dataclasses.field(default=None, repr=False, compare=False)  # of the last iteration
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False, compare=False)
    # the hook's first failure: the DDP model can take no more steps (module docstring)
    _failure: "_Failure | None" = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        where = "DCTTopKState"
        check_comm_priority(where, self.comm_priority, self.comm_guard)
        check_process_group(where, self.process_group)
        check_int("topk", self.topk, 1, where=where)
        check_int("chunk", self.chunk, 1, where=where)
        codec = get_codec(self.payload, owner=where)
        if not codec.bucketed:
            bucketed = tuple(n for n in codec_names() if get_codec(n).bucketed)
            raise ValueError(
                f"DCTTopKState: payload must be a bucketed codec, one of {bucketed}, got "
                f"{self.payload!r} (it sends one tensor per collective)"
            )
        check_value_dtype(where, self.value_dtype)
        check_number("decay", self.decay, 0.0, 1.0, where=where)
        check_int("warmup_steps", self.warmup_steps, 0, where=where)
        check_int("iteration", self.iteration, 0, where=where)
        check_nonfinite_mode(where, self.nonfinite)
        limit = parse_timeout(self.timeout, where)
        self.timeout = None if limit is None else limit.total_seconds()
        check_flag("validate_payload", self.validate_payload, where=where)
        self.comm_priority_info = priority_group(self.process_group, self.comm_priority, where=where)

    @property
    def exchange(self) -> Exchange:
        """The exchange core on this state's group (made at first use: the group may be set late,
        when only a normal or no-op priority can follow it)."""
        ex = self._exchange
        if ex is None or ex.priority is None or ex.priority.source is not self.process_group:
            prio = self.comm_priority_info
            if prio is None or prio.source is not self.process_group:
                prio = self.comm_priority_info = priority_group(
                    self.process_group, self.comm_priority, create=False, where="DCTTopKState"
                )
            ex = self._exchange = Exchange(
                "dct_topk_hook",
                self.process_group,
                self.timeout,
                validate=self.validate_payload,
                priority=prio,
            )
        return ex

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
        value_dtype, decay, warmup_steps) must match (``nonfinite``, ``timeout`` and
        ``validate_payload`` stay this state's), and the buffers must be finite fp32 tensors of
        the parameters' shapes covering every compressed parameter (or none). Buffers are
        copied onto the parameters' devices.
        """
        hook_checkpoint.load_state_dict(self, state_dict)

    def __getstate__(self) -> dict[str, Any]:
        """Pickle without the process group, lock, exchange or an iteration in flight (logged,
        as torch's ``PowerSGDState`` does); the buffers go by parameter name (needs :meth:`attach`)."""
        return hook_checkpoint.getstate(self)

    def __setstate__(self, saved: dict[str, Any]) -> None:
        """Unpickle onto the default process group (set ``state.process_group = g`` for another)
        at normal ``comm_priority`` (a runtime setting, like the group); call :meth:`attach`
        with the new DDP model before training."""
        self.comm_priority, self.comm_guard, self.comm_priority_info = "normal", None, None
        self._failure = None  # a failure stops the DDP model it happened on, not a new one
        hook_checkpoint.setstate(self, saved)

    def _failed(self, exc: BaseException) -> None:
        """Record the hook's first failure (any thread); the DDP model's next step raises."""
        group_dead = self._exchange is not None and self._exchange.comm.aborted
        with self._lock:
            if self._failure is None:
                self._failure = _Failure(self.iteration, _first_sentence(exc), group_dead)
        _install_stopper()

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

    def _describe(self, globally: bool = False) -> dict[str, Any]:
        """What the iteration's fingerprint covers (the mismatch report)."""
        settings = hook_checkpoint.settings(self)
        codec = get_codec(self.payload)
        probe = codec(payload_layout(_PROBE, self.chunk, self.topk), self.value_dtype)
        return {
            "settings": {k: v for k, v in settings.items() if k not in ("timeout",)},
            "derived": {"payload wire sizes": wire_sizes([probe])},
            "counters": {"iteration": self.iteration},
        }

    def _open(self) -> None:
        """The iteration's first collective: agree on settings, iteration and payload format
        before any bucket is sent (raises on every rank when they differ)."""
        fp = fingerprint(canonical(self._describe()))
        self.exchange.agree((fp, fp), Report(), self._describe, device=self._device)

    def _layout(
        self, bucket: dist.GradBucket, grads: list[torch.Tensor], world: int, device
    ) -> "_BucketLayout":
        """The bucket's split and its parameters' error buffers, made on first use and again when
        DDP rebuilds its buckets (the buffers follow their parameters)."""
        params = bucket.parameters()
        ids = tuple(map(id, params))
        layout = self._layouts.get(bucket.index())
        if layout is None or layout.ids != ids or layout.settings != (self.topk, self.chunk, self.payload):
            layout = _BucketLayout.build(self, params, [tuple(g.shape) for g in grads], world, device)
            self._layouts[bucket.index()] = layout
        return layout

    def _join_round(self, last: bool, device) -> "_Round":
        """The iteration this bucket belongs to (a new one, opened with the status row, after
        the previous last bucket)."""
        with self._lock:
            fresh = self._round is None or self._round.closed
            if fresh:
                self._round = _Round()
            rnd = self._round
            assert rnd is not None
            rnd.launched += 1
            rnd.closed = last
        if fresh:
            self._device = device
            self._open()
        return rnd

    def _launched(self, rnd: "_Round", last: bool, device) -> None:
        """A bucket's collectives are in flight; the iteration's last one ends backward."""
        if last:
            with self._lock:
                rnd.launch_end = self.exchange.timer.mark(device)
                self.iteration += 1

    def _bucket_done(self, rnd: "_Round", done: "_Done") -> None:
        """Record an assembled bucket; the iteration's last one commits or drops the copies."""
        with self._lock:
            rnd.done.append(done)
            rnd.dense += done.dense
            complete = rnd.closed and len(rnd.done) == rnd.launched
        if not complete:
            return
        timer = self.exchange.timer
        if rnd.launch_end is not None:
            timer.blocked(rnd.launch_end, timer.mark(done.flags.device))
        self.exchange.record(self.comm_stats, rnd.dense)
        flags = torch.stack([d.flags for d in rnd.done]).cpu()  # one small copy per iteration
        bad = [(rnd.done[b].index, r) for b, r in flags.nonzero().tolist()]
        if not bad:
            for d in rnd.done:
                if d.layout is not None:
                    self._errors.update(zip(d.layout.keys, d.work, strict=True))
            return
        if self.nonfinite == "skip":
            self.skipped_steps += 1
            return
        (index, rank), more = min(bad), f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise FloatingPointError(
            nonfinite_message(
                "DCTTopKState",
                f"DDP bucket {index} on rank {self.exchange.global_rank(rank)}{more} at iteration {self.iteration}",
                changed="no error buffer changed and the gradients are NaN (with a GradScaler, pass "
                "nonfinite='skip': the scaler then skips the step on every rank)",
            )
        )


@dataclasses.dataclass
class _Done:
    """An assembled bucket: its layout (None in warmup), the buffer copies it encoded into, its
    all-reduced per-rank non-finite flags and the dense bytes of its gradients."""

    index: int
    layout: "_BucketLayout | None"
    work: list
    flags: torch.Tensor
    dense: int


@dataclasses.dataclass
class _Round:
    """One DDP iteration's buckets, so far (guarded by ``DCTTopKState._lock``: callbacks run on
    the communication threads)."""

    launched: int = 0
    closed: bool = False  # its last bucket was launched
    done: list = dataclasses.field(default_factory=list)
    dense: int = 0  # what a dense all-reduce of its buckets would send
    launch_end: Any = None  # a timing mark: its last bucket was launched (backward ended)


@dataclasses.dataclass
class _BucketLayout:
    """Which tensors of a DDP bucket go dense, and the codec and buffer keys of the others."""

    ids: tuple[int, ...]  # id() of the bucket's parameters: a rebuilt bucket has others
    settings: tuple  # (topk, chunk, payload) it was built for
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
        for i, key in zip(sparse_idx, keys, strict=True):
            ref = state._params.get(key)
            if ref is None or ref() is not params[i]:  # new (or an id reused after its parameter died)
                state._errors[key] = torch.zeros(shapes[i], dtype=torch.float32, device=device)
                state._params[key] = weakref.ref(params[i])
        settings = (state.topk, state.chunk, state.payload)
        return cls(
            tuple(map(id, params)), settings, shapes, dense_idx, sparse_idx, codec, keys, state._errors
        )


def dct_topk_hook(state: DCTTopKState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the average of every rank's DCT/top-k-compressed gradient (module doc).

    Raises :class:`CommHookFailed` once an earlier call failed (module docstring)."""
    if state._failure is not None:
        raise state._failure.error()
    try:
        return _launch(state, bucket)
    except BaseException as exc:  # DDP's reducer is left mid-iteration: no later step can work
        state._failed(exc)
        raise


def _launch(state: DCTTopKState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The hook's work: encode the bucket, launch its collectives, and the future assembling it."""
    if state._restored is not None:
        state._check_restored()
    buffer = bucket.buffer()
    ex = state.exchange
    comm, world = ex.comm, ex.comm.world_size
    rnd = state._join_round(bucket.is_last(), buffer.device)
    # This rank's flag, without a host sync: every rank's arrives summed with the dense part.
    flags = torch.zeros(world, dtype=buffer.dtype, device=buffer.device)
    flags[comm.rank] = ~all_finite(buffer)
    grads = bucket.gradients()
    warmup = state.iteration < state.warmup_steps
    layout = None if warmup else state._layout(bucket, grads, world, buffer.device)
    dense_idx = [] if layout is None else layout.dense_idx
    codec = None if layout is None else layout.codec
    dense_parts = [buffer] if layout is None else [grads[i].reshape(-1) for i in dense_idx]
    timer, device = ex.timer, buffer.device
    pending: list[Pending] = [comm.all_reduce_sum(torch.cat([*dense_parts, flags]), "dense all-reduce")]
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
        pending += ex.gather(codec, wires)
    dense = ring_allreduce_bytes(buffer.numel() * buffer.element_size(), world)
    label = f"DDP bucket {bucket.index()}"
    state._launched(rnd, bucket.is_last(), device)

    def assemble(fut: torch.futures.Future) -> torch.Tensor:
        try:
            return assemble_bucket(fut)
        except Exception as exc:
            if ex.comm.aborted:  # a collective failed: the group is unusable
                state._failed(exc)
            raise

    def assemble_bucket(fut: torch.futures.Future) -> torch.Tensor:
        if device.type == "cuda":  # the stream got here once they completed (CPU: callbacks)
            arrived = timer.mark(device)
            for p in pending:
                if p._record is not None:
                    timer.completed_at(p._record, arrived)
        with timer.span("decode", device):
            results = [f.value() for f in fut.value()]
            reduced = results.pop(0)
            mean, summed_flags = reduced[:-world].div_(world), reduced[-world:]
            flagged = bool(summed_flags.ne(0).any())
            if not flagged:
                ex.check_dense(mean, f"{label} (dense part)")
            decoded = []
            if codec is not None and layout is not None:
                indices, values = (
                    ex.checked(codec, results, label) if not flagged else codec.from_wire(results)
                )
                shapes = [layout.shapes[i] for i in layout.sparse_idx]
                decoded = _average_decoded(codec, indices, values, shapes, state.chunk)
            if layout is None:
                buffer.copy_(mean)
            else:
                for i, part in zip(dense_idx, mean.split([grads[i].numel() for i in dense_idx]), strict=True):
                    grads[i].copy_(part.view(grads[i].shape))
                for i, d in zip(layout.sparse_idx, decoded, strict=True):
                    grads[i].copy_(d)
            buffer.masked_fill_(summed_flags.ne(0).any(), float("nan"))  # non-finite on every rank
        state._bucket_done(rnd, _Done(bucket.index(), layout, work, summed_flags.ne(0), dense))
        return buffer

    return torch.futures.collect_all([p.future() for p in pending]).then(assemble)


def _average_decoded(
    codec: PayloadCodec,
    indices: torch.Tensor,
    values: torch.Tensor,
    shapes: list[tuple[int, ...]],
    chunk: int,
) -> list[torch.Tensor]:
    """Sum every rank's coefficients in rank order, divide by the world size, inverse DCT."""
    world = indices.shape[0]
    plan = codec.plan
    coeffs = []
    for t, off in zip(plan.tilings, plan.payload_offsets, strict=True):
        ke = t.k_eff(plan.k)
        span = slice(off, off + t.n_tiles * ke)
        dense = torch.zeros(t.n_tiles, t.tile_numel, dtype=torch.float32, device=values.device)
        for r in range(world):  # positions are unique within one rank's tile: deterministic
            dense.scatter_add_(
                1, indices[r, span].long().view(t.n_tiles, ke), values[r, span].float().view(t.n_tiles, ke)
            )
        coeffs.append(dense.div_(world))
    return dct_decode_multi(coeffs, shapes, chunk, torch.float32)
