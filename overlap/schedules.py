"""Overlapped compute + communication schedules, each reproducing its non-overlapped result.

* :class:`GemmCollective` -- ``collective(A @ B)`` (tensor-parallel row-linear: each rank
  holds a K-slice, the partial products are summed): the rows are split into chunks and
  chunk i's all-reduce / reduce-scatter runs while chunk i+1's GEMM computes;
* :class:`AllGatherGemm` -- ``all_gather(shard) @ B`` (column-parallel with sequence
  parallelism: the rows of A are gathered; ``operand='a'``) or ``A @ all_gather(B columns)``
  (FSDP style: the weight is gathered; ``operand='b'``), chunked so that gathers run ahead
  of the GEMMs that consume them;
* :class:`Overlap` -- any ``compute()`` next to any ``communicate()`` (which returns a
  ``dist.Work``, a list of them, or None for stream-ordered work).

Every schedule is a :class:`~cokit.overlap.measure.Workload`: ``run_sequential()`` is the plain
version (one GEMM, one blocking collective), ``run_overlapped()`` the pipelined one, which
computes the same sum in the same precision. It is bitwise the same tensor when the arithmetic
is: on the Triton path with a fixed ``config`` and chunk boundaries on BLOCK_M multiples
(``operand='b'``: BLOCK_N), every output tile is computed by the same program on the same
inputs, and a 2-rank sum is one addition either way. Otherwise it agrees to fp32 rounding
(within ``gamma_{K+W} * sum |a| @ |b|`` of the exact value, K the reduction length, W the ranks
summed): CPU BLAS (the torch path) and config selection choose their blocking from the shape,
and a collective's summation order over 3+ ranks may depend on the buffer size.
:meth:`run` returns the output and, on request, the timings of :func:`cokit.overlap.measure.measure`.

Each takes a :class:`~cokit.triton_kernels.gemm_config.GemmConfig` (tiles, ``num_warps``,
``num_stages``, ``num_sms``, ``smem_bytes``: the occupancy shaping) and a stream priority.
Process-group collectives run on the backend's own streams: on NCCL/RCCL their priority is
the group's (:func:`cokit.overlap.streams.high_priority_group`; asking ``'high'`` of a normal
group warns); :class:`Overlap` runs ``communicate`` on a :class:`~cokit.overlap.streams.CommStream`
of the given priority. On CPU (gloo) streams are no-ops and collectives run asynchronously
on gloo's work threads while the GEMM runs on the calling thread.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from cokit.compress.stats import CommStats, ring_allgather_bytes, ring_allreduce_bytes
from cokit.compress.timing import CollectiveTiming, StepTimer
from cokit.triton_kernels._checks import check_int
from cokit.triton_kernels.backend import cached_device_limits, kernel_path
from cokit.triton_kernels.gemm import PRECISIONS, gemm
from cokit.triton_kernels.gemm_config import GemmConfig, dtype_name

from .guard import StarvationGuard
from .measure import NULL_PROBE, OverlapResult, Probe, measure
from .streams import CommGroup, CommStream, resolve_priority, wait_handle, warn_if_priority_ignored

__all__ = [
    "AllGatherGemm",
    "GemmCollective",
    "Overlap",
    "Scheduled",
    "all_gather_gemm",
    "gemm_all_reduce",
    "gemm_reduce_scatter",
    "split_sizes",
]

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")

# torch 2.13 names (the *_into_tensor / *_tensor spellings are deprecated there); older torch.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclasses.dataclass
class Scheduled:
    """What :meth:`run` returns: the output and, when asked for, the measured timings."""

    output: Any
    timings: OverlapResult | None = None


def split_sizes(n: int, chunks: int) -> list[tuple[int, int]]:
    """``chunks`` contiguous ``(start, stop)`` ranges covering ``range(n)``, sizes differing by
    at most one (the larger first)."""
    check_int("chunks", chunks)
    if chunks > n:
        raise ValueError(f"chunks={chunks} is more than the {n} rows/columns to split; allowed: 1 to {n}")
    base, extra = divmod(n, chunks)
    out, start = [], 0
    for i in range(chunks):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def _records_step(method: Callable[..., Any]) -> Callable[..., Any]:
    """A phase that communicates is one step of the schedule's ``comm_stats``: its
    collectives' bytes and timing (exposed = blocked in their waits)."""

    @functools.wraps(method)
    def run(self: _Schedule, *args: Any, **kwargs: Any) -> Any:
        self.timer.discard()
        out = method(self, *args, **kwargs)
        timing = self.timer.take()
        sent = sum(c.sent_bytes for c in timing.collectives)
        received = sum(c.received_bytes for c in timing.collectives)
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.comm_stats.record(sent, received, sent, timing, world, self.world_size)
        return out

    return run


