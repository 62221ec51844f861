"""Compile-only builds of every compression kernel for sm_80, sm_90 and gfx942, every shipped
launch config, and their resources.

The interpreter hides GPU-only errors (tl.dot shapes, layouts, register pressure); these
builds run the real compiler in a subprocess without TRITON_INTERPRET. Resources come from
``ptxas -v`` (NVIDIA) and the AMDGCN metadata (AMD): no build may spill a VGPR on AMD, and
none may have stack or spill bytes on NVIDIA (both checked on triton 3.6 and 3.9).
"""

import json
import os
import subprocess
import sys

import pytest
import triton

from cokit.triton_kernels import compress_config, tiling
from cokit.triton_kernels.compile_only import kernel_specs

TARGETS = ["sm_80", "sm_90", "gfx942"]


@pytest.fixture(scope="module")
def report():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "cokit.triton_kernels.compile_only", *TARGETS],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # the report compiles about 110 builds (~2-4 min on 2 cores)
def test_every_kernel_compiles_for_every_target(report):
    """The report (built in parallel processes) lists every build once, in spec order."""
    built = [(r["name"], r["target"]) for r in report]
    expected = [(label, t) for t in TARGETS for label, *_ in kernel_specs(t)]
    assert built == expected


@pytest.mark.slow
def test_resources_within_arch_limits(report):
    for r in report:
        assert 0 <= r["shared_bytes"] <= r["max_shared_per_block"], r
        assert r["registers"] is not None and 0 < r["registers"] <= r["max_registers_per_thread"], r


@pytest.mark.slow
def test_shared_memory_estimate_bounds_every_compression_build(report):
    """The fit check's shared-memory estimate (what rejects a too-large block before a launch)
    is at least what each compiled DCT and error-feedback build reserves."""
    blocks = {mode: (rows, width) for mode, _, rows, width in tiling.compile_blocks()}
    checked = 0
    for r in report:
        kernel, _, mode = r["name"].split("[")[0].rpartition("_")
        if kernel not in compress_config.KERNELS:
            continue
        backend = "cuda" if r["target"].startswith("sm_") else "hip"
        estimate = compress_config.estimate_shared_bytes(kernel, blocks[mode], backend)
        assert r["shared_bytes"] <= estimate, r
        checked += 1
    assert checked > 40


def _nvidia_spills(r):
    return r["stack_bytes"] or r["spill_stores"] or r["spill_loads"]


@pytest.mark.slow
def test_no_vgpr_spills_on_amd(report):
    amd = [r for r in report if r["target"].startswith("gfx")]
    assert amd
    for r in amd:
        assert r["vgpr_spills"] == 0 and r["stack_bytes"] == 0, r
        assert r["sgpr_spills"] is not None and r["occupancy"] is not None and r["occupancy"] >= 1, r


@pytest.mark.slow
def test_nvidia_builds_have_no_stack_or_spills(report):
    nvidia = [r for r in report if r["target"].startswith("sm_")]
    assert nvidia and all(r["stack_bytes"] is not None for r in nvidia), "ptxas did not report"
    spilling = {(r["name"], r["target"]): r["stack_bytes"] for r in nvidia if _nvidia_spills(r)}
    assert not spilling, f"builds that spill on triton {triton.__version__} (stack bytes): {spilling}"


