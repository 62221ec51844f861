"""Inner optimizers for SparseLoCo: a hybrid Muon, against the gap to AdamW that grows with training.

:class:`Muon` steps each matrix parameter with Muon (Jordan et al. 2024) and every other
parameter with AdamW, in one ``torch.optim.Optimizer``::

    # Muon: 2-D parameters whose both dimensions are > 1, not embeddings or heads
    b  = momentum * b + (1 - momentum) * g                 # the momentum buffer
    u  = (1 - momentum) * g + momentum * b                 # Nesterov (else u = b)
    o  = newton_schulz(u) * max(1, rows / cols) ** 0.5     # orthogonalized, Muon's scale
    p  = p * (1 - lr * weight_decay) - lr * o              # decoupled weight decay

    # AdamW (torch.optim.AdamW's formula) at lr * adamw_lr_ratio: everything else

``newton_schulz`` is the project's (:func:`cokit.compress.rules.newton_schulz`: five quintic
iterations, fp32). Which parameters take Muon: a param group's ``use_muon`` (True: all of its
parameters, each must be a matrix; False: none; None, the default: decided per parameter)
and, per parameter, the shape rule above plus, where the parameter came as a ``(name,
tensor)`` pair, a name containing none of ``exclude`` (embeddings and output heads take
AdamW, as Muon's authors advise). Plain tensors carry no name: pass ``model.named_parameters()``
or put the embeddings and heads in a group with ``use_muon=False``.

The class is thin: :meth:`Muon.step` collects each group's tensors and calls the functional
steps :func:`muon` and :func:`adamw` (through :func:`adamw_step`, which Dion shares), like
``torch.optim.adamw``. The state is torch's layout
(``momentum_buffer`` for Muon's parameters; ``step``, ``exp_avg``, ``exp_avg_sq`` for
AdamW's), so ``state_dict()`` / ``load_state_dict()`` round-trip exactly.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from cokit.compress.named_params import tensors_of
from cokit.compress.rules import newton_schulz
from cokit.triton_kernels._checks import check_int, check_number

__all__ = ["EXCLUDE", "Muon", "adamw", "adamw_settings", "adamw_step", "check_adamw_settings", "muon"]

#: name substrings of the parameters that take AdamW under :class:`Muon` (embeddings, heads)
EXCLUDE = ("embed", "head", "wte", "wpe")
_WHERE = "Muon"


class Muon(torch.optim.Optimizer):
    """Muon on the matrices, AdamW on everything else (module docstring).

    Args:
        params: tensors, ``(name, tensor)`` pairs (``model.named_parameters()``: names let
            ``exclude`` keep embeddings and heads on AdamW) or param groups of either.
        lr: Muon's learning rate (default 0.02, Muon's reference); LR schedulers drive it.
        momentum: Muon's momentum (0.95).
        nesterov: Nesterov momentum (default True, Muon's reference).
        ns_steps: Newton-Schulz iterations (5).
        weight_decay: decoupled weight decay of both parts (``p *= 1 - lr * weight_decay``,
            with each part's lr).
        adamw_lr_ratio: AdamW's lr as a fraction of ``lr`` (default 0.05: AdamW at 1e-3,
            torch's default, beside Muon at 0.02), so that a scheduler scales both.
        adamw_betas / adamw_eps: AdamW's betas (0.9, 0.95) and epsilon (1e-8).
        use_muon: the default of the groups' ``use_muon`` flag (None: per parameter).
        exclude: name substrings that send a named parameter to AdamW (:data:`EXCLUDE`).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]] | Iterable[tuple[str, torch.Tensor]],
        lr: float = 0.02,
        *,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        weight_decay: float = 0.0,
        adamw_lr_ratio: float = 0.05,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        use_muon: bool | None = None,
        exclude: Sequence[str] = EXCLUDE,
    ):
        if isinstance(exclude, str) or not all(isinstance(e, str) and e for e in exclude):
            raise TypeError(
                f"{_WHERE}: exclude must be a tuple of non-empty name substrings such as ('embed', "
                f"'head'), got {exclude!r}"
            )
        self.exclude = tuple(exclude)
        self._names: dict[int, str] = {}
        defaults = dict(
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            **adamw_settings(weight_decay, adamw_lr_ratio, adamw_betas, adamw_eps),
            use_muon=use_muon,
        )
        _check_group(defaults)
        if isinstance(params, torch.Tensor):
            raise TypeError(f"{_WHERE}: params must be an iterable of tensors, pairs or dicts, got a tensor")
        items: list[Any] = list(params)
        if items and all(isinstance(i, dict) for i in items):
            groups: list[Any] = [{**g, "params": self._unnamed(g.get("params"))} for g in items]
        else:
            groups = [{"params": self._unnamed(items)}]
        super().__init__(groups, defaults)

    def _unnamed(self, params: Any) -> list[torch.Tensor]:
        """Tensors of ``params``, remembering the names of ``(name, tensor)`` pairs."""
        return tensors_of(
            [params] if isinstance(params, torch.Tensor) else list(params or []), self._names, _WHERE
        )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _check_group(group)
        if group["use_muon"]:
            for p in group["params"]:
                if not _is_matrix(p):
                    raise ValueError(
                        f"{_WHERE}: a group with use_muon=True holds {self._label(p)} of shape "
                        f"{tuple(p.shape)}; Muon needs 2-D parameters with both dimensions > 1 (put "
                        "the others in a group with use_muon=False or None)"
                    )

    def _label(self, p: torch.Tensor) -> str:
        name = self._names.get(id(p))
        return f"parameter {name!r}" if name is not None else "a parameter"

    def uses_muon(self, p: torch.Tensor, group: dict[str, Any]) -> bool:
        """Whether ``p`` (of ``group``) takes Muon's step (else AdamW's)."""
        flag = group["use_muon"]
        if flag is not None:
            return bool(flag)
        name = self._names.get(id(p), "")
        return _is_matrix(p) and not any(e in name for e in self.exclude)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One step: :func:`muon` on the group's Muon parameters, :func:`adamw` on the rest."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            m_params, m_grads, m_bufs = [], [], []
            a_params, a_grads, a_states = [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise TypeError(
                        f"{_WHERE}: {self._label(p)} has a sparse gradient; Muon needs dense ones"
                    )
                state = self.state[p]
                if self.uses_muon(p, group):
                    if "momentum_buffer" not in state:
                        state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    m_params.append(p)
                    m_grads.append(p.grad)
                    m_bufs.append(state["momentum_buffer"])
                else:
                    if "step" not in state:
                        state["step"] = torch.zeros((), dtype=torch.float32)
                        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    a_params.append(p)
                    a_grads.append(p.grad)
                    a_states.append(state)
            muon(
                m_params,
                m_grads,
                m_bufs,
                lr=float(group["lr"]),
                momentum=float(group["momentum"]),
                nesterov=bool(group["nesterov"]),
                ns_steps=int(group["ns_steps"]),
                weight_decay=float(group["weight_decay"]),
            )
            adamw_step(a_params, a_grads, a_states, group)
        return loss


def muon(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    momentum_buffers: list[torch.Tensor],
    *,
    lr: float,
    momentum: float,
    nesterov: bool,
    ns_steps: int,
    weight_decay: float,
) -> None:
    """Muon's step of 2-D ``params`` (module docstring), in place; buffers updated too."""
    for p, g, buf in zip(params, grads, momentum_buffers, strict=True):
        buf.lerp_(g, 1 - momentum)
        u = g.lerp(buf, momentum) if nesterov else buf
        rows, cols = p.shape
        o = newton_schulz(u.float(), ns_steps) * max(1.0, rows / cols) ** 0.5
        if weight_decay != 0:
            p.mul_(1 - lr * weight_decay)
        p.add_(o.to(p.dtype), alpha=-lr)


def adamw(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """AdamW's step, in place (``torch.optim.AdamW(foreach=False)``'s operations, in its order)."""
    for p, g, m, v, t in zip(params, grads, exp_avgs, exp_avg_sqs, steps, strict=True):
        t += 1
        step = float(t.item())
        p.mul_(1 - lr * weight_decay)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        step_size = lr / (1 - beta1**step)
        denom = (v.sqrt() / (1 - beta2**step) ** 0.5).add_(eps)
        p.addcdiv_(m, denom, value=-step_size)


def adamw_step(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    states: list[dict[str, torch.Tensor]],
    group: Mapping[str, Any],
) -> None:
    """:func:`adamw` on a hybrid's AdamW parameters with their ``states`` (``step``,
    ``exp_avg``, ``exp_avg_sq``) and ``group``'s settings: lr ``lr * adamw_lr_ratio``,
    ``adamw_betas``, ``adamw_eps`` and ``weight_decay``."""
    beta1, beta2 = group["adamw_betas"]
    adamw(
        params,
        grads,
        [s["exp_avg"] for s in states],
        [s["exp_avg_sq"] for s in states],
        [s["step"] for s in states],
        lr=float(group["lr"]) * float(group["adamw_lr_ratio"]),
        beta1=float(beta1),
        beta2=float(beta2),
        eps=float(group["adamw_eps"]),
        weight_decay=float(group["weight_decay"]),
    )


def _is_matrix(p: torch.Tensor) -> bool:
    return p.dim() == 2 and p.shape[0] > 1 and p.shape[1] > 1


def _check_group(group: dict[str, Any]) -> None:
    """Raise naming the value unless ``group``'s hyper-parameters are valid."""
    check_number("lr", group["lr"], 0.0, where=_WHERE)
    check_number("momentum", group["momentum"], 0.0, 1.0, high_open=True, where=_WHERE)
    if not isinstance(group["nesterov"], bool):
        raise TypeError(f"{_WHERE}: nesterov must be True or False, got {group['nesterov']!r}")
    steps = check_int("ns_steps", group["ns_steps"], 1, where=_WHERE)
    if steps > 100:
        raise ValueError(f"{_WHERE}: ns_steps must be an integer in [1, 100], got {steps!r}")
    check_adamw_settings(group, _WHERE)
    if not (group["use_muon"] is None or isinstance(group["use_muon"], bool)):
        raise TypeError(
            f"{_WHERE}: use_muon must be True, False or None (per parameter), got {group['use_muon']!r}"
        )


def adamw_settings(
    weight_decay: float, adamw_lr_ratio: float, adamw_betas: Any, adamw_eps: float
) -> dict[str, Any]:
    """The AdamW part of a hybrid's defaults, what :func:`check_adamw_settings` checks (a list
    of betas becomes a tuple)."""
    return dict(
        weight_decay=weight_decay,
        adamw_lr_ratio=adamw_lr_ratio,
        adamw_betas=tuple(adamw_betas) if isinstance(adamw_betas, (tuple, list)) else adamw_betas,
        adamw_eps=adamw_eps,
    )


def check_adamw_settings(group: Mapping[str, Any], where: str) -> None:
    """Raise naming the value unless the AdamW part of a hybrid's group is valid:
    ``weight_decay``, ``adamw_lr_ratio``, ``adamw_betas`` and ``adamw_eps``."""
    check_number("weight_decay", group["weight_decay"], 0.0, where=where)
    check_number("adamw_lr_ratio", group["adamw_lr_ratio"], 0.0, where=where)
    betas = group["adamw_betas"]
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"{where}: adamw_betas must be a pair (beta1, beta2), got {betas!r}")
    for name, b in zip(("adamw_betas[0]", "adamw_betas[1]"), betas, strict=True):
        check_number(name, b, 0.0, 1.0, high_open=True, where=where)
    check_number("adamw_eps", group["adamw_eps"], 0.0, low_open=True, where=where)
