"""Per-chunk top-k kernel vs the reference, ties, dtypes and index widths."""

import pytest
import torch
import triton
import triton.language as tl
from helpers import DTYPES, poison  # noqa: F401

from cokit.triton_kernels.topk import chunk_topk, chunk_topk_reference, topk_select


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


@triton.jit
def _select_kernel(x, sel_out, slot_out, n_rows, n_cols, k, TWO_D: tl.constexpr, MASK_LAST: tl.constexpr):
    """topk_select of one 16x64 block (valid: ``n_rows x n_cols``): the mask and the slots."""
    r = tl.arange(0, 16)[:, None]
    c = tl.arange(0, 64)[None, :]
    selected, slot = topk_select(tl.load(x + r * 64 + c), (r < n_rows) & (c < n_cols), k, TWO_D, MASK_LAST)
    tl.store(sel_out + r * 64 + c, selected.to(tl.int32))
    tl.store(slot_out + r * 64 + c, tl.where(selected, slot, -1))


@pytest.mark.parametrize("two_d", [False, True])
def test_both_selection_forms_agree(two_d, device):
    """The mask-last form (AMD: no boolean block live across a scan) and the mask-first form
    (NVIDIA) keep the same entries in the same slots: ties, NaN, masked rows and columns."""
    x = torch.randint(-3, 4, (16, 64)).float()
    x[2, 5] = x[7, 0] = float("nan")
    x = x.to(device)
    for n_rows, n_cols, k in ((16, 64, 7), (11, 50, 1), (5, 33, 33), (16, 64, 64)):
        k = k * n_rows if two_d and k > 1 else k
        outs = []
        for mask_last in (False, True):
            sel = torch.empty(16, 64, dtype=torch.int32, device=device)
            slot = torch.empty_like(sel)
            _select_kernel[(1,)](x, sel, slot, n_rows, n_cols, k, TWO_D=two_d, MASK_LAST=mask_last)
            outs.append((sel, slot))
        (sel_a, slot_a), (sel_b, slot_b) = outs
        assert torch.equal(sel_a, sel_b) and torch.equal(slot_a, slot_b), (n_rows, n_cols, k)
        kept = sel_a[:n_rows, :n_cols].sum(dim=None if two_d else 1)
        assert (kept == min(k, n_cols * (n_rows if two_d else 1))).all()


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
