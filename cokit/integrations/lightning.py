"""DeMo / SparseLoCo and the cokit DDP comm hook under Lightning, without double sync.

    import lightning.pytorch as pl
    from cokit.integrations.lightning import CokitStrategy, CommHookDDPStrategy

    # DeMo / SparseLoCo from configure_optimizers: no DDP (they exchange their own updates)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=CokitStrategy())

    # a plain optimizer (AdamW) on DDP, gradients compressed by the cokit hook, on any device
    from cokit.compress.hooks import DCTTopKState, dct_topk_hook
    strategy = CommHookDDPStrategy(ddp_comm_state=DCTTopKState(topk=32), ddp_comm_hook=dct_topk_hook)

Why: ``strategy="ddp"`` wraps the LightningModule in ``DistributedDataParallel``, whose dense
all-reduce syncs every gradient before DeMo compresses and exchanges it again
(``DoubleSyncWarning``), and Lightning writes the checkpoint's ``optimizer_states`` from rank 0
only, losing the other ranks' error buffers. :class:`CokitStrategy` is Lightning's DDP strategy
(process group, distributed sampler, reductions, barriers) minus the DDP wrapper; it broadcasts
rank 0's weights at setup as DDP would, saves every rank's optimizer state in the checkpoint and
loads each rank's own on resume. And ``DDPStrategy(ddp_comm_hook=...)`` registers the hook on
CUDA only: on CPU it silently all-reduces densely; :class:`CommHookDDPStrategy` registers it on
every device.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

try:
    from lightning.fabric.utilities.optimizer import _optimizers_to_device
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.trainer.states import TrainerFn
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"cokit.integrations.lightning needs lightning: pip install 'cokit[lightning]' ({exc})"
    ) from exc

from cokit.integrations.state import gather_state_dict, is_cokit_optimizer, own_state_dict, sync_module_states

__all__ = ["HOOK_STATES_KEY", "CokitStrategy", "CommHookDDPStrategy"]

#: checkpoint key of the hook states of every rank (a list by global rank)
HOOK_STATES_KEY = "cokit_ddp_comm_states"


class CokitStrategy(DDPStrategy):
    """Lightning's DDP strategy without the DDP wrapper, for DeMo and SparseLoCo.

    Every optimizer ``configure_optimizers`` returns must be DeMo or SparseLoCo (a plain one
    would train each rank alone: ``ValueError`` at setup; use :class:`CommHookDDPStrategy` or
    ``"ddp"`` for those). Takes ``DDPStrategy``'s arguments except the DDP-only ones
    (``ddp_comm_*``, ``model_averaging_period``, DDP kwargs), which raise ``ValueError``.
    Gradient accumulation and ``gradient_clip_val`` work as usual (clipping uses each rank's own
    gradient norm)."""

    strategy_name = "cokit"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        ddp_only = {"ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period"}
        given = sorted(k for k in kwargs if k in ddp_only and kwargs[k] is not None)
        allowed = {"accelerator", "parallel_devices", "cluster_environment", "checkpoint_io"}
        allowed |= {"precision_plugin", "process_group_backend", "timeout", "start_method"}
        extra = sorted(k for k in kwargs if k not in ddp_only and k not in allowed)
        if given or extra or args:
            what = given + extra + ([f"{len(args)} positional argument(s)"] if args else [])
            raise ValueError(
                f"CokitStrategy: {', '.join(what)} configure DDP, which this strategy does not use "
                "(DeMo/SparseLoCo exchange their own updates); pass keyword arguments among "
                f"{sorted(allowed)}, or use CommHookDDPStrategy for a plain optimizer with the cokit hook"
            )
        super().__init__(**kwargs)

    def configure_ddp(self) -> None:
        """No DDP wrapper: only rank 0's weights broadcast, as DDP does at construction."""
        assert self.model is not None
        sync_module_states(self.model)

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        plain = [type(o).__name__ for o in self.optimizers if not is_cokit_optimizer(o)]
        if plain or not self.optimizers:
            raise ValueError(
                f"CokitStrategy: configure_optimizers returned {plain or 'no optimizer'}; this strategy "
                "skips DDP, so every optimizer must be DeMo or SparseLoCo (for a plain optimizer use "
                "strategy='ddp' or CommHookDDPStrategy with cokit.compress.hooks.dct_topk_hook)"
            )

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Every rank's state of a DeMo/SparseLoCo optimizer on rank 0, which writes the
        checkpoint (collective: Lightning calls it on every rank)."""
        if not is_cokit_optimizer(optimizer):
            return super().optimizer_state(optimizer)
        inner = getattr(optimizer, "_optimizer", optimizer)  # Lightning's LightningOptimizer
        return gather_state_dict(inner) or {}

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Each rank loads its own part of the gathered optimizer states."""
        states = checkpoint["optimizer_states"]
        if len(states) != len(self.optimizers):
            raise ValueError(
                f"CokitStrategy: the checkpoint has {len(states)} optimizer states, configure_optimizers "
                f"returned {len(self.optimizers)} optimizers"
            )
        for optimizer, state in zip(self.optimizers, states, strict=True):
            optimizer.load_state_dict(own_state_dict(state) if is_cokit_optimizer(optimizer) else state)
            _optimizers_to_device([optimizer], self.root_device)