class _TimedWork:
    """A launched communication whose ``wait()`` records how long the caller was blocked."""

    def __init__(self, handle: Any, record: CollectiveTiming, timer: StepTimer, device: torch.device):
        self.handle, self.record, self.timer, self.device = handle, record, timer, device

    def wait(self, after: Callable[[], None] | None = None) -> None:
        """Wait for the handle (then ``after``, e.g. joining the comm stream), timed."""
        start = self.timer.mark(self.device)
        wait_handle(self.handle)
        if after is not None:
            after()
        self.timer.waited(self.record, start, self.timer.mark(self.device))


def _config_backend(device: torch.device) -> str:
    path = kernel_path(device)
    return path if path in ("cuda", "hip") else "interpreter"


class _Schedule:
    """Shared plumbing: device, group, config/guard checks, run() and measure()."""

    emulated = False
    uses_group = True
    label = "schedule"
    comm_label = "collective"

    def _setup(
        self,
        device: torch.device,
        dtype: torch.dtype | None,
        config: GemmConfig | None,
        priority: str | int,
        group: Any,
        guard: StarvationGuard | None,
        needs_group: bool,
    ) -> None:
        self.device = device
        self.timer = StepTimer()
        #: bytes and timing of the last run (sequential, overlapped or communication alone)
        self.comm_stats = CommStats()
        self.priority = resolve_priority(priority, device)
        self.requested_priority = priority
        self.group = group.group if isinstance(group, CommGroup) else group
        if needs_group:
            if not dist.is_available() or not dist.is_initialized():
                raise RuntimeError(
                    f"{type(self).__name__} needs torch.distributed initialized (dist.init_process_group); "
                    "for one GPU use cokit.overlap.emulate.EmulatedComm with Overlap"
                )
            self.world_size = dist.get_world_size(self.group)
            self.rank = dist.get_rank(self.group)
            warn_if_priority_ignored(group, priority)
        else:
            self.world_size, self.rank = 1, 0
        backend = _config_backend(device)
        limits = cached_device_limits(device) if backend in ("cuda", "hip") else None
        if config is not None:
            if not isinstance(config, GemmConfig):
                raise TypeError(f"config must be a GemmConfig or None, got {type(config).__name__}")
            config.validate(backend, limits, dtype=dtype if backend == "interpreter" else None)
        self.config = config
        if guard is not None:
            guard.check(config, limits=limits, priority=priority, dtype=dtype)
        self.guard = guard
        self.info: dict[str, Any] = {
            "config": config.spec() if config is not None else "default",
            "priority": priority if isinstance(priority, str) else int(priority),
            "stream_priority": self.priority,
            "kernel_path": kernel_path(device),
        }

    def run(
        self, *, overlap: bool = True, measure: bool = False, repeats: int = 5, warmup: int = 1
    ) -> Scheduled:
        """The output (overlapped, or the plain version with ``overlap=False``), plus timings
        from :func:`cokit.overlap.measure.measure` when ``measure`` (collective: every rank calls)."""
        out = self.run_overlapped(NULL_PROBE) if overlap else self.run_sequential()
        timings = self.measure(repeats=repeats, warmup=warmup) if measure else None
        return Scheduled(out, timings)

    def measure(self, *, repeats: int = 5, warmup: int = 1, **kwargs: Any) -> OverlapResult:
        """Time this schedule (see :func:`cokit.overlap.measure.measure`)."""
        return measure(self, repeats=repeats, warmup=warmup, **kwargs)

    def _timed(self, what: str, nbytes: int, launch: Callable[[], Any]) -> _TimedWork:
        """Launch a communication (``launch()`` returns its handle), counting and timing it."""
        start = self.timer.mark(self.device)
        handle = launch()
        record = self.timer.launched(what, nbytes, nbytes, start)
        self.timer.watch(record, handle)
        return _TimedWork(handle, record, self.timer, self.device)

    # -- the four phases (defined by subclasses)
    def run_compute(self) -> Any:
        raise NotImplementedError

    def run_communicate(self) -> Any:
        raise NotImplementedError

    def run_sequential(self) -> Any:
        raise NotImplementedError

    def run_overlapped(self, probe: Probe = NULL_PROBE) -> Any:
        raise NotImplementedError


