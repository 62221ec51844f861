"""What SparseLoCo's syncs send, planned once per layout: buckets, tilings and the k's.

:class:`SyncPlan` holds the parameters' shapes and the settings that bucket them. The *static*
plan decides which tensors go dense (``topk=None``, ``dense_params``, or a payload that would
not be smaller than dense) and buckets the rest at ``topk``; with ``adaptive_topk`` the
compressed tensors keep that split and are bucketed by their current k (:attr:`SyncPlan.k`,
changed by :meth:`SyncPlan.adapt` after every sync, the same on every rank); the dense
warm-up's plan is every tensor dense.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from cokit.compress.adaptive_topk import redistribute_topk
from cokit.compress.buckets import Bucket, make_buckets
from cokit.compress.payload import PayloadCodec
from cokit.triton_kernels import tiling

__all__ = ["SyncPlan"]


class SyncPlan:
    """Buckets of the syncs and of the dense warm-up, the compressed tensors' tilings and k's
    (module docstring). ``adaptive_range`` is None unless ``adaptive_topk`` is on."""

    def __init__(
        self,
        shapes: Sequence[tuple[int, ...]],
        *,
        chunk: int,
        topk: int | None,
        codec: PayloadCodec,
        value_dtype: torch.dtype,
        bucket_cap_bytes: int,
        world: int,
        forced_dense: Collection[int],
        adaptive_range: tuple[float, float] | None,
    ):
        self.shapes = list(shapes)
        self.chunk, self.topk, self.codec, self.value_dtype = chunk, topk, codec, value_dtype
        self.bucket_cap_bytes, self.world = bucket_cap_bytes, world
        self.forced_dense, self.adaptive_range = forced_dense, adaptive_range
        #: the k of every compressed tensor at the next sync (parameter index -> k); None: not yet
        #: derived from the static plan
        self.k: dict[int, int] | None = None
        self._sync: list[Bucket] | None = None
        self._static: list[Bucket] | None = None
        self._warmup: list[Bucket] | None = None

    def buckets(self) -> list[Bucket]:
        """The next sync's buckets: the static plan, or with ``adaptive_topk`` the same split
        into dense and compressed tensors, the compressed ones bucketed by their current k."""
        if self._sync is None:
            self._sync = self._adaptive() if self.adaptive_range is not None else self.static()
        return self._sync

    def static(self) -> list[Bucket]:
        if self._static is None:
            self._static = self._make(
                [self.topk or 1],
                fallback=self.topk is not None and self.codec.dense_fallback,
                all_dense=self.topk is None,
                dense=self.forced_dense,
            )
        return self._static

    def warmup(self) -> list[Bucket]:
        """Dense buckets of every parameter for the dense warm-up."""
        if self._warmup is None:
            self._warmup = self._make([self.topk or 1], fallback=False, all_dense=True)
        return self._warmup

    def tilings(self) -> dict[int, tiling.TensorTiling]:
        """The tiling of every tensor the static plan compresses (parameter index -> tiling)."""
        members = sorted(i for b in self.static() if not b.dense for i in b.members)
        return {i: tiling.TensorTiling.of(self.shapes[i], self.chunk) for i in members}

    def topks(self) -> dict[int, int]:
        """The k's in force (:attr:`k`), ``min(topk, tile size)`` each until adapted."""
        if self.k is None:
            topk = self.topk or 1
            self.k = {i: t.k_eff(topk) for i, t in self.tilings().items()}
        return self.k

    def set_topks(self, ks: dict[int, int]) -> None:
        """Make ``ks`` the k's of the next sync (its buckets are planned anew when they differ)."""
        if ks != self.k:
            self.k, self._sync = ks, None

    def adapt(self, shares: list[float], order: list[int]) -> dict[int, int]:
        """The next sync's k's (parameter index -> k) from the captured-energy ``shares``
        agreed over the ranks, one per tensor in ``order`` (:func:`redistribute_topk`)."""
        tilings = self.tilings()
        assert self.topk is not None and self.adaptive_range is not None
        in_force = self.topks()
        ks = redistribute_topk(
            shares,
            [tilings[i].n_tiles for i in order],
            [tilings[i].tile_numel for i in order],
            self.topk,
            self.adaptive_range,
            [in_force[i] for i in order],
        )
        return dict(zip(order, ks, strict=True))

    def _adaptive(self) -> list[Bucket]:
        ks = self.topks()
        distinct = sorted(set(ks.values())) or [self.topk or 1]
        group_of = {k: g for g, k in enumerate(distinct)}
        n = len(self.shapes)
        return self._make(
            distinct,
            groups=[group_of[ks[i]] if i in ks else 0 for i in range(n)],
            fallback=False,  # the static plan decided which tensors go dense
            dense=[i for i in range(n) if i not in ks],
        )

    def _make(
        self,
        topks: list[int],
        *,
        fallback: bool,
        groups: list[int] | None = None,
        all_dense: bool = False,
        dense: Collection[int] = (),
    ) -> list[Bucket]:
        """Buckets of every parameter: parameter ``i`` in group ``groups[i]`` (default 0) of
        k ``topks[group]``; ``fallback``: dense where compression would not save bytes."""
        return make_buckets(
            groups if groups is not None else [0] * len(self.shapes),
            self.shapes,
            [{"compression_chunk": self.chunk, "compression_topk": k} for k in topks],
            self.codec,
            self.value_dtype,
            self.bucket_cap_bytes,
            fallback,
            self.world,
            all_dense=all_dense,
            dense=dense,
        )