class CommHookDDPStrategy(DDPStrategy):
    """``DDPStrategy`` that registers its ``ddp_comm_hook`` on every device (Lightning registers
    it on CUDA only, so on CPU the hook silently never runs). For plain optimizers with
    :func:`cokit.compress.hooks.dct_topk_hook`; DeMo/SparseLoCo raise ``ValueError`` at setup
    (they would sync twice: use :class:`CokitStrategy`).

    A state with ``attach`` / ``state_dict`` / ``load_state_dict`` (``DCTTopKState``) is attached
    to the DDP model, and every rank's state (its error buffers) goes into the checkpoint under
    :data:`HOOK_STATES_KEY`; on resume each rank loads its own, so the run continues exactly."""

    strategy_name = "ddp_comm_hook"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("ddp_comm_hook") is None:
            raise ValueError(
                "CommHookDDPStrategy: pass ddp_comm_hook= (e.g. cokit.compress.hooks.dct_topk_hook)"
            )
        if not callable(kwargs["ddp_comm_hook"]):
            raise TypeError(
                f"CommHookDDPStrategy: ddp_comm_hook must be callable, got {type(kwargs['ddp_comm_hook']).__name__}"
            )
        super().__init__(*args, **kwargs)

    def _register_ddp_hooks(self) -> None:
        model = self.model
        if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise RuntimeError(f"CommHookDDPStrategy: expected a DDP model, got {type(model).__name__}")
        hook = self._ddp_comm_hook
        assert hook is not None  # checked in __init__
        if self._ddp_comm_wrapper is not None:
            hook = self._ddp_comm_wrapper(hook)
        state: Any = self._ddp_comm_state
        if _checkpointable(state):
            state.attach(model)  # names the error buffers after the parameters
        model.register_comm_hook(state=state, hook=hook)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Add every rank's hook state (collective: Lightning calls it on every rank), then save."""
        state: Any = self._ddp_comm_state
        if _checkpointable(state):
            mine = state.state_dict()
            if dist.is_available() and dist.is_initialized():
                states: list[Any] = [None] * dist.get_world_size()
                dist.all_gather_object(states, mine)
            else:
                states = [mine]
            checkpoint = {**checkpoint, HOOK_STATES_KEY: states}
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """The optimizers as usual, then this rank's hook state (after setup: attached)."""
        super().load_optimizer_state_dict(checkpoint)
        state: Any = self._ddp_comm_state
        states = checkpoint.get(HOOK_STATES_KEY)
        if not _checkpointable(state):
            return
        if states is None:
            raise ValueError(
                f"CommHookDDPStrategy: the checkpoint has no {HOOK_STATES_KEY!r}: it was not saved by this "
                "strategy, so the hook's error buffers cannot be restored; resume with the strategy that "
                "saved it, or start the hook state afresh (a new checkpoint without optimizer state)"
            )
        rank = self.global_rank
        if not isinstance(states, list) or len(states) != self.world_size:
            raise ValueError(
                f"CommHookDDPStrategy: the checkpoint holds hook states of "
                f"{len(states) if isinstance(states, list) else '?'} ranks, this run has {self.world_size}: "
                "the error buffers are per rank; resume at the world size it was saved at"
            )
        state.load_state_dict(states[rank])

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            cokit = [type(o).__name__ for o in self.optimizers if is_cokit_optimizer(o)]
            if cokit:
                raise ValueError(
                    f"CommHookDDPStrategy: {cokit[0]} exchanges its own updates; with the DDP hook too "
                    "every gradient would be synced twice. Use CokitStrategy for DeMo/SparseLoCo"
                )


def _checkpointable(state: object) -> bool:
    return all(callable(getattr(state, name, None)) for name in ("attach", "state_dict", "load_state_dict"))
