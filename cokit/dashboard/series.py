"""Turn one run's records into aligned arrays over its steps: what the panels plot.

Per-rank values sit in (ranks x steps) matrices with NaN where a rank has no value; the
run's line is the mean over ranks (wall time: the slowest rank), so a run with one rank and a
run with eight read the same way. Long runs are averaged into buckets of consecutive steps
(:func:`downsample`) only when they exceed the points budget.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cokit.dashboard.reader import RunLog
from cokit.telemetry.schema import COMM_FIELDS as SCHEMA_COMM_FIELDS

#: step-record fields (top level) and ``comm`` fields read into matrices (the numeric ones)
STEP_FIELDS = ("step_s", "wall_s", "compute_s", "loss", "held_out_loss", "lr")
COMM_FIELDS = tuple(f for f in SCHEMA_COMM_FIELDS if f not in ("collectives", "world_size", "group_size"))


@dataclass
class KernelTrack:
    """One kernel's config and occupancy over the steps where it was recorded."""

    name: str
    steps: list[int] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)
    blocks_per_sm: list[float] = field(default_factory=list)
    limiter: list[str] = field(default_factory=list)
    smem_per_block: list[float] = field(default_factory=list)
    reserved_sms: list[float] = field(default_factory=list)

    def segments(self) -> list[tuple[int, int, int]]:
        """(first step, last step, record index) of each stretch where the config and its
        occupancy stay the same: what a step line needs, whatever the run's length."""
        out: list[tuple[int, int, int]] = []
        prev = None
        for i, step in enumerate(self.steps):
            key = (
                self.labels[i],
                self.blocks_per_sm[i],
                self.limiter[i],
                self.smem_per_block[i],
                self.reserved_sms[i],
            )
            if out and key == prev:
                out[-1] = (out[-1][0], step, out[-1][2])
            else:
                out.append((step, step, i))
            prev = key
        return out


@dataclass
class Decision:
    """One tuner decision, with the ranks that logged it."""

    step: int
    event: str
    reason: str
    candidate: str
    ranks: list[int]


@dataclass
class RunSeries:
    """Arrays of one run over its steps (sorted union over ranks)."""

    label: str
    run: RunLog
    ranks: list[int]
    steps: np.ndarray
    per_rank: dict[str, np.ndarray]  # field -> (len(ranks), len(steps))
    kernels: list[KernelTrack]
    decisions: list[Decision]
    summary_steps: np.ndarray
    slowest_rank: np.ndarray
    slowest_from_summary: bool

    def mean(self, name: str) -> np.ndarray:
        """Mean over ranks of a field (NaN where no rank has it)."""
        return _nanreduce(np.nanmean, self.per_rank[name])

    def max(self, name: str) -> np.ndarray:
        return _nanreduce(np.nanmax, self.per_rank[name])

    def has(self, name: str) -> bool:
        return bool(np.isfinite(self.per_rank[name]).any())

    # derived lines (seconds) ------------------------------------------------------------
    def compute_s(self) -> np.ndarray:
        """Compute time: the record's ``compute_s``, else step - encode - decode - exposed."""
        rec = self.per_rank["compute_s"]
        parts = sum(np.nan_to_num(self.per_rank[k]) for k in ("encode_s", "decode_s", "exposed_s"))
        derived = np.clip(self.per_rank["step_s"] - parts, 0.0, None)
        return _nanreduce(np.nanmean, np.where(np.isfinite(rec), rec, derived))

    def hidden_comm_s(self) -> np.ndarray:
        """Communication that overlapped compute: comm - exposed, clamped at 0."""
        hidden = np.clip(self.per_rank["comm_s"] - np.nan_to_num(self.per_rank["exposed_s"]), 0.0, None)
        return _nanreduce(np.nanmean, hidden)

    def exposed_fraction(self) -> np.ndarray:
        """Exposed communication as a fraction of the step time (mean over ranks)."""
        step = self.per_rank["step_s"]
        with np.errstate(divide="ignore", invalid="ignore"):
            frac = np.where(step > 0, self.per_rank["exposed_s"] / step, np.nan)
        return _nanreduce(np.nanmean, np.clip(frac, 0.0, 1.0))

    def cumulative_sent(self) -> np.ndarray:
        """Bytes sent per rank, summed over the steps so far (mean over ranks)."""
        return np.cumsum(np.nan_to_num(self.mean("sent_bytes")))


def _nanreduce(fn: Any, matrix: np.ndarray) -> np.ndarray:
    if matrix.shape[0] == 0:
        return np.full(matrix.shape[1], np.nan)
    with warnings.catch_warnings():  # all-NaN columns are expected (no value that step)
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.asarray(fn(matrix, axis=0), dtype=float)


