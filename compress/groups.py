"""Checking a ``process_group=`` argument before anything is built on it."""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["check_process_group"]


def check_process_group(owner: str, group: object) -> None:
    """Raise unless ``group`` is None (the default group) or a torch.distributed ProcessGroup."""
    if group is None or (dist.is_available() and isinstance(group, dist.ProcessGroup)):
        return
    raise TypeError(
        f"{owner}: process_group must be None (the default group) or a torch.distributed "
        f"ProcessGroup (e.g. from dist.new_group()), got {type(group).__name__} {group!r}"
    )
