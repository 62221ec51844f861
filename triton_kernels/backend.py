"""Which code path runs a kernel, and what the target chip allows.

cokit kernels run on one of four paths:

* ``cuda``        -- Triton on an NVIDIA GPU,
* ``hip``         -- Triton on an AMD GPU (ROCm),
* ``interpreter`` -- Triton's CPU interpreter (``TRITON_INTERPRET=1`` set before import),
* ``torch``       -- the pure-torch reference of each kernel (no Triton, or CPU tensors
  without the interpreter).

The limits of the chips we tune for are tabulated below (vendor documentation, checked
against docs/design.md §3); on a machine with a GPU they are read live from the driver.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from typing import Literal

import torch

Path = Literal["cuda", "hip", "interpreter", "torch"]

__all__ = [
    "INTERPRET_OFF",
    "KNOWN_TARGETS",
    "ArchLimits",
    "Path",
    "arch_limits",
    "compile_target",
    "device_limits",
    "interpreter_enabled",
    "kernel_path",
    "read_interpret_setting",
    "triton_available",
]


def _import_triton() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # pragma: no cover - depends on the installation
        return False
    return True


_TRITON_AVAILABLE = _import_triton()  # a constant, so that torch.compile traces no cache


def triton_available() -> bool:
    """True when ``import triton`` works."""
    return _TRITON_AVAILABLE


def _environ_reader(name: str) -> Callable[[], object]:
    """A reader of one environment variable's raw value (None when unset), about 10x cheaper
    than ``os.environ.get``: it looks the key up in ``os.environ``'s own store (bytes on POSIX)
    without encoding the key or decoding the value each time. Changes made through
    ``os.environ`` (``monkeypatch.setenv`` included) are seen, as by ``os.environ.get``."""
    data = getattr(os.environ, "_data", None)
    encodekey = getattr(os.environ, "encodekey", None)
    if isinstance(data, dict) and callable(encodekey):
        return functools.partial(data.get, encodekey(name))
    return functools.partial(os.environ.get, name)  # pragma: no cover - other Pythons


#: ``TRITON_INTERPRET``'s raw value now (None when unset; bytes on POSIX): for per-call
#: paths, ``read_interpret_setting() in INTERPRET_OFF`` is :func:`interpreter_enabled`'s test
#: in about 30 ns (True means the interpreter is off)
read_interpret_setting = _environ_reader("TRITON_INTERPRET")
#: raw TRITON_INTERPRET values that leave the interpreter off
INTERPRET_OFF = frozenset({None, "", "0", b"", b"0"})


def interpreter_enabled() -> bool:
    """True when Triton kernels run on CPU tensors through the interpreter
    (``TRITON_INTERPRET`` set and not ``0``, read at every call)."""
    return _TRITON_AVAILABLE and read_interpret_setting() not in INTERPRET_OFF


@functools.cache
def _gpu_backend() -> str | None:
    """'cuda' or 'hip' when a GPU driver is active, else None."""
    if not torch.cuda.is_available():
        return None
    return "hip" if torch.version.hip else "cuda"


def kernel_path(device: torch.device | str | None = None) -> Path:
    """The path that a kernel taking tensors on ``device`` runs on.

    GPU tensors run Triton on that vendor's backend (torch when Triton is missing).
    CPU tensors run the Triton interpreter when ``TRITON_INTERPRET=1``, else the
    torch reference.
    """
    device = torch.device("cpu" if device is None else device)
    if device.type == "cuda":
        backend = _gpu_backend()
        if backend is None:
            raise RuntimeError(f"tensors are on {device} but torch sees no GPU")
        return backend if triton_available() else "torch"  # type: ignore[return-value]
    if device.type == "cpu":
        return "interpreter" if interpreter_enabled() else "torch"
    raise ValueError(f"cokit kernels run on cuda (NVIDIA/AMD) or cpu tensors, got device {device}")


@dataclasses.dataclass(frozen=True)
class ArchLimits:
    """Per-chip resource limits that decide occupancy.

    On AMD, an SM is a compute unit (CU), a warp is a wavefront and shared memory is LDS.
    ``reserved_shared_per_block`` is memory the runtime takes from each block's share
    (1 KiB on NVIDIA sm_80+), which counts against the per-SM pool.
    """

    name: str
    backend: Literal["cuda", "hip"]
    arch: int | str
    warp_size: int
    num_sms: int
    max_shared_per_block: int
    max_shared_per_sm: int
    reserved_shared_per_block: int
    registers_per_sm: int
    max_registers_per_thread: int
    register_alloc_unit: int
    max_warps_per_sm: int
    max_blocks_per_sm: int
    max_threads_per_block: int
    source: str = "table"

    @property
    def target_name(self) -> str:
        return f"sm_{self.arch}" if self.backend == "cuda" else str(self.arch)


# Sources: NVIDIA CUDA C Programming Guide, "Compute Capabilities" table (8.0, 9.0);
# AMD CDNA2 / CDNA3 ISA guides and the ROCm "GPU hardware specifications" table.
# num_sms is the common part (A100 SXM 108, H100/H200 SXM 132, one MI250X GCD 110, MI300X 304).
KNOWN_TARGETS: dict[str, ArchLimits] = {
    "sm_80": ArchLimits(
        name="NVIDIA A100 (sm_80)",
        backend="cuda",
        arch=80,
        warp_size=32,
        num_sms=108,
        max_shared_per_block=166912,
        max_shared_per_sm=167936,
        reserved_shared_per_block=1024,
        registers_per_sm=65536,
        max_registers_per_thread=255,
        register_alloc_unit=256,
        max_warps_per_sm=64,
        max_blocks_per_sm=32,
        max_threads_per_block=1024,
    ),
    "sm_90": ArchLimits(
        name="NVIDIA H100/H200 (sm_90)",
        backend="cuda",
        arch=90,
        warp_size=32,
        num_sms=132,
        max_shared_per_block=232448,
        max_shared_per_sm=233472,
        reserved_shared_per_block=1024,
        registers_per_sm=65536,
        max_registers_per_thread=255,
        register_alloc_unit=256,
        max_warps_per_sm=64,
        max_blocks_per_sm=32,
        max_threads_per_block=1024,
    ),
    # AMD: registers are 512 VGPRs (arch + accumulation) per lane per SIMD, 4 SIMDs per CU,
    # at most 8 waves per SIMD; counted here per CU in 32-bit registers per lane x wave slots.
    "gfx90a": ArchLimits(
        name="AMD MI250X GCD (gfx90a)",
        backend="hip",
        arch="gfx90a",
        warp_size=64,
        num_sms=110,
        max_shared_per_block=65536,
        max_shared_per_sm=65536,
        reserved_shared_per_block=0,
        registers_per_sm=4 * 512 * 64,
        max_registers_per_thread=512,
        register_alloc_unit=8 * 64,
        max_warps_per_sm=32,
        max_blocks_per_sm=32,
        max_threads_per_block=1024,
    ),
    "gfx942": ArchLimits(
        name="AMD MI300X (gfx942)",
        backend="hip",
        arch="gfx942",
        warp_size=64,
        num_sms=304,
        max_shared_per_block=65536,
        max_shared_per_sm=65536,
        reserved_shared_per_block=0,
        registers_per_sm=4 * 512 * 64,
        max_registers_per_thread=512,
        register_alloc_unit=8 * 64,
        max_warps_per_sm=32,
        max_blocks_per_sm=32,
        max_threads_per_block=1024,
    ),
}


def arch_limits(target: str) -> ArchLimits:
    """Limits of a named target: 'sm_80', 'sm_90', 'gfx90a' or 'gfx942'."""
    try:
        return KNOWN_TARGETS[target]
    except KeyError:
        raise ValueError(f"unknown target {target!r}; known targets: {', '.join(KNOWN_TARGETS)}") from None


def _table_key(props: object) -> str:
    """The KNOWN_TARGETS key closest to a live device, used for fields the driver omits."""
    arch = getattr(props, "gcnArchName", "") or ""
    if torch.version.hip:
        base = arch.split(":")[0]
        return base if base in KNOWN_TARGETS else "gfx942"
    major = getattr(props, "major", 9)
    return "sm_90" if major >= 9 else "sm_80"


def device_limits(device: torch.device | str | int | None = None) -> ArchLimits:
    """Limits of a live GPU, read from the driver (table values fill what it omits)."""
    if not torch.cuda.is_available():
        raise RuntimeError("device_limits needs a GPU; use arch_limits('sm_90') for a named target")
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if isinstance(device, int):
        dev = torch.device("cuda", device)
    props = torch.cuda.get_device_properties(dev)
    base = KNOWN_TARGETS[_table_key(props)]
    backend: Literal["cuda", "hip"] = "hip" if torch.version.hip else "cuda"
    arch: int | str = props.gcnArchName.split(":")[0] if backend == "hip" else props.major * 10 + props.minor
    warp = getattr(props, "warp_size", base.warp_size)
    threads_per_sm = getattr(props, "max_threads_per_multi_processor", base.max_warps_per_sm * warp)
    return dataclasses.replace(
        base,
        name=props.name,
        backend=backend,
        arch=arch,
        warp_size=warp,
        num_sms=props.multi_processor_count,
        max_shared_per_block=getattr(props, "shared_memory_per_block_optin", base.max_shared_per_block),
        max_shared_per_sm=getattr(props, "shared_memory_per_multiprocessor", base.max_shared_per_sm),
        registers_per_sm=getattr(props, "regs_per_multiprocessor", base.registers_per_sm),
        max_warps_per_sm=threads_per_sm // warp,
        source="driver",
    )


def device_index(device: torch.device | str | int | None = None) -> int:
    """The CUDA/HIP index of ``device`` (the current device when it names none)."""
    if isinstance(device, int):
        return device
    if device is not None and torch.device(device).index is not None:
        return torch.device(device).index
    return torch.cuda.current_device() if torch.cuda.is_available() else 0


@functools.cache
def cached_device_name(index: int) -> str:
    """``torch.cuda.get_device_name(index)``, asked once per process (tuning-cache keys)."""
    return torch.cuda.get_device_name(index)


@functools.cache
def _limits_at(index: int) -> ArchLimits:
    return device_limits(torch.device("cuda", index))


def cached_device_limits(device: torch.device | str | int | None = None) -> ArchLimits:
    """:func:`device_limits`, read from the driver once per device (for launch paths)."""
    return _limits_at(device_index(device))


def compile_target(target: str):
    """A ``triton.backends.compiler.GPUTarget`` for compile-only builds of a named target."""
    from triton.backends.compiler import GPUTarget

    limits = arch_limits(target)
    return GPUTarget(limits.backend, limits.arch, limits.warp_size)
