"""Shared test helpers: poisoned outputs and the shapes every kernel is checked on."""

from __future__ import annotations

import pytest
import torch

from cokit.triton_kernels import tiling

SHAPES = [(1,), (7,), (3, 5), (64, 64), (96, 128), (130, 70), (16, 3, 3, 3)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _poisoned(shape, dtype, device):
    out = torch.empty(tuple(shape), dtype=dtype, device=device)
    if dtype.is_floating_point:
        return out.fill_(float("nan"))
    return out.fill_(-7)


@pytest.fixture
def poison(monkeypatch):
    """Every kernel output starts as NaN (floats) or -7 (indices)."""
    monkeypatch.setattr(tiling, "empty_output", _poisoned)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "output has NaN/inf (unwritten or poisoned elements)"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def byte_counts(stats: dict) -> dict:
    """``CommStats.as_dict()`` without its timing (seconds differ between equal runs)."""
    return {k: v for k, v in stats.items() if not k.endswith("_s") and k != "step_collectives"}


class SmallNet(torch.nn.Module):
    """A two-layer regression net with a LayerNorm (130 wide: odd tiles) for DeMo tests."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(24, 130)
        self.norm = torch.nn.LayerNorm(130)
        self.b = torch.nn.Linear(130, 1)

    def forward(self, x):
        return self.b(torch.relu(self.norm(self.a(x))))


def regression_data(rank: int, n: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` samples of rank ``rank``'s share of one linear regression problem."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(24, 1, generator=g)
    g.manual_seed(100 + rank)
    x = torch.randn(n, 24, generator=g)
    return x, x @ w
