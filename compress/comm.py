"""Asynchronous collectives with byte accounting and timeouts that name their owner.

Every collective is launched asynchronously and returns a :class:`Pending`; waiting on it
with a timeout turns "a rank never joined" into an error naming the owner (e.g. the
optimizer) instead of a hang. On gloo the timeout is also the collective's own, so the
abandoned work ends with it and the process can exit at once. A collective that times out
or fails leaves the group unusable (a retried collective would pair with another rank's
next one), so the group is aborted and every later collective on it raises
:class:`ProcessGroupAborted` at once: recover by restarting every rank from its last
checkpoint. Byte counts are per rank, ring algorithm volumes (:mod:`cokit.compress.stats`);
each collective is also timed (:mod:`cokit.compress.timing`: launch, completion, waits).
Without an initialized process group (or world size 1) the collectives are local copies
and count zero bytes.

Work lifetimes: every launched collective stays referenced (``_INFLIGHT``) until a wait sees it
complete, and the most recent completed ones a while longer (``_RECENT``). When its group is
aborted, every collective still in flight on it moves to ``_FAILED_WORK``; an owner whose step
raised for another reason calls :meth:`Communicator.drain`, which waits for what the step
launched. At exit the collectives still held are never freed. So no gloo worker thread is
ever the one that frees a collective while the interpreter finalizes, which would
``std::terminate`` the process (SIGABRT: freeing its tensors needs the GIL). A group the user
destroyed has no threads left by then: :mod:`cokit.compress.teardown` frees it at exit.
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import datetime
import math
import numbers
import threading
import time
import weakref
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from cokit.compress.stats import ring_allgather_bytes, ring_allreduce_bytes
from cokit.compress.teardown import release_captured_groups
from cokit.compress.timing import CollectiveTiming, StepTimer, StepTiming

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "CollectiveTimeout",
    "Communicator",
    "Pending",
    "ProcessGroupAborted",
    "guard_future",
    "parse_timeout",
    "standalone",
]

#: Seconds each cokit collective may take unless the caller says otherwise (every front end, the
#: DDP hook, :class:`Communicator`, the CLI and the study). Above the slowest step cokit takes on
#: a CPU, far below the process group's own defaults (gloo: 30 min; NCCL: 10 min), so a frozen
#: or dead rank stops the others in minutes. Raise it where one rank may work alone between
#: steps for longer (a long evaluation or checkpoint write on rank 0); ``timeout=None`` or
#: ``float("inf")``, passed explicitly, leaves only the process group's own timeout.
DEFAULT_TIMEOUT_S = 300.0

RESTART_HINT = (
    "The step cannot be retried in place: restart every rank from the last checkpoint "
    "(each rank's model and optimizer state_dict()), e.g. under torchrun --max-restarts"
)

# Process groups aborted after a failed collective -> the error that aborted them, and when
# (time.monotonic()) the collectives still running on them have ended (``_settles``).
_ABORTED: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
_SETTLES_AT: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()
# The work of failed collectives, held until exit so that its last reference (and its
# tensors') is dropped by a Python thread: dropped by gloo's worker thread while the
# interpreter finalizes, it takes the GIL and std::terminate()s the process (SIGABRT).
_FAILED_WORK: list[Any] = []
# The most recent completed collectives (work, result, input). A gloo worker thread drops its
# reference to a collective a moment after the waiter saw it complete; were that the last
# reference while the interpreter finalizes, freeing the tensors would need the GIL, which a
# finalizing interpreter refuses: the thread exits mid-unwind and the process ends in
# std::terminate (SIGABRT). Held here until newer ones replace them, and never freed at exit.
_RECENT: collections.deque = collections.deque(maxlen=8)  # > the worker threads of the groups in use
# Collectives launched and not yet seen complete, per process group (see the module docstring).
_INFLIGHT: weakref.WeakKeyDictionary[Any, dict[int, Pending]] = weakref.WeakKeyDictionary()
_INFLIGHT_LOCK = threading.Lock()
# A collective that carries its own timeout ends with it; waiting this much longer for it
# (rather than abandoning it at the same instant) lets it end on its thread first.
_GRACE = datetime.timedelta(seconds=10)


class CollectiveTimeout(RuntimeError):
    """A collective did not complete in time (some rank did not take part) or failed."""


class ProcessGroupAborted(CollectiveTimeout):
    """A collective was asked of a process group aborted after an earlier failure."""


def parse_timeout(timeout: object, owner: str = "cokit") -> datetime.timedelta | None:
    """``timeout`` (seconds or a ``timedelta``) as a ``timedelta``; ``None`` for no limit.

    ``None`` and ``float('inf')`` mean no limit of cokit's own (the process group's timeout,
    ``init_process_group(timeout=...)``, still ends a collective: gloo's default is 30 min).
    Owners that are given no timeout at all use :data:`DEFAULT_TIMEOUT_S`. Zero, negative, NaN and
    ``bool`` values raise ``ValueError``; other types ``TypeError``.
    """
    if timeout is None:
        return None
    if isinstance(timeout, bool):
        raise ValueError(f"{owner}: timeout must be a number of seconds > 0, got {timeout!r} (a bool)")
    if isinstance(timeout, datetime.timedelta):
        if timeout <= datetime.timedelta(0):
            raise ValueError(f"{owner}: timeout must be > 0 seconds, got {timeout}")
        return timeout
    if isinstance(timeout, numbers.Real):
        seconds = float(timeout)
        if math.isnan(seconds):
            raise ValueError(f"{owner}: timeout must be > 0 seconds (inf for no limit), got nan")
        if seconds == math.inf:
            return None
        if not seconds > 0:
            raise ValueError(f"{owner}: timeout must be > 0 seconds (inf for no limit), got {timeout}")
        try:
            return datetime.timedelta(seconds=seconds)
        except OverflowError:
            raise ValueError(
                f"{owner}: timeout of {timeout} s is too large; pass float('inf') for no limit"
            ) from None
    raise TypeError(
        f"{owner}: timeout must be seconds (a number, inf for no limit) or a timedelta, "
        f"got {type(timeout).__name__}"
    )


def standalone(group: Any) -> bool:
    """True for a group that lives outside torch.distributed's registry and says its own rank,
    size and backend (``standalone = True``): a torchft quorum (:mod:`cokit.compress.ft_group`),
    which needs no default group and whose ranks change with every quorum."""
    return getattr(group, "standalone", False) is True


def _abort(group: Any) -> str:
    """Abort ``group`` so that no work on it outlives the error; say how it went."""
    abort = getattr(group, "abort", None)  # ProcessGroup.abort: torch >= 2.4 (gloo: no-op-safe)
    if abort is None:
        return "this torch cannot abort it; it is marked unusable"
    try:
        abort()
    except Exception as exc:  # best effort: the caller raises the real error
        return f"aborting it failed ({type(exc).__name__}: {exc}); it is marked unusable"
    return "it was aborted"


def _keep(entry: tuple) -> None:
    """Hold a collective that just completed a little longer (see ``_RECENT``)."""
    _RECENT.append(entry)


def _settle_before_exit(limit_s: float = 60.0) -> None:
    """At exit, before the interpreter finalizes (module docstring). A gloo thread that ends a
    collective while the interpreter finalizes runs its completion callbacks and frees them
    without the GIL there is to take (std::terminate), so: let the collectives still running
    on a failed group end by their own timeouts, and the thread that failed one finish its
    callbacks (those of other libraries too, e.g. torch's PowerSGD hook), at most ``limit_s``;
    then keep the collectives still held (the most recent ones, the failed ones) from ever
    being freed."""
    wait_s = min(max(_SETTLES_AT.values(), default=0.0) - time.monotonic(), limit_s)
    if wait_s > 0:
        time.sleep(wait_s)
    kept = [*_RECENT, *_FAILED_WORK]
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(kept))  # a reference that is never dropped
    _RECENT.clear()
    _FAILED_WORK.clear()


# at exit (last registered, first run): settle the failed groups' collectives, then free the
# destroyed groups that torch's function defaults still hold (cokit.compress.teardown)
atexit.register(release_captured_groups)
atexit.register(_settle_before_exit)


def _settles(group: Any) -> float:
    """When every collective still running on ``group`` will have ended by its own timeout
    (those that carry one), or now; plus a moment for the ending thread's clean-up."""
    with _INFLIGHT_LOCK:
        running = list(_INFLIGHT.get(group, {}).values())
    ends = [
        p._launched_at + p._timeout.total_seconds()
        for p in running
        if p._work is not None and p._op_timeout and p._timeout is not None
    ]
    return max([time.monotonic(), *ends]) + 0.5


def _retire(group: Any) -> None:
    """``group`` failed: keep every collective still in flight on it referenced until exit;
    waiting on one raises :class:`ProcessGroupAborted`."""
    with _INFLIGHT_LOCK:
        stuck = _INFLIGHT.pop(group, {})
    for pending in stuck.values():
        if pending._work is not None:
            _FAILED_WORK.append((pending._work, pending._result, pending._source))
            pending._work = None
            pending._abandoned = True


class Pending:
    """A launched collective: ``wait()`` returns its result tensor."""

    def __init__(
        self,
        work,
        result: torch.Tensor,
        owner: str,
        what: str,
        timeout: datetime.timedelta | None,
        group: Any = None,
        op_timeout: bool = False,
        source: torch.Tensor | None = None,
        timer: StepTimer | None = None,
        record: CollectiveTiming | None = None,
    ):
        self._work, self._result = work, result
        self._timer, self._record = timer, record
        self._owner, self._what, self._timeout = owner, what, timeout
        # weakly: a gloo thread drops the last reference to a Pending (its future's callback),
        # and must never be the one that frees the group (its destructor joins that thread)
        self._group_ref = weakref.ref(group) if group is not None else None
        self._op_timeout = op_timeout  # the collective itself ends at `timeout`
        self._source = source  # the input tensor, when it is not the result
        self._abandoned = False  # its group was aborted while it was in flight
        self._launched_at = time.monotonic()
        if work is not None and group is not None:
            with _INFLIGHT_LOCK:
                _INFLIGHT.setdefault(group, {})[id(self)] = self

    @property
    def _group(self) -> Any:
        """The process group, while it exists (None for a local collective)."""
        return self._group_ref() if self._group_ref is not None else None

    def _landed(self) -> None:
        """The collective completed: held a little longer (``_RECENT``), then released."""
        if self._work is not None:
            _keep((self._work, self._result, self._source))
        self._work = None
        group = self._group
        if group is not None:
            with _INFLIGHT_LOCK:
                _INFLIGHT.get(group, {}).pop(id(self), None)

    def wait(self) -> torch.Tensor:
        """The result, once every rank took part; ``CollectiveTimeout`` (group aborted) if not."""
        if self._abandoned:
            group = self._group
            why = _ABORTED.get(group, "unknown") if group is not None else "unknown"
            raise ProcessGroupAborted(
                f"{self._owner}: the {self._what} was abandoned: its process group was aborted after "
                f"another collective failed ({why}). {RESTART_HINT}."
            )
        if self._work is not None:
            limit = self._timeout
            if limit is not None and self._op_timeout:
                limit += _GRACE
            device = self._result.device
            start = self._timer.mark(device) if self._timer is not None else None
            try:
                done = self._work.wait(limit) if limit is not None else self._work.wait()
            except RuntimeError as exc:
                self._fail(exc, timed_out="timed out" in str(exc).lower())
            if done is False:
                self._fail(None, timed_out=True)
            if self._timer is not None and self._record is not None:
                self._timer.waited(self._record, start, self._timer.mark(device))
            self._landed()
        return self._result

    def future(self) -> torch.futures.Future:
        """A future of the result, for callers that cannot block (a DDP comm hook). A failed
        collective fails it with :class:`CollectiveTimeout` (group aborted, work kept alive)."""
        if self._work is None:
            ready: torch.futures.Future = torch.futures.Future()
            ready.set_result(self._result)
            return ready

        def landed(fut: torch.futures.Future) -> torch.Tensor:
            try:
                fut.wait()
            except RuntimeError as exc:
                self._fail(exc, timed_out="timed out" in str(exc).lower(), abort=False)
            self._landed()
            return self._result

        return self._work.get_future().then(landed)

    def _fail(self, cause: BaseException | None, timed_out: bool, abort: bool = True) -> NoReturn:
        """Raise the error naming the owner; the group is marked dead (and aborted, unless
        ``abort=False``: on a communication thread) and its collectives in flight kept alive."""
        if self._work is not None:
            _FAILED_WORK.append((self._work, self._result, self._source))
        self._work = None
        limit = f" within {self._timeout.total_seconds():g} s" if self._timeout is not None else ""
        happened = f"did not complete{limit}"
        if cause is not None:
            happened += f" ({cause})" if timed_out else f": it failed ({cause})"
        first = f"{self._owner}: the {self._what} {happened}"
        group = self._group
        if group is not None and group not in _ABORTED:
            _ABORTED[group] = first
            _SETTLES_AT[group] = _settles(group)
            _retire(group)
            fate = _abort(group) if abort else "it is marked unusable"
        else:
            fate = "it was aborted"
        raise CollectiveTimeout(
            f"{first}. Every rank must call the same steps with the same parameters; a rank "
            f"that crashed, froze, skipped a step or diverged in control flow leaves the others "
            f"waiting. {RESTART_HINT}; the process group is unusable ({fate}). Raise "
            f"`timeout=` if steps are just slow."
        ) from cause


def guard_future(
    fut: torch.futures.Future, owner: str, what: str, timeout: object = None, group: Any = None
) -> torch.futures.Future:
    """``fut`` (a collective another library launched, e.g. torch's PowerSGD hook on a group
    made with a timeout) whose failure raises :class:`CollectiveTimeout` naming ``owner``, and
    marks ``group`` unusable, as a failed :class:`Pending` does."""
    limit = parse_timeout(timeout, owner)
    group_ref = weakref.ref(group) if group is not None else None  # gloo's thread drops `check`

    def check(done: torch.futures.Future) -> Any:
        try:
            return done.value()
        except RuntimeError as exc:
            group = group_ref() if group_ref is not None else None
            failed = Pending(None, torch.empty(0), owner, what, limit, group, op_timeout=limit is not None)
            failed._fail(exc, timed_out="timed out" in str(exc).lower(), abort=False)

    return fut.then(check)


class Communicator:
    """Collectives on one process group for one owner, with running byte counts.

    ``timeout``: seconds or a ``timedelta`` each collective may take (default
    :data:`DEFAULT_TIMEOUT_S`; ``None``/``inf``: no limit of its own, the process group's
    timeout applies). ``local=True``: a group of this
    rank alone (nothing to exchange, e.g. parameters sharded on every mesh dimension).
    ``timer``: share another communicator's step timer (one step timed over several groups).
    """

    def __init__(
        self,
        process_group=None,
        owner: str = "cokit",
        timeout: float | datetime.timedelta | None = DEFAULT_TIMEOUT_S,
        *,
        local: bool = False,
        timer: StepTimer | None = None,
    ):
        self.group = process_group
        self.owner = owner
        self.timeout = parse_timeout(timeout, owner)
        self.local = local
        self.sent = 0
        self.received = 0
        self.timer = StepTimer() if timer is None else timer

    @property
    def distributed(self) -> bool:
        if standalone(self.group):
            return self.world_size > 1
        return dist.is_available() and dist.is_initialized() and self.world_size > 1

    @property
    def world_size(self) -> int:
        return self._place()[1]

    @property
    def rank(self) -> int:
        return self._place()[0]

    def _place(self) -> tuple[int, int]:
        """(this rank, the group's size): a standalone group's own, (0, 1) for a local or
        uninitialized one, else torch.distributed's."""
        if standalone(self.group):
            return self.group.rank(), self.group.size()
        if self.local or not (dist.is_available() and dist.is_initialized()):
            return 0, 1
        return dist.get_rank(self.group), dist.get_world_size(self.group)

    @property
    def backend(self) -> str:
        """The backend's name of the group (``"gloo"``, ``"nccl"``, ...)."""
        if standalone(self.group):
            return str(self.group.getBackendName()).lower()
        return str(dist.get_backend(self.group))

    def global_rank(self, rank: int) -> int:
        """The global rank of this group's ``rank`` (a standalone group's: its group rank)."""
        if standalone(self.group):
            return rank
        if self.local and dist.is_available() and dist.is_initialized():
            return dist.get_rank()
        if not self.distributed or self.group is None:
            return rank
        return dist.get_global_rank(self.group, rank)

    @property
    def aborted(self) -> bool:
        """True once a collective on this process group failed (the group is unusable)."""
        return self.distributed and self._process_group() in _ABORTED

    def reset_counts(self) -> tuple[int, int]:
        """Return ``(sent, received)`` since the last reset and start again from zero (the
        timing marks too: a step that raised drops them)."""
        counts = (self.sent, self.received)
        self.sent = self.received = 0
        self.timer.discard()
        return counts

    def take_counts(self) -> tuple[int, int]:
        """``(sent, received)`` since the last reset; start counting again (timing untouched:
        for a communicator that shares another's timer)."""
        counts = (self.sent, self.received)
        self.sent = self.received = 0
        return counts

    def take_step(self) -> tuple[int, int, StepTiming]:
        """Close a step: ``(sent, received, timing)`` since the last reset; start again."""
        return (*self.take_counts(), self.timer.take())

    def _count(self, what: str, nbytes: int, work: Any, start: Any) -> CollectiveTiming:
        """Count and time a collective launched at ``start`` (its record goes to its Pending)."""
        self.sent += nbytes
        self.received += nbytes
        record = self.timer.launched(what, nbytes, nbytes, start)
        self.timer.watch(record, work)
        return record

    def _process_group(self) -> Any:
        if self.group is not None:
            return self.group
        return dist.distributed_c10d._get_default_group()

    def _usable_group(self, what: str) -> Any:
        """The process group, or ``ProcessGroupAborted`` if an earlier collective failed."""
        group = self._process_group()
        if group in _ABORTED:
            raise ProcessGroupAborted(
                f"{self.owner}: cannot start the {what}: this process group was aborted after "
                f"an earlier collective failed ({_ABORTED[group]}). {RESTART_HINT}."
            )
        return group

    def _options(self, options: Any, group: Any, tensor: torch.Tensor) -> tuple[Any, bool]:
        """Async options, and whether they carry the timeout: it becomes the collective's own
        (so gloo's work ends with it) except on NCCL, whose watchdog would tear the process
        down instead of letting :class:`Pending` raise."""
        options.asyncOp = True
        own = self.timeout is not None and not (tensor.is_cuda and "nccl" in self.backend)
        if own:
            options.timeout = self.timeout
        return options, own

    def all_gather(self, tensor: torch.Tensor, what: str) -> Pending:
        """Start an all-gather of a flat tensor; ``wait()`` gives ``(world_size, numel)``."""
        world = self.world_size
        if not self.distributed:
            return Pending(None, tensor.reshape(1, -1).clone(), self.owner, what, None)
        group = self._usable_group(what)
        flat = tensor.reshape(-1)
        out = tensor.new_empty(world * tensor.numel())
        opts, own = self._options(dist.distributed_c10d.AllgatherOptions(), group, flat)
        launch = getattr(group, "all_gather_single", None) or group._allgather_base  # torch < 2.12
        start = self.timer.mark(tensor.device)
        work = launch(out, flat, opts)
        nbytes = ring_allgather_bytes(tensor.numel() * tensor.element_size(), world)
        record = self._count(what, nbytes, work, start)
        return Pending(
            work, out.view(world, -1), self.owner, what, self.timeout, group, own, flat, self.timer, record
        )

    def all_reduce_mean(self, tensor: torch.Tensor, what: str) -> Pending:
        """Start an in-place all-reduce; ``wait()`` gives the mean over ranks (same tensor)."""
        return self._all_reduce(tensor, what, mean=True)

    def all_reduce_sum(self, tensor: torch.Tensor, what: str) -> Pending:
        """Start an in-place all-reduce; ``wait()`` gives the sum over ranks (same tensor)."""
        return self._all_reduce(tensor, what, mean=False)

    def _all_reduce(self, tensor: torch.Tensor, what: str, mean: bool) -> Pending:
        if not self.distributed:
            return Pending(None, tensor, self.owner, what, None)
        group = self._usable_group(what)
        opts, own = self._options(dist.distributed_c10d.AllreduceOptions(), group, tensor)
        opts.reduceOp = dist.ReduceOp.SUM
        start = self.timer.mark(tensor.device)
        work = group.allreduce([tensor], opts)
        nbytes = ring_allreduce_bytes(tensor.numel() * tensor.element_size(), self.world_size)
        record = self._count(what, nbytes, work, start)
        args = (work, tensor, self.owner, what, self.timeout, group, own)
        if not mean:
            return Pending(*args, None, self.timer, record)
        return _Scaled(*args, 1.0 / self.world_size, timer=self.timer, record=record)

    def broadcast(self, tensor: torch.Tensor, src: int, what: str) -> Pending:
        """Start an in-place broadcast from the group's rank ``src``; ``wait()`` gives the
        tensor. Counted as a pipelined broadcast: every rank but ``src`` receives the bytes
        once, every rank sends them once."""
        if not self.distributed:
            return Pending(None, tensor, self.owner, what, None)
        group = self._usable_group(what)
        opts, own = self._options(dist.distributed_c10d.BroadcastOptions(), group, tensor)
        opts.rootRank = src
        start = self.timer.mark(tensor.device)
        work = group.broadcast([tensor], opts)
        nbytes = tensor.numel() * tensor.element_size()
        self.sent += nbytes
        self.received += 0 if self.rank == src else nbytes
        record = self.timer.launched(what, nbytes, 0 if self.rank == src else nbytes, start)
        self.timer.watch(record, work)
        return Pending(work, tensor, self.owner, what, self.timeout, group, own, None, self.timer, record)

    def drain(self) -> None:
        """Wait for every collective still in flight on this process group (a step that raised
        after launching some: its peers launched them too, so they complete). Failures here
        abort the group as any failed wait does; the caller's error is the one to raise, so
        they are not raised again."""
        if not self.distributed:
            return
        with _INFLIGHT_LOCK:
            pending = list(_INFLIGHT.get(self._process_group(), {}).values())
        for p in pending:
            try:
                p.wait()
            except CollectiveTimeout:
                return  # the group is aborted: everything still in flight is kept alive


class _Scaled(Pending):
    """A pending all-reduce whose sum is scaled once, on first wait (sum -> mean)."""

    def __init__(
        self,
        work,
        result,
        owner: str,
        what: str,
        timeout,
        group=None,
        op_timeout=False,
        scale: float = 1.0,
        *,
        timer: StepTimer | None = None,
        record: CollectiveTiming | None = None,
    ):
        super().__init__(work, result, owner, what, timeout, group, op_timeout, None, timer, record)
        self._scale: float | None = scale

    def wait(self) -> torch.Tensor:
        result = super().wait()
        if self._scale is not None:
            result.mul_(self._scale)
            self._scale = None
        return result
