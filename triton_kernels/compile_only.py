"""Compile Triton kernels for a named GPU target on a machine without that GPU.

Used by tests (GPU-only compile errors show up here, not under the interpreter), by the
occupancy calculator and by ``cokit info --kernels``. Must run in a process where
``TRITON_INTERPRET`` is unset: the interpreter replaces the compiler.

Every kernel family declares its own builds: a module-level ``compile_specs(target)``
returning ``(label, kernel, signature, constexprs, launch options)`` tuples, one per shipped
launch configuration. :func:`kernel_specs` collects them from the modules named in
:data:`KERNEL_MODULES`, imported by name when asked, so those modules never import this one.
The GEMM's builds are config-dependent and go through
:func:`cokit.triton_kernels.gemm.compile_gemm` instead.

Resources are read where the compilers report them: on NVIDIA from ``ptxas -v`` run on the
build's PTX with the same ``ptxas`` and flags Triton uses (registers, stack frame, spill
stores and loads), on AMD from the AMDGCN kernel metadata and its "Kernel info" block (VGPRs,
AGPRs, SGPRs, VGPR and SGPR spills, scratch, occupancy in waves per SIMD); shared memory/LDS
is the launch's ``metadata.shared``.

Builds are specialized as the JIT specializes them for torch allocations on a GPU
(:func:`pointer_attrs`): without that, hints that rest on a pointer's alignment (the basis
loads, the ``ALIGNED`` builds) do not vectorize and the report describes another binary.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
import subprocess
import tempfile
from typing import Any

from ._compat import TRITON_VERSION_STRING, compile_option_names, ptxas_path
from .backend import ArchLimits, arch_limits, compile_target
from .roofline import bytes_per_element

__all__ = [
    "KERNEL_MODULES",
    "CompiledKernel",
    "compile_all",
    "compile_for_target",
    "global_accesses",
    "kernel_specs",
    "pointer_attrs",
    "resource_rows",
    "spill_problems",
]

#: modules of this package whose ``compile_specs(target)`` :func:`kernel_specs` collects, in order.
KERNEL_MODULES = ("dct", "error_feedback", "topk", "sm_copy")

#: (label, @triton.jit kernel, {argument: Triton type}, {constexpr argument: value},
#: {launch option: value})
KernelSpec = tuple[str, Any, dict[str, str], dict[str, Any], dict[str, Any]]


@dataclasses.dataclass(frozen=True)
class CompiledKernel:
    """What a compile-only build reports about one kernel on one target.

    Fields a backend does not have are None (``agprs``/``sgprs``/``vgpr_spills``/
    ``sgpr_spills``/``occupancy`` on NVIDIA; ``spill_stores``/``spill_loads`` on AMD), and
    so are NVIDIA's when ``ptxas`` is missing.
    """

    name: str
    target: str
    num_warps: int
    shared_bytes: int  # dynamic shared memory / LDS the launch reserves (metadata.shared)
    registers: int | None  # per thread: ptxas's registers (NVIDIA); VGPRs + AGPRs (AMD)
    limits: ArchLimits
    stack_bytes: int | None = None  # per-thread stack frame (NVIDIA) / scratch (AMD)
    spill_stores: int | None = None  # bytes per thread (NVIDIA)
    spill_loads: int | None = None  # bytes per thread (NVIDIA)
    agprs: int | None = None  # AMD accumulation registers (part of ``registers``)
    sgprs: int | None = None  # AMD scalar registers
    vgpr_spills: int | None = None  # AMD spilled VGPRs
    sgpr_spills: int | None = None  # AMD spilled SGPRs
    occupancy: int | None = None  # AMD waves per SIMD the compiler expects
    wide_accesses: int | None = None  # 128-bit global loads and stores in the code (static count)
    narrow_accesses: int | None = None  # narrower global loads and stores (static count)
    num_stages: int | None = None
    bytes_per_element: float | None = None  # HBM traffic per tensor element (roofline.bytes_per_element)
    compiled: Any = dataclasses.field(repr=False, compare=False, default=None)

    @property
    def spills(self) -> int | None:
        """One number for "does it spill": spill-store bytes (NVIDIA), spilled VGPRs + SGPRs
        (AMD); None when unknown."""
        if self.limits.backend == "cuda":
            return self.spill_stores
        if self.vgpr_spills is None:
            return None
        return self.vgpr_spills + (self.sgpr_spills or 0)

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

    def as_row(self) -> dict[str, Any]:
        """JSON-ready resource report (no compiled object)."""
        row = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in ("limits", "compiled")
        }
        row["max_shared_per_block"] = self.limits.max_shared_per_block
        row["max_registers_per_thread"] = self.limits.max_registers_per_thread
        return row


_PTX_ACCESS = re.compile(r"\b(?:ld|st)\.global((?:\.[\w:]+)+)")
_AMD_ACCESS = re.compile(r"\b(?:global|buffer)_(?:load|store)_(\w+)")


def global_accesses(asm: str, backend: str) -> dict[str, int]:
    """Global-memory load and store instructions in a build's code (PTX or AMDGCN), split
    into 128-bit ones and narrower ones: a static count, the number that shows whether the
    alignment hints turned a kernel's tensor accesses into vector accesses."""
    wide = narrow = 0
    if backend == "cuda":
        for suffix in _PTX_ACCESS.findall(asm):
            vec = re.search(r"\.v(\d)\b", suffix)
            bits = re.findall(r"\.[bsuf](\d+)\b", suffix)
            width = (int(vec.group(1)) if vec else 1) * (int(bits[-1]) if bits else 0)
            wide, narrow = (wide + 1, narrow) if width >= 128 else (wide, narrow + 1)
    else:
        for suffix in _AMD_ACCESS.findall(asm):
            wide, narrow = (
                (wide + 1, narrow) if suffix.startswith(("dwordx4", "b128")) else (wide, narrow + 1)
            )
    return {"wide_accesses": wide, "narrow_accesses": narrow}


