"""Compute/communication overlap: occupancy-shaped compute next to asynchronous collectives.

docs/design.md §1.2 (Cui & Pericas): give the compute kernel a shaped footprint (more shared
memory per block, fewer SMs for a persistent GEMM) and run communication on high-priority
streams, so that collectives hide behind compute on NVIDIA and AMD alike.

* :mod:`cokit.overlap.streams`   -- comm stream with a priority, high-priority process group (CPU no-ops)
* :mod:`cokit.overlap.guard`     -- the starvation guard (bounds on SMs reserved, footprint inflation)
* :mod:`cokit.overlap.metrics`   -- the metric formulas
* :mod:`cokit.overlap.measure`   -- alone / sequential / overlapped timing with repeats
* :mod:`cokit.overlap.schedules` -- GEMM + all-reduce/reduce-scatter, all-gather + GEMM, generic Overlap
* :mod:`cokit.overlap.tensor_parallel` -- Megatron-style column/row-parallel Linear layers on these schedules
* :mod:`cokit.overlap.layers`    -- ``Linear``, a drop-in for ``torch.nn.Linear`` on the Triton GEMM
* :mod:`cokit.overlap.training`  -- ``apply_overlap``: a model's linear layers on it, configs tuned while training
* :mod:`cokit.overlap.emulate`   -- one-GPU emulated communication (labelled as such)
* :mod:`cokit.overlap.sweep`     -- sweep grids, their measurement, progress and records (ranks, files, plots: :mod:`cokit.sweeps`)
* :mod:`cokit.overlap.tuner`     -- online tuner for training loops
"""

from .emulate import EmulatedComm
from .guard import GuardViolation, StarvationGuard
from .layers import Linear
from .measure import OverlapResult, measure
from .metrics import OverlapMetrics, compute_metrics
from .schedules import (
    AllGatherGemm,
    GemmCollective,
    Overlap,
    Scheduled,
    all_gather_gemm,
    gemm_all_reduce,
    gemm_reduce_scatter,
)
from .streams import CommStream, high_priority_group
from .tensor_parallel import ColumnParallelLinear, RowParallelLinear
from .training import OverlapTuning, apply_overlap
from .tuner import OnlineTuner

__all__ = [
    "AllGatherGemm",
    "ColumnParallelLinear",
    "CommStream",
    "EmulatedComm",
    "GemmCollective",
    "GuardViolation",
    "Linear",
    "OnlineTuner",
    "Overlap",
    "OverlapMetrics",
    "OverlapResult",
    "OverlapTuning",
    "RowParallelLinear",
    "Scheduled",
    "StarvationGuard",
    "all_gather_gemm",
    "apply_overlap",
    "compute_metrics",
    "gemm_all_reduce",
    "gemm_reduce_scatter",
    "high_priority_group",
    "measure",
]
