"""DeMo's settings: what each param group holds, their checks, and what every rank agrees on.

:data:`GROUP_SETTINGS` are the per-group settings that change what is sent or how the update
is computed; :func:`check_group` checks a group (at construction, ``add_param_group`` and load);
:func:`fingerprinted` is every setting the round's fingerprint covers (and the checkpoint's
records keep). :data:`RULE_OPTIONS` are the update rules' tuning, keyword options of DeMo
beside the shared ones of :class:`~cokit.compress.frontend.FrontEndOptions`.
"""

from __future__ import annotations

from typing import Any

import torch

from cokit.compress import rules
from cokit.compress.frontend import plain
from cokit.compress.payload import VALUE_DTYPES
from cokit.triton_kernels._checks import check_int, check_number

__all__ = [
    "GROUP_SETTINGS",
    "RULE_OPTIONS",
    "check_group",
    "check_plain_parallel",
    "fingerprinted",
]

#: DeMo's per-group settings that change what is sent or how the update is computed (checked
#: across ranks every round), with their plain types
GROUP_SETTINGS = {
    "lr": float,
    "weight_decay": float,
    "compression_decay": float,
    "compression_topk": int,
    "compression_chunk": int,
    "alpha": float,
    "update_rule": str,
    "rule_beta2": float,
    "rule_eps": float,
    "ns_steps": int,
    "rule_fallback": str,
}
#: the update rules' tuning, keyword options of DeMo and per-group settings, with defaults:
#: ``rule_beta2``/``rule_eps``, the adam rule's second-moment decay and epsilon; ``ns_steps``,
#: Newton-Schulz iterations; ``rule_fallback``, ``"adam"`` or ``"sign"``: the rule of < 2-D
#: parameters under newton_schulz
RULE_OPTIONS = {"rule_beta2": 0.999, "rule_eps": 1e-8, "ns_steps": 5, "rule_fallback": "adam"}


def check_group(group: dict[str, Any], index: int) -> None:
    """Raise unless ``group`` (defaults filled in) holds valid settings and parameters."""
    where = f"DeMo param group {index}"
    check_number("lr", group["lr"], 0.0, where=where)
    check_number("weight_decay", group["weight_decay"], 0.0, where=where)
    check_number("compression_decay", group["compression_decay"], 0.0, 1.0, where=where)
    if "momentum" in group:  # the alias of compression_decay (guards.sync_decay)
        check_number("momentum", group["momentum"], 0.0, 1.0, where=where)
    check_number("alpha", group["alpha"], 0.0, 1.0, low_open=True, where=where)
    check_int("compression_topk", group["compression_topk"], 1, where=where)
    check_int("compression_chunk", group["compression_chunk"], 1, where=where)
    rules.check_rule_settings(where, group)
    for p in group["params"]:
        p = p[1] if isinstance(p, tuple) and len(p) == 2 else p  # (name, parameter)
        if isinstance(p, torch.Tensor) and p.dtype not in VALUE_DTYPES:
            raise TypeError(
                f"{where}: DeMo optimizes float32, float16 and bfloat16 parameters, got {p.dtype}"
            )


def check_plain_parallel(group: dict[str, Any], index: int, precision: str) -> None:
    """The update rules and precision modes keep state that must be identical on every rank and
    see whole tensors: plain data parallel only (raise for DTensor parameters or hierarchy=)."""
    if group["update_rule"] != "sign" or precision != "nearest":
        raise ValueError(
            f"DeMo param group {index}: update_rule={group['update_rule']!r} with precision="
            f"{precision!r} needs plain data parallel; with DTensor (FSDP2) parameters or "
            "hierarchy= use update_rule='sign' and precision='nearest'"
        )


def fingerprinted(opt: Any) -> dict[str, Any]:
    """Every setting of the DeMo optimizer ``opt`` that changes what is sent or how the update
    is computed (all ranks must agree: every round's fingerprint covers them)."""
    return {
        "payload": opt.payload,
        "value_dtype": str(opt.value_dtype),
        "dense_fallback": opt.dense_fallback,
        "bucket_cap_mb": opt.bucket_cap_mb,
        "full_sync_every": opt.full_sync_every,
        "overlap_backward": opt.overlap_backward,
        "nonfinite": opt.nonfinite,
        "validate_payload": opt.validate_payload,
        "policy": opt.policy.describe(),
        "precision": opt.precision,
        "seed": opt.seed,
        "groups": [{k: _typed(g[k], kind) for k, kind in GROUP_SETTINGS.items()} for g in opt.param_groups],
    }


def _typed(value: object, kind: type) -> object:
    """A group setting as a plain ``kind`` (:func:`~cokit.compress.frontend.plain`, then cast:
    ``compression_topk`` stays an int)."""
    value = plain(value)
    return kind(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value