_PTXAS_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")


def _cuda_resources(ptx: str, capability: int) -> dict[str, int | None]:
    """Registers, stack frame and spill bytes from ``ptxas -v`` on ``ptx`` (Triton's own tool
    and register-allocation flag), all None when ptxas is missing."""
    tool = ptxas_path(capability)
    if tool is None or not os.path.exists(tool):
        return {"registers": None, "stack_bytes": None, "spill_stores": None, "spill_loads": None}
    arch = f"sm_{capability}{'a' if capability >= 90 else ''}"
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [tool, "-lineinfo", "-v", "--regAllocOptLevel=2", f"--gpu-name={arch}", src, "-o", src + ".o"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"ptxas -v failed ({proc.returncode}): {log[-2000:]}")
    stack, regs = _PTXAS_STACK.search(log), _PTXAS_REGS.search(log)
    if stack is None or regs is None:
        raise RuntimeError(f"cannot read ptxas -v output: {log[-2000:]}")
    return {
        "registers": int(regs.group(1)),
        "stack_bytes": int(stack.group(1)),
        "spill_stores": int(stack.group(2)),
        "spill_loads": int(stack.group(3)),
    }


def _amd_field(amdgcn: str, pattern: str) -> int | None:
    m = re.search(pattern, amdgcn)
    return int(m.group(1)) if m else None


def _hip_resources(amdgcn: str) -> dict[str, int | None]:
    """VGPRs (+AGPRs), SGPRs, spills, scratch and occupancy from the AMDGCN metadata."""
    vgpr = _amd_field(amdgcn, r"\.vgpr_count:\s+(\d+)")
    agpr = _amd_field(amdgcn, r"\.agpr_count:\s+(\d+)")
    return {
        "registers": None if vgpr is None else vgpr + (agpr or 0),
        "agprs": agpr,
        "sgprs": _amd_field(amdgcn, r"\.sgpr_count:\s+(\d+)"),
        "vgpr_spills": _amd_field(amdgcn, r"\.vgpr_spill_count:\s+(\d+)"),
        "sgpr_spills": _amd_field(amdgcn, r"\.sgpr_spill_count:\s+(\d+)"),
        "stack_bytes": _amd_field(amdgcn, r"\.private_segment_fixed_size:\s+(\d+)"),
        "occupancy": _amd_field(amdgcn, r"; Occupancy:\s+(\d+)"),
    }


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
        resources = _cuda_resources(compiled.asm["ptx"], int(limits.arch))
        resources.update(global_accesses(compiled.asm["ptx"], "cuda"))
    else:
        resources = _hip_resources(compiled.asm["amdgcn"])
        resources.update(global_accesses(compiled.asm["amdgcn"], "hip"))
    return CompiledKernel(
        name=compiled.metadata.name,
        target=target,
        num_warps=compiled.metadata.num_warps,
        num_stages=getattr(compiled.metadata, "num_stages", None),
        shared_bytes=compiled.metadata.shared,
        limits=limits,
        compiled=compiled,
        **resources,
    )


def pointer_attrs(fn: Any, signature: dict[str, str], backend: str) -> dict[tuple[int, ...], list]:
    """The specialization attributes the JIT gives ``fn``'s pointer arguments when they are
    torch allocations (``ASTSource`` ``attrs``): 16-byte alignment and, on AMD, a buffer under
    2 GB (buffer loads and stores)."""
    attrs: dict[tuple[int, ...], list] = {}
    for name, ty in signature.items():
        if ty.startswith("*"):
            attr = [["tt.divisibility", 16]]
            if backend == "hip":
                attr.append(["tt.pointer_range", 32])
            attrs[(fn.arg_names.index(name),)] = attr
    return attrs


