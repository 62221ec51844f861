"""What a DeMo step is planned from, and what the optimizer hands its strategy each step.

:class:`DemoPlan` reads the optimizer's public state (``param_groups``, ``state`` and its
payload settings) and plans from it: the entries ``(group, index, parameter)``, their names in
messages, the buckets under a policy's decision, each bucket as the functional step's input
(:class:`~cokit.compress.demo_step.BucketInput`), the fp32 error buffers, and the layout that
every round's fingerprint covers. :class:`StepContext` is one step as the optimizer hands it to
its strategy (:mod:`cokit.compress.strategies`): the round to run, the policy's decision and
the rounding, as values and callables, so that a strategy never reaches into the optimizer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from cokit.compress.agreement import Round, canonical, fingerprint
from cokit.compress.buckets import Bucket, make_buckets
from cokit.compress.demo_settings import fingerprinted
from cokit.compress.demo_step import BucketInput, GeneratorFor
from cokit.compress.dtensor import local
from cokit.compress.guards import Amp
from cokit.compress.payload import get_codec, wire_sizes
from cokit.compress.policy import Decision

__all__ = ["DemoPlan", "Entry", "StepContext"]

#: a parameter of the optimizer: (param group, index in the group, parameter)
Entry = tuple[int, int, torch.Tensor]


class DemoPlan:
    """Entries, names, buckets, inputs, error buffers and layout of a DeMo optimizer (module
    docstring). ``opt`` is read through its public attributes only; caches last until
    :meth:`forget` (the param groups changed)."""

    def __init__(self, opt: Any) -> None:
        self.opt = opt
        self._buckets: dict[tuple, list[Bucket]] = {}
        self._layouts: dict[bool, tuple[dict[str, Any], str]] = {}  # by globally: layout, its JSON

    def forget(self) -> None:
        """The param groups changed (added, loaded): drop every cached plan."""
        self._buckets.clear()
        self._layouts.clear()

    # ------------------------------------------------------------------ entries and names
    def entries(self) -> list[Entry]:
        return [(gi, i, p) for gi, g in enumerate(self.opt.param_groups) for i, p in enumerate(g["params"])]

    def device(self) -> torch.device:
        """The first parameter's (local) device; the CPU when there is none."""
        first = next((p for g in self.opt.param_groups for p in g["params"]), None)
        return local(first).device if first is not None else torch.device("cpu")

    def label(self, gi: int, i: int) -> str:
        names = self.opt.param_groups[gi].get("param_names")
        return f"'{names[i]}'" if names else f"group {gi} param {i}"

    def name(self, gi: int, i: int, p: torch.Tensor) -> str:
        return f"{self.label(gi, i)} {tuple(p.shape)}"

    def entry_name(self, n: int, entries: list[Entry] | None = None) -> str:
        """Entry ``n`` (of ``entries``, default: all) as messages name it."""
        entries = entries if entries is not None else self.entries()
        return self.name(*entries[n]) if 0 <= n < len(entries) else f"entry {n}"

    # ------------------------------------------------------------------ layout
    def layout(self, globally: bool) -> tuple[dict[str, Any], str]:
        """The parameters (local shard shapes, or global shapes and placements for agreement
        groups whose ranks hold other shards) and the payload wire sizes, and their JSON."""
        cached = self._layouts.get(globally)
        if cached is None:
            entries = self.entries()
            params = [
                [
                    self.label(gi, i),
                    f"{tuple(p.shape)} {p.dtype} {tuple(p.placements)}"
                    if globally and hasattr(p, "placements")
                    else f"{tuple(local(p).shape)} {p.dtype}",
                ]
                for gi, i, p in entries
            ]
            layout = {"params": params, "wire": wire_sizes(b.codec for b in self.buckets(entries))}
            cached = self._layouts[globally] = (layout, canonical(layout))
        return cached

    def fingerprints(self, counters: dict[str, int], *, agreement: bool) -> tuple[int, int]:
        """(exchange group, agreement groups) fingerprints of settings, layout and ``counters``
        (without agreement groups there is no global layout to compare: both are the local one)."""
        settings, counted = canonical(fingerprinted(self.opt)), canonical(counters)
        local_fp = fingerprint(settings, self.layout(False)[1], counted)
        return local_fp, fingerprint(settings, self.layout(True)[1], counted) if agreement else local_fp

    def describe(self, globally: bool, counters: dict[str, int]) -> dict[str, Any]:
        """What the fingerprint covers, as JSON (the mismatch report)."""
        settings = fingerprinted(self.opt)
        layout = self.layout(globally)[0]
        return {
            "settings": {k: v for k, v in settings.items() if k != "groups"},
            "groups": settings["groups"],
            "layout": layout["params"],
            "derived": {"payload wire sizes": layout["wire"]},
            "counters": counters,
        }

    # ------------------------------------------------------------------ buckets and buffers
    def buckets(self, active: list[Entry], decision: Decision | None = None) -> list[Bucket]:
        """The buckets of ``active`` under ``decision`` (default: the optimizer's settings)."""
        opt = self.opt
        decision = decision or Decision()
        groups = tuple((g["compression_chunk"], g["compression_topk"]) for g in opt.param_groups)
        key = (tuple((gi, i) for gi, i, _ in active), decision, groups)
        buckets = self._buckets.get(key)
        if buckets is None:
            codec, value_dtype = opt.codec, opt.value_dtype
            if decision.payload is not None:
                codec = get_codec(decision.payload, owner="DeMo policy")
                value_dtype = codec.resolve_value_dtype(opt.requested_value_dtype)
            settings = [
                {"compression_chunk": chunk, "compression_topk": max(1, round(k * decision.topk_scale))}
                for chunk, k in groups
            ]
            buckets = make_buckets(
                [gi for gi, _, _ in active],
                [tuple(local(p).shape) for _, _, p in active],
                settings,
                codec,
                value_dtype,
                opt.bucket_cap_bytes,
                opt.dense_fallback,
                opt.comm.world_size,
                all_dense=decision.dense,
                dense_itemsizes=[local(p).element_size() for _, _, p in active],
            )
            self._buckets[key] = buckets
        return buckets

    def error_buffer(self, p: torch.Tensor) -> torch.Tensor:
        """``p``'s fp32 error buffer ``delta`` (zeros at first use)."""
        state = self.opt.state[p]
        if "delta" not in state:
            state["delta"] = torch.zeros_like(
                local(p), dtype=torch.float32, memory_format=torch.contiguous_format
            )
        return state["delta"]

    def set_error_buffer(self, p: torch.Tensor, delta: torch.Tensor) -> None:
        """Make ``delta`` (a copy the overlapped strategy encoded into) ``p``'s error buffer."""
        self.opt.state[p]["delta"] = delta

    def bucket_input(
        self,
        b: int,
        bucket: Bucket,
        active: list[Entry],
        *,
        grads: list[torch.Tensor] | None = None,
        deltas: list[torch.Tensor] | None = None,
    ) -> BucketInput:
        """Bucket ``b`` of ``active`` as the functional step's input (``grads`` default: the
        parameters' own; ``deltas``: their error buffers)."""
        entries = [active[i] for i in bucket.members]
        params = [p for _, _, p in entries]
        return BucketInput(
            index=b,
            bucket=bucket,
            group=self.opt.param_groups[bucket.group],
            params=[local(p) for p in params],  # DTensor parameters are updated through their shard
            grads=grads if grads is not None else [local(p.grad) for p in params],
            deltas=deltas if deltas is not None else [self.error_buffer(p) for p in params],
            states=[self.opt.state[p] for p in params],
            names=[self.name(gi, i, p) for gi, i, p in entries],
        )


@dataclasses.dataclass(frozen=True)
class StepContext:
    """One DeMo step as the optimizer hands it to its strategy.

    ``agree()`` runs the step's round (gradient checks, non-finite, a GradScaler's inf,
    settings) and returns the entries that step, or None when every rank skips; ``status`` runs
    a status round carrying event bits and the non-finite entries a strategy found itself (the
    overlapped one), and ``go_on`` is the skip-or-raise after it. ``decision()`` is the policy's
    decision for this step, ``skipped_sync()`` counts a sync the decision skipped."""

    entries: list[Entry]
    amp: Amp
    agree: Callable[[], list[Entry] | None]
    status: Callable[[int, list[int]], Round]
    go_on: Callable[[Round], bool]
    decision: Callable[[], Decision]
    skipped_sync: Callable[[], None]
    precision: str
    generator: GeneratorFor
