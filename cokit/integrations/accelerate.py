"""DeMo / SparseLoCo under Hugging Face accelerate, without DDP's dense all-reduce.

    from accelerate import Accelerator
    from cokit.integrations.accelerate import prepare

    accelerator = Accelerator(gradient_accumulation_steps=2)
    opt = DeMo(model.parameters(), lr=3e-4)          # after Accelerator(): the group exists
    model, opt, loader, sched = prepare(accelerator, model, opt, loader, sched)
    ...                                               # the usual accumulate / backward / step
    accelerator.save_state("ckpt")                    # every rank's optimizer state, one file
    accelerator.load_state("ckpt")                    # each rank loads its own

Why: ``accelerator.prepare`` wraps a model in ``DistributedDataParallel`` at world > 1, whose
all-reduce syncs every gradient densely before DeMo compresses and exchanges it again
(``DoubleSyncWarning``); and ``save_state`` writes ``optimizer.bin`` from rank 0 only, which
loses the other ranks' error buffers (their ``load_state`` is refused). :func:`prepare` gives
models accelerate's device placement and mixed precision but no DDP (their weights are broadcast
from rank 0, as DDP does), wraps DeMo/SparseLoCo in
accelerate's ``AcceleratedOptimizer`` (so ``accumulate`` skips the steps between syncs), and
registers a :class:`~cokit.integrations.state.RankStates` for checkpointing, which saves every
rank's optimizer state in ``custom_checkpoint_<i>.pkl``.

The other route, a plain optimizer on accelerate's DDP model with the cokit DDP hook, is
:func:`register_comm_hook`, which also checkpoints every rank's hook state.
"""

from __future__ import annotations

from typing import Any

import torch

from cokit.integrations.state import HookStates, RankStates, is_cokit_optimizer, sync_module_states

__all__ = ["prepare", "register_comm_hook"]


def _accelerate() -> Any:
    """The accelerate package, or an ImportError saying how to install it."""
    try:
        import accelerate
        import accelerate.optimizer
        import accelerate.utils
    except ImportError as exc:
        raise ImportError(
            f"cokit.integrations.accelerate needs accelerate: pip install 'cokit[hf]' ({exc})"
        ) from exc
    return accelerate


_WHERE = "cokit.integrations.accelerate.prepare"


