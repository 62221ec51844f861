"""Inner update rules for DeMo's decoded direction: alternatives to sign, which keeps only the
sign of each element and drops every magnitude.

DeMo decodes, per parameter, the same direction ``u`` on every rank (the mean over ranks of
the transmitted DCT coefficients, inverse-transformed). A rule turns ``u`` into the update::

    p = p * (1 - lr * wd) - lr * rule(u)

Rules and their lr scale (what makes a tuned AdamW lr carry over; measured numbers are in
docs/optimizers.md, "Update rules and low precision", and the calibration guide of
docs/validation-study.md):

* ``"sign"``: ``sign(u)`` (DeMo): every element +-1, RMS 1.
* ``"rms"``: ``u / rms(u)`` per tensor: RMS exactly 1, like sign, but keeps magnitudes.
* ``"adam"``: ``u / (sqrt(v_hat) + eps)`` with ``v = beta2 * v + (1 - beta2) * u**2`` and
  ``v_hat = v / (1 - beta2**t)``: Adam's own scale (u plays Adam's first moment: DeMo's
  error-feedback buffer is the momentum), RMS 1 at the first step and below 1 after.
* ``"newton_schulz"``: Muon's orthogonalization of ``u`` viewed as ``(shape[0], -1)``,
  scaled by ``0.2 * sqrt(max(rows, cols))`` (Moonlight, Liu et al. 2025): RMS ~0.2, the
  RMS of a typical AdamW update, so AdamW's lr and weight decay carry over. Parameters
  with fewer than 2 dimensions use ``rule_fallback`` (``"adam"`` or ``"sign"``).

Everything here is pure torch on fp32 tensors (any device); ``reference_update`` is an
independent float64 version for tests.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from cokit.triton_kernels._checks import check_choice, check_int, check_number

__all__ = [
    "FALLBACKS",
    "NS_COEFFICIENTS",
    "NS_RMS",
    "RULE_DEFAULTS",
    "UPDATE_RULES",
    "adam_update",
    "apply_rule",
    "check_rule_settings",
    "effective_rule",
    "newton_schulz",
    "ns_scale",
    "reference_update",
    "rms_update",
]

UPDATE_RULES = ("sign", "rms", "adam", "newton_schulz")
FALLBACKS = ("sign", "adam")
# Muon's quintic Newton-Schulz iteration X <- a X + (b A + c A^2) X, A = X X^T (Jordan et al.
# 2024): pushes every singular value of X (spectral norm <= 1) into ~[0.7, 1.2] in 5 steps.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_RMS = 0.2  # target RMS of a newton_schulz update (an AdamW update's typical RMS)
RULE_DEFAULTS: dict[str, Any] = {
    "update_rule": "sign",
    "rule_beta2": 0.999,
    "rule_eps": 1e-8,
    "ns_steps": 5,
    "rule_fallback": "adam",
}
_TINY = 1e-30  # below this a norm counts as zero: the update is zero, never a division by ~0


def check_rule_settings(where: str, group: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming the allowed values unless ``group``'s rule settings are valid."""
    check_choice("update_rule", group["update_rule"], UPDATE_RULES, where=where)
    check_choice(
        "rule_fallback (the rule of <2-D parameters under newton_schulz)",
        group["rule_fallback"],
        FALLBACKS,
        where=where,
    )
    check_number("rule_beta2", group["rule_beta2"], 0, 1, high_open=True, where=where)
    check_number("rule_eps", group["rule_eps"], 0, low_open=True, where=where)
    steps = check_int("ns_steps", group["ns_steps"], 1, where=where)
    if steps > 100:
        raise ValueError(f"{where}: ns_steps must be an integer in [1, 100], got {steps!r}")


def effective_rule(rule: str, fallback: str, shape: tuple[int, ...] | torch.Size) -> str:
    """The rule a parameter of ``shape`` uses: newton_schulz needs >= 2 dimensions."""
    return fallback if rule == "newton_schulz" and len(shape) < 2 else rule


