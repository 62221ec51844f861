"""Parameters given by name: param groups from tensors, ``(name, tensor)`` pairs or dicts, and
``dense_params``, the name substrings of the tensors an optimizer sends dense.

Shared by :class:`cokit.compress.SparseLoCo` and :class:`cokit.compress.Dion`, so both accept
the same inputs and refuse the same mistakes with the same words (``where`` names the owner),
and both save their param groups by position the same way.
"""

from __future__ import annotations

from typing import Any

import torch

from cokit.compress.dtensor import is_dtensor

__all__ = [
    "check_dense_params",
    "check_replicated",
    "dense_members",
    "indexed_groups",
    "param_groups",
    "param_name",
    "tensors_of",
]


def param_groups(params: Any, where: str) -> tuple[list[dict[str, Any]], dict[int, str]]:
    """Param groups (tensors only) and a name per parameter id for ``(name, tensor)`` input."""
    if isinstance(params, torch.Tensor):
        raise TypeError(
            f"{where}: params must be an iterable of tensors, (name, tensor) pairs or dicts, got a tensor"
        )
    items = list(params)
    names: dict[int, str] = {}
    if items and all(isinstance(i, dict) for i in items):
        groups = []
        for g in items:
            ps = g.get("params")
            ps = [ps] if isinstance(ps, torch.Tensor) else list(ps or [])
            groups.append({**g, "params": tensors_of(ps, names, where)})
        return groups, names
    return [{"params": tensors_of(items, names, where)}], names


def check_replicated(params: list[torch.Tensor], where: str, dtypes: tuple[torch.dtype, ...]) -> None:
    """Raise unless ``params`` is a non-empty list of distinct, plain (not DTensor) tensors of
    ``dtypes``: these optimizers keep a whole replica of the model on every rank."""
    if not params:
        raise ValueError(f"{where}: got an empty parameter list")
    if len({id(p) for p in params}) != len(params):
        raise ValueError(f"{where}: a parameter appears more than once")
    for p in params:
        if is_dtensor(p):
            raise TypeError(
                f"{where}: DTensor (FSDP) parameters are not supported; use plain data-parallel "
                "replicas (each rank holds the whole model)"
            )
        if p.dtype not in dtypes:
            raise TypeError(f"{where} optimizes float32, float16 and bfloat16 parameters, got {p.dtype}")


def indexed_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``groups`` as a state dict holds them: each group's settings, and its parameters as
    positions in the flat parameter list (torch's layout)."""
    out, first = [], 0
    for g in groups:
        out.append(
            {
                **{k: v for k, v in g.items() if k != "params"},
                "params": list(range(first, first + len(g["params"]))),
            }
        )
        first += len(g["params"])
    return out


def tensors_of(items: list[Any], names: dict[int, str], where: str) -> list[torch.Tensor]:
    """The tensors of ``items`` (tensors or ``(name, tensor)`` pairs), recording each pair's
    name in ``names`` (by the tensor's id)."""
    out = []
    for item in items:
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor):
            names[id(item[1])] = str(item[0])
            item = item[1]
        if not isinstance(item, torch.Tensor):
            raise TypeError(
                f"{where}: params must be tensors, (name, tensor) pairs or dicts, got {type(item).__name__}"
            )
        out.append(item)
    return out


def check_dense_params(value: object, where: str) -> tuple[str, ...] | None:
    """``dense_params`` as a tuple of substrings (None: none, also for an empty one)."""
    if value is None:
        return None
    if isinstance(value, str):
        raise TypeError(
            f"{where}: dense_params must be a tuple of name substrings, got the string {value!r}; "
            f"write ({value!r},)"
        )
    if not isinstance(value, (tuple, list)) or not all(isinstance(s, str) and s for s in value):
        raise TypeError(
            f"{where}: dense_params must be None or a tuple of non-empty name substrings such as "
            f"('embed', 'head'), got {value!r}"
        )
    return tuple(value) or None


def dense_members(
    substrings: tuple[str, ...] | None, params: list[torch.Tensor], names: dict[int, str], where: str
) -> frozenset[int]:
    """Positions of the parameters whose name contains one of ``substrings`` (``dense_params``);
    every substring must match a name, and every parameter must have one."""
    if substrings is None:
        return frozenset()
    unnamed = [n for n, p in enumerate(params) if id(p) not in names]
    if unnamed:
        raise ValueError(
            f"{where}: dense_params selects parameters by name, but {len(unnamed)} of the "
            f"{len(params)} parameters came without one; pass model.named_parameters() (or (name, "
            "tensor) pairs, also inside param groups)"
        )
    labels = [names[id(p)] for p in params]
    for s in substrings:
        if not any(s in label for label in labels):
            shown = ", ".join(repr(x) for x in labels[:6]) + (" ..." if len(labels) > 6 else "")
            raise ValueError(
                f"{where}: dense_params entry {s!r} matches no parameter name (they are {shown}); "
                "fix it or leave it out"
            )
    return frozenset(n for n, label in enumerate(labels) if any(s in label for s in substrings))


def param_name(params: list[torch.Tensor], names: dict[int, str], n: int) -> str:
    """Parameter ``n`` as messages name it: its name (or ``param n``) and shape; a position
    outside ``params`` is a GradScaler's report."""
    if not 0 <= n < len(params):
        return "(a GradScaler's report)"
    p = params[n]
    return f"'{names.get(id(p), f'param {n}')}' {tuple(p.shape)}"
