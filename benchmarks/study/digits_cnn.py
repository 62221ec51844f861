"""Classifying 8x8 digits with a small convolutional network (cross-entropy).

A vision workload with 4-D convolution weights that the validation study can hold out: the
images, the stratified held-out split and the per-rank batches are the digits workload's own
(:mod:`cokit.bench.study.digits`), but the model is a CNN rather than the MLP, so a setting chosen
on the MLP and the autoencoder is tested on a network it was not chosen on. Nothing is
downloaded (scikit-learn's bundled ``load_digits``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from cokit.bench.study.digits import NUM_CLASSES, DigitsWorkload, DigitsWorkloadConfig

SIDE = 8  # images are SIDE x SIDE


class DigitsCNN(nn.Module):
    """``8x8 -> conv3x3(c1) -> conv3x3(c2) -> 2x2 average pool -> 4x4 x c2 -> linear(10)``.

    GELU after each conv. Weights ~ N(0, 1/fan_in) (the classifier scaled by 0.1), biases 0,
    deterministic from ``seed``; the global RNG is left untouched."""

    def __init__(self, channels: tuple[int, int] = (32, 64), seed: int = 0) -> None:
        super().__init__()
        c1, c2 = channels
        self.channels = channels
        with torch.random.fork_rng(devices=[]):  # module constructors draw from the global RNG
            self.conv1 = nn.Conv2d(1, c1, 3, padding=1)
            self.conv2 = nn.Conv2d(c1, c2, 3, padding=1)
            self.head = nn.Linear(c2 * (SIDE // 2) ** 2, NUM_CLASSES)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for module, scale in ((self.conv1, 1.0), (self.conv2, 1.0), (self.head, 0.1)):
                fan_in = module.weight[0].numel()
                module.weight.copy_(
                    torch.randn(module.weight.shape, generator=gen) * scale / math.sqrt(fan_in)
                )
                assert module.bias is not None
                module.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(batch, 64)`` pixels -> ``(batch, 10)`` logits."""
        x = x.reshape(-1, 1, SIDE, SIDE)
        x = F.gelu(self.conv2(F.gelu(self.conv1(x))))
        return self.head(F.avg_pool2d(x, 2).flatten(1))


@dataclass(frozen=True)
class DigitsCNNWorkloadConfig:
    """Channel widths, batch shape and the held-out split (a picklable workload factory)."""

    channels: tuple[int, int] = (32, 64)
    batch_size: int = 32
    heldout_fraction: float = 0.25
    split_seed: int = 0
    eval_batch_size: int = 128

    def __post_init__(self) -> None:
        if len(self.channels) != 2 or any(c < 1 for c in self.channels):
            raise ValueError(f"channels must be two positive widths, got {self.channels}")
        # the images, split and batch checks are the digits workload's
        self.digits_config()

    def digits_config(self) -> DigitsWorkloadConfig:
        """The digits workload whose images, split and batches this one shares."""
        return DigitsWorkloadConfig(
            batch_size=self.batch_size,
            heldout_fraction=self.heldout_fraction,
            split_seed=self.split_seed,
            eval_batch_size=self.eval_batch_size,
        )

    def build(self, device: torch.device | str = "cpu") -> DigitsCNNWorkload:
        """The workload on ``device`` (what each rank of a distributed run calls)."""
        return DigitsCNNWorkload(self, device)


class DigitsCNNWorkload(DigitsWorkload):
    """The digits classification task with a :class:`DigitsCNN`."""

    def __init__(
        self, config: DigitsCNNWorkloadConfig = DigitsCNNWorkloadConfig(), device: torch.device | str = "cpu"
    ) -> None:
        super().__init__(config.digits_config(), device)
        self.cnn_config = config

    def build_model(self, seed: int) -> DigitsCNN:  # a CNN, not the MLP
        """A freshly initialised model (identical on every rank for the same seed)."""
        return DigitsCNN(self.cnn_config.channels, seed=seed).to(self.device)

    def info(self) -> dict:
        """JSON-ready description of the workload."""
        c1, c2 = self.cnn_config.channels
        return {
            **super().info(),
            "task": "8x8 digit classification with a CNN (sklearn load_digits)",
            "model": {
                "kind": "cnn",
                "channels": [c1, c2],
                "pool": 2,
                "classifier_inputs": c2 * (SIDE // 2) ** 2,
            },
            **dataclasses.asdict(self.cnn_config),
        }
