"""accelerate + DeMo/SparseLoCo at world 2 (torchrun, CPU/gloo): ``cokit.integrations.accelerate.
prepare`` trains without DDP (no double sync), with gradient accumulation, clipping and an LR
scheduler, and ``save_state``/``load_state`` resume bit-identically on every rank with each
rank's own optimizer state; the other route, AdamW on DDP with ``register_comm_hook``, resumes
bit-identically with each rank's hook state (tests/integrations_accelerate_worker.py is one rank)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import torchrun_ok

from cokit.integrations.state import GATHERED_KEY, merge_states, own_state_dict

WORKER = Path(__file__).with_name("integrations_accelerate_worker.py")


def _torchrun(tmp_path: Path, *args: str) -> None:
    torchrun_ok(WORKER, *args, "--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path))


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["demo", "sparseloco", "adamw"])
def test_accelerate_resume_is_bit_identical_at_world_2(tmp_path, optimizer):
    pytest.importorskip("accelerate", reason="accelerate is not installed (pip install 'cokit[hf]')")
    _torchrun(tmp_path, "--optimizer", optimizer, "--phase", "ref", "--steps", "3", "--more", "3")
    _torchrun(tmp_path, "--optimizer", optimizer, "--phase", "resume", "--steps", "3", "--more", "3")
    ref = [torch.load(tmp_path / f"ref_rank{r}.pt", weights_only=False) for r in range(2)]
    res = [torch.load(tmp_path / f"resume_rank{r}.pt", weights_only=False) for r in range(2)]
    for r in range(2):
        assert ref[r]["world"] == 2
        assert not [w for w in ref[r]["warnings"] + res[r]["warnings"] if "DoubleSync" in w], ref[r][
            "warnings"
        ]
        assert ref[r]["bytes_sent"] > 0  # the optimizer exchanged (and DDP did not)
        assert "custom_checkpoint_0.pkl" in ref[r]["files"]
        # DeMo/SparseLoCo: every rank's state in the custom checkpoint; adamw: DDP + the hook,
        # whose per-rank state is the custom checkpoint
        assert ("optimizer.bin" in ref[r]["files"]) == (optimizer == "adamw")
        assert ref[r]["lr"] == res[r]["lr"]
        if optimizer in ("demo", "adamw"):  # optimizer steps / hook iterations, resumed included
            assert ref[r]["steps"] == res[r]["steps"] == 6
        for a, b in zip(ref[r]["params"], res[r]["params"], strict=True):
            assert torch.equal(a, b), f"rank {r}: resumed parameters differ from the uninterrupted run"
    if optimizer != "sparseloco":  # DeMo and DDP keep the replicas bit-identical
        for a, b in zip(ref[0]["params"], ref[1]["params"], strict=True):
            assert torch.equal(a, b)


def _fake_state(rank: int) -> dict:
    """A DeMo-shaped state of global rank ``rank``: shared keys and the rank's own."""
    return {
        "state": {0: {f"delta_rank{rank}": torch.full((2,), float(rank)), "v": torch.ones(2)}},
        "param_groups": [{"params": [0], "lr": 0.1, "demo": "{}", f"demo_rank{rank}": f"r{rank}"}],
    }


def test_merged_state_splits_back_into_each_ranks_own():
    merged = merge_states([_fake_state(0), _fake_state(1)])
    assert merged[GATHERED_KEY] == 2
    assert set(merged["state"][0]) == {"delta_rank0", "delta_rank1", "v"}
    for r in range(2):
        own = own_state_dict(merged, r)
        want = _fake_state(r)
        assert own["param_groups"] == want["param_groups"]
        assert set(own["state"][0]) == set(want["state"][0])
        assert torch.equal(own["state"][0][f"delta_rank{r}"], want["state"][0][f"delta_rank{r}"])


def test_rank_state_bad_inputs_are_clear_errors():
    with pytest.raises(TypeError, match="expected an optimizer state dict"):
        own_state_dict({"state": 1}, 0)
    with pytest.raises(ValueError, match="gathered from a world of 2 ranks, this is rank 3"):
        own_state_dict(merge_states([_fake_state(0), _fake_state(1)]), 3)
    with pytest.raises(ValueError, match="rank must be an integer"):
        own_state_dict(_fake_state(0), -1)
    other = _fake_state(1)
    other["state"][1] = {}
    with pytest.raises(ValueError, match="other parameters or param groups"):
        merge_states([_fake_state(0), other])
    with pytest.raises(ValueError, match="no states"):
        merge_states([])
    plain = own_state_dict(_fake_state(0), 0)  # not gathered: unchanged
    assert plain["param_groups"] == _fake_state(0)["param_groups"]


def test_prepare_refuses_a_non_accelerator():
    pytest.importorskip("accelerate", reason="accelerate is not installed (pip install 'cokit[hf]')")
    from cokit.integrations.accelerate import prepare

    with pytest.raises(TypeError, match=r"expected an accelerate\.Accelerator"):
        prepare(object(), torch.nn.Linear(2, 2))
