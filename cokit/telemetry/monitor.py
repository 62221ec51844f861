"""The :class:`Monitor`: one telemetry record per training step per rank.

    monitor = Monitor("results/run1", run="demo-DeMo", optimizer=opt, config={"lr": 1e-3})
    for step in range(1, steps + 1):
        ...                                  # forward, backward, opt.step()
        monitor.step(step, loss=loss_value, lr=lr)
    monitor.close()                          # or: with Monitor(...) as monitor:

Each rank writes ``<out_dir>/telemetry/<run>/rank<r>.jsonl`` (schema
:mod:`cokit.telemetry.schema`): a ``meta`` line, one ``step`` line per call, an ``end`` line
on close. A step line holds the step time, loss and learning rate, the optimizer's
communication of that step (bytes, encode/decode, exposed and total communication time),
the kernel configs in use with their occupancy, the tuner's decisions, and the process's
memory high-water mark. When a process group is initialized, every rank joins one small
all-gather per step (started without waiting; it completes behind the next step) and rank 0
writes that step's ``summary`` line (slowest and fastest rank, largest exposed
communication) at the next call or at close. Cost on the demo: well under 1% of a step
(``python -m cokit.bench.telemetry_overhead``).
"""

from __future__ import annotations

import contextlib
import datetime
import math
import numbers
import os
import re
import socket
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from cokit.telemetry.collect import CommReader, TunerReader, device_name, kernel_entry, max_memory_bytes
from cokit.telemetry.schema import SCHEMA, clean, iso_time
from cokit.telemetry.sinks import SINK_NAMES, Sink, make_sink

__all__ = ["Monitor", "TelemetryError", "telemetry_dir"]

_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+=@-]*")
_RANK_FILE = re.compile(r"rank(\d+)(\.part-\d+)?\.(jsonl|csv|parquet)")
_SUMMARY_WIDTH = 3  # per rank: step, step_s, exposed_s
# Gathers left in flight by a failed run: held until exit so that their last reference is not
# dropped on gloo's thread (see cokit.compress.comm).
_ABANDONED: list[Any] = []


class TelemetryError(ValueError):
    """Telemetry cannot be written as asked; the message says what to change."""


def telemetry_dir(out_dir: str | os.PathLike, run: str) -> Path:
    """Where a run's per-rank files go: ``<out_dir>/telemetry/<run>``."""
    return Path(out_dir) / "telemetry" / run


