"""SparseLoCo's local side: the inner optimizer, over fp32 masters of low-precision parameters.

Every rank steps its own inner optimizer (AdamW by default) between syncs. With
``precision="master"`` each bf16/fp16 parameter has an fp32 master (by the parameter's id) that
the inner optimizer steps instead; the parameter then holds the master's rounding. The inner
optimizer's state never leaves the rank; a sync that finds a non-finite pseudo-gradient resets
the state that is no longer finite (:func:`reset_nonfinite_state`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from cokit.compress import precision as lowp
from cokit.compress.guards import all_finite

__all__ = ["build_inner", "hyper", "make_masters", "reset_nonfinite_state", "step_inner"]


def make_masters(params: list[torch.Tensor], precision: str) -> dict[int, torch.Tensor]:
    """fp32 masters of the low-precision ``params`` (by id) under ``precision="master"``."""
    if precision != "master":
        return {}
    return {id(p): lowp.master_copy(p.detach()) for p in params if p.dtype != torch.float32}


def build_inner(
    inner: Any, groups: list[dict[str, Any]], params: list[torch.Tensor], masters: dict[int, torch.Tensor]
) -> torch.optim.Optimizer:
    """The inner optimizer over ``params`` in ``groups``: ``inner`` itself when it is an
    optimizer (checked: exactly ``params``, in order), else ``inner(groups)``, or AdamW(lr=1e-3)
    when None; parameters with a master in ``masters`` (by id) are stepped through it."""
    swap = masters

    def stepped(ps: list[torch.Tensor]) -> list[torch.Tensor]:
        return [swap.get(id(p), p) for p in ps]

    if isinstance(inner, torch.optim.Optimizer):
        held = [p for g in inner.param_groups for p in g["params"]]
        if {id(p) for p in held} != {id(p) for p in params} or len(held) != len(params):
            raise ValueError(
                "SparseLoCo: the inner optimizer must optimize exactly the parameters given to "
                "SparseLoCo (build it over the same model.parameters())"
            )
        if [id(p) for p in held] != [id(p) for p in params] or len(inner.param_groups) != len(groups):
            raise ValueError(
                "SparseLoCo: the inner optimizer's param groups must list the parameters in the order "
                "given to SparseLoCo (build both from the same groups)"
            )
        if swap:
            if inner.state:
                raise ValueError(
                    "SparseLoCo(precision='master'): the inner optimizer already has state; pass it "
                    "before its first step, or pass a callable params -> Optimizer"
                )
            for g in inner.param_groups:
                g["params"] = stepped(g["params"])
        return inner
    if inner is not None and not callable(inner):
        raise TypeError(
            "SparseLoCo: inner must be None (AdamW, lr 1e-3), a torch.optim.Optimizer or a callable "
            f"params -> Optimizer, got {type(inner).__name__}"
        )
    inner_groups = [{**g, "params": stepped(g["params"])} for g in groups]
    if inner is None:
        # foreach on CPU too (torch defaults to it on GPUs only): the same per-tensor kernels
        # in the same order, bit for bit, without AdamW's per-tensor Python loop
        plain_cpu = all(p.device.type == "cpu" and not hasattr(p, "placements") for p in params)
        opt: Any = torch.optim.AdamW(inner_groups, lr=1e-3, foreach=True if plain_cpu else None)
    else:
        opt = inner(inner_groups)
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(
            f"SparseLoCo: inner(params) must return a torch.optim.Optimizer, got {type(opt).__name__}"
        )
    held_ids = [id(p) for g in opt.param_groups for p in g["params"]]
    if held_ids != [id(p) for g in inner_groups for p in g["params"]]:
        raise ValueError("SparseLoCo: inner(params) must optimize exactly the parameters it was given")
    return opt


def step_inner(
    inner: torch.optim.Optimizer,
    params: list[torch.Tensor],
    masters: dict[int, torch.Tensor],
    groups: list[dict[str, Any]],
    master_grads: dict[int, torch.Tensor] | None = None,
) -> None:
    """The inner optimizer's step on the (unscaled) gradients of ``params``, its groups' hyper-
    parameters first taken from ``groups`` (the ones schedulers drive) when those are copies;
    ``master_grads``: the fp32 gradients of the masters (by parameter id) instead of their
    parameters' gradients. The parameters then hold their masters' rounding."""
    if groups is not inner.param_groups:
        for outer, group in zip(groups, inner.param_groups, strict=True):
            group.update(hyper(outer))
    for p in params:
        m = masters.get(id(p))
        if m is not None:
            if master_grads is not None and id(p) in master_grads:
                m.grad = master_grads[id(p)]
            else:
                m.grad = None if p.grad is None else p.grad.float()
    inner.step()
    for p in params:
        m = masters.get(id(p))
        if m is not None:
            p.copy_(m)


def reset_nonfinite_state(
    inner: torch.optim.Optimizer,
    params: list[torch.Tensor],
    masters: dict[int, torch.Tensor],
    name: Callable[[int], str],
) -> list[str]:
    """Drop the inner optimizer's state of every parameter whose state holds a non-finite
    tensor; the names of those parameters."""
    reset = []
    for n, p in enumerate(params):
        held = masters.get(id(p), p)
        state = inner.state.get(held, {})
        if any(isinstance(v, torch.Tensor) and not bool(all_finite(v)) for v in state.values()):
            del inner.state[held]
            reset.append(name(n))
    return reset


def hyper(group: dict[str, Any]) -> dict[str, Any]:
    """A param group's hyper-parameters (everything but its parameters)."""
    return {k: v for k, v in group.items() if k != "params"}
