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
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # the report compiles 30 kernels (~70 s on 2 cores)
def test_every_kernel_compiles_for_every_target(report):
    built = {(r["kernel"], r["target"]) for r in report}
    expected = {(label, t) for label, *_ in kernel_specs() for t in TARGETS}
    assert built == expected


@pytest.mark.slow
def test_resources_within_arch_limits(report):
    for r in report:
        assert 0 <= r["shared_bytes"] <= r["max_shared_per_block"], r
        assert r["registers"] is not None and 0 < r["registers"] <= r["max_registers_per_thread"], r


def test_compile_only_refuses_interpreter_process(monkeypatch):
    from cokit.triton_kernels.compile_only import compile_for_target

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # as in CPU test runs; GPU runs leave it unset
    _, fn, sig, constexprs = kernel_specs()[0]
    with pytest.raises(RuntimeError, match="without TRITON_INTERPRET"):
        compile_for_target(fn, sig, constexprs, "sm_90")


def test_compile_only_rejects_options_the_backend_lacks(monkeypatch):
    """Triton drops unknown options silently; compile_for_target names them instead (checked
    before compiling, so this needs no compiler)."""
    from cokit.triton_kernels.compile_only import compile_for_target

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    _, fn, sig, constexprs = kernel_specs()[0]
    with pytest.raises(ValueError, match=r"has no cuda compile option 'waves_per_eu'; allowed: .*num_warps"):
        compile_for_target(fn, sig, constexprs, "sm_90", waves_per_eu=2)