def rms_update(u: torch.Tensor) -> torch.Tensor:
    """``u / rms(u)`` (RMS 1); a zero (or ~0) ``u`` gives a zero update."""
    rms = u.square().mean().sqrt()
    return torch.where(rms > _TINY, u / rms.clamp_min(_TINY), torch.zeros_like(u))


def adam_update(u: torch.Tensor, v: torch.Tensor, step: int, beta2: float, eps: float) -> torch.Tensor:
    """Update ``v`` in place with ``u``'s square (``step``: this is the step-th update, from 1)
    and return ``u / (sqrt(v / (1 - beta2**step)) + eps)``."""
    v.mul_(beta2).addcmul_(u, u, value=1.0 - beta2)
    correction = 1.0 - beta2**step
    return u / ((v / correction).sqrt() + eps)


def newton_schulz(u: torch.Tensor, steps: int) -> torch.Tensor:
    """Muon's quintic Newton-Schulz orthogonalization of ``u`` as a ``(shape[0], -1)`` matrix
    (fp32), returned in ``u``'s shape; a ~0 ``u`` gives zeros."""
    a, b, c = NS_COEFFICIENTS
    x = u.reshape(u.shape[0], -1)
    tall = x.shape[0] > x.shape[1]
    if tall:  # iterate on the smaller Gram matrix
        x = x.T
    norm = x.norm()
    if not bool(norm > _TINY):
        return torch.zeros_like(u)
    x = x / norm  # spectral norm <= Frobenius norm = 1
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.T if tall else x).reshape(u.shape)


def ns_scale(shape: tuple[int, ...] | torch.Size) -> float:
    """``0.2 * sqrt(max(rows, cols))``: brings an orthogonalized update to RMS ~0.2."""
    rows, cols = shape[0], math.prod(shape[1:])
    return NS_RMS * math.sqrt(max(rows, cols))


def apply_rule(u: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> torch.Tensor:
    """The update ``rule(u)`` (fp32, ``u``'s shape) of a parameter with optimizer state
    ``state`` (the adam rule keeps ``v`` and ``rule_step`` there) under ``group``'s settings."""
    rule = effective_rule(group["update_rule"], group["rule_fallback"], u.shape)
    if rule == "sign":
        return u.sign()
    if rule == "rms":
        return rms_update(u)
    if rule == "adam":
        if "v" not in state:
            state["v"] = torch.zeros_like(u, dtype=torch.float32, memory_format=torch.contiguous_format)
            state["rule_step"] = torch.zeros((), dtype=torch.float32)
        state["rule_step"] += 1
        step = int(state["rule_step"].item())
        return adam_update(u, state["v"], step, float(group["rule_beta2"]), float(group["rule_eps"]))
    return newton_schulz(u, int(group["ns_steps"])) * ns_scale(u.shape)


def reference_update(
    rule: str,
    u: torch.Tensor,
    v: torch.Tensor | None = None,
    step: int = 1,
    *,
    beta2: float = 0.999,
    eps: float = 1e-8,
    ns_steps: int = 5,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Float64 reference of one rule (already resolved by :func:`effective_rule`): returns
    ``(update, new v)``; ``v`` (adam only) is not modified."""
    u = u.to(torch.float64)
    if rule == "sign":
        return u.sign(), v
    if rule == "rms":
        rms = math.sqrt(float((u * u).mean()))
        return (u / rms if rms > 0 else torch.zeros_like(u)), v
    if rule == "adam":
        prev = torch.zeros_like(u) if v is None else v.to(torch.float64)
        new_v = beta2 * prev + (1 - beta2) * u * u
        return u / (torch.sqrt(new_v / (1 - beta2**step)) + eps), new_v
    if rule != "newton_schulz":
        raise ValueError(f"unknown rule {rule!r}")
    a, b, c = NS_COEFFICIENTS
    m = u.reshape(u.shape[0], -1)
    x = m if m.shape[0] <= m.shape[1] else m.T
    x = x / torch.linalg.matrix_norm(x)
    for _ in range(ns_steps):
        s = x @ x.T
        x = a * x + b * s @ x + c * s @ s @ x
    x = x if m.shape[0] <= m.shape[1] else x.T
    return x.reshape(u.shape) * 0.2 * math.sqrt(max(m.shape)), v
