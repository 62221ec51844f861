"""The torchrun examples of docs/fsdp-hsdp.md, docs/overlap.md and docs/recipes.md run and end
with bit-identical replicas (two_level.py, amp_fp16.py: an fp16 overflow on one rank is skipped
on every rank by DeMo, on that rank only by SparseLoCo, and halves that rank's scale only), or
with a tensor-parallel block that matches the dense one (tp_block.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import script_env

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
    env = script_env(TRITON_INTERPRET="0", OMP_NUM_THREADS="1")  # this tree, not an installed cokit
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "bit-identical weights" in proc.stdout, proc.stdout
    assert "step   5  loss" in proc.stdout


@pytest.mark.parametrize("args", [[], ["--sequence-parallel"]], ids=["tp", "sequence-parallel"])
def test_tp_block_example_under_torchrun(args):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [str(ROOT / "examples" / "tp_block.py"), "--steps", "4", *args]
    env = script_env(TRITON_INTERPRET="0", OMP_NUM_THREADS="1")  # this tree, not an installed cokit
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "max |tp - dense| = " in proc.stdout and "matches the dense block" in proc.stdout, proc.stdout
    assert "step   3  loss tp" in proc.stdout


@pytest.mark.parametrize(
    ("optimizer", "overflow", "skipped"),
    [
        ("demo", 3, "skipped on every rank, no rank's weights changed"),
        ("sparseloco", 2, "skipped on rank 0 only, the other ranks stepped"),
        ("sparseloco", 3, "every rank's weights changed: a sync followed the skipped local step"),
    ],
)
def test_amp_fp16_example_skips_an_overflow_as_docs_recipes_says(optimizer, overflow, skipped):
    """What docs/recipes.md and the example's docstring say: DeMo skips the overflowing step on
    every rank, SparseLoCo only the overflowing rank's local step; only that rank's scale
    halves (1024 -> 512), the other stays at 1024; the replicas end bit-identical."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [
        str(ROOT / "examples" / "amp_fp16.py"),
        "--optimizer",
        optimizer,
        "--steps",
        "6",
        "--overflow-step",
        str(overflow),
    ]
    env = script_env(TRITON_INTERPRET="0", OMP_NUM_THREADS="1")  # this tree, not an installed cokit
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("step")]
    assert len(lines) == 6, proc.stdout
    assert f"scale 1024/1024 -> 512/1024  (an inf on rank 0: {skipped})" in lines[overflow], proc.stdout
    assert all(line.endswith("scale 1024/1024") for line in lines[:overflow]), proc.stdout
    assert all(line.endswith("scale 512/1024") for line in lines[overflow + 1 :]), proc.stdout
    assert "bit-identical weights" in proc.stdout, proc.stdout
    # docs/recipes.md shows these lines (its loss figures aside)
    recipes = (ROOT / "docs" / "recipes.md").read_text()
    command = f"amp_fp16.py{' --optimizer sparseloco' if optimizer == 'sparseloco' else ''} --overflow-step {overflow}"
    shown = re.search(re.escape(command) + r"\n# (step +\d+)  loss [\d.]+  (.*)\n", recipes)
    if shown is not None:
        assert lines[overflow].startswith(shown.group(1)) and lines[overflow].endswith(shown.group(2)), (
            shown.group(0),
            lines[overflow],
        )
    else:
        assert (optimizer, overflow) == ("sparseloco", 3), (
            "docs/recipes.md shows the DeMo and SparseLoCo runs"
        )
