"""Run a function on every rank of a local process group (loopback), or in the current one.

The one launcher of cokit (``cokit demo``/``sweep``/``bench``, notebooks, benchmarks, tests):
under ``torchrun`` (``RANK``/``WORLD_SIZE`` in the environment) the group comes from the
environment; otherwise ``world_size`` processes are spawned on this machine (gloo on CPU,
NCCL/RCCL with one GPU per rank), each with torchrun's rank variables set. Spawned ranks
never outlive the process that spawned them: on Linux each asks the kernel for SIGKILL when
its parent dies (``PR_SET_PDEATHSIG``), and SIGTERM to the parent terminates them first.

Spawned ranks listen on no outside interface: they meet through a ``file://`` rendezvous in a
private temporary folder (torch's TCP store would listen on every interface, whatever
``MASTER_ADDR`` says), and on loopback gloo's and NCCL's own sockets are bound to the loopback
interface (``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME``) unless ``env`` names another.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import ipaddress
import os
import pickle
import queue as queue_module
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from cokit.triton_kernels._checks import check_int

__all__ = [
    "RankFailed",
    "backend_for",
    "free_port",
    "in_torchrun",
    "is_loopback",
    "local_device",
    "loopback_interface",
    "run",
    "spawn",
]


class RankFailed(RuntimeError):
    """A spawned rank raised: the message holds its traceback; ``rank`` is the rank and
    ``error`` its exception, when it could be carried back (pickled), else None."""

    def __init__(self, rank: int, trace: str, error: BaseException | None = None) -> None:
        super().__init__(f"rank {rank} failed:\n{trace}")
        self.rank = rank
        self.error = error


def _pickled(exc: BaseException) -> bytes | None:
    """``exc`` pickled for the parent (without its traceback), or None when it cannot be."""
    try:
        return pickle.dumps(exc)
    except Exception:
        return None


def _unpickled(data: bytes | None) -> BaseException | None:
    if data is None:
        return None
    try:
        error = pickle.loads(data)  # from our own child process
    except Exception:
        return None
    return error if isinstance(error, BaseException) else None


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def is_loopback(address: str) -> bool:
    """True for ``localhost`` and loopback IP addresses (127.0.0.0/8, ::1)."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:  # a host name: not known to be this machine's loopback
        return False


def loopback_interface() -> str:
    """The name of this machine's loopback interface (``lo`` on Linux, ``lo0`` on BSD/macOS)."""
    names = {name for _, name in socket.if_nameindex()}
    for name in ("lo", "lo0"):
        if name in names:
            return name
    raise RuntimeError(
        f"no loopback interface (lo, lo0) among this machine's interfaces {sorted(names)}; "
        "bring it up (`ip link set lo up`) or run under torchrun"
    )


