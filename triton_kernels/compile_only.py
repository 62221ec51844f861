"""Compile Triton kernels for a named GPU target on a machine without that GPU.

Used by tests (GPU-only compile errors show up here, not under the interpreter), by the
occupancy calculator and by ``cokit info``. Must run in a process where
``TRITON_INTERPRET`` is unset: the interpreter replaces the compiler.

Every kernel family declares its own builds: a module-level ``compile_specs()`` returning
``(label, kernel, signature, constexprs)`` tuples. :func:`kernel_specs` collects them from the
modules named in :data:`KERNEL_MODULES`, imported by name when asked, so those modules never
import this one. The GEMM's builds are config-dependent and go through
:func:`cokit.triton_kernels.gemm.compile_gemm` instead.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
import shutil
import subprocess
import tempfile
from typing import Any

from ._compat import TRITON_VERSION_STRING, compile_option_names
from .backend import ArchLimits, arch_limits, compile_target

__all__ = ["KERNEL_MODULES", "CompiledKernel", "compile_all", "compile_for_target", "kernel_specs"]

#: modules of this package whose ``compile_specs()`` :func:`kernel_specs` collects, in order.
KERNEL_MODULES = ("dct", "error_feedback", "topk", "sm_copy")

#: (label, @triton.jit kernel, {argument: Triton type}, {constexpr argument: value})
KernelSpec = tuple[str, Any, dict[str, str], dict[str, Any]]


@dataclasses.dataclass(frozen=True)
class CompiledKernel:
    """What a compile-only build reports about one kernel on one target."""

    name: str
    target: str
    num_warps: int
    shared_bytes: int  # dynamic shared memory / LDS the launch reserves (metadata.shared)
    registers: int | None  # per thread (VGPRs on AMD); None when the tool to read it is missing
    spills: int | None
    limits: ArchLimits
    compiled: Any = dataclasses.field(repr=False, compare=False, default=None)

    def check_limits(self) -> None:
        """Raise when the kernel cannot launch on its target."""
        if self.shared_bytes > self.limits.max_shared_per_block:
            raise ValueError(
                f"{self.name} on {self.target} needs {self.shared_bytes} B of shared memory per "
                f"block; the limit is {self.limits.max_shared_per_block} B"
            )
        if self.registers is not None and self.registers > self.limits.max_registers_per_thread:
            raise ValueError(
                f"{self.name} on {self.target} uses {self.registers} registers per thread; "
                f"the limit is {self.limits.max_registers_per_thread}"
            )


def _cuobjdump() -> str | None:
    import triton

    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return bundled if os.path.exists(bundled) else shutil.which("cuobjdump")


def _cuda_registers(cubin: bytes) -> tuple[int | None, int | None]:
    tool = _cuobjdump()
    if tool is None:
        return None, None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    reg = re.search(r"REG:(\d+)", out)
    local = re.search(r"LOCAL:(\d+)", out)
    return (int(reg.group(1)) if reg else None, int(local.group(1)) if local else None)


def _hip_registers(amdgcn: str) -> tuple[int | None, int | None]:
    vgpr = re.search(r"\.vgpr_count:\s+(\d+)", amdgcn)
    agpr = re.search(r"\.agpr_count:\s+(\d+)", amdgcn)
    spill = re.search(r"\.vgpr_spill_count:\s+(\d+)", amdgcn)
    regs = None if vgpr is None else int(vgpr.group(1)) + (int(agpr.group(1)) if agpr else 0)
    return regs, (int(spill.group(1)) if spill else None)


def compile_for_target(
    fn: Any,
    signature: dict[str, str],
    constexprs: dict[str, Any],
    target: str,
    attrs: dict | None = None,
    **options: Any,
) -> CompiledKernel:
    """Build ``fn`` for ``target`` ('sm_80', 'sm_90', 'gfx90a', 'gfx942') without a GPU.

    ``signature`` maps every argument to a Triton type ('*fp32', 'i32', 'constexpr', ...);
    ``attrs`` are specialization attributes (``{(arg_index,): [["tt.divisibility", 16]]}``),
    what the JIT infers from real arguments on a GPU (aligned pointers, divisible sizes);
    ``options`` are launch options (num_warps, num_stages, maxnreg, waves_per_eu, ...).
    """
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("compile-only builds need a process without TRITON_INTERPRET=1")
    import triton
    from triton.compiler import ASTSource

    limits = arch_limits(target)
    known = compile_option_names(limits.backend, limits.arch, limits.warp_size)
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(
            f"triton {TRITON_VERSION_STRING} has no {limits.backend} compile option "
            f"{', '.join(map(repr, unknown))}; allowed: {', '.join(sorted(known))}"
        )
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=compile_target(target), options=options)
    if limits.backend == "cuda":
        regs, spills = _cuda_registers(compiled.asm["cubin"])
    else:
        regs, spills = _hip_registers(compiled.asm["amdgcn"])
    return CompiledKernel(
        name=compiled.metadata.name,
        target=target,
        num_warps=compiled.metadata.num_warps,
        shared_bytes=compiled.metadata.shared,
        registers=regs,
        spills=spills,
        limits=limits,
        compiled=compiled,
    )


def kernel_specs() -> list[KernelSpec]:
    """Every build of :data:`KERNEL_MODULES`: each module's ``compile_specs()``, in order."""
    specs: list[KernelSpec] = []
    for name in KERNEL_MODULES:
        module = importlib.import_module(f"{__package__}.{name}")
        specs.extend(module.compile_specs())
    return specs


def compile_all(targets: list[str], num_warps: int = 4) -> list[CompiledKernel]:
    """Compile every kernel of :func:`kernel_specs` for each target; raise on any failure."""
    out = []
    for target in targets:
        for label, fn, sig, constexprs in kernel_specs():
            try:
                ck = compile_for_target(fn, sig, constexprs, target, num_warps=num_warps)
            except Exception as exc:
                raise RuntimeError(f"{label} failed to compile for {target}: {exc}") from exc
            out.append(dataclasses.replace(ck, name=label, compiled=None))
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m cokit.triton_kernels.compile_only sm_80 sm_90 gfx942``: JSON report on stdout."""
    import argparse
    import json

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("targets", nargs="*", default=["sm_80", "sm_90", "gfx942"])
    args = parser.parse_args(argv)
    rows = []
    for ck in compile_all(args.targets):
        rows.append(
            {
                "kernel": ck.name,
                "target": ck.target,
                "num_warps": ck.num_warps,
                "shared_bytes": ck.shared_bytes,
                "registers": ck.registers,
                "spills": ck.spills,
                "max_shared_per_block": ck.limits.max_shared_per_block,
                "max_registers_per_thread": ck.limits.max_registers_per_thread,
            }
        )
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
