"""One rank of tests/test_integrations_lightning.py (run under torchrun, world 2, CPU/gloo).

``--mode cokit``: DeMo or SparseLoCo from ``configure_optimizers`` under ``CokitStrategy`` with an
LR scheduler, gradient accumulation and clipping; ``--phase ref`` trains 2 epochs saving after
each (and, in ``<mode>_ckpt_mid``, every 2 optimizer steps: mid-epoch, an epoch has 3),
``--phase resume`` resumes from the first epoch's checkpoint in fresh processes, ``--phase
resume-mid`` from the mid-epoch one at step 2.
``--mode hook``: the same with AdamW on DDP and the cokit hook through ``CommHookDDPStrategy``;
``--mode ddp``: AdamW on Lightning's own ``DDPStrategy``, for comparison.
Each rank writes its facts to ``<out>/<mode>_<phase>_rank<R>.pt``.
"""

from __future__ import annotations

import argparse
import os
import warnings

import lightning.pytorch as pl
import torch
from helpers import end_process_group

from cokit.compress import DeMo, SparseLoCo
from cokit.compress.hooks import DCTTopKState, dct_topk_hook
from cokit.integrations.lightning import CokitStrategy, CommHookDDPStrategy


class Net(pl.LightningModule):
    def __init__(self, optimizer: str):
        super().__init__()
        self.kind = optimizer
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.wrapper = type(self.trainer.strategy.model).__name__  # what runs the step (DDP or not)
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        if self.kind == "demo":
            opt = DeMo(
                self.parameters(), lr=1e-2, compression_topk=8, compression_chunk=16, weight_decay=0.01
            )
        elif self.kind == "sparseloco":
            opt = SparseLoCo(self.parameters(), sync_every=2, topk=8, chunk=16)
        else:
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def data() -> torch.utils.data.DataLoader:
    """24 samples: 6 batches of 2 per rank at world 2, 3 optimizer steps per epoch (accumulating 2)."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(24, 16, generator=g)
    ds = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True).sin())
    return torch.utils.data.DataLoader(ds, batch_size=2, shuffle=False)


def refusals(out: str, rank: int) -> None:
    """A plain optimizer under CokitStrategy and DeMo under CommHookDDPStrategy raise at setup."""
    cases = [
        ("adamw", lambda: CokitStrategy(), "every optimizer must be DeMo or SparseLoCo"),
        ("demo", lambda: CommHookDDPStrategy(ddp_comm_hook=dct_topk_hook), "synced twice"),
    ]
    messages = []
    for kind, make, text in cases:
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=make(),
            max_steps=1,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
        )
        try:
            trainer.fit(Net(kind), data())
        except ValueError as exc:
            assert text in str(exc), exc
            messages.append(str(exc))
        else:
            raise AssertionError(f"{kind} under {type(trainer.strategy).__name__} trained")
    torch.save({"messages": messages}, os.path.join(out, f"refusals_rank{rank}.pt"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["cokit", "hook", "ddp", "refusals"], required=True)
    ap.add_argument("--optimizer", choices=["demo", "sparseloco", "adamw"], required=True)
    ap.add_argument("--phase", choices=["ref", "resume", "resume-mid"], required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rank = int(os.environ["RANK"])
    if args.mode == "refusals":
        refusals(args.out, rank)
        return

    warnings.simplefilter("always")
    with warnings.catch_warnings(record=True) as caught:
        torch.manual_seed(rank)  # other weights per rank: the strategy starts every rank from rank 0's
        model = Net(args.optimizer)
        hook_state = None
        if args.mode == "cokit":
            strategy: pl.strategies.Strategy = CokitStrategy()
        elif args.mode == "ddp":
            strategy = pl.strategies.DDPStrategy(process_group_backend="gloo")
        else:
            hook_state = DCTTopKState(topk=8, chunk=16, warmup_steps=0)
            strategy = CommHookDDPStrategy(ddp_comm_state=hook_state, ddp_comm_hook=dct_topk_hook)
        ckpt_dir = os.path.join(args.out, f"{args.mode}_ckpt")
        callbacks = [pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1, every_n_epochs=1)]
        if args.phase == "ref":  # mid-epoch checkpoints too (saving changes nothing in training)
            callbacks.append(
                pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir + "_mid", save_top_k=-1, every_n_train_steps=2)
            )
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=strategy,
            max_epochs=2,
            accumulate_grad_batches=2,
            gradient_clip_val=1.0,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=callbacks,
            deterministic=True,
        )
        resume = {
            "ref": None,
            "resume": os.path.join(ckpt_dir, "epoch=0-step=3.ckpt"),
            "resume-mid": os.path.join(ckpt_dir + "_mid", "epoch=0-step=2.ckpt"),
        }[args.phase]
        trainer.fit(model, data(), ckpt_path=resume)
    opt = trainer.optimizers[0]
    facts = {
        "params": [p.detach().clone() for p in model.parameters()],
        "wrapper": model.wrapper,
        "global_step": trainer.global_step,
        "lr": [g["lr"] for g in opt.param_groups],
        "bytes_sent": None
        if args.mode == "ddp"  # DDP's own all-reduce counts nothing
        else (hook_state or opt).comm_stats.as_dict()["total_sent_bytes"],
        "hook_iterations": hook_state.iteration if hook_state is not None else None,
        "files": sorted(os.listdir(ckpt_dir)),
        "warnings": [f"{type(w.message).__name__}: {w.message}" for w in caught],
    }
    torch.save(facts, os.path.join(args.out, f"{args.mode}_{args.phase}_rank{rank}.pt"))
    trainer = model = opt = hook_state = None
    end_process_group()


if __name__ == "__main__":
    main()