def _check_matrix(name: str, t: Any) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    if t.numel() == 0:
        raise ValueError(f"{name} is empty (shape {tuple(t.shape)})")
    dtype_name(t.dtype)  # raises for unsupported dtypes
    return t


def _check_pair(a: torch.Tensor, b: torch.Tensor, a_name: str, b_name: str) -> None:
    _check_matrix(a_name, a)
    _check_matrix(b_name, b)
    if a.dtype != b.dtype or a.device != b.device:
        raise ValueError(
            f"{a_name} and {b_name} must share dtype and device; got {a.dtype} on {a.device} and {b.dtype} on {b.device}"
        )


class GemmCollective(_Schedule):
    """``all_reduce(A @ B)`` or ``reduce_scatter(A @ B)`` (rows), chunked along the rows of A.

    ``a`` (M, K) and ``b`` (K, N) are this rank's operands (row-parallel linear: a K-slice
    each; the partial products are summed across ranks). ``all_reduce`` returns the (M, N)
    sum; ``reduce_scatter`` returns this rank's ``M / world_size`` rows of it, and needs M
    divisible by ``world_size * chunks`` (chunk i holds, for every rank, the i-th part of
    that rank's rows, so the result equals one reduce-scatter of the whole product).
    """

    def __init__(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        *,
        collective: str = "all_reduce",
        chunks: int = 2,
        config: GemmConfig | None = None,
        precision: str = "ieee",
        priority: str | int = "high",
        group: Any = None,
        guard: StarvationGuard | None = None,
    ) -> None:
        _check_pair(a, b, "a", "b")
        if a.shape[1] != b.shape[0]:
            raise ValueError(
                f"a is {tuple(a.shape)} and b is {tuple(b.shape)}: a.shape[1] must equal b.shape[0]"
            )
        if collective not in ("all_reduce", "reduce_scatter"):
            raise ValueError(f"collective={collective!r} is invalid; allowed: all_reduce, reduce_scatter")
        if precision not in PRECISIONS:
            raise ValueError(f"precision={precision!r} is invalid; allowed: {', '.join(PRECISIONS)}")
        self._setup(a.device, a.dtype, config, priority, group, guard, needs_group=True)
        self.a, self.b, self.collective, self.precision = a, b, collective, precision
        M, K = a.shape
        N = b.shape[1]
        W = self.world_size
        if collective == "reduce_scatter":
            check_int("chunks", chunks)
            if M % (W * chunks):
                raise ValueError(
                    f"reduce_scatter: M={M} rows must split into world_size={W} x chunks={chunks} equal parts; "
                    f"M % {W * chunks} = {M % (W * chunks)}"
                )
            m = M // (W * chunks)
            self.ranges = [(i * m, (i + 1) * m) for i in range(chunks)]  # rows of each rank's output
        else:
            self.ranges = split_sizes(M, chunks)
        self.chunks = chunks
        self.M, self.N, self.K = M, N, K
        self._inputs = (
            self._chunk_inputs()
        )  # A never changes: its chunked (reduce_scatter: permuted) rows, once
        self.label = f"gemm+{collective}"
        self.comm_label = f"{collective} ({W} ranks, {dist.get_backend(self.group)})"
        esz = a.element_size()
        self.info.update(
            schedule="gemm_collective",
            collective=collective,
            M=M,
            N=N,
            K=K,
            chunks=chunks,
            dtype=dtype_name(a.dtype),
            world_size=W,
            message_bytes=M * N * esz,
        )
        self._scratch: list[torch.Tensor] | None = None

    # ---------------------------------------------------------------- helpers
    def _gemm(self, a: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return gemm(a, self.b, config=self.config, precision=self.precision, out=out)

    def _chunk_inputs(self) -> list[torch.Tensor]:
        """The A rows of each chunk (reduce_scatter: every rank's i-th part, stacked)."""
        if self.collective == "all_reduce":
            return [self.a[s:e] for s, e in self.ranges]
        W, C = self.world_size, self.chunks
        m = self.M // (W * C)
        perm = self.a.reshape(W, C, m, self.K).transpose(0, 1).reshape(C, W * m, self.K)  # one copy
        return list(perm.unbind(0))

    def _launch(self, buf: torch.Tensor, out: torch.Tensor | None) -> _TimedWork:
        nbytes = buf.numel() * buf.element_size()
        if self.collective == "all_reduce":
            return self._timed(
                "all_reduce",
                ring_allreduce_bytes(nbytes, self.world_size),
                lambda: dist.all_reduce(buf, group=self.group, async_op=True),
            )
        return self._timed(
            "reduce_scatter",
            ring_allreduce_bytes(nbytes, self.world_size) // 2,  # half a ring all-reduce
            lambda: _reduce_scatter_single(out, buf, group=self.group, async_op=True),
        )

    def _out_rows(self) -> int:
        return self.M if self.collective == "all_reduce" else self.M // self.world_size

    # ---------------------------------------------------------------- phases
    @_records_step
    def run_sequential(self) -> torch.Tensor:
        """One GEMM, then one blocking collective: the reference result."""
        y = self._gemm(self.a)
        if self.collective == "all_reduce":
            self._launch(y, None).wait()
            return y
        out = torch.empty((self._out_rows(), self.N), dtype=y.dtype, device=y.device)
        self._launch(y, out).wait()
        return out

    @_records_step
    def run_overlapped(self, probe: Probe = NULL_PROBE) -> torch.Tensor:
        """GEMM chunk i, then its collective asynchronously while chunk i+1 computes."""
        works = []
        if self.collective == "all_reduce":
            y = torch.empty((self.M, self.N), dtype=self.a.dtype, device=self.device)
            for (s, e), a_i in zip(self.ranges, self._inputs, strict=True):
                with probe.span():
                    self._gemm(a_i, out=y[s:e])
                works.append(self._launch(y[s:e], None))
            wait_handle(works)
            return y
        out = torch.empty((self._out_rows(), self.N), dtype=self.a.dtype, device=self.device)
        partials = []
        for (s, e), a_i in zip(self.ranges, self._inputs, strict=True):
            with probe.span():
                y_i = self._gemm(a_i)
            partials.append(y_i)  # kept alive until its collective is waited
            works.append(self._launch(y_i, out[s:e]))
        wait_handle(works)
        return out

    def run_compute(self) -> list[torch.Tensor]:
        """The chunked GEMMs alone (what the overlapped run computes)."""
        return [self._gemm(a_i) for a_i in self._inputs]

    @_records_step
    def run_communicate(self) -> None:
        """The chunked collectives alone, on zero buffers of the chunk shapes."""
        if self._scratch is None:
            z = torch.zeros
            if self.collective == "all_reduce":
                self._scratch = [
                    z((e - s, self.N), dtype=self.a.dtype, device=self.device) for s, e in self.ranges
                ]
            else:
                W = self.world_size
                self._scratch = [
                    z(((e - s) * W, self.N), dtype=self.a.dtype, device=self.device) for s, e in self.ranges
                ]
                self._scratch_out = z((self._out_rows(), self.N), dtype=self.a.dtype, device=self.device)
        works = [
            self._launch(buf, None if self.collective == "all_reduce" else self._scratch_out[s:e])
            for buf, (s, e) in zip(self._scratch, self.ranges, strict=True)
        ]
        wait_handle(works)


class AllGatherGemm(_Schedule):
    """``all_gather`` of one GEMM operand, then the GEMM, chunked.

    ``operand='a'`` (column-parallel with sequence parallelism): ``shard`` is this rank's
    (m, K) rows of A, ``other`` is B (K, N); the result is the (world_size * m, N) product,
    rows in rank order. ``operand='b'`` (FSDP style): ``shard`` is this rank's (K, n)
    columns of B (e.g. a row-shard of a Linear weight, transposed), ``other`` is A (M, K);
    the result is (M, world_size * n), columns in rank order. The shard is split into
    ``chunks``; every chunk's gather is launched up front and chunk i's GEMM starts as soon
    as its gather is done, while the later gathers continue.
    """

    def __init__(
        self,
        shard: torch.Tensor,
        other: torch.Tensor,
        *,
        operand: str = "a",
        chunks: int = 2,
        config: GemmConfig | None = None,
        precision: str = "ieee",
        priority: str | int = "high",
        group: Any = None,
        guard: StarvationGuard | None = None,
    ) -> None:
        if operand not in ("a", "b"):
            raise ValueError(
                f"operand={operand!r} is invalid; allowed: 'a' (gather rows of A), 'b' (gather columns of B)"
            )
        _check_pair(shard, other, "shard", "other")
        if operand == "a" and shard.shape[1] != other.shape[0]:
            raise ValueError(
                f"shard is {tuple(shard.shape)} and other (B) is {tuple(other.shape)}: "
                "shard.shape[1] must equal other.shape[0]"
            )
        if operand == "b" and other.shape[1] != shard.shape[0]:
            raise ValueError(
                f"other (A) is {tuple(other.shape)} and shard is {tuple(shard.shape)}: "
                "other.shape[1] must equal shard.shape[0]"
            )
        if precision not in PRECISIONS:
            raise ValueError(f"precision={precision!r} is invalid; allowed: {', '.join(PRECISIONS)}")
        self._setup(shard.device, shard.dtype, config, priority, group, guard, needs_group=True)
        self.shard, self.other, self.operand, self.precision = shard, other, operand, precision
        self.chunks = chunks
        W = self.world_size
        if operand == "a":
            m, K = shard.shape
            self.ranges = split_sizes(m, chunks)
            self.out_shape = (W * m, other.shape[1])
            M, N = W * m, other.shape[1]
        else:
            K, n = shard.shape
            self.ranges = split_sizes(n, chunks)
            self.out_shape = (other.shape[0], W * n)
            M, N = other.shape[0], W * n
        self.M, self.N, self.K = M, N, K
        self.label = f"all_gather({operand})+gemm"
        self.comm_label = f"all_gather ({W} ranks, {dist.get_backend(self.group)})"
        self.info.update(
            schedule="all_gather_gemm",
            collective="all_gather",
            operand=operand,
            M=M,
            N=N,
            K=K,
            chunks=chunks,
            dtype=dtype_name(shard.dtype),
            world_size=W,
            message_bytes=shard.numel() * shard.element_size() * W,
        )
        self._scratch: list[torch.Tensor] | None = None

    # ---------------------------------------------------------------- helpers
    def _piece(self, s: int, e: int) -> torch.Tensor:
        """This rank's part of chunk (s, e), contiguous for the gather."""
        p = self.shard[s:e] if self.operand == "a" else self.shard[:, s:e]
        return p.contiguous()

    def _gather_buffer(self, s: int, e: int) -> torch.Tensor:
        W = self.world_size
        rows, cols = (W * (e - s), self.K) if self.operand == "a" else (W * self.K, e - s)
        return torch.empty((rows, cols), dtype=self.shard.dtype, device=self.device)

    def _launch(self, buf: torch.Tensor, piece: torch.Tensor) -> _TimedWork:
        nbytes = ring_allgather_bytes(piece.numel() * piece.element_size(), self.world_size)
        return self._timed(
            "all_gather", nbytes, lambda: _all_gather_single(buf, piece, group=self.group, async_op=True)
        )

    def _gemm_chunk(self, gathered: torch.Tensor, s: int, e: int, out: torch.Tensor) -> None:
        """The GEMM of one gathered chunk, written to its rows/columns of ``out``."""
        W, width = self.world_size, e - s
        if self.operand == "a":
            if self.chunks == 1:
                gemm(gathered, self.other, config=self.config, precision=self.precision, out=out)
                return
            y = gemm(gathered, self.other, config=self.config, precision=self.precision)
            m = self.M // W
            out.view(W, m, self.N)[:, s:e].copy_(y.view(W, width, self.N))
            return
        b = gathered.view(W, self.K, width).permute(1, 0, 2).reshape(self.K, W * width)
        n = self.N // W
        if self.chunks == 1:
            gemm(self.other, b, config=self.config, precision=self.precision, out=out)
            return
        y = gemm(self.other, b, config=self.config, precision=self.precision)
        out.view(self.M, W, n)[:, :, s:e].copy_(y.view(self.M, W, width))

    # ---------------------------------------------------------------- phases
    @_records_step
    def run_sequential(self) -> torch.Tensor:
        """One blocking all-gather of the whole shard, then one GEMM: the reference result."""
        full = self._gather_buffer(0, self.shard.shape[0] if self.operand == "a" else self.shard.shape[1])
        self._launch(full, self.shard.contiguous()).wait()
        if self.operand == "a":
            return gemm(full, self.other, config=self.config, precision=self.precision)
        W, n = self.world_size, self.N // self.world_size
        b = full.view(W, self.K, n).permute(1, 0, 2).reshape(self.K, W * n)
        return gemm(self.other, b, config=self.config, precision=self.precision)

    @_records_step
    def run_overlapped(self, probe: Probe = NULL_PROBE) -> torch.Tensor:
        """Launch every chunk's gather, then GEMM chunk i once gather i is done."""
        out = torch.empty(self.out_shape, dtype=self.shard.dtype, device=self.device)
        bufs, pieces, works = [], [], []
        for s, e in self.ranges:
            piece, buf = self._piece(s, e), self._gather_buffer(s, e)
            pieces.append(piece)  # kept alive until its gather is waited
            bufs.append(buf)
            works.append(self._launch(buf, piece))
        for (s, e), buf, work in zip(self.ranges, bufs, works, strict=True):
            work.wait()
            with probe.span():
                self._gemm_chunk(buf, s, e, out)
        return out

    def _ensure_scratch(self) -> list[torch.Tensor]:
        if self._scratch is None:
            self._scratch = [self._gather_buffer(s, e).zero_() for s, e in self.ranges]
            self._scratch_pieces = [self._piece(s, e).zero_() for s, e in self.ranges]
        return self._scratch

    def run_compute(self) -> torch.Tensor:
        """The chunked GEMMs alone, on gathered buffers of the chunk shapes."""
        out = torch.empty(self.out_shape, dtype=self.shard.dtype, device=self.device)
        for (s, e), buf in zip(self.ranges, self._ensure_scratch(), strict=True):
            self._gemm_chunk(buf, s, e, out)
        return out

    @_records_step
    def run_communicate(self) -> None:
        """The chunked gathers alone."""
        bufs = self._ensure_scratch()
        wait_handle([self._launch(buf, p) for buf, p in zip(bufs, self._scratch_pieces, strict=True)])


class Overlap(_Schedule):
    """Any ``compute()`` next to any ``communicate()``.

    ``communicate`` starts the communication and returns a handle: a ``dist.Work``
    (``async_op=True`` collectives), a list of them, or None for stream-ordered GPU work
    (it runs on a :class:`~cokit.overlap.streams.CommStream` of ``priority``). Overlapped, the
    communication is started first, ``compute`` runs meanwhile on the current stream / the
    calling thread, then the handle is waited and the comm stream joined. The output is what
    ``compute`` returns; ``communicate`` delivers its results through its own tensors.
    ``config`` records the compute's GemmConfig (its occupancy shaping happens inside
    ``compute``) for the guard and the report. An ``EmulatedComm`` is labelled as emulation.
    """

    def __init__(
        self,
        compute: Callable[[], Any],
        communicate: Callable[[], Any],
        *,
        device: torch.device | str | int | None = None,
        priority: str | int = "high",
        stream: CommStream | None = None,
        group: Any = None,
        config: GemmConfig | None = None,
        guard: StarvationGuard | None = None,
        label: str = "overlap",
        comm_label: str | None = None,
        emulated: bool | None = None,
    ) -> None:
        if not callable(compute) or not callable(communicate):
            raise TypeError("compute and communicate must be callables")
        from .streams import _device

        dev = _device(device if device is not None else getattr(communicate, "device", None))
        self.emulated = bool(getattr(communicate, "emulated", False) if emulated is None else emulated)
        self.uses_group = not self.emulated and dist.is_available() and dist.is_initialized()
        self._setup(dev, None, config, priority, group, guard, needs_group=False)
        if self.uses_group:
            self.world_size = dist.get_world_size(self.group)
            self.rank = dist.get_rank(self.group)
        if stream is not None:
            if not isinstance(stream, CommStream):
                raise TypeError(
                    f"stream must be an cokit.overlap.streams.CommStream, got {type(stream).__name__}"
                )
            if stream.device != dev:
                raise ValueError(f"stream is on {stream.device} but the overlap runs on {dev}")
        self.stream = stream or CommStream(dev, priority)
        self.compute, self.communicate = compute, communicate
        self.label = label
        self.comm_label = str(
            comm_label or getattr(communicate, "label", getattr(communicate, "__name__", "communicate"))
        )
        self.info.update(schedule="overlap", emulated=self.emulated)

    def _start_comm(self) -> _TimedWork:
        """Start ``communicate`` on the comm stream (bytes: its ``nbytes``, if it says)."""
        self.stream.wait_for_current()

        def launch() -> Any:
            with self.stream:
                return self.communicate()

        return self._timed(self.comm_label, int(getattr(self.communicate, "nbytes", 0)), launch)

    def run_compute(self) -> Any:
        return self.compute()

    @_records_step
    def run_communicate(self) -> None:
        self._start_comm().wait(self.stream.join)

    @_records_step
    def run_sequential(self) -> Any:
        out = self.compute()
        self._start_comm().wait(self.stream.join)
        return out

    @_records_step
    def run_overlapped(self, probe: Probe = NULL_PROBE) -> Any:
        handle = self._start_comm()
        with probe.span():
            out = self.compute()
        handle.wait(self.stream.join)
        return out

    def __call__(self) -> Any:
        """Run overlapped; return what ``compute`` returns."""
        return self.run_overlapped(NULL_PROBE)


# ---------------------------------------------------------------------- functional forms
def gemm_all_reduce(a: torch.Tensor, b: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """``all_reduce(a @ b)``, chunked and overlapped (see :class:`GemmCollective`)."""
    return GemmCollective(a, b, collective="all_reduce", **kwargs).run().output


def gemm_reduce_scatter(a: torch.Tensor, b: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """This rank's rows of ``reduce_scatter(a @ b)``, chunked and overlapped."""
    return GemmCollective(a, b, collective="reduce_scatter", **kwargs).run().output


def all_gather_gemm(
    shard: torch.Tensor, other: torch.Tensor, *, operand: str = "a", **kwargs: Any
) -> torch.Tensor:
    """``all_gather(shard) @ other`` (``operand='a'``) or ``other @ all_gather(shard)``
    (``operand='b'``), chunked and overlapped (see :class:`AllGatherGemm`)."""
    return AllGatherGemm(shard, other, operand=operand, **kwargs).run().output
