"""One rank of tests/test_integrations_hf.py (run under torchrun, world 2, CPU/gloo): a tiny GPT-2
trained by ``CokitTrainer`` with DeMo or SparseLoCo, an LR schedule, gradient accumulation and
``max_grad_norm``. ``--phase ref`` trains 6 steps saving at step 3; ``--phase resume`` resumes
from that checkpoint in fresh processes. Each rank writes its facts to ``<out>/<phase>_rank<R>.pt``.
"""

from __future__ import annotations

import argparse
import os
import warnings

import torch
from helpers import end_process_group
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from cokit.compress import DeMo, SparseLoCo
from cokit.integrations.hf import CokitTrainer


class Tokens(torch.utils.data.Dataset):
    """32 sequences of 8 tokens from a fixed pattern (in memory)."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = (torch.arange(8) * (i % 5 + 1) + i) % 64
        return {"input_ids": ids, "labels": ids.clone()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--optimizer", choices=["demo", "sparseloco"], required=True)
    ap.add_argument("--phase", choices=["ref", "resume"], required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    warnings.simplefilter("always")
    with warnings.catch_warnings(record=True) as caught:
        torch.manual_seed(int(os.environ["RANK"]))  # other weights per rank: CokitTrainer broadcasts rank 0's
        config = GPT2Config(
            n_layer=1,
            n_embd=32,
            n_head=2,
            vocab_size=64,
            n_positions=16,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        model = GPT2LMHeadModel(config)
        training = TrainingArguments(
            output_dir=os.path.join(args.out, args.phase),
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            max_steps=6,
            save_strategy="steps",
            save_steps=3,
            learning_rate=1e-2,
            lr_scheduler_type="linear",
            warmup_steps=1,
            max_grad_norm=1.0,
            weight_decay=0.01,
            report_to=[],
            logging_strategy="no",
            use_cpu=True,
            seed=0,
            dataloader_num_workers=0,
            disable_tqdm=True,
        )
        if args.optimizer == "demo":
            opt: tuple = (DeMo, {"compression_topk": 8, "compression_chunk": 16})
        else:
            opt = (SparseLoCo, {"sync_every": 2, "topk": 8, "chunk": 16})
        trainer = CokitTrainer(
            model=model, args=training, train_dataset=Tokens(), optimizer_cls_and_kwargs=opt
        )
        if args.phase == "ref":
            trainer.train()
        else:
            trainer.train(resume_from_checkpoint=os.path.join(args.out, "ref", "checkpoint-3"))
    inner = trainer.optimizer.optimizer
    rank = training.process_index
    facts = {
        "params": [p.detach().clone() for p in model.parameters()],
        "world": training.world_size,
        "ddp": isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel),
        "bytes_sent": inner.comm_stats.as_dict()["total_sent_bytes"],
        "lr": trainer.lr_scheduler.get_last_lr(),
        "global_step": trainer.state.global_step,
        "warnings": [f"{type(w.message).__name__}: {w.message}" for w in caught],
    }
    torch.save(facts, os.path.join(args.out, f"{args.phase}_rank{rank}.pt"))
    trainer.accelerator.free_memory()
    trainer = inner = model = None
    end_process_group()


if __name__ == "__main__":
    main()