def _number(name: str, value: Any) -> float | None:
    """``value`` as a float (None stays None; NaN/inf become None); a bad type raises."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TypeError(
                f"{name} must be a number or a one-element tensor, got a tensor of shape {tuple(value.shape)}"
            )
        value = value.item()  # note: synchronizes with the GPU; pass a float to avoid it
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name} must be a number (float, int or a one-element tensor), got {type(value).__name__}"
        )
    out = float(value)
    return out if math.isfinite(out) else None


def _versions() -> tuple[str, str | None]:
    from cokit._versions import installed_version

    return torch.__version__, installed_version("triton")


class Monitor:
    """Writes one telemetry record per step on this rank; see the module docstring.

    Args:
        out_dir: results folder; files go to ``out_dir/telemetry/<run>/``. It is created and
            checked for writing here: an unwritable one raises :class:`TelemetryError`.
        run: the run's name (letters, digits, ``._+=@-``): one folder per run, so several
            runs (e.g. ``demo-DeMo`` and ``demo-AdamW``) can be overlaid by the dashboard.
        optimizer: read after each step (see :meth:`attach`); None: no ``comm``.
        sinks: where records go: :class:`~cokit.telemetry.sinks.Sink` objects and/or names
            (``"jsonl"``, ``"csv"``, ``"parquet"``, ``"tensorboard"``: that sink at its default
            path in the run's folder; ``"prometheus"``: gauges served on
            ``$COKIT_PROMETHEUS_PORT`` + rank). Default ``["jsonl"]``.
        rank, world_size: default from the initialized process group (else 0 and 1).
        gather: join one all-gather per step so rank 0 writes a ``summary`` line. Default:
            on when a process group is initialized. Every rank must then call :meth:`step`
            equally often.
        group: the process group to gather over (default: the world).
        config: the run's settings, written in the ``meta`` line.
        method: the method's name (e.g. ``"DeMo"``), written in the ``meta`` line.
        clock: seconds (``time.perf_counter``); tests pass a fake one. On a GPU, steps are
            timed on the host: synchronize (e.g. read the loss) before calling :meth:`step`.
        device: the device of the run (default: the optimizer's parameters', else the current
            GPU if any, else CPU).
    """

    def __init__(
        self,
        out_dir: str | os.PathLike,
        run: str = "run",
        *,
        optimizer: Any = None,
        sinks: Sequence[Sink | str] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        gather: bool | None = None,
        group: Any = None,
        config: Mapping[str, Any] | None = None,
        method: str | None = None,
        clock: Callable[[], float] = time.perf_counter,
        device: torch.device | str | None = None,
    ) -> None:
        # --- checks first: nothing is created before every argument is known to be good
        if not isinstance(out_dir, (str, os.PathLike)) or not os.fspath(out_dir):
            raise TypeError(f"out_dir must be a folder path (str or Path), got {out_dir!r}")
        if not isinstance(run, str) or not _RUN_NAME.fullmatch(run):
            raise ValueError(
                f"run={run!r} is not a usable run name; use letters, digits and ._+=@- "
                "(it names a folder), e.g. run='demo-DeMo'"
            )
        if not callable(clock):
            raise TypeError(f"clock must be a callable returning seconds, got {clock!r}")
        if config is not None and not isinstance(config, Mapping):
            raise TypeError(f"config must be a dict of the run's settings, got {type(config).__name__}")
        if method is not None and not isinstance(method, str):
            raise TypeError(f"method must be a string (e.g. 'DeMo'), got {type(method).__name__}")
        if gather is not None and not isinstance(gather, bool):
            raise TypeError(f"gather must be True, False or None, got {gather!r}")
        initialized = dist.is_available() and dist.is_initialized()
        for name, v in (("rank", rank), ("world_size", world_size)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise TypeError(f"{name} must be an integer, got {v!r}")
        self.rank = rank if rank is not None else (dist.get_rank(group) if initialized else 0)
        self.world_size = (
            world_size if world_size is not None else (dist.get_world_size(group) if initialized else 1)
        )
        if not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"rank {self.rank} is outside world_size {self.world_size}; allowed: 0 to world_size-1"
            )
        self.gather = initialized if gather is None else gather
        if self.gather and not initialized:
            raise ValueError(
                "gather=True needs an initialized process group (torch.distributed); pass gather=False"
            )
        if self.gather and (self.rank, self.world_size) != (dist.get_rank(group), dist.get_world_size(group)):
            raise ValueError(
                f"rank={self.rank}, world_size={self.world_size} disagree with the process group "
                f"({dist.get_rank(group)} of {dist.get_world_size(group)}), over which gather=True gathers"
            )
        specs = ["jsonl"] if sinks is None else list(sinks)
        for s in specs:
            if isinstance(s, str):
                if s not in SINK_NAMES:
                    raise ValueError(f"unknown sink {s!r}; known: {', '.join(SINK_NAMES)} (or a Sink)")
            elif not all(callable(getattr(s, m, None)) for m in ("write", "flush", "close")):
                raise TypeError(
                    f"a sink must be a name or have write(record), flush() and close(); got {type(s).__name__}"
                )
        self.out_dir = Path(out_dir)
        self.run = run
        self.folder = telemetry_dir(out_dir, run)
        self.clock = clock
        self.group = group
        self.config = dict(config) if config is not None else {}
        self.method = method
        self._comm: CommReader | None = None
        self._optimizer: Any = None
        self._tuners: list[TunerReader] = []
        self._kernels: dict[str, dict[str, Any]] = {}
        self._device = torch.device(device) if device is not None else None
        if optimizer is not None:
            self.attach(optimizer)
        if self._device is None:
            self._device = (
                torch.device("cuda", torch.cuda.current_device())
                if torch.cuda.is_available()
                else torch.device("cpu")
            )
        self._device_name = device_name(self._device)

        # --- the folder, then the sinks, then the first record
        self._check_writable()
        if self.rank == 0:
            self._remove_stale_rank_files()
        self.sinks: list[Sink] = []
        self._failed_sinks: set[int] = set()  # id() of sinks that raised on a write: not written again
        try:
            for s in specs:
                self.sinks.append(make_sink(s, self.folder, self.rank) if isinstance(s, str) else s)
        except BaseException:
            for sink in self.sinks:
                sink.close()
            raise
        self._gather_buf: torch.Tensor | None = None
        self._gather_out: torch.Tensor | None = None
        self._pending: tuple[int, Any] | None = None  # (step, work) of the gather in flight
        self.steps = 0
        self.last_step: int | None = None
        self._closed = False
        self._paused_s = 0.0
        self._start = float(clock())
        self._prev = self._start
        torch_version, triton_version = _versions()
        self._emit(
            "meta",
            started=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            host=socket.gethostname(),
            pid=os.getpid(),
            torch=torch_version,
            triton=triton_version,
            device=self._device_name,
            method=method,
            config=self.config,
            gather=self.gather,
        )

    # ------------------------------------------------------------------ setup
    def _check_writable(self) -> None:
        from cokit.files import OutputError, prepare_out_dir

        try:
            prepare_out_dir(self.folder, (), overwrite=True, flag="telemetry folder")
        except OutputError as exc:
            raise TelemetryError(
                f"cannot write telemetry for run {self.run!r}: {exc}. Give Monitor an out_dir you can "
                "write to (or turn telemetry off, e.g. --no-telemetry)"
            ) from None

    def _remove_stale_rank_files(self) -> None:
        """Rank files of ranks this run does not have (an earlier, larger run's): removed, so
        the folder holds one run."""
        for entry in os.scandir(self.folder):
            m = _RANK_FILE.fullmatch(entry.name)
            if m and int(m.group(1)) >= self.world_size:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)

    def attach(self, optimizer: Any) -> Monitor:
        """Read ``optimizer``'s communication after every step: anything with ``comm_stats``
        (DeMo, DCTTopKState, overlap schedules, cokit.train's methods) gives the step's
        bytes and times; a plain torch optimizer gives ``comm: null`` (and the learning rate,
        when :meth:`step` gets none). Returns the monitor."""
        has_stats = getattr(optimizer, "comm_stats", None) is not None
        if not has_stats and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                "attach() needs a torch optimizer or an object with .comm_stats (DeMo, DCTTopKState, "
                f"an overlap schedule), got {type(optimizer).__name__}"
            )
        self._comm = CommReader(optimizer) if has_stats else None
        self._optimizer = optimizer
        if self._device is None:
            param = _first_param(optimizer)
            if param is not None:
                self._device = param.device
        return self

    def attach_tuner(self, tuner: Any) -> Monitor:
        """Record ``tuner``'s decisions (an ``OnlineTuner``: explore, trial, lock, drift,
        reject) in the step after they were made. Returns the monitor."""
        self._tuners.append(TunerReader(tuner))
        return self

    def add_kernel(
        self,
        name: str,
        gemm_config: Any,
        device: torch.device | str | None = None,
        *,
        dtype: str | torch.dtype = "bf16",
        target: str | None = None,
        occupancy: Any = None,
    ) -> Monitor:
        """Record a GEMM config in use (in every later step line, replacing an earlier one of
        the same ``name``), with its occupancy: blocks per SM, the limiting resource, shared
        memory per block and SMs reserved for communication. Limits: the live GPU when
        ``device`` (default: the monitor's) is CUDA, else the named ``target`` ('sm_90' when
        not given, recorded as the entry's ``target``). Returns the monitor."""
        if not isinstance(name, str) or not name:
            raise TypeError(f"kernel name must be a non-empty string, got {name!r}")
        dev = torch.device(device) if device is not None else self._device
        self._kernels[name] = clean(
            kernel_entry(name, gemm_config, device=dev, dtype=dtype, target=target, occupancy=occupancy)
        )
        return self

    def remove_kernel(self, name: str) -> None:
        """Stop recording the kernel ``name`` (KeyError when it is not recorded)."""
        del self._kernels[name]

    # ------------------------------------------------------------------ per step
    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Time spent in the body (evaluation, checkpointing) is left out of the next step's
        ``step_s`` (it still counts in ``wall_s``)."""
        t0 = float(self.clock())
        try:
            yield
        finally:
            self._paused_s += float(self.clock()) - t0

    def step(
        self,
        step: int,
        *,
        loss: Any = None,
        lr: Any = None,
        held_out_loss: Any = None,
        metrics: Mapping[str, Any] | None = None,
        **more: Any,
    ) -> dict[str, Any]:
        """Record step ``step`` (an int above the previous one); returns the record written.

        ``loss``, ``lr``, ``held_out_loss`` and the extra metrics (a ``metrics`` mapping and/or
        keywords: ``metrics={"grad_norm": g}`` or ``grad_norm=g``) are numbers (or one-element
        tensors, read with ``.item()``); NaN and inf are written as null. The
        step time is the time since the previous call (the first: since the monitor
        started), less time spent in :meth:`paused`; ``compute_s`` is the step time less the
        optimizer's encode, decode and exposed communication time (null when the optimizer
        reports no such times). Nothing is recorded when an argument is refused.
        """
        if self._closed:
            raise ValueError(f"Monitor for run {self.run!r} is closed; create a new one to record more steps")
        if isinstance(step, bool) or not isinstance(step, numbers.Integral):
            raise TypeError(f"step must be an integer, got {type(step).__name__} {step!r}")
        step = int(step)
        if self.last_step is not None and step <= self.last_step:
            raise ValueError(
                f"step {step} after step {self.last_step}: step numbers must increase "
                "(one call per training step)"
            )
        if metrics is not None and not isinstance(metrics, Mapping):
            raise TypeError(f"metrics must be a mapping of names to numbers, got {type(metrics).__name__}")
        twice = sorted(set(metrics or {}) & set(more))
        if twice:
            raise ValueError(
                f"metric(s) {', '.join(map(repr, twice))} given both in metrics= and as keywords"
            )
        metrics = {**(metrics or {}), **more}
        values = {"loss": loss, "lr": lr, "held_out_loss": held_out_loss}
        numbers_ = {k: _number(k, v) for k, v in values.items()}
        extra = {}
        for key, value in metrics.items():
            extra[key] = _number(f"metric {key!r}", value)
        now = float(self.clock())
        step_s = max(now - self._prev - self._paused_s, 0.0)
        self._prev, self._paused_s = now, 0.0
        if numbers_["lr"] is None and lr is None and isinstance(self._optimizer, torch.optim.Optimizer):
            numbers_["lr"] = _number("lr", self._optimizer.param_groups[0].get("lr"))
        comm = self._comm.read() if self._comm is not None else None
        compute_s: float | None = None  # unknown without the communication's times
        if comm is not None:
            parts = [comm.get(k) for k in ("encode_s", "decode_s", "exposed_s")]
            if all(isinstance(p, (int, float)) for p in parts):
                compute_s = max(step_s - sum(parts), 0.0)
        tuner: list[dict[str, Any]] = []
        for reader in self._tuners:
            tuner.extend(reader.read())
        assert self._device is not None
        record = self._emit(
            "step",
            step=step,
            wall_s=now - self._start,
            step_s=step_s,
            loss=numbers_["loss"],
            held_out_loss=numbers_["held_out_loss"],
            lr=numbers_["lr"],
            comm=comm,
            compute_s=compute_s,
            kernels=list(self._kernels.values()),
            tuner=tuner,
            process={"max_memory_bytes": max_memory_bytes(self._device), "device": self._device_name},
            metrics=extra,
        )
        self.steps += 1
        self.last_step = step
        if self.gather:
            exposed = comm.get("exposed_s") if comm is not None else None
            self._summarize(step, step_s, exposed)
        return record

    def _summarize(self, step: int, step_s: float, exposed: float | None) -> None:
        """Start this step's all-gather of (step, step_s, exposed_s) per rank, without waiting:
        it completes behind the next step's work, and the next call (or :meth:`close`) writes
        its summary. Only the previous step's gather is waited for here."""
        self._finish_summary()
        if self._gather_buf is None:
            backend = str(dist.get_backend(self.group))
            dev = (
                torch.device("cuda", torch.cuda.current_device())
                if "nccl" in backend
                else torch.device("cpu")
            )
            self._gather_buf = torch.empty(_SUMMARY_WIDTH, dtype=torch.float64, device=dev)
            self._gather_out = torch.empty(self.world_size * _SUMMARY_WIDTH, dtype=torch.float64, device=dev)
        buf = self._gather_buf
        buf.copy_(torch.tensor([step, step_s, math.nan if exposed is None else exposed], dtype=torch.float64))
        gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._pending = (step, gather_single(self._gather_out, buf, group=self.group, async_op=True))

    def _finish_summary(self) -> None:
        """Wait for the pending all-gather and, on rank 0, write its ``summary`` line."""
        if self._pending is None:
            return
        (step, work), self._pending = self._pending, None
        work.wait()
        assert self._gather_out is not None
        rows = self._gather_out.view(self.world_size, _SUMMARY_WIDTH).tolist()
        steps = [int(r[0]) for r in rows]
        if any(s != step for s in steps):
            raise RuntimeError(
                f"telemetry run {self.run!r}: ranks recorded different steps at once ({steps}); every rank "
                "must call Monitor.step with the same step numbers (or pass gather=False)"
            )
        if self.rank != 0:
            return
        times = [r[1] for r in rows]
        exposed_all = [r[2] for r in rows if math.isfinite(r[2])]
        slowest = max(range(len(times)), key=lambda i: times[i])
        self._emit(
            "summary",
            step=step,
            step_s_max=times[slowest],
            step_s_min=min(times),
            slowest_rank=slowest,
            exposed_s_max=max(exposed_all) if exposed_all else None,
            ranks=len(rows),
            step_s_by_rank=times,
        )

    # ------------------------------------------------------------------ output
    def _emit(self, kind: str, **fields: Any) -> dict[str, Any]:
        now = time.time()
        record = clean(
            {
                "schema": SCHEMA,
                "kind": kind,
                "run": self.run,
                "rank": self.rank,
                "world_size": self.world_size,
                "time": now,
                "time_iso": iso_time(now),
                **fields,
            }
        )
        for sink in self.sinks:
            if id(sink) in self._failed_sinks:
                continue
            try:
                sink.write(record)
            except BaseException:
                self._failed_sinks.add(id(sink))
                raise
        return record

    def flush(self) -> None:
        """Flush every sink (Parquet writes a part file of the rows since the last one; JSONL and
        CSV hand every line to the OS as written anyway)."""
        for sink in self.sinks:
            sink.flush()

    def close(self, error: BaseException | None = None) -> None:
        """Write the ``end`` line (with ``error`` when the run failed) and close the sinks.
        A second call does nothing.

        Every sink is closed whatever fails. Without ``error`` the first failure is raised
        (one exception, e.g. :class:`cokit.files.WriteError` on a full disk); with ``error``
        (the run is already failing with it, e.g. a sink's own write) failures here are
        dropped, so the caller's exception is the one that surfaces, without a chain of
        others. A sink that failed a write gets no ``end`` line."""
        if self._closed:
            return
        self._closed = True
        extra = {"error": f"{type(error).__name__}: {error}"[:1000]} if error is not None else {}
        problems: list[Exception] = []
        try:
            if error is None:
                self._finish_summary()
            elif self._pending is not None:  # another rank may never join the last gather
                _ABANDONED.append(self._pending[1])
                self._pending = None
            self._emit("end", steps=self.steps, wall_s=float(self.clock()) - self._start, **extra)
        except Exception as exc:
            problems.append(exc)
        finally:
            for sink in self.sinks:
                try:
                    sink.close()
                except Exception as exc:  # close the others anyway
                    problems.append(exc)
        if problems and error is None:
            raise problems[0]

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        self.close(exc)

    def __repr__(self) -> str:
        return f"Monitor(run={self.run!r}, rank={self.rank}/{self.world_size}, folder={str(self.folder)!r}, steps={self.steps})"


def _first_param(optimizer: Any) -> torch.Tensor | None:
    groups = getattr(optimizer, "param_groups", None)
    if not groups:
        return None
    for g in groups:
        for p in g.get("params", ()):
            if isinstance(p, torch.Tensor):
                return p
    return None
