"""The GEMM configs cokit picks fit the chip: no spills, shared memory and registers in limits
(a spill costs speed, a limit overrun fails at launch, on GPUs the CPU suite never runs on).
Compile-only builds for sm_80, sm_90 and gfx942, no GPU needed.

Covered, for bf16, fp16 and fp32 on each target, with the installed Triton (CI runs the suite
on triton 3.9 and again on 3.6 with ``make test-triton36``):

* the default config (:func:`default_config` for the dtype and chip), tiled and persistent,
  and on NVIDIA the fp32 default at ``precision="tf32"`` too;
* a deterministic sample of the space the autotuner chooses from (the dtype's space pruned
  for the chip): :data:`SAMPLE` configs spread evenly over it, the middle one persistent.
  The vendor modules' spaces were checked whole when curated (their docstrings say so).

Zero spills is what ``ptxas -v`` reports on NVIDIA (0 B stack frame, spill stores and loads)
and the AMDGCN metadata on AMD (0 VGPR and SGPR spills, no scratch). All builds run in ONE
subprocess without TRITON_INTERPRET (this file run as a script prints a JSON report), as in
tests/test_gemm_compile.py.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import pytest
from helpers import ROOT, worker_report

MARK = "COKIT-CONFIG-FIT-REPORT:"
# ~47 builds in one subprocess: about 1-2 min on 2 cores with a cold Triton cache
pytestmark = pytest.mark.slow

TARGETS = ("sm_80", "sm_90", "gfx942")
DTYPES = ("bf16", "fp16", "fp32")
#: configs sampled from each pruned space, besides the default
SAMPLE = 3


def sample(space: list, n: int = SAMPLE) -> list:
    """``n`` configs of ``space`` after its first (the default), spread evenly, first and last
    included: deterministic, and it reaches both ends of the vendor's order (large to small)."""
    rest = space[1:]
    if len(rest) <= n:
        return rest
    return [rest[round(i * (len(rest) - 1) / (n - 1))] for i in range(n)]


# ---------------------------------------------------------------------- the worker (subprocess)
def _cases() -> list[tuple[str, str, str, Any, str]]:
    """(target, dtype name, role, config, precision) of every build."""
    from cokit.triton_kernels.backend import arch_limits
    from cokit.triton_kernels.gemm_config import config_space, default_config, parse_dtype, prune_configs

    cases: list[tuple[str, str, str, Any, str]] = []
    for target in TARGETS:
        limits = arch_limits(target)
        for name in DTYPES:
            dtype = parse_dtype(name)
            default = default_config(limits.backend, dtype=dtype, limits=limits)
            cases.append((target, name, "default", default, "ieee"))
            persistent = default_config(limits.backend, True, dtype=dtype, limits=limits)
            cases.append((target, name, "default", persistent, "ieee"))
            if name == "fp32" and limits.backend == "cuda":
                tf32 = default_config(limits.backend, dtype=dtype, limits=limits, precision="tf32")
                cases.append((target, name, "default", tf32, "tf32"))
            pruned = prune_configs(config_space(limits.backend, dtype=dtype), dtype, limits)
            picked = sample(pruned)
            for i, cfg in enumerate(picked):
                if i == len(picked) // 2:
                    cfg = cfg.replace(persistent=True)
                cases.append((target, name, "space", cfg, "ieee"))
    return cases


def _worker() -> dict:
    import time
    import traceback

    from cokit.triton_kernels._compat import TRITON_VERSION_STRING
    from cokit.triton_kernels.backend import arch_limits
    from cokit.triton_kernels.gemm import compile_gemm
    from cokit.triton_kernels.gemm_config import estimate_shared_bytes, parse_dtype

    report: dict = {"triton": TRITON_VERSION_STRING, "builds": []}
    for target, name, role, cfg, precision in _cases():
        dtype = parse_dtype(name)
        row: dict = {
            "target": target,
            "dtype": name,
            "role": role,
            "config": cfg.spec(),
            "precision": precision,
        }
        t0 = time.time()
        try:
            k = compile_gemm(cfg, dtype, target, precision=precision)
            row.update(k.as_row())
            row.update(
                ok=True,
                label=f"{role} {name}/{precision} {cfg.spec()}",
                estimate=estimate_shared_bytes(cfg, dtype, arch_limits(target), precision),
            )
            k.check_limits()
        except Exception:
            row.update(ok=False, error=traceback.format_exc()[-2000:])
        row["seconds"] = round(time.time() - t0, 2)
        report["builds"].append(row)
    return report


# ---------------------------------------------------------------------- the tests
@pytest.fixture(scope="module")
def report() -> dict:
    return worker_report(__file__, mark=MARK, timeout=900, TRITON_DEFAULT_FP_FUSION="1")


def _builds(report: dict, target: str) -> list[dict]:
    rows = [r for r in report["builds"] if r["target"] == target]
    assert rows
    for r in rows:
        assert r["ok"], f"{target} {r['dtype']} {r['config']} failed:\n{r.get('error')}"
    return rows


def test_sample_is_deterministic_and_spread():
    assert sample(list(range(11))) == [1, 5, 10]
    assert sample(list(range(3))) == [1, 2]
    assert sample([0]) == []


def test_every_default_and_a_sample_of_every_space_is_built(report):
    from cokit.triton_kernels.backend import arch_limits
    from cokit.triton_kernels.gemm_config import default_config, parse_dtype

    for target in TARGETS:
        limits = arch_limits(target)
        rows = _builds(report, target)
        for name in DTYPES:
            built = {r["config"] for r in rows if r["dtype"] == name}
            for persistent in (False, True):
                cfg = default_config(limits.backend, persistent, dtype=parse_dtype(name), limits=limits)
                assert cfg.spec() in built, (target, name, persistent)
            sampled = [r for r in rows if r["dtype"] == name and r["role"] == "space"]
            assert len(sampled) >= min(SAMPLE, 2), (target, name)
            assert any("persistent=True" in r["config"] for r in sampled)


@pytest.mark.parametrize("target", TARGETS)
def test_no_spills(report, target):
    """0 B of stack and spills (ptxas -v) on NVIDIA; 0 VGPR/SGPR spills and no scratch on AMD."""
    from cokit.triton_kernels.compile_only import spill_problems

    rows = _builds(report, target)
    rows = [{**r, "name": r["label"]} for r in rows]
    problems = spill_problems(rows)
    problems += [
        f"{r['name']} on {target}: {r['sgpr_spills']} SGPR spills" for r in rows if r.get("sgpr_spills")
    ]
    assert not problems, f"triton {report['triton']}:\n" + "\n".join(problems)


@pytest.mark.parametrize("target", TARGETS)
def test_shared_memory_and_registers_within_the_chip(report, target):
    from cokit.triton_kernels.backend import arch_limits

    limits = arch_limits(target)
    for r in _builds(report, target):
        where = f"{r['label']} on {target} (triton {report['triton']})"
        assert 0 < r["shared_bytes"] <= limits.max_shared_per_block, where
        # the pruning estimate bounds what the build uses (what makes pruning sound)
        assert r["shared_bytes"] <= r["estimate"], where
        regs = r["registers"]
        assert regs is not None and 0 < regs <= limits.max_registers_per_thread, where
        assert regs * r["num_warps"] * limits.warp_size <= limits.registers_per_sm, where


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("run without TRITON_INTERPRET")
    sys.path.insert(0, str(ROOT))
    print(MARK + json.dumps(_worker()))