def in_torchrun() -> bool:
    """True when launched by torchrun (the environment names this process's rank)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def local_device(device: str) -> torch.device:
    """``cpu``, or this process's GPU (``cuda:LOCAL_RANK``)."""
    if device == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def backend_for(device: str) -> str:
    """gloo for CPU tensors, NCCL (RCCL on ROCm) for GPU tensors."""
    return "nccl" if device == "cuda" else "gloo"


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent_pid: int) -> None:
    """Linux: have the kernel SIGKILL this process when its parent dies; exit now if the
    parent (``parent_pid``) is already gone. Elsewhere: nothing (no such kernel feature).

    The parent is the *thread* that started this process: :func:`spawn` blocks in it."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:  # it died before the request took effect
        os._exit(1)


def _entry(
    rank: int,
    world_size: int,
    init_method: str,
    backend: str,
    threads: int,
    fn: Callable,
    args: tuple,
    queue,
    child_setup: Callable[[int], None] | None = None,
    master_addr: str = "127.0.0.1",
    parent_pid: int | None = None,
) -> None:
    if parent_pid is not None:
        die_with_parent(parent_pid)
    import torch.distributed as dist

    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": master_addr,
        }
    )
    os.environ.pop("MASTER_PORT", None)  # no TCP store: the group meets through init_method
    torch.set_num_threads(threads)
    try:
        if child_setup is not None:  # e.g. enter this rank's network namespace
            child_setup(rank)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
        try:
            buffer = io.BytesIO()  # plain bytes: tensors must not travel as shared memory
            torch.save(fn(rank, world_size, *args), buffer)
            queue.put((rank, True, buffer.getvalue()))
        except BaseException as exc:  # reported before the group goes, so before its echoes on others
            queue.put((rank, False, (traceback.format_exc(), _pickled(exc))))
            return
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # reported to the parent
        queue.put((rank, False, (traceback.format_exc(), _pickled(exc))))


class _Terminated(BaseException):
    """SIGTERM reached :func:`spawn`'s parent process: stop its ranks, then die of it."""


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """While inside, SIGTERM raises :class:`_Terminated` (once) in the main thread, so the
    caller's cleanup runs; on the way out the previous handler is restored and, if SIGTERM
    came, applied (the default one ends this process with SIGTERM, as it would have)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous == signal.SIG_IGN:
        yield
        return
    came: list[int] = []

    def handler(signum: int, frame: Any) -> None:
        if not came:  # a second SIGTERM must not interrupt the cleanup of the first
            came.append(signum)
            raise _Terminated(signum)

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    except _Terminated:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
    if came:
        if callable(previous):
            previous(signal.SIGTERM, None)
        else:
            os.kill(os.getpid(), signal.SIGTERM)
        raise SystemExit(128 + signal.SIGTERM)


def _reap(procs: list, grace: float) -> None:
    """Join ``procs`` within ``grace`` seconds, then terminate (SIGTERM) what is left and,
    after 5 s more, kill it."""
    started = [p for p in procs if p.pid is not None]
    deadline = time.monotonic() + grace
    for p in started:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for stop in ("terminate", "kill"):
        alive = [p for p in started if p.is_alive()]
        if not alive:
            return
        for p in alive:
            getattr(p, stop)()
        deadline = time.monotonic() + 5.0
        for p in alive:
            p.join(timeout=max(0.0, deadline - time.monotonic()))


@contextlib.contextmanager
def _child_env(env: Mapping[str, str | None]) -> Iterator[None]:
    """Set (None: remove) variables while the children start, so they see them at import."""
    saved = {k: os.environ.get(k) for k in env}
    try:
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def spawn(
    world_size: int,
    fn: Callable,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 900.0,
    env: Mapping[str, str | None] | None = None,
    master_addr: str = "127.0.0.1",
    child_setup: Callable[[int], None] | None = None,
) -> list[Any]:
    """Spawn ``world_size`` ranks on ``backend``, run ``fn(rank, world_size, *args)`` on each
    (a module-level function), return the results in rank order.

    ``env`` sets (or with None removes) variables in the children from their start. A rank
    that raises, dies or outlives ``timeout`` seconds raises ``RuntimeError``/``TimeoutError``
    here with its traceback (a raise: :class:`RankFailed`, which also carries the exception).
    Each rank gets ``cpu_count // world_size`` threads. The ranks die with this process
    (SIGKILL on Linux, from the kernel) and SIGTERM to it terminates them first; call from the
    thread that stays in this call (the main one for SIGTERM).
    ``master_addr`` is rank 0's address (``MASTER_ADDR`` in the ranks); ``child_setup(rank)``, a
    module-level function (or a partial of one), runs in each child before the group is
    created (e.g. to enter the rank's network namespace, :mod:`cokit.bench.netbed`); its errors fail
    that rank. The ranks meet through a file in a private temporary folder (removed afterwards),
    so no rendezvous port is opened; when ``master_addr`` is a loopback address, gloo (NCCL)
    binds its sockets to the loopback interface unless ``env`` sets ``GLOO_SOCKET_IFNAME``
    (``NCCL_SOCKET_IFNAME``).
    """
    import torch.multiprocessing as mp

    check_int("world_size", world_size)
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r} is invalid; allowed: gloo, nccl")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(f"backend nccl needs {world_size} GPUs here; found {torch.cuda.device_count()}")
    child_env: dict[str, str | None] = dict(env or {})
    if is_loopback(master_addr):
        ifname = "GLOO_SOCKET_IFNAME" if backend == "gloo" else "NCCL_SOCKET_IFNAME"
        child_env.setdefault(ifname, loopback_interface())
    threads = max(1, (os.cpu_count() or 1) // world_size)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    rendezvous = tempfile.mkdtemp(prefix="cokit-rendezvous-")  # mode 0700: this user's only
    init_method = "file://" + os.path.join(rendezvous, "store")
    results: dict[int, Any] = {}
    with _sigterm_raises():
        try:
            procs = [
                ctx.Process(
                    target=_entry,
                    args=(r, world_size, init_method, backend, threads, fn, args, queue),
                    kwargs={
                        "child_setup": child_setup,
                        "master_addr": master_addr,
                        "parent_pid": os.getpid(),
                    },
                    daemon=True,
                )
                for r in range(world_size)
            ]
            _wait_for_ranks(procs, queue, results, timeout, child_env)
        finally:  # before a SIGTERM ends this process
            shutil.rmtree(rendezvous, ignore_errors=True)
    return [results[r] for r in range(world_size)]


def _wait_for_ranks(
    procs: list, queue, results: dict[int, Any], timeout: float, env: Mapping[str, str | None] | None
) -> None:
    """Start ``procs`` and collect each rank's result into ``results``; always reap them."""
    world_size = len(procs)
    try:
        with _child_env(env or {}):
            for p in procs:
                p.start()
        deadline = time.monotonic() + timeout
        while len(results) < world_size:
            try:
                rank, ok, value = queue.get(timeout=1.0)
            except queue_module.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(
                        f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}"
                    ) from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks did not finish within {timeout:.0f} s") from None
                continue
            if not ok:
                trace, error = value
                raise RankFailed(rank, trace, _unpickled(error))
            results[rank] = torch.load(io.BytesIO(value), weights_only=False)
    except _Terminated:
        _reap(procs, grace=0.0)
        raise
    except BaseException:
        _reap(procs, grace=1.0)
        raise
    _reap(procs, grace=30.0)