def _num(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return math.nan
    f = float(v)  # an int beyond float64 never gets here: the reader skips its record
    return f if math.isfinite(f) else math.nan  # 1e999 parses as inf


def config_label(config: Any) -> str:
    """A short name of a GemmConfig dict (tile, warps, stages, and the knobs that are set)."""
    if not isinstance(config, dict):
        return str(config) if config is not None else "?"
    c = dict(config)
    parts = []
    if all(k in c for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")):
        parts.append(f"{c.pop('BLOCK_M')}x{c.pop('BLOCK_N')}x{c.pop('BLOCK_K')}")
    for key, short in (("num_warps", "w"), ("num_stages", "s")):
        if key in c:
            parts.append(f"{short}{c.pop(key)}")
    if c.pop("persistent", False):
        parts.append("persistent")
    c.pop("GROUP_M", None)
    parts.extend(f"{k}={v}" for k, v in c.items() if v is not None and v is not False)
    return " ".join(parts) or "default"


def _describe(candidate: Any) -> str:
    if isinstance(candidate, dict):
        return config_label(candidate)
    return "" if candidate is None else str(candidate)


def run_series(run: RunLog) -> RunSeries:
    """Align one run's ranks over the union of their steps."""
    ranks = sorted(run.ranks)
    steps = sorted({s["step"] for r in ranks for s in run.ranks[r].steps})
    col = {s: i for i, s in enumerate(steps)}
    names = STEP_FIELDS + COMM_FIELDS
    per_rank = {n: np.full((len(ranks), len(steps)), np.nan) for n in names}
    for i, rank in enumerate(ranks):
        for rec in run.ranks[rank].steps:
            j = col[rec["step"]]
            for n in STEP_FIELDS:
                per_rank[n][i, j] = _num(rec.get(n))
            comm = rec.get("comm")
            if isinstance(comm, dict):
                for n in COMM_FIELDS:
                    per_rank[n][i, j] = _num(comm.get(n))
    kernels = _kernel_tracks(run, ranks)
    decisions = _decisions(run, ranks)
    summary_steps, slowest, from_summary = _slowest(run, ranks, np.asarray(steps), per_rank["step_s"])
    return RunSeries(
        label=run.label or run.name,
        run=run,
        ranks=ranks,
        steps=np.asarray(steps, dtype=np.int64),
        per_rank=per_rank,
        kernels=kernels,
        decisions=decisions,
        summary_steps=summary_steps,
        slowest_rank=slowest,
        slowest_from_summary=from_summary,
    )


def _kernel_tracks(run: RunLog, ranks: list[int]) -> list[KernelTrack]:
    """Kernel configs of the lowest rank that recorded any (ranks run the same kernels)."""
    for rank in ranks:
        tracks: dict[str, KernelTrack] = {}
        for rec in run.ranks[rank].steps:
            kernels = rec.get("kernels")
            if not isinstance(kernels, list):
                continue
            for k in kernels:
                if not isinstance(k, dict):
                    continue
                name = str(k.get("name") or "kernel")
                t = tracks.setdefault(name, KernelTrack(name=name))
                t.steps.append(rec["step"])
                t.labels.append(config_label(k.get("config")))
                t.blocks_per_sm.append(_num(k.get("blocks_per_sm")))
                t.limiter.append(str(k.get("limiter") or "-"))
                t.smem_per_block.append(_num(k.get("smem_per_block")))
                t.reserved_sms.append(_num(k.get("reserved_sms")))
        if tracks:
            return list(tracks.values())
    return []


def _decisions(run: RunLog, ranks: list[int]) -> list[Decision]:
    """Tuner decisions of every rank; one marker for a decision several ranks made alike."""
    merged: dict[tuple[int, str, str, str], Decision] = {}
    for rank in ranks:
        for rec in run.ranks[rank].steps:
            tuner = rec.get("tuner")
            if not isinstance(tuner, list):
                continue
            for d in tuner:
                if not isinstance(d, dict):
                    continue
                event = str(d.get("event") or "decision")
                reason = str(d.get("reason") or "")
                cand = _describe(d.get("candidate"))
                key = (rec["step"], event, reason, cand)
                if key in merged:
                    if rank not in merged[key].ranks:
                        merged[key].ranks.append(rank)
                else:
                    merged[key] = Decision(rec["step"], event, reason, cand, [rank])
    return sorted(merged.values(), key=lambda d: d.step)


def _slowest(
    run: RunLog, ranks: list[int], steps: np.ndarray, step_s: np.ndarray
) -> tuple[np.ndarray, np.ndarray, bool]:
    """(steps, slowest rank) from rank 0's summary records when present, else from the files."""
    for rank in ranks:
        rows = [s for s in run.ranks[rank].summaries if isinstance(s.get("slowest_rank"), int)]
        if rows:
            return (
                np.asarray([s["step"] for s in rows], dtype=np.int64),
                np.asarray([s["slowest_rank"] for s in rows], dtype=float),
                True,
            )
    if len(ranks) < 2 or step_s.size == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0), False
    ok = np.isfinite(step_s).sum(axis=0) >= 2
    filled = np.where(np.isfinite(step_s), step_s, -np.inf)
    slowest = np.asarray(ranks, dtype=float)[np.argmax(filled, axis=0)]
    return steps[ok], slowest[ok], False


def downsample(
    x: np.ndarray, ys: list[np.ndarray], max_points: int
) -> tuple[np.ndarray, list[np.ndarray], int]:
    """Average consecutive points into buckets so at most ``max_points`` remain.

    Returns (x of each bucket's first point, the averaged ys, bucket size); unchanged (size 1)
    when short enough. NaNs are ignored within a bucket, so sparse lines (held-out loss) keep
    their points.
    """
    n = len(x)
    if max_points <= 0 or n <= max_points:
        return x, ys, 1
    k = math.ceil(n / max_points)
    pad = (-n) % k
    xs = np.asarray(x)[::k]
    out = []
    for y in ys:
        yp = np.concatenate([np.asarray(y, dtype=float), np.full(pad, np.nan)]).reshape(-1, k)
        out.append(_nanreduce(np.nanmean, yp.T))
    return xs, out, k
