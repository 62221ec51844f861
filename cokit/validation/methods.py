"""Methods the study adds to :mod:`cokit.train`'s registry, and the model wrapper they need.

* ``"powersgd"`` -- DDP with torch's ``powerSGD_hook`` (low-rank gradient all-reduce with error
  feedback and warm start), then ``torch.optim.AdamW``. Options: ``rank`` (matrix
  approximation rank), ``start_iter`` (dense all-reduce iterations first, torch's
  ``start_powerSGD_iter``, >= 2), ``min_compression_rate``, ``seed``, ``base``
  (``"adamw"`` or ``"sgd"``) and ``momentum`` (for ``"sgd"``).

DDP's hooks run only when the forward pass goes through the DDP module, but the runner calls
``workload.loss(model, batch)`` on the model the workload built. :class:`EngineSlot` bridges
that: the study's workloads return a slot whose ``forward`` goes through whatever engine a
method installs (DDP here), and through the plain model otherwise.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cokit.compress.comm import guard_future, parse_timeout
from cokit.compress.stats import dense_allreduce_bytes, ring_allreduce_bytes
from cokit.train import Method, MethodSpec, register_method


class EngineSlot(nn.Module):
    """Holds ``inner`` (its parameters are this module's) and forwards through ``engine``.

    ``engine`` is stored outside the module tree (a DDP wrapper would otherwise list the same
    parameters twice); it defaults to ``inner``.
    """

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        object.__setattr__(self, "engine", inner)

    engine: nn.Module  # set with object.__setattr__ (outside the module tree)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine(*args, **kwargs)


class PowerSGDMethod(Method):
    """Gradients averaged by DDP + ``powerSGD_hook`` during backward; ``step()`` updates.

    Bytes per step: a ring all-reduce of what the hook all-reduced this step (its
    ``total_numel_after_compression`` grows by the elements of P, Q and the uncompressed
    tensors) -- or of the whole fp32 gradient during the dense warm-up iterations.
    """

    def __init__(self, spec: MethodSpec, model: nn.Module, group: dist.ProcessGroup | None) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
        from torch.nn.parallel import DistributedDataParallel as DDP

        if not isinstance(model, EngineSlot):
            raise TypeError("powersgd needs a model wrapped in cokit.validation.methods.EngineSlot")
        opts = dict(spec.options)
        rank = int(opts.pop("rank", 4))
        start = int(opts.pop("start_iter", 10))
        min_rate = float(opts.pop("min_compression_rate", 2.0))
        seed = int(opts.pop("seed", 0))
        base = opts.pop("base", "adamw")
        self.world_size = dist.get_world_size(group)
        owner = f"method {spec.name!r} (powerSGD_hook)"
        limit = parse_timeout(spec.timeout, owner)
        if limit is not None:  # a group of its own whose collectives end at the timeout
            ranks = dist.get_process_group_ranks(group) if group is not None else None
            group = dist.new_group(ranks, timeout=limit)
        ddp = DDP(model.inner, process_group=group)  # the study's models have no buffers
        self.state = psgd.PowerSGDState(
            process_group=group,
            matrix_approximation_rank=rank,
            start_powerSGD_iter=max(2, start),
            min_compression_rate=min_rate,
            use_error_feedback=True,
            warm_start=True,
            random_seed=seed,
        )

        def hook(state, bucket):  # unannotated: DDP compares annotations (this module's are strings)
            fut = psgd.powerSGD_hook(state, bucket)
            return guard_future(fut, owner, f"all-reduce of DDP bucket {bucket.index()}", limit, group)

        ddp.register_comm_hook(self.state, hook)
        object.__setattr__(model, "engine", ddp)
        params = list(model.parameters())
        if base == "adamw":
            self.optimizer: torch.optim.Optimizer = torch.optim.AdamW(
                params, lr=spec.lr, weight_decay=spec.weight_decay, **opts
            )
        elif base == "sgd":
            self.optimizer = torch.optim.SGD(params, lr=spec.lr, weight_decay=spec.weight_decay, **opts)
        else:
            raise ValueError(f"powersgd: base must be 'adamw' or 'sgd', got {base!r}")
        self.dense_bytes = dense_allreduce_bytes([p for p in params if p.requires_grad], self.world_size)
        self.elem_size = params[0].element_size()
        self._seen = 0

    def step(self) -> tuple[int, int]:
        self.optimizer.step()
        after = int(self.state.total_numel_after_compression)
        moved, self._seen = after - self._seen, after
        sent = ring_allreduce_bytes(moved * self.elem_size, self.world_size) if moved else self.dense_bytes
        return sent, self.dense_bytes

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)


register_method("powersgd")(PowerSGDMethod)
