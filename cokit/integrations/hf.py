"""DeMo / SparseLoCo under the Hugging Face ``Trainer``, without DDP's dense all-reduce.

    from cokit.integrations.hf import CokitTrainer

    trainer = CokitTrainer(
        model=model, args=TrainingArguments(..., gradient_accumulation_steps=2, max_grad_norm=1.0),
        train_dataset=ds, optimizer_cls_and_kwargs=(DeMo, {"lr": 3e-4, "compression_topk": 32}),
    )
    trainer.train()                                   # and later: trainer.train(resume_from_checkpoint=True)

Why: at world > 1 ``Trainer`` wraps the model in ``DistributedDataParallel`` (gradients all-reduced
densely, then DeMo compresses and exchanges them again: ``DoubleSyncWarning``), and writes
``optimizer.pt`` from rank 0 only, so the other ranks' error buffers are lost and their resume
is refused. :class:`CokitTrainer` prepares the model without DDP when the optimizer is DeMo or
SparseLoCo, saves every rank's optimizer state in ``optimizer.pt``
(:func:`cokit.integrations.state.gather_state_dict`) and loads each rank's own part on resume.
With any other optimizer it is the plain ``Trainer``.
"""

from __future__ import annotations

import os
from typing import Any

import torch

try:
    from transformers import Trainer
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"cokit.integrations.hf needs transformers and accelerate: pip install 'cokit[hf]' ({exc})"
    ) from exc

from cokit.integrations.state import gather_state_dict, is_cokit_optimizer, own_state_dict, sync_module_states

__all__ = ["CokitTrainer"]

_WHERE = "CokitTrainer"
OPTIMIZER_NAME = "optimizer.pt"  # transformers.trainer's names (stable since v4)
SCHEDULER_NAME = "scheduler.pt"


class CokitTrainer(Trainer):
    """A ``transformers.Trainer`` that runs DeMo/SparseLoCo without DDP and checkpoints every
    rank's optimizer state (see the module docstring). Pass the optimizer as
    ``optimizer_cls_and_kwargs=(DeMo, {...})`` or ``optimizers=(opt, scheduler)``. LR schedulers,
    gradient accumulation and ``max_grad_norm`` work as usual (clipping uses each rank's own
    gradient norm: there is no all-reduced gradient). DeepSpeed and FSDP raise ``ValueError``."""

    def _cokit(self) -> bool:
        return self.optimizer is not None and is_cokit_optimizer(self.optimizer)

    def _check_cokit(self) -> None:
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise ValueError(
                f"{_WHERE}: DeMo/SparseLoCo need plain data parallel; turn off DeepSpeed/FSDP (they shard "
                "and reduce gradients themselves)"
            )

    def _wrap_model(
        self, model: torch.nn.Module, training: bool = True, dataloader: Any = None
    ) -> torch.nn.Module:
        """The model without DDP when the optimizer is DeMo/SparseLoCo (they exchange their own
        updates): accelerate's device placement and mixed precision only, and rank 0's weights
        broadcast as DDP would."""
        if not (training and self._cokit()):
            return super()._wrap_model(model, training=training, dataloader=dataloader)
        self._check_cokit()
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise ValueError(
                f"{_WHERE}: the model is already wrapped in DistributedDataParallel; pass the bare model"
            )
        if not getattr(model, "_is_accelerate_prepared", False):
            model = self.accelerator.prepare_model(model, evaluation_mode=True)
            sync_module_states(model)  # what DDP would have done: every rank starts from rank 0's weights
            # accelerate's own mark of a prepared model: its prepare() then leaves it unwrapped
            setattr(model, "_is_accelerate_prepared", True)  # noqa: B010
        return model

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Every rank's optimizer state in ``optimizer.pt`` (collective), then as usual."""
        if not self._cokit():
            super()._save_optimizer_and_scheduler(output_dir)
            return
        assert self.optimizer is not None  # _cokit() checked it
        merged = gather_state_dict(self.optimizer, everywhere=bool(self.args.save_on_each_node))
        super()._save_optimizer_and_scheduler(output_dir)  # the scheduler (and rank 0's state)
        if self.args.should_save:
            if merged is None:
                raise RuntimeError(f"{_WHERE}: this rank saves but holds no gathered optimizer state")
            torch.save(merged, os.path.join(output_dir, OPTIMIZER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Each rank loads its own part of ``optimizer.pt``; the scheduler as usual."""
        if checkpoint is None or not self._cokit():
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        opt_file = os.path.join(checkpoint, OPTIMIZER_NAME)
        sched_file = os.path.join(checkpoint, SCHEDULER_NAME)
        if not (os.path.isfile(opt_file) and os.path.isfile(sched_file)):
            return  # like Trainer: a checkpoint saved with save_only_model has neither
        assert self.optimizer is not None  # _cokit() checked it
        state = torch.load(opt_file, map_location="cpu", weights_only=True)
        self.optimizer.load_state_dict(own_state_dict(state))
        if self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(torch.load(sched_file, map_location="cpu", weights_only=True))
