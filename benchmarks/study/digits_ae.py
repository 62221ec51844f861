"""Reconstructing 8x8 digits with a small convolutional autoencoder (MSE).

A third kind of study workload, unlike next-character text and digit classification: a
regression loss, a 16-number bottleneck, and 4-D convolution weights (``Conv2d``
``(out, in, kh, kw)`` and ``ConvTranspose2d`` ``(in, out, kh, kw)``), so DeMo's DCT tiling
of non-matrix weights is exercised. The images, the stratified held-out split and the
per-rank batch sampling are the digits workload's own (:mod:`cokit.bench.study.digits`), so
both see the same images in the same order. Nothing is downloaded (scikit-learn's bundled
``load_digits``). The interface matches :class:`cokit.train.Workload`; a batch is a
``(b, 64)`` float32 tensor of pixels in [-1, 1], input and target at once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from cokit.bench.study.digits import NUM_FEATURES, DigitsWorkload, DigitsWorkloadConfig

SIDE = 8  # images are SIDE x SIDE


class DigitsAutoencoder(nn.Module):
    """``8x8 -> conv(c1) -> conv/2(c2) 4x4 -> conv/2(c3) 2x2 -> latent -> ... -> 8x8``.

    Encoder: a 3x3 conv, two stride-2 3x3 convs, a linear bottleneck; decoder: a linear layer
    back to ``c3 x 2 x 2``, two stride-2 3x3 transposed convs and a 3x3 conv to one channel.
    GELU between layers, no output squashing (targets are in [-1, 1]). Init deterministic
    from ``seed``; the global RNG is left untouched."""

    def __init__(
        self, channels: tuple[int, int, int] = (16, 32, 48), latent: int = 16, seed: int = 0
    ) -> None:
        super().__init__()
        c1, c2, c3 = channels
        self.channels, self.latent = channels, latent
        with torch.random.fork_rng(devices=[]):  # module constructors draw from the global RNG
            self.enc = nn.ModuleList(
                [
                    nn.Conv2d(1, c1, 3, padding=1),
                    nn.Conv2d(c1, c2, 3, stride=2, padding=1),
                    nn.Conv2d(c2, c3, 3, stride=2, padding=1),
                ]
            )
            self.to_latent = nn.Linear(c3 * 4, latent)
            self.from_latent = nn.Linear(latent, c3 * 4)
            self.dec = nn.ModuleList(
                [
                    nn.ConvTranspose2d(c3, c2, 3, stride=2, padding=1, output_padding=1),
                    nn.ConvTranspose2d(c2, c1, 3, stride=2, padding=1, output_padding=1),
                ]
            )
            self.out = nn.Conv2d(c1, 1, 3, padding=1)
        self.reset_parameters(seed)

    def reset_parameters(self, seed: int) -> None:
        """Weights ~ N(0, 1/fan_in) (the output conv scaled by 0.1, so the first
        reconstructions are near 0), biases 0."""
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("bias"):
                    p.zero_()
                    continue
                module = self.get_submodule(name.rsplit(".", 1)[0])
                if isinstance(module, nn.ConvTranspose2d):  # weight (in, out, kh, kw)
                    fan_in = module.in_channels * math.prod(module.kernel_size) / math.prod(module.stride)
                elif isinstance(module, nn.Conv2d):
                    fan_in = module.in_channels * math.prod(module.kernel_size)
                else:
                    assert isinstance(module, nn.Linear)
                    fan_in = module.in_features
                scale = (0.1 if module is self.out else 1.0) / math.sqrt(fan_in)
                p.copy_(torch.randn(p.shape, generator=gen) * scale)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """``(b, 64)`` pixels -> ``(b, latent)`` codes."""
        h = x.reshape(-1, 1, SIDE, SIDE)
        for conv in self.enc:
            h = F.gelu(conv(h))
        return self.to_latent(h.flatten(1))

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """``(b, latent)`` codes -> ``(b, 64)`` reconstructed pixels."""
        h = F.gelu(self.from_latent(z)).reshape(-1, self.channels[2], 2, 2)
        for conv in self.dec:
            h = F.gelu(conv(h))
        return self.out(h).flatten(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(b, 64)`` pixels -> ``(b, 64)`` reconstruction."""
        return self.decode(self.encode(x))

    def num_params(self) -> int:
        """Number of scalar parameters."""
        return sum(p.numel() for p in self.parameters())


