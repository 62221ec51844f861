"""The starvation guard: bounds on what overlap may take from other work.

Occupancy shaping and SM carve-out make room for communication by taking resources from
the compute kernel; a high-priority stream lets communication preempt it. Pushed too far,
communication starves compute (and whatever else shares the GPU). A
:class:`StarvationGuard` states the limits; :meth:`StarvationGuard.violations` lists what a
setting breaks (the tuner skips such settings and logs why), :meth:`StarvationGuard.check`
raises :class:`GuardViolation` (the class of :mod:`cokit.compress.priority`, which checks a
compression front end's ``comm_guard`` against its ``comm_priority``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from cokit.compress.priority import GuardViolation, is_high
from cokit.triton_kernels.backend import ArchLimits
from cokit.triton_kernels.gemm_config import GemmConfig, estimate_shared_bytes

__all__ = ["GuardViolation", "StarvationGuard", "reserved_sms"]


def reserved_sms(config: GemmConfig, limits: ArchLimits) -> int:
    """SMs/CUs a GEMM config leaves free for communication: ``num_sms - config.num_sms`` for
    the persistent form with a program count, else 0 (the tiled form may use every SM)."""
    if not config.persistent or config.num_sms is None:
        return 0
    return max(limits.num_sms - config.num_sms, 0)


@dataclasses.dataclass(frozen=True)
class StarvationGuard:
    """Limits on what an overlap setting may take from compute.

    * ``max_reserved_fraction`` / ``max_reserved_sms``: SMs/CUs carved out of the compute
      kernel (persistent GEMM ``num_sms`` below the device's count) plus SMs an emulated
      communication kernel occupies, as a fraction of the device and as a count;
    * ``max_footprint_inflation``: ``smem_bytes`` / the shared memory the kernel needs
      (occupancy shaping; 4.0 = at most 4 times the natural per-block footprint);
    * ``max_compute_slowdown``: measured ``T_comp_under_overlap / T_comp - 1`` (checked by
      :meth:`check_measured`; None = not bounded);
    * ``allow_high_priority``: whether communication may run on a high-priority stream.
    """

    max_reserved_fraction: float = 0.25
    max_reserved_sms: int | None = None
    max_footprint_inflation: float = 4.0
    max_compute_slowdown: float | None = None
    allow_high_priority: bool = True

    def __post_init__(self) -> None:
        f = self.max_reserved_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 <= f <= 1.0:
            raise ValueError(f"max_reserved_fraction={f!r} is invalid; allowed: a number from 0 to 1")
        n = self.max_reserved_sms
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
            raise ValueError(f"max_reserved_sms={n!r} is invalid; allowed: an integer >= 0 or None")
        g = self.max_footprint_inflation
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not math.isfinite(g) or g < 1.0:
            raise ValueError(f"max_footprint_inflation={g!r} is invalid; allowed: a number >= 1")
        s = self.max_compute_slowdown
        if s is not None and (isinstance(s, bool) or not isinstance(s, (int, float)) or not s >= 0):
            raise ValueError(f"max_compute_slowdown={s!r} is invalid; allowed: a number >= 0 or None")

    def violations(
        self,
        config: GemmConfig | None = None,
        *,
        limits: ArchLimits | None = None,
        priority: Any = None,
        natural_smem: int | None = None,
        dtype: torch.dtype | None = None,
        comm_sms: int | None = None,
    ) -> list[str]:
        """What ``config`` (and a communication side occupying ``comm_sms`` SMs, at
        ``priority``) breaks; empty when allowed.

        SM counts need ``limits``. The footprint check uses ``natural_smem`` (from a compiled
        kernel) or, given ``dtype``, the shared-memory estimate of ``config``.
        """
        out: list[str] = []
        if is_high(priority) and not self.allow_high_priority:
            out.append(
                f"priority {priority!r} is high but the guard allows no high-priority communication "
                "(allow_high_priority=False)"
            )
        if limits is not None:
            taken = (reserved_sms(config, limits) if config is not None else 0) + (comm_sms or 0)
            cap = math.floor(self.max_reserved_fraction * limits.num_sms)
            if self.max_reserved_sms is not None:
                cap = min(cap, self.max_reserved_sms)
            if taken > cap:
                out.append(
                    f"{taken} of {limits.num_sms} SMs/CUs taken for communication exceeds the guard's "
                    f"{cap} (max_reserved_fraction={self.max_reserved_fraction}, "
                    f"max_reserved_sms={self.max_reserved_sms})"
                )
        elif self.max_reserved_sms is not None and comm_sms is not None and comm_sms > self.max_reserved_sms:
            out.append(
                f"communication occupies {comm_sms} SMs/CUs, above max_reserved_sms={self.max_reserved_sms}"
            )
        if config is not None and config.smem_bytes is not None:
            need = natural_smem
            if need is None and dtype is not None:
                need = estimate_shared_bytes(config, dtype, limits if limits is not None else "cuda")
            if need is not None and need > 0:
                inflation = config.smem_bytes / need
                if inflation > self.max_footprint_inflation:
                    out.append(
                        f"smem_bytes={config.smem_bytes} is {inflation:.2f}x the {need} B the kernel needs, "
                        f"above max_footprint_inflation={self.max_footprint_inflation}"
                    )
        return out

    def check(self, config: GemmConfig | None = None, **kwargs: Any) -> None:
        """Raise :class:`GuardViolation` when :meth:`violations` is not empty."""
        bad = self.violations(config, **kwargs)
        if bad:
            raise GuardViolation("starvation guard: " + "; ".join(bad))

    def check_measured(self, compute_slowdown: float | None) -> list[str]:
        """What a measured compute slowdown (``T_comp_under_overlap / T_comp - 1``) breaks."""
        if self.max_compute_slowdown is None or compute_slowdown is None:
            return []
        if compute_slowdown > self.max_compute_slowdown:
            return [
                f"compute slowed by {compute_slowdown:.1%} under overlap, above "
                f"max_compute_slowdown={self.max_compute_slowdown:.1%}"
            ]
        return []

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return dataclasses.asdict(self)
