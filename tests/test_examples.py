"""The torchrun examples of docs/fsdp-hsdp.md, docs/overlap.md and docs/recipes.md run and end
with bit-identical replicas (two_level.py, amp_fp16.py: an fp16 overflow on one rank is skipped
on every rank), or with a tensor-parallel block that matches the dense one (tp_block.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("nproc", "args"),
    [
        (2, ["--mode", "fsdp"]),
        (4, ["--mode", "hsdp", "--replicas", "2"]),
        (4, ["--mode", "hierarchy", "--ranks-per-node", "2"]),
    ],
)
def test_two_level_example_under_torchrun(nproc, args):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    cmd += ["--standalone", str(ROOT / "examples" / "two_level.py"), "--steps", "6", *args]
    env = {**os.environ, "TRITON_INTERPRET": "0", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "bit-identical weights" in proc.stdout, proc.stdout
    assert "step   5  loss" in proc.stdout


@pytest.mark.parametrize("args", [[], ["--sequence-parallel"]], ids=["tp", "sequence-parallel"])
def test_tp_block_example_under_torchrun(args):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [str(ROOT / "examples" / "tp_block.py"), "--steps", "4", *args]
    env = {**os.environ, "TRITON_INTERPRET": "0", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "max |tp - dense| = " in proc.stdout and "matches the dense block" in proc.stdout, proc.stdout
    assert "step   3  loss tp" in proc.stdout


@pytest.mark.parametrize("optimizer", ["demo", "sparseloco"])
def test_amp_fp16_example_skips_an_overflow_on_every_rank(optimizer):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [
        str(ROOT / "examples" / "amp_fp16.py"),
        "--optimizer",
        optimizer,
        "--steps",
        "6",
        "--overflow-step",
        "3",
    ]
    env = {**os.environ, "TRITON_INTERPRET": "0", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("step")]
    assert len(lines) == 6 and "skipped on every rank" in lines[3], proc.stdout
    assert not any("skipped" in line for line in lines[:3] + lines[4:]), proc.stdout
    assert "bit-identical weights" in proc.stdout, proc.stdout
