"""Argument checks for every layer (kernels, compress, overlap, the app): one dialect.

Each check raises ``ValueError``/``TypeError`` saying ``<where>: <name> must be <what is
allowed>, got <value>`` before anything changes, and returns the checked value.
"""

from __future__ import annotations

import math

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_ALLOWED = "float32, float16 or bfloat16"


def check_float_tensor(name: str, t: object, dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES) -> torch.Tensor:
    """A dense, non-empty floating tensor of an allowed dtype."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(
            f"{name} must be a dense (strided) tensor, got layout {t.layout}; call .to_dense() first"
        )
    if t.dtype not in dtypes:
        allowed = (
            _ALLOWED if dtypes == FLOAT_DTYPES else ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        )
        raise TypeError(f"{name} must have dtype {allowed}, got {t.dtype}")
    if t.numel() == 0:
        raise ValueError(f"{name} is empty (shape {tuple(t.shape)}); nothing to compress")
    return t


def check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _prefix(where: str) -> str:
    return f"{where}: " if where else ""


def check_int(name: str, value: object, minimum: int = 1, *, where: str = "", more: str = "") -> int:
    """An integer (not a bool) >= ``minimum``; ``where`` names the owner in the error,
    ``more`` adds to what is allowed (e.g. "or None for ...")."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        extra = f" {more}" if more else ""
        raise ValueError(f"{_prefix(where)}{name} must be an integer >= {minimum}{extra}, got {value!r}")
    return value


def _bounds(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    if low is not None and high is not None:
        return f" in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    if low is not None:
        return f" {'>' if low_open else '>='} {low}"
    if high is not None:
        return f" {'<' if high_open else '<='} {high}"
    return ""


def check_number(
    name: str,
    value: object,
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
    where: str = "",
) -> float:
    """A finite real number (not a bool; a one-element tensor counts, as LR schedulers write
    them) within the bounds, as a float; ``where`` names the owner in the error."""
    number = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
    ok = isinstance(number, (int, float)) and not isinstance(number, bool) and math.isfinite(number)
    if ok:
        v = float(number)  # type: ignore[arg-type]
        ok = (low is None or (v > low if low_open else v >= low)) and (
            high is None or (v < high if high_open else v <= high)
        )
    if not ok:
        bounds = _bounds(low, high, low_open, high_open)
        raise ValueError(f"{_prefix(where)}{name} must be a finite number{bounds}, got {value!r}")
    return float(number)  # type: ignore[arg-type]


def check_flag(name: str, value: object, *, where: str = "") -> bool:
    """``True`` or ``False`` (not 0/1 or other truthy values)."""
    if not isinstance(value, bool):
        raise TypeError(f"{_prefix(where)}{name} must be True or False, got {value!r}")
    return value


def check_choice(name: str, value: object, choices: tuple[str, ...], *, where: str = "") -> str:
    """One of ``choices``."""
    if not isinstance(value, str) or value not in choices:
        allowed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{_prefix(where)}{name} must be one of {allowed}, got {value!r}")
    return value


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    """All tensors on one device; returns it."""
    devices = {name: t.device for name, t in tensors.items()}
    first = next(iter(devices.values()))
    for dev in devices.values():
        if dev != first:
            listing = ", ".join(f"{n} on {d}" for n, d in devices.items())
            raise ValueError(f"all tensors must be on one device, got {listing}")
    return first


def check_tensor_list(name: str, tensors: object) -> list[torch.Tensor]:
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)) or len(tensors) == 0:
        raise TypeError(f"{name} must be a non-empty list of tensors")
    return list(tensors)
