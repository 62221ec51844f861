"""SparseLoCo's local side: the inner optimizer, over fp32 masters of low-precision parameters.

Every rank steps its own inner optimizer (AdamW by default) between syncs. With
``precision="master"`` each bf16/fp16 parameter has an fp32 master (by the parameter's id) that
the inner optimizer steps instead; the parameter then holds the master's rounding. The inner
optimizer's state never leaves the rank; a sync that finds a non-finite pseudo-gradient resets
the state that is no longer finite (:func:`reset_nonfinite_state`).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from cokit.compress import precision as lowp
from cokit.compress.guards import all_finite

if TYPE_CHECKING:
    from cokit.compress.agreement import Round
    from cokit.compress.sparseloco import SparseLoCo

__all__ = [
    "build_inner",
    "clear_grads",
    "dense_step",
    "hyper",
    "local_value",
    "make_masters",
    "outer_groups",
    "recovered",
    "replicated_state",
    "reset_nonfinite_state",
    "skip_bad_sync",
    "snapshot",
    "step_inner",
    "swapped_in",
    "write_weights",
]


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


def local_value(p: torch.Tensor, masters: dict[int, torch.Tensor]) -> torch.Tensor:
    """This rank's fp32 value of ``p``: its master when there is one."""
    m = masters.get(id(p))
    return m if m is not None else p.float()


def write_weights(
    params: list[torch.Tensor],
    values: list[torch.Tensor],
    masters: dict[int, torch.Tensor],
    precision: str,
    generator: torch.Generator | None,
) -> None:
    """Every parameter (and its master) takes its fp32 value from ``values``, rounded as
    ``precision`` says."""
    for p, value in zip(params, values, strict=True):
        lowp.write_update(p, value, precision, master=masters.get(id(p)), generator=generator)


@contextlib.contextmanager
def swapped_in(params: list[torch.Tensor], values: list[torch.Tensor | None]) -> Iterator[None]:
    """Inside the block each parameter holds its value from ``values`` (None: left alone); on
    exit the parameters' own values come back, bit for bit."""
    swapped = []
    with torch.no_grad():
        for p, v in zip(params, values, strict=True):
            if v is not None:
                swapped.append((p, p.detach().clone()))
                p.copy_(v)
    try:
        yield
    finally:
        with torch.no_grad():
            for p, own in swapped:
                p.copy_(own)


def clear_grads(params: list[torch.Tensor], masters: dict[int, torch.Tensor], set_to_none: bool) -> None:
    """Clear the parameters' gradients (and drop their masters')."""
    for p in params:
        if p.grad is not None:
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_().zero_()
    for m in masters.values():
        m.grad = None


def outer_groups(
    groups: list[dict[str, Any]], inner: torch.optim.Optimizer, masters: dict[int, torch.Tensor]
) -> list[dict[str, Any]]:
    """The param groups the front end shows: the inner optimizer's (schedulers drive them); with
    fp32 masters, copies holding the model's parameters (what DCP maps to names), whose hyper-
    parameters :func:`step_inner` copies into the inner groups before every step."""
    if len(groups) != len(inner.param_groups):
        raise ValueError("SparseLoCo: inner(params) must keep the param groups it was given")
    if not masters:
        return inner.param_groups
    return [{**hyper(ig), "params": g["params"]} for g, ig in zip(groups, inner.param_groups, strict=True)]


def dense_step(
    inner: torch.optim.Optimizer,
    params: list[torch.Tensor],
    masters: dict[int, torch.Tensor],
    groups: list[dict[str, Any]],
    means: list[torch.Tensor],
    has_grad: list[bool],
) -> None:
    """The inner step on the gradients averaged over the ranks (``means``, fp32), written into
    the gradients of the parameters that have one (their masters take the fp32 means)."""
    master_grads: dict[int, torch.Tensor] = {}
    for p, mean, has in zip(params, means, has_grad, strict=True):
        if has and p.grad is not None:
            p.grad.copy_(mean)
            if id(p) in masters:
                master_grads[id(p)] = mean
    step_inner(inner, params, masters, groups, master_grads)