@dataclass(frozen=True)
class DigitsAEWorkloadConfig:
    """Model sizes, batch shape and the held-out split (a picklable workload factory)."""

    channels: tuple[int, int, int] = (16, 32, 48)
    latent: int = 16
    batch_size: int = 32
    heldout_fraction: float = 0.25
    split_seed: int = 0
    eval_batch_size: int = 128

    def __post_init__(self) -> None:
        if len(self.channels) != 3 or any(not isinstance(c, int) or c < 1 for c in self.channels):
            raise ValueError(f"channels must be three positive ints (c1, c2, c3), got {self.channels}")
        if not isinstance(self.latent, int) or self.latent < 1:
            raise ValueError(f"latent must be a positive int, got {self.latent}")
        self.images()  # batch sizes and the split fraction are checked there

    def images(self) -> DigitsWorkloadConfig:
        """The digits workload whose images, split and batches this one reuses."""
        return DigitsWorkloadConfig(
            batch_size=self.batch_size,
            heldout_fraction=self.heldout_fraction,
            split_seed=self.split_seed,
            eval_batch_size=self.eval_batch_size,
        )

    def build(self, device: torch.device | str = "cpu") -> DigitsAEWorkload:
        """The workload on ``device`` (what each rank of a distributed run calls)."""
        return DigitsAEWorkload(self, device)


class DigitsAEWorkload:
    """Reconstruct 8x8 digits with a :class:`DigitsAutoencoder` (mean squared error)."""

    def __init__(
        self, config: DigitsAEWorkloadConfig = DigitsAEWorkloadConfig(), device: torch.device | str = "cpu"
    ) -> None:
        self.config = config
        self.device = torch.device(device)
        self.digits = DigitsWorkload(config.images(), device)

    def build_model(self, seed: int) -> DigitsAutoencoder:
        """A freshly initialised model (identical on every rank for the same seed)."""
        return DigitsAutoencoder(self.config.channels, self.config.latent, seed=seed).to(self.device)

    def train_batch(self, seed: int, step: int, rank: int, world_size: int) -> torch.Tensor:
        """``batch_size`` images ``(b, 64)`` from this rank's shard: the digits workload's batch
        for the same ``(seed, step, rank, world_size)``, without its labels."""
        return self.digits.train_batch(seed, step, rank, world_size)[0]

    def heldout_batches(self) -> list[torch.Tensor]:
        """Every held-out image once, in fixed batches of ``eval_batch_size``."""
        return [x for x, _ in self.digits.heldout_batches()]

    @staticmethod
    def loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        """Mean squared reconstruction error per pixel."""
        return F.mse_loss(model(batch).float(), batch)

    def mean_image_loss(self) -> float:
        """Held-out loss of the best constant predictor fit on the training images (their
        per-pixel mean), averaged over held-out batches as the training loop averages a model's:
        the analogue of the classifiers' uniform-guess loss."""
        mean = self.digits.train_x.float().mean(0)
        losses = [F.mse_loss(mean.expand_as(b), b).item() for b in self.heldout_batches()]
        return float(sum(losses) / len(losses))

    def info(self) -> dict:
        """JSON-ready description of the workload."""
        d = self.digits
        data = d.train_x.cpu().numpy().tobytes() + d.heldout_x.numpy().tobytes()
        baseline = self.mean_image_loss()
        c1, c2, c3 = self.config.channels
        model = self.build_model(0)
        return {
            "task": "8x8 digit reconstruction, conv autoencoder (sklearn load_digits)",
            "train_examples": int(d.train_y.numel()),
            "heldout_examples": int(d.heldout_y.numel()),
            "batch_size_per_rank": self.config.batch_size,
            # the report's baseline line: for a regression, the constant (mean-image) predictor
            "uniform_loss": baseline,
            "mean_image_loss": baseline,
            "baseline_label": "mean-image loss",
            "loss": "mean squared error per pixel, pixels in [-1, 1]",
            "sha256": hashlib.sha256(data).hexdigest(),
            "model": {
                "kind": "conv-autoencoder",
                "encoder": [f"conv3x3 1->{c1}", f"conv3x3/2 {c1}->{c2}", f"conv3x3/2 {c2}->{c3}"],
                "latent": self.config.latent,
                "decoder": [f"convT3x3/2 {c3}->{c2}", f"convT3x3/2 {c2}->{c1}", f"conv3x3 {c1}->1"],
                "params": model.num_params(),
                "pixels": NUM_FEATURES,
            },
            **{k: v for k, v in dataclasses.asdict(self.config).items() if k not in ("channels", "latent")},
        }