@pytest.mark.slow
def test_aligned_builds_have_wider_memory_accesses(report):
    """Every ``+aligned`` build turns some of its twin's narrow global loads and stores into
    128-bit ones, on every target. Hints that never reach the compiler (triton 3.6 dropped a
    ``tl.multiple_of`` on a called function's result) leave the two builds alike."""
    rows = {(r["name"], r["target"]): r for r in report}
    pairs = [
        (r, rows[(r["name"].removesuffix("+aligned"), r["target"])])
        for r in report
        if r["name"].endswith("+aligned")
    ]
    assert {a["name"].split("[")[0] for a, _ in pairs} == {
        "dct_encode_2d",
        "dct_decode_2d",
        "dct_encode_1d",
        "dct_decode_1d",
        "ef_encode_2d",
        "ef_encode_1d",
        "ef_decode_2d",
        "ef_decode_1d",
    }
    alike = [
        f"{a['name']} on {a['target']}: {a['wide_accesses']}/{a['narrow_accesses']} wide/narrow, "
        f"without hints {b['wide_accesses']}/{b['narrow_accesses']}"
        for a, b in pairs
        if not (a["wide_accesses"] > b["wide_accesses"] and a["narrow_accesses"] < b["narrow_accesses"])
    ]
    assert not alike, f"alignment hints without effect on triton {triton.__version__}: {alike}"


def test_resource_parsers_read_the_compiler_reports():
    """The ptxas and AMDGCN readers on text in the tools' own formats (no compiler needed)."""
    from cokit.triton_kernels.compile_only import _PTXAS_REGS, _PTXAS_STACK, _hip_resources, global_accesses

    log = (
        "ptxas info    : Function properties for k\n"
        "    872 bytes stack frame, 968 bytes spill stores, 1224 bytes spill loads\n"
        "ptxas info    : Used 255 registers, used 1 barriers, 872 bytes cumulative stack size\n"
    )
    assert _PTXAS_STACK.search(log).groups() == ("872", "968", "1224")
    assert _PTXAS_REGS.search(log).group(1) == "255"
    amdgcn = (
        "; Occupancy: 2\n  - .agpr_count:     4\n    .private_segment_fixed_size: 16\n"
        "    .sgpr_count:     106\n    .sgpr_spill_count: 168\n    .vgpr_count:     208\n"
        "    .vgpr_spill_count: 0\n"
    )
    ptx = (
        "@%p1 ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];\n"
        "ld.global.L1::evict_last.b64 %rd5, [%rd6];\n"
        "st.global.v2.b64 [%rd7], {%rd8, %rd9};\n"
        "st.global.b16 [%rd10], %rs1;\n"
    )
    assert global_accesses(ptx, "cuda") == {"wide_accesses": 2, "narrow_accesses": 2}
    gcn = "global_load_dwordx4 v[0:3], v[4:5], off\nbuffer_load_dword v1, v2, s[0:3], 0 offen\nglobal_store_short v[0:1], v2, off\n"
    assert global_accesses(gcn, "hip") == {"wide_accesses": 1, "narrow_accesses": 2}
    assert _hip_resources(amdgcn) == {
        "registers": 212,
        "agprs": 4,
        "sgprs": 106,
        "vgpr_spills": 0,
        "sgpr_spills": 168,
        "stack_bytes": 16,
        "occupancy": 2,
    }


def test_compile_all_rejects_a_job_count_below_one():
    from cokit.triton_kernels.compile_only import compile_all

    with pytest.raises(ValueError, match="jobs must be >= 1"):
        compile_all(["sm_90"], jobs=0)


def test_compile_only_refuses_interpreter_process(monkeypatch):
    from cokit.triton_kernels.compile_only import compile_for_target

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # as in CPU test runs; GPU runs leave it unset
    _, fn, sig, constexprs, _ = kernel_specs("sm_90")[0]
    with pytest.raises(RuntimeError, match="without TRITON_INTERPRET"):
        compile_for_target(fn, sig, constexprs, "sm_90")


def test_compile_only_rejects_options_the_backend_lacks(monkeypatch):
    """Triton drops unknown options silently; compile_for_target names them instead (checked
    before compiling, so this needs no compiler)."""
    from cokit.triton_kernels.compile_only import compile_for_target

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    _, fn, sig, constexprs, _ = kernel_specs("sm_90")[0]
    with pytest.raises(ValueError, match=r"has no cuda compile option 'waves_per_eu'; allowed: .*num_warps"):
        compile_for_target(fn, sig, constexprs, "sm_90", waves_per_eu=2)


