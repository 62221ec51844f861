"""What a :class:`~cokit.telemetry.Monitor` reads each step: communication stats, kernel
configs with their occupancy, tuner decisions and process facts.

Each reader is tolerant of older objects: a ``CommStats`` without timing fields gives null
times, a tuner without an in-memory log is read from its JSONL file.
"""

from __future__ import annotations

import json
import resource
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = ["CommReader", "TunerReader", "device_name", "kernel_entry", "max_memory_bytes"]

_TIMES = ("encode_s", "decode_s", "exposed_s", "comm_s")
_BYTES = ("sent_bytes", "received_bytes", "dense_bytes")


def _stats_dict(stats: Any) -> dict[str, Any]:
    as_dict = getattr(stats, "as_dict", None)
    if callable(as_dict):
        d = as_dict()
        if isinstance(d, Mapping):
            return dict(d)
    return {k: v for k, v in vars(stats).items() if not k.startswith("_")}


class CommReader:
    """Reads ``source.comm_stats`` after each step: what happened since the previous read.

    ``source`` is anything with a ``comm_stats`` attribute whose ``as_dict()`` gives the
    :class:`~cokit.compress.stats.CommStats` fields (DeMo, DCTTopKState, overlap schedules,
    cokit.train's methods). The attribute is looked up every time (``load_state_dict`` may
    replace the object). One optimizer step since the last read gives that step's fields;
    several (a Monitor called every N steps) give the differences of the running totals;
    none gives zero bytes and times.
    """

    def __init__(self, source: Any) -> None:
        self.source = source
        self._last = self._read()

    def _read(self) -> dict[str, Any] | None:
        stats = getattr(self.source, "comm_stats", None)
        return None if stats is None else _stats_dict(stats)

    def read(self) -> dict[str, Any] | None:
        """The ``comm`` object of a step record, or None when the source has no stats."""
        d = self._read()
        if d is None:
            return None
        prev, self._last = self._last, d
        steps, prev_steps = d.get("steps"), (prev or {}).get("steps")
        n = steps - prev_steps if isinstance(steps, int) and isinstance(prev_steps, int) else None
        out: dict[str, Any] = {}
        if n is None or n == 1 or n < 0 or prev is None:  # one step (or stats were reset): its fields
            for key in (*_TIMES, *_BYTES):
                out[key] = d.get(f"step_{key}")
            out["collectives"] = d.get("step_collectives")
        elif n == 0:
            for key in _TIMES:
                out[key] = 0.0 if f"total_{key}" in d else None
            for key in _BYTES:
                out[key] = 0
            out["collectives"] = [] if "step_collectives" in d else None
        else:  # several optimizer steps: the differences of the totals
            for key in (*_TIMES, *_BYTES):
                now, before = d.get(f"total_{key}"), prev.get(f"total_{key}")
                out[key] = now - before if now is not None and before is not None else None
            out["collectives"] = d.get("step_collectives")  # the last step's
        out["ratio"] = d.get("ratio")
        out["world_size"] = d.get("world_size")
        out["group_size"] = d.get("group_size")
        out["steps"] = n if n is not None and n >= 0 else 1
        return out


class TunerReader:
    """The decisions an ``OnlineTuner`` made since the previous read: from its in-memory
    ``log`` list when it has one, else read incrementally from its JSONL ``log_path``."""

    def __init__(self, tuner: Any) -> None:
        log = getattr(tuner, "log", None)
        path = getattr(tuner, "log_path", None)
        if not isinstance(log, list) and path is None:
            raise TypeError(
                f"attach_tuner needs an OnlineTuner (or an object with a `log` list or a "
                f"`log_path` JSONL file), got {type(tuner).__name__}"
            )
        self.tuner = tuner
        self._index = 0  # decisions made before attaching count too (the initial exploration)
        self._offset = 0
        self._path = Path(path) if path is not None and not isinstance(log, list) else None

    def read(self) -> list[dict[str, Any]]:
        """New decisions (dicts: event, call, wall_time, candidate, reason, ...)."""
        if self._path is None:
            log = self.tuner.log
            new = log[self._index :]
            self._index = len(log)
            return [dict(d) for d in new]
        try:
            with self._path.open("rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1  # whole lines only; a line being written waits
        self._offset += end
        out = []
        for line in data[:end].splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict):
                out.append(rec)
        return out


def kernel_entry(
    name: str,
    config: Any,
    *,
    device: torch.device | None,
    dtype: str | torch.dtype,
    target: str | None,
    occupancy: Any = None,
) -> dict[str, Any]:
    """A step record's ``kernels`` entry for a GemmConfig: its fields and its occupancy.

    Limits come from the live GPU when ``device`` is a CUDA device, else from the named
    ``target`` (``'sm_90'`` by default: the table of :mod:`cokit.triton_kernels.backend`); the
    shared memory per block is ``config.smem_bytes`` or the estimate of
    :func:`~cokit.triton_kernels.gemm_config.estimate_shared_bytes`; registers are not known
    without compiling, so they do not limit here. ``occupancy`` (an
    :class:`~cokit.triton_kernels.occupancy.Occupancy`, e.g. from ``gemm_occupancy``, which
    compiles) replaces the estimate.
    """
    from cokit.overlap.guard import reserved_sms
    from cokit.triton_kernels.backend import arch_limits, cached_device_limits
    from cokit.triton_kernels.gemm_config import GemmConfig, estimate_shared_bytes, parse_dtype
    from cokit.triton_kernels.occupancy import occupancy as compute_occupancy

    if not isinstance(config, GemmConfig):
        raise TypeError(
            f"add_kernel({name!r}) needs a cokit.triton_kernels.gemm_config.GemmConfig, "
            f"got {type(config).__name__}"
        )
    if device is not None and device.type == "cuda" and target is None:
        limits = cached_device_limits(device)
    else:
        limits = arch_limits(target or "sm_90")
    if occupancy is None:
        smem = (
            config.smem_bytes
            if config.smem_bytes is not None
            else estimate_shared_bytes(config, parse_dtype(dtype), limits)
        )
        occupancy = compute_occupancy(config.num_warps, smem, None, limits)
    return {
        "name": name,
        "config": config.to_dict(),
        "blocks_per_sm": occupancy.blocks_per_sm,
        "limiter": occupancy.limiting,
        "smem_per_block": occupancy.shared_bytes,
        "reserved_sms": reserved_sms(config, limits),
        "target": limits.target_name,
        "limits": limits.source,
        "occupancy": occupancy.occupancy,
    }


def device_name(device: torch.device) -> str:
    """``'cuda:0 (NVIDIA H200)'``, ``'cpu'``..."""
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda:{index} ({torch.cuda.get_device_name(index)})"
    return str(device)


def max_memory_bytes(device: torch.device) -> int:
    """The memory high-water mark: ``torch.cuda.max_memory_allocated`` on a GPU (no
    synchronization), the process's peak resident set size (``ru_maxrss``) on CPU."""
    if device.type == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux
