"""Argument checks shared by the kernel families: clear errors naming the argument."""

from __future__ import annotations

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


def check_int(name: str, value: object, minimum: int = 1) -> int:
    """An integer (not a bool) >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} is invalid; allowed: an integer >= {minimum}")
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
