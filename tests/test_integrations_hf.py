"""HF Trainer + DeMo/SparseLoCo at world 2 (torchrun, CPU/gloo): ``cokit.integrations.hf.
CokitTrainer`` trains a tiny GPT-2 without DDP (no double sync) with an LR schedule, gradient
accumulation and ``max_grad_norm``, and a resume from a mid-run checkpoint in fresh processes
ends bit-identical to the uninterrupted run on every rank (tests/integrations_hf_worker.py is
one rank)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import assert_resumed_like_the_reference, torchrun_ok

WORKER = Path(__file__).with_name("integrations_hf_worker.py")


def _torchrun(*args: str) -> None:
    torchrun_ok(WORKER, *args)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["demo", "sparseloco"])
def test_trainer_resume_is_bit_identical_at_world_2(tmp_path, optimizer):
    pytest.importorskip("transformers", reason="transformers is not installed (pip install 'cokit[hf]')")
    pytest.importorskip("accelerate", reason="accelerate is not installed (pip install 'cokit[hf]')")
    for phase in ("ref", "resume"):
        _torchrun("--optimizer", optimizer, "--phase", phase, "--out", str(tmp_path))
    assert (tmp_path / "ref" / "checkpoint-3" / "optimizer.pt").is_file()
    saved = torch.load(tmp_path / "ref" / "checkpoint-3" / "optimizer.pt", weights_only=True)
    key = "demo_rank1" if optimizer == "demo" else "sparseloco_rank1"
    assert key in saved["param_groups"][0]  # rank 1's state is in the file rank 0 wrote
    ref = [torch.load(tmp_path / f"ref_rank{r}.pt", weights_only=False) for r in range(2)]
    res = [torch.load(tmp_path / f"resume_rank{r}.pt", weights_only=False) for r in range(2)]
    for r in range(2):
        assert ref[r]["world"] == 2 and not ref[r]["ddp"] and not res[r]["ddp"]
    assert_resumed_like_the_reference(ref, res)
    for a, b in zip(
        ref[0]["params"], ref[1]["params"], strict=True
    ):  # the step ends on a sync: replicas agree
        assert torch.equal(a, b)