def prepare(accelerator: Any, *objects: Any, device_placement: bool | None = None) -> Any:
    """``accelerator.prepare(*objects)`` for a DeMo or SparseLoCo run: the same objects back, in
    order (one object: that object).

    Models are prepared without DDP (DeMo/SparseLoCo exchange their own updates); DeMo and
    SparseLoCo come back as ``AcceleratedOptimizer`` and their per-rank state is saved and loaded
    by ``accelerator.save_state`` / ``load_state`` (collective: every rank calls them, as accelerate
    requires anyway). Data loaders and LR schedulers are prepared by accelerate as usual. Call it
    once per optimizer; the registration order of checkpointed objects must be the same when
    loading. Raises ``TypeError``/``ValueError`` for a non-Accelerator, no DeMo/SparseLoCo among
    ``objects``, a model already wrapped in DDP, a plain optimizer next to them (it would need
    DDP: prepare it with ``accelerator.prepare``), fp16 mixed precision (a GradScaler; use bf16)
    and DeepSpeed/FSDP/Megatron-LM.
    """
    acc = _accelerate()
    Accelerator, AcceleratedOptimizer = acc.Accelerator, acc.optimizer.AcceleratedOptimizer
    DistributedType = acc.utils.DistributedType

    if not isinstance(accelerator, Accelerator):
        raise TypeError(f"{_WHERE}: expected an accelerate.Accelerator, got {type(accelerator).__name__}")
    if device_placement is not None and not isinstance(device_placement, bool):
        raise TypeError(f"{_WHERE}: device_placement must be None or a bool, got {device_placement!r}")
    unsupported = {DistributedType.DEEPSPEED, DistributedType.FSDP, DistributedType.MEGATRON_LM}
    if accelerator.distributed_type in unsupported:
        raise ValueError(
            f"{_WHERE}: distributed type {accelerator.distributed_type} is not supported; DeMo/SparseLoCo "
            "need plain data parallel (multi-GPU/CPU without DDP)"
        )
    if accelerator.scaler is not None:
        raise ValueError(
            f"{_WHERE}: mixed_precision='fp16' (a GradScaler) is not supported here: accelerate would "
            "unscale and clip through optimizers it prepared itself; use mixed_precision='bf16' or 'no'"
        )
    cokit_opts = [o for o in objects if isinstance(o, torch.optim.Optimizer) and is_cokit_optimizer(o)]
    if not cokit_opts:
        raise ValueError(
            f"{_WHERE}: no DeMo or SparseLoCo optimizer among the objects; for a plain optimizer use "
            "accelerator.prepare (and the DDP comm hook cokit.compress.hooks.dct_topk_hook)"
        )
    for o in objects:
        if isinstance(o, torch.optim.Optimizer) and not is_cokit_optimizer(o):
            raise ValueError(
                f"{_WHERE}: {type(o).__name__} is not DeMo/SparseLoCo: its model would need DDP, which "
                "this call does not apply; prepare it with accelerator.prepare in a separate call"
            )
        if isinstance(o, torch.nn.parallel.DistributedDataParallel):
            raise ValueError(
                f"{_WHERE}: the model is already wrapped in DistributedDataParallel; pass the bare "
                "module (DeMo/SparseLoCo exchange their own updates: DDP would sync gradients twice)"
            )
    placement = accelerator.device_placement if device_placement is None else device_placement
    out: list[Any] = list(objects)
    rest: list[int] = []
    for i, o in enumerate(objects):
        if isinstance(o, torch.nn.Module):
            # evaluation_mode: device placement, mixed precision and compile, but no DDP
            out[i] = accelerator.prepare_model(o, device_placement=placement, evaluation_mode=True)
            sync_module_states(o)  # what DDP would have done: every rank starts from rank 0's weights
    for i, o in enumerate(objects):
        if isinstance(o, torch.optim.Optimizer):
            out[i] = AcceleratedOptimizer(o, device_placement=placement, scaler=None)
            accelerator.register_for_checkpointing(
                RankStates(o, everywhere=bool(accelerator.project_configuration.save_on_each_node))
            )
        elif not isinstance(o, torch.nn.Module):
            rest.append(i)
    if rest:
        prepared = accelerator.prepare(*(objects[i] for i in rest), device_placement=device_placement)
        prepared = prepared if len(rest) > 1 else (prepared,)
        for i, p in zip(rest, prepared, strict=True):
            out[i] = p
    return out[0] if len(out) == 1 else tuple(out)


def register_comm_hook(accelerator: Any, model: Any, state: Any, hook: Any = None) -> Any:
    """Register the cokit DDP comm hook on a model ``accelerator.prepare`` wrapped in DDP (a plain
    optimizer such as AdamW), and every rank's hook state for ``save_state`` / ``load_state``
    (its error buffers are per rank). ``state``: a ``DCTTopKState``; ``hook`` defaults to
    :func:`cokit.compress.hooks.dct_topk_hook`. Returns ``state``, attached to the model.

    Raises ``TypeError``/``ValueError`` for a non-Accelerator, a model that is not DDP (world 1, or
    prepared by :func:`prepare`: DeMo/SparseLoCo need no hook) or a state of another kind.
    """
    from cokit.compress.hooks import DCTTopKState, dct_topk_hook

    Accelerator = _accelerate().Accelerator

    where = "cokit.integrations.accelerate.register_comm_hook"
    if not isinstance(accelerator, Accelerator):
        raise TypeError(f"{where}: expected an accelerate.Accelerator, got {type(accelerator).__name__}")
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise ValueError(
            f"{where}: the model is a {type(model).__name__}, not DistributedDataParallel: the hook "
            "compresses DDP's gradient exchange (accelerate wraps in DDP only at world > 1; DeMo/"
            "SparseLoCo prepared with cokit.integrations.accelerate.prepare need no hook)"
        )
    if not isinstance(state, DCTTopKState):
        raise TypeError(
            f"{where}: state must be a cokit.compress.hooks.DCTTopKState, got {type(state).__name__}"
        )
    if hook is not None and not callable(hook):
        raise TypeError(f"{where}: hook must be callable, got {type(hook).__name__}")
    model.register_comm_hook(state.attach(model), hook if hook is not None else dct_topk_hook)
    accelerator.register_for_checkpointing(
        HookStates(state, everywhere=bool(accelerator.project_configuration.save_on_each_node))
    )
    return state