#: (target, kernel, mode) whose default build still holds one block per SM: the fused 2-D
#: encode on sm_90 (tf32x3 at 8 warps: 182-208 registers; at 4 it spills 32 B on triton 3.9)
#: and the fused 1-D decode on sm_80 and sm_90 (at 4 warps it spills 280 B on sm_80 with
#: triton 3.6, 144-280 B on sm_90).
ONE_BLOCK_DEFAULTS = {
    ("sm_90", "ef_encode", "2d"),
    ("sm_90", "ef_decode", "1d"),
    ("sm_80", "ef_decode", "1d"),
}


@pytest.mark.slow
def test_default_compression_builds_keep_two_blocks_per_sm(report):
    """The default config (the first of the chip's space for the block's mode) of every DCT
    build and of the fused kernels but :data:`ONE_BLOCK_DEFAULTS` leaves room for 2 resident
    blocks per SM by the occupancy calculator, so one block's loads overlap another's dots
    (they were 1 block at 8 warps)."""
    from cokit.triton_kernels.roofline import estimates

    by_build = {(e["name"], e["target"]): e for e in estimates(report)}
    checked = 0
    for target in ("sm_80", "sm_90"):
        arch = int(target.removeprefix("sm_"))
        for kernel in compress_config.KERNELS:
            for mode, two_d, rows, width in tiling.compile_blocks():
                if (target, kernel, mode) in ONE_BLOCK_DEFAULTS:
                    continue
                spec = compress_config.config_space(kernel, "cuda", (rows, width), arch, two_d)[0].spec()
                for suffix in ("", "+aligned"):
                    e = by_build[(f"{kernel}_{mode}[{spec}]{suffix}", target)]
                    assert e["blocks_per_sm"] >= 2, e
                    checked += 1
    assert checked == (2 * len(compress_config.KERNELS) * 2 - len(ONE_BLOCK_DEFAULTS)) * 2


@pytest.mark.slow
def test_gfx942_dct_basis_loads_are_wide_and_sgpr_clean(report):
    """The DCT basis is read with 128-bit loads on gfx942 too (its offsets are provably
    multiples of 256 elements; before, the buffer loads stayed 32-bit: 0 wide of 64 in the
    unhinted 64x64 encode), and no DCT build spills an SGPR."""
    dct = [
        r for r in report if r["target"] == "gfx942" and r["name"].startswith(("dct_encode", "dct_decode"))
    ]
    assert dct
    for r in dct:
        assert r["wide_accesses"] > 0 and r["sgpr_spills"] == 0, r


@pytest.mark.slow
def test_gfx942_builds_are_sgpr_clean_and_fused_encode_basis_loads_are_wide(report):
    """No gfx942 build spills an SGPR (the fused encode spilled 10-64 and chunk_topk 8-12: a
    wavefront keeps every boolean block in 64-bit SGPR pairs; the 1-D decode 20 at 4 waves:
    an exec mask per masked row load), and the fused encode reads its basis with 128-bit
    loads: every 4 basis fp32 of a thread in one load (the forward and the inverse transform
    each load ``B_w`` and, in TWO_D, ``B_h``)."""
    gfx = [r for r in report if r["target"] == "gfx942"]
    assert gfx
    spilling = {r["name"]: r["sgpr_spills"] for r in gfx if r["sgpr_spills"] != 0}
    assert not spilling, f"SGPR spills on triton {triton.__version__}: {spilling}"
    blocks = {mode: (two_d, rows, width) for mode, two_d, rows, width in tiling.compile_blocks()}
    encodes = [r for r in gfx if r["name"].startswith("ef_encode")]
    assert encodes
    for r in encodes:
        two_d, rows, width = blocks[r["name"].split("[")[0].rpartition("_")[2]]
        basis = 2 * (width * width + (rows * rows if two_d else 0))  # fp32 per block
        assert r["wide_accesses"] >= basis // (r["num_warps"] * 64 * 4), r