def run(
    world_size: int,
    fn: Callable,
    *args: Any,
    device: str = "cpu",
    timeout: float = 900.0,
    env: Mapping[str, str | None] | None = None,
) -> list[Any] | None:
    """Run ``fn(rank, world_size, *args)`` on every rank; return the results in rank order.

    Under ``torchrun`` this process is one rank of the group the environment describes
    (``world_size`` and ``env`` are ignored): it sets its GPU (``cuda:LOCAL_RANK``) for
    ``device="cuda"``, joins the env:// group (or uses the one already initialised), runs
    ``fn``, gathers the results on rank 0 and destroys the group only if it created it; rank 0
    gets the list, the other ranks ``None``. Otherwise :func:`spawn` starts ``world_size``
    ranks on loopback (gloo for ``cpu``, NCCL/RCCL for ``cuda`` with one GPU per rank).
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r} is invalid; allowed: cpu, cuda")
    if not in_torchrun():
        return spawn(world_size, fn, *args, backend=backend_for(device), timeout=timeout, env=env)
    import torch.distributed as dist

    if device == "cuda":
        torch.cuda.set_device(local_device(device))
    created = not dist.is_initialized()
    if created:
        dist.init_process_group(backend_for(device), init_method="env://")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        out = fn(rank, world, *args)
        gathered: list[Any] | None = [None] * world if rank == 0 else None
        dist.gather_object(out, gathered, dst=0)
        return gathered
    finally:
        if created:
            dist.destroy_process_group()
