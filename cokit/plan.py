"""``cokit plan``: predicted step time, and time and cost per epoch, for each way to train.

For AdamW with DDP's dense all-reduce, DeMo, SparseLoCo and DeMo's two-level exchange
(``DeMo(hierarchy=...)``), a step is

    step = compute + exposed communication,    communication = sum over collectives of
           hops * latency + bytes on the busiest link / (bandwidth * efficiency)

- **Bytes** come from the real payload layout (:mod:`cokit.compress.traffic`: the buckets,
  codecs, dense fallback and status row the optimizers use; equal to their ``comm_stats``).
  Ring collectives: an all-gather of ``p`` bytes per rank sends ``(W-1) p`` over ``W-1``
  hops, an all-reduce of ``n`` bytes ``2 (W-1)/W n`` over ``2 (W-1)`` hops. A flat exchange
  over several nodes is limited by the inter-node link; two-level sends the intra part over
  the node's links and the inter part over the inter-node link.
- **Compute** is given (``compute_ms``: forward, backward and the optimizer's own math, per
  method if they differ; measure it in one run), or estimated from FLOPs: ``6 N`` per token
  at ``mfu`` of the GPU's peak, plus the optimizer's memory traffic at HBM bandwidth.
- **Overlap**: DeMo's and SparseLoCo's exchange runs inside ``step()``, after backward, so
  it is all exposed. DDP all-reduces a bucket while backward goes on: all but the last
  bucket's transfer can hide behind the backward pass (2/3 of forward + backward). Give
  ``exposed`` (a measured exposed fraction, e.g. from ``cokit sweep``) to override.
- **SparseLoCo** syncs every ``sync_every`` steps: its step time is the average over a period.

The result is a :class:`Plan` (rows, JSON, CSV, a table). ``benchmarks/plan_validation.py``
checks the predictions against real gloo runs on the netbed's rate-limited links.

Every input has a range, in one table, :data:`LIMITS`: :class:`Link`, :class:`Workload`,
:class:`Methods`, :func:`plan`, :func:`cokit.model_shapes.counted_model` and ``cokit plan``
check their inputs against it (:func:`check_input`) before planning anything, and an input
outside it raises :class:`PlanInputError`, a ``ValueError`` naming the input, the range and
what to give (the CLI names its option instead).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from cokit.compress.payload import get_codec
from cokit.compress.stats import ring_allreduce_bytes
from cokit.compress.traffic import Setup, exchange_traffic, hierarchical_traffic
from cokit.display import human_duration
from cokit.model_shapes import Model
from cokit.plan_limits import (
    _RATE_UNITS,
    LIMITS,
    Limit,
    PlanInputError,
    check_input,
)

__all__ = [
    "GPU",
    "GPUS",
    "LIMITS",
    "METHODS",
    "TCP_EFFICIENCY",
    "Limit",
    "Link",
    "Methods",
    "Plan",
    "PlanInputError",
    "Workload",
    "check_input",
    "parse_rate",
    "plan",
]

#: goodput / line rate of TCP over Ethernet: 1448 B of data per 1514 B frame, and the ACKs
#: of the other direction's stream (gloo; NCCL over IB/RoCE is close to it)
TCP_EFFICIENCY = 0.94
METHODS = ("adamw-ddp", "demo", "sparseloco", "two-level")
DDP_BUCKET_BYTES = 25 * 2**20  # DDP's bucket_cap_mb default
BACKWARD_SHARE = 2 / 3  # backward's share of forward + backward (2 of the 6 N FLOPs per token are forward)
# Optimizer memory traffic per parameter (fp32 state), for the FLOP-based compute estimate:
# AdamW reads p, g, m, v and writes p, m, v; DeMo adds the DCT encode, top-k, error feedback
# and decode passes over the momentum; SparseLoCo runs its inner AdamW every step and, at a
# sync, the pseudo-gradient, error buffer and decode passes.
OPTIMIZER_BYTES = {"adamw-ddp": 28, "demo": 64, "sparseloco": 28, "two-level": 64}
SPARSELOCO_SYNC_BYTES = 40


@dataclasses.dataclass(frozen=True)
class GPU:
    """Nominal figures from the vendor's data sheet: dense bf16 peak, HBM and per-GPU
    intra-node bandwidth (NVLink / Infinity Fabric, one direction)."""

    name: str
    bf16_tflops: float
    hbm_gbs: float
    intra_gbs: float


GPUS: dict[str, GPU] = {
    "a100": GPU("NVIDIA A100 SXM 80GB", 312.0, 2039.0, 300.0),
    "h100": GPU("NVIDIA H100 SXM", 989.0, 3350.0, 450.0),
    "h200": GPU("NVIDIA H200 SXM", 989.0, 4800.0, 450.0),
    "mi300x": GPU("AMD Instinct MI300X", 1307.0, 5300.0, 448.0),
}


def parse_rate(text: str) -> float:
    """``"10gbit"``, ``"100mbit"``, ``"400gbit"`` -> bits per second (tc's decimal units)."""
    t = str(text).strip().lower()
    for unit in sorted(_RATE_UNITS, key=len, reverse=True):
        if t.endswith(unit):
            try:
                value = float(t[: -len(unit)]) * _RATE_UNITS[unit]
            except ValueError:
                break
            if math.isfinite(value) and value > 0:
                return value
            break
    raise ValueError(f"bandwidth {text!r} is not a positive rate like 100mbit, 25gbit or 400gbit")


@dataclasses.dataclass(frozen=True)
class Link:
    """One direction of a rank's link: rate in bit/s, one-way latency per hop, goodput share,
    and a token-bucket shaper's burst (bytes that pass at once when the link was idle long
    enough to refill it: ``tc tbf``'s bucket, a cloud NIC's burst allowance)."""

    bits_per_s: float
    latency_s: float = 0.0
    efficiency: float = TCP_EFFICIENCY
    burst_bytes: int = 0

    def __post_init__(self) -> None:
        for name in ("bits_per_s", "latency_s", "efficiency", "burst_bytes"):
            check_input("Link", name, getattr(self, name))

    def seconds(self, nbytes: float, hops: int, idle_s: float = 0.0) -> float:
        """Time to move ``nbytes`` in ``hops`` latency-bound steps, after ``idle_s`` seconds
        without traffic (which refill the burst allowance at the link's rate)."""
        rate = self.bits_per_s * self.efficiency / 8.0  # bytes per second
        free = min(self.burst_bytes, idle_s * rate)
        return hops * self.latency_s + max(0.0, nbytes - free) / rate


@dataclasses.dataclass(frozen=True)
class Workload:
    """What a step computes and how much data an epoch holds.

    ``compute_ms``: forward + backward + the optimizer's math per step on one rank, one number
    for every method or one per method (measured); None: estimated from ``tokens_per_step``
    (per rank) at ``mfu`` of ``gpu``'s peak. ``samples_per_step``: per rank.
    """

    samples_per_step: int
    dataset_samples: int
    compute_ms: float | Mapping[str, float] | None = None
    tokens_per_step: int | None = None
    gpu: str | None = None
    mfu: float = 0.4

    def __post_init__(self) -> None:
        for name in ("samples_per_step", "dataset_samples", "mfu"):
            check_input("Workload", name, getattr(self, name))
        if self.tokens_per_step is not None:
            check_input("Workload", "tokens_per_step", self.tokens_per_step)
        if self.gpu is not None and self.gpu not in GPUS:
            raise ValueError(f"Workload: unknown gpu {self.gpu!r}; choose one of {', '.join(GPUS)}")
        given = self.compute_ms
        if given is not None:
            if isinstance(given, Mapping):
                if unknown := set(given) - set(METHODS):
                    raise ValueError(
                        f"Workload: compute_ms for unknown method(s) {sorted(unknown)}; known: {METHODS}"
                    )
                for method, v in given.items():
                    check_input("Workload", "compute_ms", v, key=method)
            else:
                check_input("Workload", "compute_ms", given)
        elif self.tokens_per_step is None or self.gpu is None:
            raise ValueError(
                "Workload: give compute_ms (measured forward + backward + optimizer per step), or "
                "tokens_per_step and gpu to estimate it from FLOPs"
            )

    def compute_s(self, method: str, params: int) -> tuple[float, str]:
        """(seconds of compute per step for ``method``, where the figure comes from)."""
        given = self.compute_ms
        if isinstance(given, Mapping):
            if method in given:
                return given[method] / 1e3, "given"
            if "demo" in given and method == "two-level":
                return given["demo"] / 1e3, "given (demo's)"
        elif given is not None:
            return float(given) / 1e3, "given"
        if self.tokens_per_step is None or self.gpu is None:
            raise ValueError(
                f"Workload: no compute_ms for {method!r}; give it, or tokens_per_step and gpu to estimate"
            )
        gpu = GPUS[self.gpu]
        flops = 6.0 * params * self.tokens_per_step / (gpu.bf16_tflops * 1e12 * self.mfu)
        return flops + OPTIMIZER_BYTES[method] * params / (gpu.hbm_gbs * 1e9), "FLOPs estimate"


@dataclasses.dataclass(frozen=True)
class Methods:
    """The settings each planned method runs with (the optimizers' defaults)."""

    demo_topk: int = 32
    demo_chunk: int = 64
    demo_payload: str = "compact"
    sparseloco_topk: int = 64
    sparseloco_chunk: int = 64
    sparseloco_payload: str = "int2"
    sync_every: int = 5
    grad_itemsize: int = 4  # fp32 gradients (bf16: 2)
    bucket_cap_mb: float = 25.0

    def __post_init__(self) -> None:
        for name in ("demo_chunk", "sparseloco_chunk", "sync_every", "grad_itemsize", "bucket_cap_mb"):
            check_input("Methods", name, getattr(self, name))
        # a chunk holds chunk**2 coefficients: a larger top-k keeps them all (dense)
        check_input("Methods", "demo_topk", self.demo_topk, high=self.demo_chunk**2)
        check_input("Methods", "sparseloco_topk", self.sparseloco_topk, high=self.sparseloco_chunk**2)

    def demo(self) -> Setup:
        codec = get_codec(self.demo_payload, owner="plan")
        return Setup(codec, self.demo_topk, self.demo_chunk, cap_bytes=int(self.bucket_cap_mb * 2**20))

    def sparseloco(self) -> Setup:
        codec = get_codec(self.sparseloco_payload, owner="plan")
        return Setup(
            codec, self.sparseloco_topk, self.sparseloco_chunk, cap_bytes=int(self.bucket_cap_mb * 2**20)
        )


@dataclasses.dataclass
class Plan:
    """Predicted rows, one per method, and what they were predicted from."""

    rows: list[dict[str, Any]]
    inputs: dict[str, Any]

    def row(self, method: str) -> dict[str, Any]:
        for r in self.rows:
            if r["method"] == method:
                return r
        raise KeyError(f"no row for {method!r}; planned: {[r['method'] for r in self.rows]}")

    def as_dict(self) -> dict[str, Any]:
        return {"inputs": self.inputs, "rows": self.rows}

    def table(self) -> str:
        """The rows as a markdown table."""
        cost = any(r["cost_per_epoch"] is not None for r in self.rows)
        head = "| method | MB/rank/step | comm ms | exposed ms | compute ms | step ms | epoch |"
        rule = "|---|---:|---:|---:|---:|---:|---:|"
        if cost:
            head += " cost/epoch |"
            rule += "---:|"
        lines = [head, rule]
        for r in self.rows:
            line = (
                f"| {r['method']} | {r['sent_bytes'] / 1e6:.3g} | {r['comm_ms']:.4g} | {r['exposed_ms']:.4g} "
                f"| {r['compute_ms']:.4g} | {r['step_ms']:.4g} | {human_duration(r['epoch_s'])} |"
            )
            if cost:
                line += f" {r['cost_per_epoch']:,.2f} |" if r["cost_per_epoch"] is not None else " - |"
            lines.append(line)
        return "\n".join(lines)


def _flat_exchange(
    shapes, setup: Setup, world: int, itemsize: int, link: Link, idle_s: float
) -> tuple[float, int]:
    """DeMo's (or a SparseLoCo sync's) flat exchange: (seconds, bytes a rank sends)."""
    t = exchange_traffic(shapes, setup, world, itemsize)
    return link.seconds(t.sent, t.hops(world), idle_s), t.sent


def plan(
    model: Model,
    world: int,
    workload: Workload,
    inter: Link,
    *,
    ranks_per_node: int = 1,
    intra: Link | None = None,
    methods: Methods | None = None,
    price_per_hour: float | None = None,
    exposed: Mapping[str, float] | None = None,
    which: Sequence[str] = METHODS,
) -> Plan:
    """Predict each method's step time and its time and cost per epoch (see the module doc).

    ``inter``: each rank's link across nodes (or its only link); ``intra``: a rank's link
    inside its node (default: the GPU's NVLink / Infinity Fabric figure, else ``inter``).
    ``price_per_hour``: per GPU. ``exposed``: per method, the measured share of communication
    left after overlap.
    """
    check_input("plan", "world", world)
    check_input("plan", "ranks_per_node", ranks_per_node)
    if world % ranks_per_node:
        raise ValueError(
            f"plan: world {world} is not a multiple of ranks_per_node {ranks_per_node}; give whole nodes"
        )
    if price_per_hour is not None:
        check_input("plan", "price_per_hour", price_per_hour)
    unknown = [m for m in which if m not in METHODS]
    if unknown or not which:
        raise ValueError(f"plan: methods must be some of {', '.join(METHODS)}, got {list(which)}")
    for name, share in (exposed or {}).items():
        if name not in METHODS:
            raise ValueError(f"plan: exposed names unknown method {name!r}; known: {', '.join(METHODS)}")
        check_input("plan", "exposed", share, key=name)
    if model.params == 0:
        raise ValueError("plan: the model has no parameters")
    check_input("plan", "params", model.params)
    methods = methods or Methods()
    if intra is None:
        gpu = GPUS.get(workload.gpu or "")
        intra = Link(gpu.intra_gbs * 8e9, 0.0, 1.0) if gpu else inter
    nodes = world // ranks_per_node
    flat_link = inter if nodes > 1 else intra
    shapes, n, b = model.shapes, model.params, methods.grad_itemsize
    steps_per_epoch = math.ceil(workload.dataset_samples / (workload.samples_per_step * world))

    rows = []
    for method in which:
        if method == "two-level" and (nodes < 2 or ranks_per_node < 2):
            continue  # needs several nodes of several ranks
        notes: list[str] = []
        compute, source = workload.compute_s(method, n)
        # between two exchanges the link idles for the compute (a shaper's burst refills)
        if method == "adamw-ddp":
            size = n * b
            sent = ring_allreduce_bytes(size, world)
            n_buckets = max(1, math.ceil(size / DDP_BUCKET_BYTES))
            comm = flat_link.seconds(sent, 2 * (world - 1) * n_buckets, compute)
        elif method == "demo":
            comm, sent = _flat_exchange(shapes, methods.demo(), world, b, flat_link, compute)
        elif method == "sparseloco":
            period = methods.sync_every
            setup = methods.sparseloco()
            sync, sync_sent = _flat_exchange(shapes, setup, world, b, flat_link, compute * period)
            comm, sent = sync / period, sync_sent / period
            notes.append(f"one sync every {period} steps, averaged over the period")
        else:  # two-level
            intra_bytes, across = hierarchical_traffic(shapes, methods.demo(), nodes, ranks_per_node, b)
            comm = intra.seconds(intra_bytes, 4 * (ranks_per_node - 1), compute) + inter.seconds(
                across.sent, across.hops(nodes), compute
            )
            sent = intra_bytes + across.sent
            notes.append(f"{intra_bytes / 1e6:.3g} MB inside the node, {across.sent / 1e6:.3g} MB across")
        if exposed and method in exposed:
            share = exposed[method]
            notes.append(f"exposed share {share:g} (given)")
        elif method == "adamw-ddp":
            last = min(size, DDP_BUCKET_BYTES) / size  # the last bucket waits for backward's end
            hidden = min(comm * (1 - last), BACKWARD_SHARE * compute)
            share = 1 - hidden / comm if comm > 0 else 1.0
        else:
            share = 1.0
        step = compute + share * comm
        epoch = step * steps_per_epoch
        rows.append(
            {
                "method": method,
                "sent_bytes": sent,
                "comm_ms": comm * 1e3,
                "exposed_share": share,
                "exposed_ms": share * comm * 1e3,
                "compute_ms": compute * 1e3,
                "compute_from": source,
                "step_ms": step * 1e3,
                "steps_per_epoch": steps_per_epoch,
                "epoch_s": epoch,
                "cost_per_epoch": None if price_per_hour is None else epoch / 3600 * world * price_per_hour,
                "notes": "; ".join(notes),
            }
        )
    base = next((r for r in rows if r["method"] == "adamw-ddp"), None)
    for r in rows:
        r["speedup_vs_adamw_ddp"] = base["step_ms"] / r["step_ms"] if base and r["step_ms"] > 0 else None
    inputs = {
        "model": {"name": model.name, "description": model.description, "params": n, "tensors": len(shapes)},
        "world": world,
        "ranks_per_node": ranks_per_node,
        "inter": dataclasses.asdict(inter),
        "intra": dataclasses.asdict(intra),
        "workload": {
            **{k: v for k, v in dataclasses.asdict(workload).items() if k != "compute_ms"},
            "compute_ms": dict(workload.compute_ms)
            if isinstance(workload.compute_ms, Mapping)
            else workload.compute_ms,
        },
        "methods": dataclasses.asdict(methods),
        "price_per_hour": price_per_hour,
    }
    return Plan(rows, inputs)
