"""Compile-only builds of every compression kernel for sm_80, sm_90 and gfx942.

The interpreter hides GPU-only errors (tl.dot shapes, layouts, register pressure); these
builds run the real compiler in a subprocess without TRITON_INTERPRET.
"""

import json
import os
import subprocess
import sys

import pytest

from cokit.triton_kernels.compile_only import kernel_specs

TARGETS = ["sm_80", "sm_90", "gfx942"]


@pytest.fixture(scope="module")
def report():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "cokit.triton_kernels.compile_only", *TARGETS],
        capture_output=True, text=True, env=env, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_kernel_compiles_for_every_target(report):
    built = {(r["kernel"], r["target"]) for r in report}
    expected = {(label, t) for label, *_ in kernel_specs() for t in TARGETS}
    assert built == expected


def test_resources_within_arch_limits(report):
    for r in report:
        assert 0 <= r["shared_bytes"] <= r["max_shared_per_block"], r
        assert r["registers"] is not None and 0 < r["registers"] <= r["max_registers_per_thread"], r


def test_compile_only_refuses_interpreter_process():
    from cokit.triton_kernels.compile_only import compile_for_target

    label, fn, sig, constexprs = kernel_specs()[0]
    with pytest.raises(RuntimeError, match="without TRITON_INTERPRET"):
        compile_for_target(fn, sig, constexprs, "sm_90")
