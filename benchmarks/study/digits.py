"""Handwritten-digit classification: scikit-learn's bundled 8x8 ``load_digits`` and an MLP.

No download: the 1797 images ship inside the scikit-learn wheel (``pip install scikit-learn``,
part of cokit's ``dev`` extra). Pixels (0..16) are mapped to [-1, 1]; the held-out split is
stratified per class and fixed by ``split_seed`` (independent of the training seed, so every
training seed is evaluated on the same images).

Batches are deterministic from ``(seed, step, rank)``: each rank samples with replacement from
its own contiguous shard of the (shuffled) training images, so every method in a comparison
sees the same data in the same order. The interface matches :class:`cokit.train.Workload`.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import hashlib
import importlib.util
import itertools
import math
import os
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

NUM_CLASSES = 10
NUM_FEATURES = 64
_BATCH_STREAM = 0xD161  # keeps batch sampling apart from other uses of the same seed


@functools.lru_cache(maxsize=1)
def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """``(images (1797, 64) float32 in [-1, 1], labels (1797,) int64)`` from scikit-learn."""
    pixels, labels = _bundled_digits()
    x = (np.asarray(pixels, dtype=np.float32) / 8.0) - 1.0
    return x, np.asarray(labels, dtype=np.int64)


def _bundled_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled digits file, read as ``load_digits`` reads it (pixels, then the
    label in the last column) without importing scikit-learn, which costs each rank about 1 s;
    ``load_digits`` itself where the file is not where this release keeps it."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or spec.origin is None:
        raise RuntimeError("the digits workload needs scikit-learn: pip install scikit-learn")
    path = os.path.join(os.path.dirname(spec.origin), "datasets", "data", "digits.csv.gz")
    if os.path.exists(path):
        with gzip.open(path, "rt") as f:
            table = np.loadtxt(f, delimiter=",")
        return table[:, :-1], table[:, -1].astype(int)
    from sklearn.datasets import load_digits  # pragma: no cover - another layout of the package

    data = load_digits()  # pragma: no cover
    return data.data, data.target  # pragma: no cover


class DigitsMLP(nn.Module):
    """``64 -> hidden... -> 10`` with GELU; init deterministic from ``seed`` (global RNG untouched)."""

    def __init__(self, hidden: tuple[int, ...] = (128, 128), seed: int = 0) -> None:
        super().__init__()
        sizes = (NUM_FEATURES, *hidden, NUM_CLASSES)
        with torch.random.fork_rng(devices=[]):
            self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(sizes))
        self.reset_parameters(seed)

    def reset_parameters(self, seed: int) -> None:
        """Weights ~ N(0, 1/fan_in) (the last layer scaled by 0.1), biases 0."""
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for i, layer in enumerate(self.layers):
                assert isinstance(layer, nn.Linear)
                scale = (0.1 if i == len(self.layers) - 1 else 1.0) / math.sqrt(layer.in_features)
                layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen) * scale)
                layer.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(batch, 64)`` pixels -> ``(batch, 10)`` logits."""
        for layer in self.layers[:-1]:
            x = F.gelu(layer(x))
        return self.layers[-1](x)


@dataclass(frozen=True)
class DigitsWorkloadConfig:
    """Model width, batch shape and the held-out split (a picklable workload factory)."""

    hidden: tuple[int, ...] = (128, 128)
    batch_size: int = 32
    heldout_fraction: float = 0.25
    split_seed: int = 0
    eval_batch_size: int = 128

    def __post_init__(self) -> None:
        if not self.hidden or any(h < 1 for h in self.hidden):
            raise ValueError(f"hidden must be a non-empty tuple of positive sizes, got {self.hidden}")
        if self.batch_size < 1 or self.eval_batch_size < 1:
            raise ValueError("batch_size and eval_batch_size must be >= 1")
        if not 0.0 < self.heldout_fraction < 0.5:
            raise ValueError(f"heldout_fraction must be in (0, 0.5), got {self.heldout_fraction}")

    def build(self, device: torch.device | str = "cpu") -> DigitsWorkload:
        """The workload on ``device`` (what each rank of a distributed run calls)."""
        return DigitsWorkload(self, device)


def split_indices(labels: np.ndarray, heldout_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Stratified ``(train, heldout)`` index arrays: per class, a seeded shuffle, the first
    ``round(fraction * n_class)`` go to held-out. Train indices come back shuffled."""
    rng = np.random.default_rng([seed, 0x5E7])
    train, held = [], []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        n = int(round(heldout_fraction * idx.size))
        held.append(idx[:n])
        train.append(idx[n:])
    return rng.permutation(np.concatenate(train)), np.sort(np.concatenate(held))


class DigitsWorkload:
    """Classify 8x8 digits with a :class:`DigitsMLP` (cross-entropy)."""

    def __init__(
        self, config: DigitsWorkloadConfig = DigitsWorkloadConfig(), device: torch.device | str = "cpu"
    ) -> None:
        self.config = config
        self.device = torch.device(device)
        x, y = load_digits_arrays()
        tr, ho = split_indices(y, config.heldout_fraction, config.split_seed)
        # the training set lives on the device: a batch is gathered there (no per-step copy)
        self.train_x = torch.from_numpy(x[tr]).to(self.device)
        self.train_y = torch.from_numpy(y[tr]).to(self.device)
        self.heldout_x, self.heldout_y = torch.from_numpy(x[ho]), torch.from_numpy(y[ho])

    def build_model(self, seed: int) -> DigitsMLP:
        """A freshly initialised model (identical on every rank for the same seed)."""
        return DigitsMLP(self.config.hidden, seed=seed).to(self.device)

    def shard(self, rank: int, world_size: int) -> slice:
        """This rank's contiguous slice of the training images."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        n = self.train_y.numel()
        lo, hi = rank * n // world_size, (rank + 1) * n // world_size
        if hi <= lo:
            raise ValueError(f"world size {world_size} leaves rank {rank} without training images")
        return slice(lo, hi)

    def train_batch(
        self, seed: int, step: int, rank: int, world_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch_size`` images ``(b, 64)`` and labels ``(b,)`` from this rank's shard."""
        part = self.shard(rank, world_size)
        rng = np.random.default_rng([seed, step, rank, _BATCH_STREAM])
        idx = torch.from_numpy(rng.integers(part.start, part.stop, self.config.batch_size)).to(self.device)
        return self.train_x[idx], self.train_y[idx]

    def heldout_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every held-out image once, in fixed batches of ``eval_batch_size``."""
        b = self.config.eval_batch_size
        return [
            (self.heldout_x[i : i + b].to(self.device), self.heldout_y[i : i + b].to(self.device))
            for i in range(0, self.heldout_y.numel(), b)
        ]

    @staticmethod
    def loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Mean cross-entropy (nats)."""
        x, y = batch
        return F.cross_entropy(model(x).float(), y)

    def info(self) -> dict:
        """JSON-ready description of the workload."""
        data = self.train_x.cpu().numpy().tobytes() + self.heldout_x.numpy().tobytes()
        digest = hashlib.sha256(data).hexdigest()
        return {
            "task": "8x8 digit classification (sklearn load_digits)",
            "train_examples": int(self.train_y.numel()),
            "heldout_examples": int(self.heldout_y.numel()),
            "batch_size_per_rank": self.config.batch_size,
            "uniform_loss": float(np.log(NUM_CLASSES)),
            "sha256": digest,
            "model": {"kind": "mlp", "layers": [NUM_FEATURES, *self.config.hidden, NUM_CLASSES]},
            **{k: v for k, v in dataclasses.asdict(self.config).items() if k != "hidden"},
        }
