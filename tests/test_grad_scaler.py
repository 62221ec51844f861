"""torch.amp.GradScaler with DeMo and SparseLoCo on real gloo groups.

GradScaler decides per rank: a rank that saw an inf used to skip ``step()`` alone, and the
ranks' collectives then paired wrongly (SIGABRT). Both optimizers declare
``_step_supports_amp_scaling``: GradScaler calls ``step()`` on every rank with its scale and
``found_inf``; the optimizer unscales the gradients itself and every rank agrees (the status
row of the exchange core) to skip. Without an inf, training under a GradScaler (power-of-2
scales: exact) gives the parameters of training without one, bit for bit. The fault matrix
(tests/test_reliability_matrix.py) covers an inf on one rank.
"""

from __future__ import annotations

import os

import pytest
import torch
from distributed import run_gloo
from helpers import SmallNet, regression_data

from cokit.compress import DeMo, SparseLoCo

pytestmark = pytest.mark.distributed


def _train(rank: int, which: str, scaled: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = SmallNet()
    x, y = regression_data(rank)
    if which == "demo":
        opt = DeMo(model.parameters(), lr=1e-2, compression_topk=8, timeout=120)
    else:
        opt = SparseLoCo(
            model.parameters(), lambda ps: torch.optim.AdamW(ps, lr=1e-2), sync_every=2, timeout=120
        )
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=2) if scaled else None
    for step in range(6):
        loss = torch.nn.functional.mse_loss(
            model(x[32 * step : 32 * step + 32]), y[32 * step : 32 * step + 32]
        )
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            if step % 2:  # unscaled by the user first (to clip), or by the optimizer
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _both(rank: int, world: int) -> dict:
    os.environ["TRITON_INTERPRET"] = "0"
    return {(w, s): _train(rank, w, s) for w in ("demo", "sparseloco") for s in (False, True)}


def test_a_gradscaler_without_inf_changes_nothing():
    for out in run_gloo(2, _both):
        for which in ("demo", "sparseloco"):
            plain, scaled = out[(which, False)], out[(which, True)]
            for a, b in zip(plain, scaled, strict=True):
                assert torch.equal(a, b), which


def test_the_optimizers_take_gradscalers_step_protocol():
    for cls in (DeMo, SparseLoCo):
        assert cls._step_supports_amp_scaling is True
