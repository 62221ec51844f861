"""Per-chunk top-k kernel vs the reference, ties, dtypes and index widths."""

import pytest
import torch
from helpers import DTYPES, poison  # noqa: F401

from cokit.triton_kernels.topk import chunk_topk, chunk_topk_reference


def float64_topk(x: torch.Tensor, k: int):
    """Independent float64 reference: sort by (-|x|, position), keep k, order by position."""
    x = x.double()
    out_i, out_v = [], []
    for row in x:
        order = sorted(range(row.numel()), key=lambda i: (-abs(row[i].item()), i))[:k]
        order.sort()
        out_i.append(order)
        out_v.append([row[i].item() for i in order])
    return torch.tensor(out_i), torch.tensor(out_v, dtype=torch.float64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols", [(1, 1), (3, 7), (2, 15), (2, 4096), (5, 910), (4, 432)])
@pytest.mark.parametrize("k", [1, 3, 32, "tile"])
@pytest.mark.usefixtures("poison")
def test_topk_vs_float64(rows, cols, k, dtype, device):
    k = cols if k == "tile" else k
    x = torch.randn(rows, cols).to(dtype)
    idx, vals = (t.cpu() for t in chunk_topk(x.to(device), k))
    ref_i, ref_v = float64_topk(x, min(k, cols))
    assert idx.dtype == torch.int16 and vals.dtype == dtype
    assert torch.equal(idx.long(), ref_i)
    assert torch.equal(vals.double(), ref_v)


@pytest.mark.usefixtures("poison")
def test_ties_lower_position_wins(device):
    x = torch.tensor([[1.0, -2.0, 2.0, 0.5, -2.0, 2.0, 1.0]], device=device)
    idx, vals = chunk_topk(x, 3)
    assert idx.tolist() == [[1, 2, 4]]
    assert vals.tolist() == [[-2.0, 2.0, -2.0]]
    zeros = torch.zeros(2, 40, device=device)
    idx, _ = chunk_topk(zeros, 5)
    assert idx.tolist() == [list(range(5))] * 2


@pytest.mark.usefixtures("poison")
def test_reference_matches_kernel_on_many_ties(device):
    x = torch.randint(-3, 4, (6, 50)).float().to(device)
    for k in (1, 7, 50):
        i1, v1 = chunk_topk(x, k)
        i2, v2 = chunk_topk_reference(x, k)
        assert torch.equal(i1, i2) and torch.equal(v1, v2)


@pytest.mark.usefixtures("poison")
def test_large_tile_uses_int32_indices(device):
    x = torch.randn(1, 40000)
    idx, vals = (t.cpu() for t in chunk_topk(x.to(device), 5))
    assert idx.dtype == torch.int32
    ref_i, ref_v = float64_topk(x, 5)
    assert torch.equal(idx.long(), ref_i) and torch.equal(vals.double(), ref_v)


@pytest.mark.usefixtures("poison")
def test_k_larger_than_tile_is_clamped(device):
    idx, _ = chunk_topk(torch.randn(2, 6, device=device), 100)
    assert idx.shape == (2, 6) and idx.tolist() == [list(range(6))] * 2


@pytest.mark.usefixtures("poison")
def test_extreme_values(device):
    x = torch.tensor(
        [[0.0, -0.0, float("inf"), -float("inf"), 1e-40, -3e38, 1.0, float("nan")]], device=device
    )
    idx, _ = chunk_topk(x, 4)
    assert idx.tolist() == [[2, 3, 5, 7]]  # NaN ranks above every number (documented)


def test_fast_reference_equals_the_key_rule_on_ties_nan_and_signed_zeros():
    """The reference's topk(|x|) fast path redoes rows whose k-th magnitude is tied across
    the cut (or NaN) with int64 keys; every row must match the keys-only rule."""
    from cokit.triton_kernels.topk import _topk_by_keys

    gen = torch.Generator().manual_seed(7)
    for trial in range(60):
        rows, n = 1 + trial % 9, 1 + (trial * 37) % 257
        k = 1 + (trial * 11) % n
        x = torch.randint(-3, 4, (rows, n), generator=gen).float()
        if trial % 3 == 1:
            x = torch.randn(rows, n, generator=gen)
            x[torch.rand(rows, n, generator=gen) < 0.2] = float("nan")
            x[torch.rand(rows, n, generator=gen) < 0.2] = -0.0
        idx, vals = chunk_topk_reference(x, k)
        want = _topk_by_keys(x, min(k, n)).sort(dim=1).values
        assert torch.equal(idx.long(), want), trial
        assert torch.equal(vals.nan_to_num(9.0), x.gather(1, want).nan_to_num(9.0)), trial
