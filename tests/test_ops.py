"""The cokit:: ops: schema/fake/autograd registration (opcheck) and torch.compile."""

import torch

from cokit.triton_kernels.dct import dct_decode, dct_encode
from cokit.triton_kernels.error_feedback import ef_decode, ef_encode
from cokit.triton_kernels.topk import chunk_topk


def test_opcheck_every_op(device):
    def randn(*shape):
        return torch.randn(*shape, device=device)

    xs = [randn(96, 128), randn(7).half()]
    torch.library.opcheck(torch.ops.cokit.dct_encode_multi.default, (xs, 64))
    coeffs = [randn(4, 3072), randn(1, 7)]
    torch.library.opcheck(
        torch.ops.cokit.dct_decode_multi.default, (coeffs, [96, 128, 7], [2, 1], 64, torch.float32)
    )
    torch.library.opcheck(torch.ops.cokit.chunk_topk.default, (randn(5, 40), 3))
    deltas, grads = [randn(64, 64), randn(7)], [randn(64, 64), randn(7)]
    torch.library.opcheck(
        torch.ops.cokit.ef_encode.default, (deltas, grads, 0.9, 0.1, 1.0, 64, 4, torch.float16)
    )
    idx, vals = ef_encode([randn(64, 64), randn(7)], grads, beta=0.9, lr=0.1, k=4)
    params = [randn(64, 64), randn(7)]
    torch.library.opcheck(
        torch.ops.cokit.ef_decode.default, (params, idx[None], vals[None], 64, 4, 0.01, 0.0, True)
    )


def test_torch_compile_fullgraph(device):
    def step(x, delta, grad, param):
        coeffs = dct_encode(x, 64)
        idx, vals = chunk_topk(coeffs, 8)
        back = dct_decode(coeffs, x.shape, 64)
        p_idx, p_vals = ef_encode([delta], [grad], beta=0.9, lr=0.1, k=8)
        ef_decode([param], p_idx[None], p_vals[None], lr=0.01, k=8, validate=False)
        return back * 2, idx, vals

    x, g = torch.randn(96, 128, device=device), torch.randn(64, 64, device=device)
    d_eager, p_eager = torch.randn(64, 64, device=device), torch.randn(64, 64, device=device)
    d_comp, p_comp = d_eager.clone(), p_eager.clone()
    eager = step(x, d_eager, g, p_eager)
    compiled = torch.compile(step, fullgraph=True, backend="inductor")(x, d_comp, g, p_comp)
    for a, b in zip(eager, compiled, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(d_eager, d_comp) and torch.equal(p_eager, p_comp)


def test_dynamic_compile_of_the_dct_round_trip_builds_one_graph(device):
    """torch.compile(dynamic=True): one graph serves every input shape (the tile grid's sizes
    are known at run time), and the op still checks the concrete shapes when it runs."""
    import pytest

    graphs = []

    def count(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def round_trip(x):
        return dct_decode(dct_encode(x, 64), x.shape, 64)

    compiled = torch.compile(round_trip, dynamic=True, fullgraph=True, backend=count)
    for shape in [(128, 96), (192, 160), (256, 64), (100, 70)]:
        x = torch.randn(shape, device=device)
        assert torch.allclose(compiled(x), x, atol=1e-4)
    assert len(graphs) == 1

    def wrong(c):
        return dct_decode(c, (96, 128), 64)

    with pytest.raises(ValueError, match=r"coeffs\[0\] has shape \(2, 3072\)"):
        torch.compile(wrong, dynamic=True, fullgraph=True, backend=count)(torch.randn(2, 3072, device=device))