def replicated_state(
    params: list[torch.Tensor],
    state: Mapping[torch.Tensor, dict[str, Any]],
    masters: dict[int, torch.Tensor],
    name: Callable[[int], str],
    momentum: bool,
) -> list[tuple[str, torch.Tensor]]:
    """What every replica holds alike, named: each parameter's ``theta_global`` (its local
    value before the first step) and, with ``momentum``, its outer momentum (zero if none yet)."""
    states = [state.get(p, {}) for p in params]
    named = [
        (f"parameter {name(i)}", s.get("global", local_value(p, masters)))
        for i, (s, p) in enumerate(zip(states, params, strict=True))
    ]
    if momentum:
        zero = torch.zeros((), device=params[0].device)
        named += [(f"the outer momentum of {name(i)}", s.get("momentum", zero)) for i, s in enumerate(states)]
    return named


#: SparseLoCo's counters that a step changes (the attributes' names)
_COUNTS: tuple[str, ...] = ("_steps", "_since_sync", "_skipped", "_checked", "syncs", "skipped_syncs")
_COUNTS += ("skipped_steps", "inner_resets", "current_interval", "captured_energy")


def snapshot(opt: SparseLoCo) -> Callable[[], None]:
    """A copy of what ``opt.step()`` changes; the function returned puts it back, bit for bit.

    Copied: the local weights (parameters, fp32 masters), the inner optimizer's state, each
    parameter's ``theta_global`` and outer momentum (an outer step changes them in place), the
    counters, the adaptive k's and the policy driver's state. Not copied: the error buffers (a sync
    writes the next ones into its spare set and swaps them in only once applied, so the live ones
    are kept by reference) and the comm stats
    (they count what was sent). A fraction of a full ``state_dict()``: no error buffers, no
    zeros for the buffers not made yet, no records, and no checks on the way back.
    """
    params = opt._model_params
    weights = [p.detach().clone() for p in params]
    masters = {k: m.detach().clone() for k, m in opt._masters.items()}
    states = [
        {k: v.clone() if k in ("global", "momentum") else v for k, v in opt.state.get(p, {}).items()}
        for p in params
    ]
    inner = opt.inner.state_dict()
    inner["state"] = {
        n: {k: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v) for k, v in s.items()}
        for n, s in inner["state"].items()
    }
    inner["param_groups"] = copy.deepcopy(inner["param_groups"])
    counts = {name: copy.copy(getattr(opt, name)) for name in _COUNTS}
    topks = dict(opt.plan.topks()) if opt.adaptive_topk else None
    driver = opt._driver.snapshot()

    def undo() -> None:
        with torch.no_grad():
            for p, w in zip(params, weights, strict=True):
                p.copy_(w)
            for k, m in masters.items():
                opt._masters[k].copy_(m)
        for p, s in zip(params, states, strict=True):
            opt.state[p] = dict(s)
        opt.inner.load_state_dict(inner)
        for name, value in counts.items():
            setattr(opt, name, value)
        if topks is not None:
            opt.plan.set_topks(dict(topks))
        driver()

    return undo


def skip_bad_sync(opt: SparseLoCo, rnd: Round) -> None:
    """A sync whose round found a non-finite pseudo-gradient on some rank (``rnd.bad``): every
    rank back at ``theta_global`` with its non-finite inner state reset, then skip or raise as
    the front end's ``nonfinite`` says (the message says what changed)."""
    reset = opt._back_to_global(opt._model_params)
    when = f"sync {opt.syncs + 1}"
    opt.skip_or_raise(
        rnd, opt._name, when=when, what="pseudo-gradient", changed=recovered(reset), unit="sync"
    )
    opt.skipped_syncs += 1
    opt._driver.step_done(0, 0, synced=False)


def recovered(reset: list[str], shown: int = 4) -> str:
    """What a sync that found a non-finite pseudo-gradient changed (``reset``: the parameters
    whose inner state this rank reset)."""
    listing = ", ".join(reset[:shown]) + (f" (and {len(reset) - shown} more)" if len(reset) > shown else "")
    return (
        "a non-finite gradient or an overflow reached an inner optimizer; the sync was not applied "
        "(theta_global, error buffers and outer momentum as they were); every rank's weights are "
        "back at the last sync's"
        + (f", and this rank reset the inner optimizer's state of {listing}" if reset else "")
        + ", so training can go on"
    )
