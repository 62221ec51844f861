"""Lightning at world 2 (torchrun, CPU/gloo; tests/integrations_lightning_worker.py is one rank):
``CokitStrategy`` runs DeMo/SparseLoCo without DDP (no double sync), with an LR scheduler,
gradient accumulation and clipping, and a resume from a checkpoint in fresh processes ends
bit-identical to the uninterrupted run on every rank; ``CommHookDDPStrategy`` registers the
cokit DDP hook on CPU (Lightning's ``DDPStrategy`` skips it there) and checkpoints every rank's
hook state, so its resume is bit-identical too; each refuses the other's
optimizers, and bad arguments are clear errors. Bit-identical means from an end-of-epoch
checkpoint: a mid-epoch one resumes to other weights, under CokitStrategy as under Lightning's
own DDPStrategy (what docs/recipes.md says)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import assert_resumed_like_the_reference, torchrun_ok

WORKER = Path(__file__).with_name("integrations_lightning_worker.py")
SKIP = "lightning is not installed (pip install 'cokit[lightning]')"


def _torchrun(*args: str) -> None:
    torchrun_ok(WORKER, *args)


def _facts(folder: Path, name: str) -> list[dict]:
    return [torch.load(folder / f"{name}_rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["demo", "sparseloco"])
def test_cokit_strategy_resume_is_bit_identical_at_world_2(tmp_path, optimizer):
    pytest.importorskip("lightning", reason=SKIP)
    for phase in ("ref", "resume"):
        _torchrun("--mode", "cokit", "--optimizer", optimizer, "--phase", phase, "--out", str(tmp_path))
    ref, res = _facts(tmp_path, "cokit_ref"), _facts(tmp_path, "cokit_resume")
    for r in range(2):
        assert ref[r]["wrapper"] == res[r]["wrapper"] == "Net"  # no DDP around the module
    assert_resumed_like_the_reference(ref, res)
    for a, b in zip(ref[0]["params"], ref[1]["params"], strict=True):  # ranks started from rank 0's weights
        assert torch.equal(a, b)
    if optimizer == "demo":  # from a mid-epoch checkpoint: other weights (see the next test)
        _torchrun(
            "--mode", "cokit", "--optimizer", optimizer, "--phase", "resume-mid", "--out", str(tmp_path)
        )
        _assert_mid_epoch_resume_differs(ref, _facts(tmp_path, "cokit_resume-mid"))


def _assert_mid_epoch_resume_differs(ref: list[dict], mid: list[dict]) -> None:
    for r in range(2):
        assert mid[r]["global_step"] == ref[r]["global_step"] == 6 and mid[r]["lr"] == ref[r]["lr"]
        same = all(torch.equal(a, b) for a, b in zip(ref[r]["params"], mid[r]["params"], strict=True))
        assert not same, f"rank {r}: a mid-epoch resume ended bit-identical; update docs/recipes.md"
    # Lightning itself says why (rank 0 only): the dataloader's place in the epoch is not restored
    assert any("ended before the epoch ended" in w for w in mid[0]["warnings"]), mid[0]["warnings"]


@pytest.mark.distributed
@pytest.mark.slow
def test_plain_lightning_ddp_resumes_bit_identically_from_an_epoch_end_only(tmp_path):
    """docs/recipes.md: a bit-exact resume needs an end-of-epoch checkpoint, with Lightning's
    own DDPStrategy as with CokitStrategy: from a checkpoint at step 2 of a 3-step epoch, the
    run ends at the same step and lr with other weights, and Lightning warns that the
    dataloader is not resumable mid-epoch."""
    pytest.importorskip("lightning", reason=SKIP)
    for phase in ("ref", "resume-mid"):
        _torchrun("--mode", "ddp", "--optimizer", "adamw", "--phase", phase, "--out", str(tmp_path))
    _assert_mid_epoch_resume_differs(_facts(tmp_path, "ddp_ref"), _facts(tmp_path, "ddp_resume-mid"))


@pytest.mark.distributed
@pytest.mark.slow
def test_comm_hook_strategy_registers_the_hook_on_cpu_and_resumes_it(tmp_path):
    pytest.importorskip("lightning", reason=SKIP)
    for phase in ("ref", "resume"):
        _torchrun("--mode", "hook", "--optimizer", "adamw", "--phase", phase, "--out", str(tmp_path))
    ref, res = _facts(tmp_path, "hook_ref"), _facts(tmp_path, "hook_resume")
    for r in range(2):
        assert ref[r]["wrapper"] == res[r]["wrapper"] == "DistributedDataParallel"
        # once per optimizer step (accumulation: DDP's no_sync); the resumed state counts on
        assert ref[r]["hook_iterations"] == res[r]["hook_iterations"] == 6
        assert ref[r]["bytes_sent"] > 0
        for a, b in zip(ref[r]["params"], res[r]["params"], strict=True):
            assert torch.equal(a, b), f"rank {r}: resumed parameters differ from the uninterrupted run"
    for a, b in zip(ref[0]["params"], ref[1]["params"], strict=True):
        assert torch.equal(a, b)


@pytest.mark.distributed
@pytest.mark.slow
def test_strategies_refuse_the_other_kind_of_optimizer(tmp_path):
    pytest.importorskip("lightning", reason=SKIP)
    _torchrun("--mode", "refusals", "--optimizer", "demo", "--phase", "ref", "--out", str(tmp_path))
    for f in _facts(tmp_path, "refusals"):
        assert len(f["messages"]) == 2


def test_strategy_arguments_are_checked():
    pytest.importorskip("lightning", reason=SKIP)
    from cokit.compress.hooks import dct_topk_hook
    from cokit.integrations.lightning import CokitStrategy, CommHookDDPStrategy

    with pytest.raises(ValueError, match="ddp_comm_hook configure DDP"):
        CokitStrategy(ddp_comm_hook=dct_topk_hook)
    with pytest.raises(ValueError, match="find_unused_parameters configure DDP"):
        CokitStrategy(find_unused_parameters=True)
    with pytest.raises(ValueError, match="pass ddp_comm_hook="):
        CommHookDDPStrategy()
    with pytest.raises(TypeError, match="must be callable"):
        CommHookDDPStrategy(ddp_comm_hook=3)
    CokitStrategy(process_group_backend="gloo")
