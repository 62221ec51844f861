"""One rank of tests/test_integrations_accelerate.py (run under torchrun, world 2, CPU/gloo).

``--phase ref`` trains ``--steps`` optimizer steps, saves with ``accelerator.save_state`` and
trains ``--more`` steps; ``--phase resume`` starts fresh, loads the state and trains ``--more``
steps. Each rank writes its final parameters and facts to ``<out>/<phase>_rank<R>.pt``.
"""

from __future__ import annotations

import argparse
import gc
import os
import warnings

import torch
from accelerate import Accelerator

from cokit.compress import DeMo, SparseLoCo
from cokit.compress.hooks import DCTTopKState
from cokit.integrations.accelerate import prepare, register_comm_hook

ACCUM = 2


def batch(rank: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s micro-batch number ``micro`` (deterministic, so a resumed run sees the same)."""
    g = torch.Generator().manual_seed(1000 * rank + micro)
    x = torch.randn(8, 16, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def check_bad_inputs(accelerator: Accelerator, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """prepare() and register_comm_hook() refuse what would train wrongly, naming the fix."""
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    cases = [
        (prepare, (object(), model, opt), TypeError, "expected an accelerate.Accelerator"),
        (prepare, (accelerator, model), ValueError, "no DeMo or SparseLoCo optimizer"),
        (prepare, (accelerator, model, opt, sgd), ValueError, "is not DeMo"),
        (prepare, (accelerator, ddp, opt), ValueError, "already wrapped"),
        (register_comm_hook, (accelerator, model, DCTTopKState()), ValueError, "not DistributedDataParallel"),
        (
            register_comm_hook,
            (accelerator, ddp, object()),
            TypeError,
            "must be a cokit.compress.hooks.DCTTopKState",
        ),
    ]
    for fn, args, kind, text in cases:
        try:
            fn(*args)
        except kind as exc:
            assert text in str(exc), exc
        else:
            raise AssertionError(
                f"{fn.__name__}{tuple(type(a).__name__ for a in args)} did not raise {text!r}"
            )
    assert not accelerator._models and not accelerator._custom_objects  # nothing registered


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--optimizer", choices=["demo", "sparseloco", "adamw"], required=True)
    ap.add_argument("--phase", choices=["ref", "resume"], required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--more", type=int, default=3)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    warnings.simplefilter("always")
    with warnings.catch_warnings(record=True) as caught:
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUM)
        rank = accelerator.process_index
        torch.manual_seed(rank)  # other weights on each rank: prepare() starts every rank from rank 0's
        model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
        if args.optimizer == "demo":
            opt: torch.optim.Optimizer = DeMo(
                model.parameters(), lr=1e-2, compression_topk=8, compression_chunk=16, weight_decay=0.01
            )
        elif args.optimizer == "sparseloco":
            opt = SparseLoCo(model.parameters(), sync_every=2, topk=8, chunk=16)
        else:  # the other route: a plain optimizer on DDP with the cokit hook
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
        hook_state = None
        if args.optimizer == "adamw":
            model, opt, sched = accelerator.prepare(model, opt, sched)
            hook_state = register_comm_hook(
                accelerator, model, DCTTopKState(topk=8, chunk=16, warmup_steps=0)
            )
        else:
            check_bad_inputs(accelerator, model, opt)
            model, opt, sched = prepare(accelerator, model, opt, sched)
            assert not isinstance(model, torch.nn.parallel.DistributedDataParallel)

        def train(steps: int) -> None:
            for _ in range(steps * ACCUM):
                x, y = batch(rank, accelerator.step)
                with accelerator.accumulate(model):
                    loss = torch.nn.functional.mse_loss(model(x), y)
                    accelerator.backward(loss)
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                    opt.step()
                    sched.step()
                    opt.zero_grad()

        if args.phase == "ref":
            train(args.steps)
            accelerator.save_state(args.ckpt)
        else:
            accelerator.load_state(args.ckpt)
        train(args.more)
    inner = hook_state if hook_state is not None else opt.optimizer
    facts = {
        "params": [p.detach().clone() for p in model.parameters()],
        "world": accelerator.num_processes,
        "steps": hook_state.iteration if hook_state is not None else getattr(inner, "_steps", None),
        "bytes_sent": inner.comm_stats.as_dict()["total_sent_bytes"],
        "lr": sched.get_last_lr(),
        "warnings": [f"{type(w.message).__name__}: {w.message}" for w in caught],
        "files": sorted(os.listdir(args.ckpt)),
    }
    torch.save(facts, os.path.join(args.out, f"{args.phase}_rank{rank}.pt"))
    # release DDP (and its comm hook) before the process group goes: destroying the group under
    # a live DDP model can abort the process at exit ("Resource deadlock avoided")
    accelerator.free_memory()
    model = opt = sched = inner = hook_state = None
    gc.collect()
    accelerator.end_training()


if __name__ == "__main__":
    main()