def kernel_specs(target: str) -> list[KernelSpec]:
    """Every build of :data:`KERNEL_MODULES` for ``target``: each module's
    ``compile_specs(target)`` (every shipped launch config of its kernels), in order."""
    specs: list[KernelSpec] = []
    for name in KERNEL_MODULES:
        module = importlib.import_module(f"{__package__}.{name}")
        specs.extend(module.compile_specs(target))
    return specs


def _compile_spec(target: str, index: int) -> CompiledKernel:
    """Build the ``index``-th of :func:`kernel_specs` for ``target`` (a worker of
    :func:`compile_all`: specs hold kernels, so each process collects its own)."""
    label, fn, sig, constexprs, options = kernel_specs(target)[index]
    try:
        attrs = pointer_attrs(fn, sig, arch_limits(target).backend)
        ck = compile_for_target(fn, sig, constexprs, target, attrs=attrs, **options)
    except Exception as exc:
        raise RuntimeError(f"{label} failed to compile for {target}: {exc}") from exc
    nbytes = bytes_per_element(label, sig, constexprs)
    return dataclasses.replace(ck, name=label, compiled=None, bytes_per_element=nbytes)


def compile_all(targets: list[str], jobs: int = 1) -> list[CompiledKernel]:
    """Compile every build of :func:`kernel_specs` for each target, with its launch options;
    raise on any failure. ``jobs > 1`` builds in that many spawned processes (a script that
    asks for them needs the ``if __name__ == "__main__":`` guard of :mod:`multiprocessing`);
    reports come back in spec order whatever the number of jobs."""
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    work = [(target, i) for target in targets for i in range(len(kernel_specs(target)))]
    jobs = min(len(work), jobs)
    if jobs <= 1:
        return [_compile_spec(target, i) for target, i in work]
    import concurrent.futures
    import multiprocessing

    # spawn, not fork: the parent may hold torch's and Triton's threads and locks.
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
        return list(pool.map(_compile_spec, *zip(*work, strict=True)))


def spill_problems(rows: list[dict[str, Any]]) -> list[str]:
    """What keeps each reported build (:meth:`CompiledKernel.as_row`) from being spill-free:
    any stack or spill bytes on NVIDIA, any VGPR spill or scratch on AMD, unknown resources.
    Empty when every build is clean."""
    problems = []
    for r in rows:
        where = f"{r['name']} on {r['target']}"
        if str(r["target"]).startswith("sm_"):
            if r["stack_bytes"] is None:
                problems.append(f"{where}: resources unknown (no ptxas)")
            elif r["stack_bytes"] or r["spill_stores"] or r["spill_loads"]:
                problems.append(
                    f"{where}: {r['stack_bytes']} B stack, {r['spill_stores']} B spill stores, "
                    f"{r['spill_loads']} B spill loads ({r['registers']} registers)"
                )
        elif r["vgpr_spills"] is None:
            problems.append(f"{where}: resources unknown (no AMDGCN metadata)")
        elif r["vgpr_spills"] or r["stack_bytes"]:
            problems.append(
                f"{where}: {r['vgpr_spills']} VGPR spills, {r['stack_bytes']} B scratch ({r['registers']} VGPRs+AGPRs)"
            )
    return problems


def resource_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    """A printable table (header first) of :meth:`CompiledKernel.as_row` reports, one line
    per build; a dash where the backend has no such resource."""

    def cell(row: dict[str, Any], *names: str) -> str:
        vals = [row.get(n) for n in names]
        return "-" if all(v is None for v in vals) else "/".join("-" if v is None else str(v) for v in vals)

    header = [
        "kernel",
        "target",
        "warps",
        "regs",
        "stack B",
        "spill st/ld B",
        "AGPR",
        "SGPR",
        "spills V/S",
        "smem B",
        "waves/SIMD",
        "ld/st 128b/narrow",
    ]
    table = [header]
    for r in rows:
        table.append(
            [
                str(r["name"]),
                str(r["target"]),
                cell(r, "num_warps"),
                cell(r, "registers"),
                cell(r, "stack_bytes"),
                cell(r, "spill_stores", "spill_loads"),
                cell(r, "agprs"),
                cell(r, "sgprs"),
                cell(r, "vgpr_spills", "sgpr_spills"),
                cell(r, "shared_bytes"),
                cell(r, "occupancy"),
                cell(r, "wide_accesses", "narrow_accesses"),
            ]
        )
    return table


def main(argv: list[str] | None = None) -> int:
    """``python -m cokit.triton_kernels.compile_only sm_80 sm_90 gfx942``: JSON report on stdout
    (one :meth:`CompiledKernel.as_row` per build; ``cokit info --kernels`` prints it as a table)."""
    import argparse
    import json

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("targets", nargs="*", default=["sm_80", "sm_90", "gfx942"])
    parser.add_argument(
        "--jobs", type=int, default=os.cpu_count() or 1, help="build processes (default: one per CPU)"
    )
    args = parser.parse_args(argv)
    print(json.dumps([ck.as_row() for ck in compile_all(args.targets, args.jobs)]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
