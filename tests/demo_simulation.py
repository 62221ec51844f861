"""A from-scratch float64 simulation of one DeMo step (docs/design.md §1.1) for tests.

Written independently of cokit's kernels and references: explicit DCT matrices, tiles by
reshape, ``torch.topk`` per tile, scatter-mean over the ranks that chose a position.
"""

from __future__ import annotations

import math

import torch

F64 = torch.float64


def side(size: int, chunk: int) -> int:
    return max(d for d in range(1, min(size, chunk) + 1) if size % d == 0)


def as_2d(shape: tuple[int, ...]) -> tuple[int, int]:
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return 1, shape[0]
    return shape[0], math.prod(shape[1:])


def basis(n: int) -> torch.Tensor:
    i = torch.arange(n, dtype=F64)
    b = math.sqrt(2.0 / n) * torch.cos(math.pi * (2 * i[None, :] + 1) * i[:, None] / (2 * n))
    b[0] /= math.sqrt(2.0)
    return b


def tiles(x: torch.Tensor, shape, chunk):
    """(n_tiles, h, w) view of a tensor's 2-D form, plus the tile sides."""
    rows, cols = as_2d(tuple(shape))
    h, w = side(rows, chunk), side(cols, chunk)
    t = x.reshape(rows // h, h, cols // w, w).transpose(1, 2).reshape(-1, h, w)
    return t, h, w


def untile(t: torch.Tensor, shape, h: int, w: int) -> torch.Tensor:
    rows, cols = as_2d(tuple(shape))
    return t.reshape(rows // h, cols // w, h, w).transpose(1, 2).reshape(tuple(shape))


def encode(delta: torch.Tensor, grad: torch.Tensor, beta, lr, chunk, k, alpha=1.0):
    """Rank-local part: returns (new delta, (idx, vals) per tile)."""
    buf = beta * delta.to(F64) + lr * grad.to(F64)
    x, h, w = tiles(buf, buf.shape, chunk)
    bh, bw = basis(h), basis(w)
    y = (bh @ x @ bw.T).reshape(x.shape[0], h * w)
    ke = min(k, h * w)
    idx = y.abs().topk(ke, dim=1).indices
    vals = y.gather(1, idx)
    sparse = torch.zeros_like(y).scatter_(1, idx, vals).reshape(-1, h, w)
    buf = buf - alpha * untile(bh.T @ sparse @ bw, buf.shape, h, w)
    return buf, (idx, vals)


def decode(shape, payloads, chunk) -> torch.Tensor:
    """Mean over the ranks that chose each position, inverse DCT (before the sign)."""
    rows, cols = as_2d(tuple(shape))
    h, w = side(rows, chunk), side(cols, chunk)
    n_tiles = (rows // h) * (cols // w)
    total = torch.zeros(n_tiles, h * w, dtype=F64)
    count = torch.zeros(n_tiles, h * w, dtype=F64)
    for idx, vals in payloads:
        total.scatter_add_(1, idx, vals)
        count.scatter_add_(1, idx, torch.ones_like(vals))
    mean = torch.where(count > 0, total / count.clamp_min(1), 0.0).reshape(-1, h, w)
    return untile(basis(h).T @ mean @ basis(w), shape, h, w)


def demo_step(param, deltas, grads, *, lr, beta, chunk, k, wd=0.0, alpha=1.0):
    """One DeMo step of one parameter over all ranks: (new param, new deltas, decoded)."""
    new_deltas, payloads = [], []
    for d, g in zip(deltas, grads, strict=True):
        nd, pl = encode(d, g, beta, lr, chunk, k, alpha)
        new_deltas.append(nd)
        payloads.append(pl)
    decoded = decode(param.shape, payloads, chunk)
    new_param = param.to(F64) * (1 - lr * wd) - lr * decoded.sign()
    return new_param, new_deltas, decoded
