"""Compile-only builds of the GEMM for sm_80, sm_90 and gfx942 (no GPU needed).

All builds run in ONE subprocess without TRITON_INTERPRET (this file run as a script prints a
JSON report); the tests below check that report. What is checked:

* several configs per target compile, with shared memory and registers within the limits,
  and the shared-memory estimate used for pruning is an upper bound that is not far off;
* the smem_bytes knob: ``with_shared_memory`` yields a launchable Triton kernel object whose
  launch footprint (``metadata.shared``, the packed launch metadata) is the requested size,
  with the same binary, and the computed blocks/SM drops; on CUDA it equals what Triton's own
  ``min_shared_mem`` compile option produces (identical cubin);
* ``cokit occupancy --target ...`` prints the calculator's result.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
from helpers import ROOT, worker_report

MARK = "COKIT-COMPILE-REPORT:"
# one subprocess compiles ~15 kernels for three targets: ~30 s on 2 cores with a cold cache
pytestmark = pytest.mark.slow


# ---------------------------------------------------------------------- the worker (subprocess)
def _cases():
    import torch

    from cokit.triton_kernels.gemm_config import GemmConfig as G

    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    return {
        "sm_80": [
            (G(128, 256, 64, 8, num_warps=8, num_stages=3), bf16, {}),
            (G(128, 128, 64, 8, num_warps=4, num_stages=4), fp16, {"even_k": False, "has_bias": True}),
            (
                G(64, 64, 32, 8, num_warps=4, num_stages=4, persistent=True, num_sms=100, maxnreg=128),
                bf16,
                {},
            ),
            (G(128, 128, 32, 8, num_warps=4, num_stages=3), fp32, {"precision": "tf32"}),
        ],
        "sm_90": [
            (G(128, 256, 64, 8, num_warps=8, num_stages=3), bf16, {}),
            (G(128, 128, 64, 8, num_warps=8, num_stages=4, persistent=True), fp16, {}),
            (
                G(64, 128, 32, 8, num_warps=4, num_stages=4, maxnreg=128),
                bf16,
                {"even_k": False, "has_bias": True},
            ),
            (G(128, 128, 32, 8, num_warps=4, num_stages=3), fp32, {"precision": "tf32"}),
        ],
        "gfx942": [
            (G(256, 256, 64, 4, num_warps=8, num_stages=2, matrix_instr_nonkdim=32, kpack=2), bf16, {}),
            (G(128, 128, 64, 8, num_warps=4, num_stages=2, waves_per_eu=2), fp16, {"has_bias": True}),
            (
                G(128, 128, 32, 1, num_warps=8, num_stages=2, persistent=True, matrix_instr_nonkdim=32),
                bf16,
                {},
            ),
            (G(64, 64, 32, 1, num_warps=4, num_stages=2), fp32, {"even_k": False}),
        ],
    }


# one config per target for the smem_bytes knob: (config, dtype)
def _knob_cases():
    import torch

    from cokit.triton_kernels.gemm_config import GemmConfig as G

    return {
        "sm_80": (G(128, 128, 64, 8, num_warps=4, num_stages=3), torch.bfloat16),
        "sm_90": (G(128, 128, 64, 8, num_warps=8, num_stages=3), torch.bfloat16),
        # 64x128: two blocks per CU on triton 3.6 and 3.9 (128x128 needs 268 VGPRs on 3.6: one)
        "gfx942": (G(64, 128, 64, 8, num_warps=4, num_stages=2), torch.bfloat16),
    }


def _worker() -> dict:
    import contextlib
    import io
    import time
    import traceback

    from cokit.triton_kernels._compat import compile_option_names
    from cokit.triton_kernels.backend import arch_limits
    from cokit.triton_kernels.gemm import compile_gemm
    from cokit.triton_kernels.gemm_config import dtype_name, estimate_shared_bytes
    from cokit.triton_kernels.occupancy import kernel_occupancy, smem_for_blocks
    from cokit.triton_kernels.shaped_launch import with_shared_memory

    report: dict = {"builds": [], "knob": {}, "cli": {}}
    for target, cases in _cases().items():
        limits = arch_limits(target)
        for cfg, dtype, kw in cases:
            row = {"target": target, "config": cfg.spec(), "dtype": dtype_name(dtype), **kw}
            t0 = time.time()
            try:
                k = compile_gemm(cfg, dtype, target, **kw)
                k.check_limits()
                occ = kernel_occupancy(k)
                row.update(
                    ok=True,
                    shared=k.shared_bytes,
                    registers=k.registers,
                    spills=k.spills,
                    num_warps=k.num_warps,
                    name=k.name,
                    estimate=estimate_shared_bytes(cfg, dtype, limits, kw.get("precision", "ieee")),
                    blocks_per_sm=occ.blocks_per_sm,
                    limiting=occ.limiting,
                )
            except Exception:
                row.update(ok=False, error=traceback.format_exc()[-2000:])
            row["seconds"] = round(time.time() - t0, 2)
            report["builds"].append(row)

    for target, (cfg, dtype) in _knob_cases().items():
        limits = arch_limits(target)
        out: dict = {"config": cfg.spec()}
        try:
            base = compile_gemm(cfg, dtype, target)
            before = kernel_occupancy(base)
            request = smem_for_blocks(limits, before.blocks_per_sm - 1)
            shaped = with_shared_memory(base, request)
            after = kernel_occupancy(shaped)
            tk = shaped.compiled
            out.update(
                used=base.shared_bytes,
                registers=base.registers,
                request=request,
                shaped_shared_bytes=shaped.shared_bytes,
                metadata_shared=tk.metadata.shared,
                packed_metadata=list(tk.packed_metadata),
                base_metadata_shared=base.compiled.metadata.shared,
                same_binary=tk.kernel == base.compiled.kernel,
                same_name=tk.metadata.name == base.compiled.metadata.name,
                launchable=callable(getattr(tk, "__getitem__", None)) and tk.function is None,
                type=type(tk).__module__ + "." + type(tk).__qualname__,
                blocks_before=before.blocks_per_sm,
                blocks_after=after.blocks_per_sm,
                limiting_after=after.limiting,
            )
            for bad in (base.shared_bytes - 1, limits.max_shared_per_block + 1):
                try:
                    with_shared_memory(base, bad)
                    out.setdefault("errors", []).append(None)
                except ValueError as exc:
                    out.setdefault("errors", []).append(str(exc))
            if limits.backend == "cuda" and "min_shared_mem" in compile_option_names("cuda", limits.arch, 32):
                # Triton's own CUDA option (not in every version): same code, larger metadata.shared
                native = compile_gemm(cfg, dtype, target, extra_options={"min_shared_mem": request})
                out.update(
                    native_shared=native.shared_bytes,
                    native_packed=list(native.compiled.packed_metadata),
                    native_same_cubin=native.compiled.asm["cubin"] == base.compiled.asm["cubin"],
                    native_same_ptx=native.compiled.asm["ptx"] == base.compiled.asm["ptx"],
                )
            out["ok"] = True
        except Exception:
            out.update(ok=False, error=traceback.format_exc()[-2000:])
        report["knob"][target] = out

    # the CLI, in this process (no TRITON_INTERPRET here)
    import argparse

    from cokit.commands import occupancy as occupancy_cmd

    parser = argparse.ArgumentParser(prog="cokit")
    occupancy_cmd.add_parser(parser.add_subparsers(dest="command"))
    runs = {
        "sm_90_json": [
            "--target",
            "sm_90",
            "--dtype",
            "bf16",
            "--json",
            "--config",
            "BLOCK_M=128,BLOCK_N=128,BLOCK_K=64,num_warps=8,num_stages=3,smem_bytes=115840",
        ],
        "gfx942_table": [
            "--target",
            "gfx942",
            "--dtype",
            "fp16",
            "--config",
            "BLOCK_M=128,BLOCK_N=128,BLOCK_K=64,num_warps=4,num_stages=2,waves_per_eu=2",
        ],
        "sm_90_too_small": [
            "--target",
            "sm_90",
            "--config",
            "BLOCK_M=128,BLOCK_N=128,BLOCK_K=64,num_warps=8,num_stages=3,smem_bytes=70000",
        ],
    }
    from cokit.cli import CliError

    for name, argv in runs.items():
        buf = io.StringIO()
        try:
            with contextlib.redirect_stdout(buf):
                args = parser.parse_args(["occupancy", *argv])
                rc = args.func(args)
            report["cli"][name] = {"rc": rc, "stdout": buf.getvalue()}
        except CliError as exc:
            report["cli"][name] = {"rc": 2, "error": str(exc)}
        except Exception:
            report["cli"][name] = {"rc": 1, "error": traceback.format_exc()[-2000:]}
    return report


# ---------------------------------------------------------------------- the tests
@pytest.fixture(scope="module")
def report() -> dict:
    return worker_report(__file__, mark=MARK, timeout=900, TRITON_DEFAULT_FP_FUSION="1")


def _builds(report: dict, target: str) -> list[dict]:
    rows = [r for r in report["builds"] if r["target"] == target]
    assert rows
    return rows


@pytest.mark.parametrize("target", ["sm_80", "sm_90", "gfx942"])
def test_configs_compile_within_limits(report, target):
    from cokit.triton_kernels.backend import arch_limits

    limits = arch_limits(target)
    for row in _builds(report, target):
        assert row["ok"], f"{target} {row['config']} {row['dtype']}:\n{row.get('error')}"
        assert 0 < row["shared"] <= limits.max_shared_per_block, row
        assert row["registers"] is not None and 0 < row["registers"] <= limits.max_registers_per_thread, row
        assert row["num_warps"] == int(row["config"].split("num_warps=")[1].split(",")[0])
        assert row["blocks_per_sm"] >= 1, row
        # the pruning estimate is an upper bound, and not a loose one
        assert row["shared"] <= row["estimate"] <= 2 * row["shared"], row


def test_vendor_knobs_reach_the_compiler(report):
    """maxnreg caps registers on CUDA; the persistent form is its own kernel."""
    for target in ("sm_80", "sm_90"):
        capped = [r for r in _builds(report, target) if "maxnreg=128" in r["config"]]
        assert capped and all(r["registers"] <= 128 for r in capped)
    persistent = [r for r in report["builds"] if "persistent=True" in r["config"]]
    assert persistent and all(r["name"].startswith("_gemm_persistent_kernel") for r in persistent)


@pytest.mark.parametrize("target", ["sm_80", "sm_90", "gfx942"])
def test_smem_bytes_knob(report, target):
    k = report["knob"][target]
    assert k["ok"], k.get("error")
    req = k["request"]
    assert req > k["used"]
    # the launchable copy: a Triton CompiledKernel, not yet loaded, same binary and name
    assert k["type"] == "triton.compiler.compiler.CompiledKernel" and k["launchable"]
    assert k["same_binary"] and k["same_name"]
    # its launch footprint is the requested size (metadata.shared and the packed launch
    # metadata (num_warps, num_ctas, shared) the launcher passes as dynamic shared memory)
    assert k["shaped_shared_bytes"] == k["metadata_shared"] == req
    assert k["packed_metadata"][-1] == req
    assert k["base_metadata_shared"] == k["used"]  # the original is untouched
    # residency drops by one block per SM, limited by shared memory
    assert k["blocks_after"] == k["blocks_before"] - 1 >= 1
    assert k["limiting_after"] == "shared memory"
    below, above = k["errors"]
    assert below and f"smem_bytes={k['used'] - 1} is below the {k['used']} B" in below
    assert above and "above the device limit" in above


@pytest.mark.parametrize("target", ["sm_80", "sm_90"])
def test_smem_knob_equals_tritons_min_shared_mem_on_cuda(report, target):
    k = report["knob"][target]
    if "native_shared" not in k:
        pytest.skip("the installed triton has no CUDA min_shared_mem compile option")
    assert k["native_shared"] == k["request"]
    assert k["native_packed"] == k["packed_metadata"]
    assert k["native_same_cubin"] and k["native_same_ptx"]


def test_cli_occupancy_for_named_targets(report):
    from cokit.triton_kernels.backend import arch_limits

    run = report["cli"]["sm_90_json"]
    assert run["rc"] == 0, run
    data = json.loads(run["stdout"])
    assert data["target"] == "sm_90" and data["shared_bytes"] == 115840
    assert data["kernel_shared_bytes"] == report["knob"]["sm_90"]["used"]
    assert data["blocks_per_sm"] == 1 and data["limiting"] == "shared memory"
    assert data["occupancy"] == 8 / 64
    assert data["resident_blocks"] == arch_limits("sm_90").num_sms
    run = report["cli"]["gfx942_table"]
    assert run["rc"] == 0, run
    out = run["stdout"]
    assert "gfx942" in out and "blocks / CU" in out and "limited by" in out and "occupancy shaping" in out
    run = report["cli"]["sm_90_too_small"]
    assert run["rc"] == 2 and "smem_bytes=70000 is below the" in run["error"]


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("run without TRITON_INTERPRET")
    sys.path.insert(0, str(ROOT))
    print(MARK + json.dumps(_worker()))
