"""SparseLoCo's sync works in reused buffers and touches the mean only where ranks sent values
(less CPU time per sync): each shortcut against the plain computation it replaces, bit for bit."""

from __future__ import annotations

import pytest
import torch

from cokit.compress import SparseLoCo
from cokit.compress import payload as payload_mod
from cokit.compress.sparseloco_step import mean_at_positions
from cokit.triton_kernels import tiling
from cokit.triton_kernels.tiling import flat_positions, from_tiles, tiles_into, to_tiles

SHAPES = [(128, 192), (96, 64), (256,), (3, 40), (64, 1)]


def _selection(t: tiling.TensorTiling, k: int, gen: torch.Generator) -> torch.Tensor:
    """Sorted distinct positions per tile, ``(n_tiles, k)``."""
    return torch.rand(t.n_tiles, t.tile_numel, generator=gen).argsort(dim=1)[:, :k].sort(dim=1).values


@pytest.mark.parametrize("shape", SHAPES)
def test_tiles_into_and_positions_match_the_tile_matrix(shape):
    gen = torch.Generator().manual_seed(0)
    t = tiling.tile_plan([shape], 64, 8).tilings[0]
    x = torch.randn(shape, generator=gen)
    buf = torch.empty(shape)
    assert torch.equal(tiles_into(buf, x, t), to_tiles(x, t))
    k = min(8, t.tile_numel)
    ix = _selection(t, k, gen)
    assert torch.equal(x.view(-1)[flat_positions(ix, t)], to_tiles(x, t).gather(1, ix).view(-1))


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("shape", SHAPES)
def test_mean_at_positions_is_the_dense_mean(shape, world):
    """Overlapping selections of several ranks: the values at the positions are the dense
    decode's (zero, add in rank order, divide), and the dense mean is zero everywhere else."""
    gen = torch.Generator().manual_seed(1)
    t = tiling.tile_plan([shape], 64, 8).tilings[0]
    k = min(4, t.tile_numel)
    ix = torch.stack([_selection(t, k, gen) for _ in range(world)]).view(world, -1)
    v = torch.randn(world, ix.shape[1], generator=gen).to(torch.bfloat16)
    v[0, :3] = torch.tensor([0.0, -0.0, 1e-30])
    dense = torch.zeros(t.n_tiles, t.tile_numel)
    for r in range(world):
        dense.scatter_add_(1, ix[r].view(t.n_tiles, -1), v[r].float().view(t.n_tiles, -1))
    dense.div_(world)
    expect = from_tiles(dense, t)
    scratch = torch.randn(t.n_tiles, t.tile_numel, generator=gen)  # garbage outside the positions
    mean, pos = mean_at_positions(scratch, ix.to(torch.int16), v, t, world)
    assert pos is not None
    assert torch.equal(mean, expect.view(-1)[pos])
    off = torch.ones(expect.numel(), dtype=torch.bool)
    off[pos] = False
    assert not expect.view(-1)[off].any()
    # the outer step through the positions equals the dense one, bit for bit
    g = torch.randn(shape, generator=gen)
    g[(0,) * len(shape)] = -0.0
    dense_g = g.clone().sub_(expect, alpha=0.7)
    flat = g.view(-1)
    flat.index_put_((pos,), flat[pos].sub_(mean, alpha=0.7))
    assert torch.equal(g, dense_g)
    assert torch.equal(torch.signbit(g), torch.signbit(dense_g))


def _int2_quantize_plain(codec, values):
    """Int2Codec.quantize as first written (fresh temporaries for every operation)."""
    v = values.float()
    codes, steps, pos = [], [], 0
    for n_tiles, ke in codec.tile_slots:
        tile = v[pos : pos + n_tiles * ke].view(n_tiles, ke)
        pos += n_tiles * ke
        rms = tile.square().mean(dim=1, keepdim=True).sqrt()
        factors = torch.tensor(payload_mod.INT2_STEPS, dtype=torch.float32).view(-1, 1, 1)
        cand = (rms.unsqueeze(0) * factors).to(codec.value_dtype).float()
        safe = torch.where(cand > 0, cand, torch.ones_like(cand))
        q = torch.round((tile.unsqueeze(0) / safe + 3) / 2).clamp_(0, 3)
        q = torch.where(cand > 0, q, torch.full_like(q, 2)).to(torch.uint8)
        err = ((2 * q.float() - 3) * cand - tile).square().sum(dim=2)
        best = err.argmin(dim=0)
        tiles = torch.arange(n_tiles)
        codes.append(q[best, tiles].reshape(-1))
        steps.append(cand[best, tiles, 0])
    return torch.cat(codes), torch.cat(steps).to(codec.value_dtype)


@pytest.mark.parametrize("scale", [1e-30, 1e-3, 1.0, 1e30])
def test_int2_quantize_in_place_is_the_plain_formula(scale):
    gen = torch.Generator().manual_seed(2)
    plan = tiling.tile_plan([(256, 320), (1024,)], 64, 16)
    codec = payload_mod.Int2Codec(plan)
    vals = torch.randn(plan.payload_numel, generator=gen) * scale
    vals[:16] = 0.0  # a tile whose selection is all zero: step 0, code 2
    vals[20] = -0.0
    got, want = codec.quantize(vals), _int2_quantize_plain(codec, vals)
    assert got[0].dtype == want[0].dtype == torch.uint8
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_syncs_alternate_between_two_error_buffers():
    """From the second sync on, a sync writes the next error buffer into the spare one and
    swaps the two: no new buffer per sync (the values stay the out-of-place formula's, which
    the bit-for-bit tests of test_sparseloco.py check)."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64, 64))
    opt = SparseLoCo([p], sync_every=1)
    ptrs = []
    for _ in range(4):
        p.grad = torch.randn(64, 64)
        opt.step()
        ptrs.append(opt.state[p]["error"].data_ptr())
    assert ptrs[0] != ptrs[1] and ptrs[2:] == ptrs[:2]
