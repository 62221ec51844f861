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
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

from cokit.compress.payload import get_codec
from cokit.compress.stats import ring_allreduce_bytes
from cokit.compress.traffic import Setup, exchange_traffic, hierarchical_traffic
from cokit.display import human_duration
from cokit.model_shapes import Model

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

_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}


def _rate_text(bits_per_s: float) -> str:
    """``2.5e10`` -> ``"25gbit"`` (tc's decimal units, as ``--bandwidth`` takes them)."""
    for unit, scale in sorted(_RATE_UNITS.items(), key=lambda kv: -kv[1]):
        if bits_per_s >= scale:
            return f"{bits_per_s / scale:g}{unit}"
    return f"{bits_per_s:g}bit"


def _as_number(value: Any) -> int | float | None:
    """``value`` as a Python int (any integral type: numpy's too) or float (any real), else
    None (a bool, text, None)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return None


def _finite(value: float) -> bool:
    """Whether a number is finite (integers always are, even beyond float's range)."""
    return isinstance(value, int) or math.isfinite(value)


def _number_text(value: float) -> str:
    """``1048576`` -> ``"1,048,576"``, ``0.5`` -> ``"0.5"``, ``10**30`` -> ``"1e+30"``, an
    integer beyond float's range -> ``"about 10**400"``."""
    if isinstance(value, int):
        v = value
        if abs(v) < 10**16:
            return f"{v:,}"
        if abs(v) < 10**300:
            return f"{float(v):g}"
        return f"{'-' if v < 0 else ''}about 10**{int(abs(v).bit_length() * math.log10(2))}"
    if abs(value) < 1e16 and float(value).is_integer():
        return f"{int(value):,}"
    return f"{float(value):g}"


@dataclasses.dataclass(frozen=True)
class Limit:
    """The range one plan input may take, and what to give when it is outside.

    ``low`` to ``high`` inclusive (``low`` excluded when ``low_open``), an integer when
    ``integer``; ``choices``, when given, the only values. ``flag`` is the ``cokit plan``
    option that sets it (``flag_scale``: the option's value is the input times it, e.g.
    milliseconds for seconds); ``rate``: shown as a rate like ``25gbit``.
    """

    low: float
    high: float
    integer: bool
    advice: str
    flag: str | None = None
    flag_scale: float = 1.0
    low_open: bool = False
    rate: bool = False
    choices: tuple[int, ...] = ()

    def allows(self, value: Any, high: float | None = None) -> bool:
        """Whether ``value`` is in range (``high`` overrides :attr:`high`)."""
        number = _as_number(value)
        if number is None or (self.integer and not isinstance(number, int)) or not _finite(number):
            return False
        if self.choices:
            return number in self.choices
        top = self.high if high is None else high
        return (self.low < number if self.low_open else self.low <= number) and number <= top

    def describe(self, high: float | None = None, cli: bool = False) -> str:
        """The range in words, e.g. ``an integer from 2 to 1,048,576``."""
        scale = self.flag_scale if cli else 1.0
        if self.choices:
            return "one of " + ", ".join(map(str, self.choices))

        def show(v: float) -> str:
            return _rate_text(v) if self.rate else _number_text(v * scale)

        top = self.high if high is None else high
        kind = "an integer" if self.integer else "a rate" if self.rate else "a finite number"
        if self.low_open:
            return f"{kind} above {show(self.low)} and at most {show(top)}"
        return f"{kind} from {show(self.low)} to {show(top)}"


#: the largest parameter count planned: a bare count is laid out as 4096x4096 matrices, and
#: the payload layout is built tensor by tensor (10T parameters: ~600k tensors, under a minute)
MAX_PARAMS = 10**13
#: every input's range (keys: the API's argument or field names)
LIMITS: dict[str, Limit] = {
    "params": Limit(
        1,
        MAX_PARAMS,
        True,
        "give the model's parameter count, e.g. 124M, 7B or 1.8T",
        "--params",
    ),
    "world": Limit(2, 2**20, True, "give the ranks (GPUs) in all; one rank exchanges nothing", "--world"),
    "ranks_per_node": Limit(1, 1024, True, "give the ranks (GPUs) in one node, e.g. 8", "--ranks-per-node"),
    "bits_per_s": Limit(
        1e3,
        1e15,
        False,
        "give each rank's link rate like 100mbit, 25gbit or 400gbit",
        "--bandwidth",
        rate=True,
    ),
    "latency_s": Limit(
        0,
        10,
        False,
        "give the one-way latency of one hop",
        "--latency-ms",
        flag_scale=1e3,
    ),
    "efficiency": Limit(
        0, 1, False, "give the link's goodput / line rate (0.94 for TCP)", "--efficiency", low_open=True
    ),
    "burst_bytes": Limit(0, 10**15, True, "give the shaper's burst in bytes (0: no burst)", "--burst-bytes"),
    "samples_per_step": Limit(1, 10**9, True, "give the samples each rank takes per step", "--batch"),
    "dataset_samples": Limit(1, 10**15, True, "give the samples in one epoch", "--dataset-size"),
    "tokens_per_sample": Limit(
        1,
        10**9,
        True,
        "give the tokens in one sample (its sequence length), or a measured --compute-ms",
        "--tokens-per-sample",
    ),
    "tokens_per_step": Limit(
        1,
        10**15,
        True,
        "give the tokens one rank computes per step (tokens per sample x samples), or a measured compute_ms",
        "--tokens-per-sample x --batch",
    ),
    "compute_ms": Limit(
        0,
        1e9,
        False,
        "give the measured forward + backward + optimizer time of one step, in milliseconds",
        "--compute-ms",
    ),
    "mfu": Limit(
        0,
        1,
        False,
        "give the share of the GPU's peak the model reaches (0.4 is typical)",
        "--mfu",
        low_open=True,
    ),
    "price_per_hour": Limit(
        0, 1e6, False, "give the price of one GPU for an hour, or leave it out", "--price-per-hour"
    ),
    "exposed": Limit(
        0,
        1,
        False,
        "give the measured share of communication left exposed after overlap, e.g. 0.6",
        "--exposed",
    ),
    "demo_topk": Limit(
        1,
        2**20,
        True,
        "give DeMo's coefficients kept per chunk (default 32; a chunk holds chunk**2)",
        "--demo-topk",
    ),
    "sparseloco_topk": Limit(
        1,
        2**20,
        True,
        "give SparseLoCo's coefficients kept per chunk (default 64; a chunk holds chunk**2)",
        "--sparseloco-topk",
    ),
    "demo_chunk": Limit(1, 1024, True, "give DeMo's DCT chunk side (default 64)"),
    "sparseloco_chunk": Limit(1, 1024, True, "give SparseLoCo's DCT chunk side (default 64)"),
    "sync_every": Limit(1, 10**6, True, "give SparseLoCo's steps between syncs (default 5)", "--sync-every"),
    "grad_itemsize": Limit(
        1,
        8,
        True,
        "give the gradient dtype's element size in bytes (4: fp32, 2: bf16)",
        "--grad-dtype",
        choices=(1, 2, 4, 8),
    ),
    "bucket_cap_mb": Limit(
        0, 1e6, False, "give the exchange's bucket cap in MiB (default 25)", low_open=True
    ),
}


class PlanInputError(ValueError):
    """A plan input outside its :data:`LIMITS` range. The message names the input (``owner:
    name``), the range, the value given and what to give; :meth:`cli_message` says the same
    with ``cokit plan``'s option."""

    def __init__(self, owner: str, name: str, value: Any, high: float | None = None, key: str = "") -> None:
        self.owner, self.name, self.value, self.high, self.key = owner, name, value, high, key
        super().__init__(self._text(f"{owner}: {name}" + (f"[{key!r}]" if key else ""), cli=False))

    def _text(self, label: str, cli: bool) -> str:
        limit = LIMITS[self.name]
        value = _as_number(self.value)
        if value is None:
            shown = repr(self.value)
        elif limit.rate and 0 < value < 1e300:
            shown = _rate_text(float(value))
        elif cli and limit.flag_scale != 1.0 and abs(value) < 1e300:
            shown = _number_text(float(value) * limit.flag_scale)
        else:
            shown = _number_text(value)
        return f"{label} must be {limit.describe(self.high, cli)}, got {shown}; {limit.advice}"

    def cli_message(self, flags: Mapping[str, str] | None = None) -> str:
        """The message with the option that sets the input (``flags`` overrides
        :attr:`Limit.flag`, e.g. ``--intra-bandwidth`` for a second link; an empty flag keeps
        the API's wording)."""
        flag = (flags or {}).get(self.name, LIMITS[self.name].flag)
        if not flag:
            return str(self)
        return self._text(flag + (f" ({self.key})" if self.key else ""), cli=True)


def check_input(owner: str, name: str, value: Any, *, high: float | None = None, key: str = "") -> None:
    """Raise :class:`PlanInputError` unless ``value`` is in ``LIMITS[name]``'s range (``high``:
    a tighter top, e.g. a top-k's chunk**2; ``key``: which entry of a per-method mapping)."""
    if not LIMITS[name].allows(value, high):
        raise PlanInputError(owner, name, value, high, key)


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
