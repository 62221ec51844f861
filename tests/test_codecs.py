"""Payload codecs: round trips on random selections, exact wire sizes, the registry, and a
codec added by a user training on a real gloo group (DeMo and the DDP hook)."""

from __future__ import annotations

import math

import pytest
import torch
from distributed import run_gloo
from helpers import AGREEMENT_ROW, STATUS_ROW, byte_counts

from cokit.compress import DeMo
from cokit.compress.hooks import DCTTopKState
from cokit.compress.payload import (
    PayloadCodec,
    Wire,
    codec_names,
    get_codec,
    register_codec,
    unregister_codec,
)
from cokit.triton_kernels.error_feedback import ef_decode, payload_layout

BUILTIN = ("reference", "compact", "sign", "int2")
# Odd tiles: 6x7 (30x42 at chunk 8), prime lengths (tile side 1), a 3-D tensor, 1xN; and tiles
# of more than 32768 positions (181x199, both prime, at chunk 256), which need int32 indices.
LAYOUTS = {
    "odd": ([(30, 42), (13,), (9, 5, 6), (1, 7), (5,)], 8, 5),
    "large": ([(181, 199), (6,)], 256, 7),
}


class Int32Fp32(PayloadCodec):
    """The codec of the module docstring: int32 indices and fp32 values, two all-gathers."""

    name = "test-int32-fp32"

    @classmethod
    def resolve_value_dtype(cls, value_dtype):
        return torch.float32

    def wire_layout(self):
        n = self.plan.payload_numel
        return [Wire("index", torch.int32, n), Wire("value", torch.float32, n)]

    def encode(self, indices, values):
        return [indices.to(torch.int32), values.to(torch.float32)]

    def decode(self, gathered):
        return gathered[0], gathered[1]


@pytest.fixture
def toy_codec():
    register_codec(Int32Fp32)
    yield Int32Fp32
    unregister_codec(Int32Fp32.name)


def _aligned(n: int) -> int:
    return -(-n // 8) * 8


def _selection(plan, world: int, gen: torch.Generator):
    """Per rank: distinct positions per tile and random fp32 values (what ef_encode gives)."""
    idx, vals = [], []
    for _ in range(world):
        parts = []
        for t in plan.tilings:
            ke = t.k_eff(plan.k)
            parts += [torch.randperm(t.tile_numel, generator=gen)[:ke] for _ in range(t.n_tiles)]
        idx.append(torch.cat(parts).to(plan.index_dtype))
        vals.append(torch.randn(plan.payload_numel, generator=gen) * 10 ** torch.randn(1, generator=gen))
    return idx, vals


def _int2_reference(plan, value_dtype, vals: torch.Tensor) -> torch.Tensor:
    """float64 int2 quantizer from the codec's definition: per tile, of the steps rms * c (c in
    0.25, 0.30, .. 0.75, rounded to the value dtype) the one whose nearest levels (2q - 3) * step,
    q in 0..3, reconstruct the tile with the least squared error (the smaller on ties)."""
    out, pos = [], 0
    factors = [0.25 + 0.05 * i for i in range(11)]
    for t in plan.tilings:
        ke = t.k_eff(plan.k)
        for tile in vals[pos : pos + t.n_tiles * ke].double().view(t.n_tiles, ke):
            rms = tile.square().mean().sqrt()
            best = None
            for c in factors:
                step = (rms * c).float().to(value_dtype).double()
                if step == 0:
                    q = torch.zeros_like(tile)
                else:
                    q = (2 * torch.round((tile / step + 3) / 2).clamp(0, 3) - 3) * step
                err = float((q - tile).square().sum())
                if best is None or err < best[0] * (1 - 1e-9):  # float64: the first of (near) ties
                    best = (err, q)
            out.append(best[1])
        pos += t.n_tiles * ke
    return torch.cat(out)


def _expected(name: str, plan, value_dtype, vals: torch.Tensor) -> torch.Tensor:
    """What the receiver should see for one rank's fp32 values, from the codec's definition."""
    if name == "reference":
        return vals
    if name == "compact":
        return vals.to(value_dtype)
    if name == "int2":
        return _int2_reference(plan, value_dtype, vals)
    out, pos = [], 0
    for t in plan.tilings:  # sign: ±(mean |value| of the tile, in the value dtype)
        ke = t.k_eff(plan.k)
        tile = vals[pos : pos + t.n_tiles * ke].view(t.n_tiles, ke)
        scale = tile.abs().mean(1, keepdim=True).to(value_dtype).float()
        out.append(torch.where(tile < 0, -scale, scale).flatten())
        pos += t.n_tiles * ke
    return torch.cat(out)


def _expected_nbytes(name: str, plan, value_dtype) -> int:
    slots, isz = plan.payload_numel, plan.index_dtype.itemsize
    tiles = sum(t.n_tiles for t in plan.tilings)
    if name == "reference":
        return slots * (8 + 4)
    if name == "compact":
        return _aligned(slots * isz) + _aligned(slots * value_dtype.itemsize)
    if name == "int2":  # 2-bit codes, four per byte, and one step per tile
        return _aligned(slots * isz) + _aligned(-(-slots // 4)) + _aligned(tiles * value_dtype.itemsize)
    return _aligned(slots * isz) + _aligned(-(-slots // 8)) + _aligned(tiles * value_dtype.itemsize)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("value_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", BUILTIN)
def test_builtin_codecs_round_trip_random_selections(name, value_dtype, layout, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # ef_decode on the torch path
    shapes, chunk, k = LAYOUTS[layout]
    plan = payload_layout(shapes, chunk, k)
    assert plan.index_dtype == (torch.int32 if layout == "large" else torch.int16)
    codec = get_codec(name)(plan, value_dtype)
    assert codec.nbytes == _expected_nbytes(name, plan, value_dtype) == sum(w.nbytes for w in codec.wire)
    world = 3
    gen = torch.Generator().manual_seed(hash((name, str(value_dtype), layout)) % 2**31)
    idx, vals = _selection(plan, world, gen)
    sent = [codec.to_wire(i, v.to(codec.encode_dtype)) for i, v in zip(idx, vals, strict=True)]
    for wires in sent:
        assert [(t.dtype, t.numel()) for t in wires] == [(w.dtype, w.numel) for w in codec.wire]
    gathered = [torch.stack([wires[j].reshape(-1) for wires in sent]) for j in range(len(codec.wire))]
    got_idx, got_vals = codec.from_wire(gathered)
    assert got_idx.shape == got_vals.shape == (world, plan.payload_numel)
    # int2 picks its step from an fp32 RMS: equal to the float64 reference up to fp32 rounding
    tol = {"rtol": 1e-6, "atol": 0.0} if name == "int2" else {"rtol": 0.0, "atol": 0.0}
    for r in range(world):
        assert torch.equal(got_idx[r].long(), idx[r].long())
        want_vals = _expected(name, plan, codec.value_dtype, vals[r])
        torch.testing.assert_close(got_vals[r].double(), want_vals.double(), **tol)

    # the decoded payload is what ef_decode takes: same update as from the exact selection
    params = [torch.randn(s, generator=gen) for s in shapes]
    want = [p.clone() for p in params]
    ef_decode(params, got_idx, got_vals, lr=0.01, chunk=chunk, k=k, validate=True)
    exact = torch.stack([_expected(name, plan, codec.value_dtype, v).float() for v in vals])
    ef_decode(want, torch.stack(idx).long(), exact, lr=0.01, chunk=chunk, k=k, validate=True)
    for a, b in zip(params, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0.0, atol=0.0)


@pytest.mark.parametrize("value_dtype", [torch.bfloat16, torch.float16])
def test_int2_takes_low_precision_values_and_reconstructs_better_than_a_max_scale(value_dtype):
    plan = payload_layout([(64, 64), (96,)], 32, 16)
    codec = get_codec("int2")(plan, torch.bfloat16)
    gen = torch.Generator().manual_seed(3)
    vals = (torch.randn(plan.payload_numel, generator=gen) ** 3).to(value_dtype)  # heavy tails
    idx = torch.zeros(plan.payload_numel, dtype=plan.index_dtype)
    _, got = codec.from_wire([w.reshape(1, -1) for w in codec.to_wire(idx, vals)])
    v = vals.double()
    torch.testing.assert_close(
        got[0].double(), _int2_reference(plan, torch.bfloat16, v.float()), rtol=1e-6, atol=0
    )
    levels = set(torch.unique(got[0].abs()).tolist())
    assert len(levels) > 2  # the steps differ per tile (searched), not one global scale
    err = float((got[0].double() - v).norm() / v.norm())
    out, pos = [], 0  # the rejected alternative: step = max|v| / 3 per tile
    for t in plan.tilings:
        ke = t.k_eff(plan.k)
        tile = v[pos : pos + t.n_tiles * ke].view(t.n_tiles, ke)
        step = tile.abs().amax(1, keepdim=True) / 3
        out.append(((2 * torch.round((tile / step + 3) / 2).clamp(0, 3) - 3) * step).flatten())
        pos += t.n_tiles * ke
    max_err = float((torch.cat(out) - v).norm() / v.norm())
    assert err < max_err
    zero = codec.to_wire(idx, torch.zeros(plan.payload_numel, dtype=value_dtype))
    assert not codec.from_wire([w.reshape(1, -1) for w in zero])[1].any()  # all-zero tiles decode to 0


def test_the_value_dtype_applies_as_each_codec_says():
    plan = payload_layout([(16, 16)], 8, 3)
    ref, compact, sign = (get_codec(n)(plan, torch.float16) for n in ("reference", "compact", "sign"))
    int2 = get_codec("int2")(plan, torch.float16)
    assert int2.value_dtype == torch.float16 and int2.encode_dtype == torch.float32  # steps of fp32
    assert int2.bucketed and int2.dense_fallback and [w.name for w in int2.wire] == ["payload"]
    assert ref.value_dtype == ref.encode_dtype == torch.float32  # the reference always sends fp32
    assert compact.value_dtype == compact.encode_dtype == torch.float16
    assert sign.value_dtype == torch.float16 and sign.encode_dtype == torch.float32  # scales of fp32
    assert [c.bucketed for c in (ref, compact, sign)] == [False, True, True]
    assert [c.dense_fallback for c in (ref, compact, sign)] == [False, True, True]
    assert [w.name for w in ref.wire] == ["index", "value"] and [w.name for w in sign.wire] == ["payload"]


def test_a_gathered_payload_of_another_layout_is_rejected():
    codec = get_codec("reference")(payload_layout([(8, 8)], 8, 2), torch.float32)
    good = [torch.zeros(2, 2, dtype=torch.int64), torch.zeros(2, 2)]
    codec.from_wire(good)
    with pytest.raises(ValueError, match="expects 2 gathered tensors, got 1"):
        codec.from_wire(good[:1])
    with pytest.raises(ValueError, match=r"gathered value must be torch.float32 \(world_size, 2\).*disagree"):
        codec.from_wire([good[0], torch.zeros(2, 3)])


# ----------------------------------------------------------------------------- registry


def test_unknown_codec_names_fail_clearly_before_anything_changes():
    names = codec_names()
    assert set(BUILTIN) <= set(names)
    with pytest.raises(
        ValueError, match=r"payload must be one of \('reference', 'compact', 'sign'.*got 'zip'"
    ):
        get_codec("zip")
    p = torch.nn.Parameter(torch.randn(8, 8))
    p.grad = torch.randn(8, 8)
    before, grad = p.detach().clone(), p.grad.clone()
    with pytest.raises(ValueError, match=r"DeMo: payload must be one of .* got 'zip'"):
        DeMo([p], payload="zip", overlap_backward=True)
    assert torch.equal(p.detach(), before) and torch.equal(p.grad, grad)
    with pytest.raises(ValueError, match="DCTTopKState: payload must be one of"):
        DCTTopKState(payload="zip")
    with pytest.raises(ValueError, match=r"DCTTopKState: payload must be a bucketed codec.*got 'reference'"):
        DCTTopKState(payload="reference")
    with pytest.raises(ValueError, match="payload must be one of"):
        unregister_codec("zip")
    assert codec_names() == names


def test_register_codec_refuses_bad_classes_and_taken_names(toy_codec):
    names = codec_names()
    assert get_codec(toy_codec.name) is toy_codec and register_codec(toy_codec) is toy_codec

    class Taken(Int32Fp32):
        name = "compact"

    class Nameless(Int32Fp32):
        name = ""

    class Unfinished(PayloadCodec):
        name = "test-unfinished"

    with pytest.raises(ValueError, match=r"'compact' is taken by cokit\.compress\.payload\.CompactCodec"):
        register_codec(Taken)
    with pytest.raises(ValueError, match="needs a non-empty string `name`"):
        register_codec(Nameless)
    with pytest.raises(TypeError, match="does not implement decode, encode, wire_layout"):
        register_codec(Unfinished)
    with pytest.raises(TypeError, match="needs a PayloadCodec subclass"):
        register_codec(dict)
    assert codec_names() == names and get_codec("compact").__name__ == "CompactCodec"


def test_an_encode_that_breaks_its_wire_layout_is_caught_before_sending():
    class Short(Int32Fp32):
        name = "test-short"

        def encode(self, indices, values):
            return [indices.to(torch.int32), values[:-1]]

    codec = Short(payload_layout([(8, 8)], 8, 2))
    with pytest.raises(ValueError, match=r"'test-short': encode\(\) gave .* its wire_layout\(\) says"):
        codec.to_wire(torch.zeros(2, dtype=torch.int16), torch.zeros(2))


# ----------------------------------------------------------------------------- a user codec on gloo


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(24, 40)
        self.b = torch.nn.Linear(40, 3)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _steps(model, opt, x, y, steps):
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _user_codec_run(rank: int, world: int):
    import os

    from torch.nn.parallel import DistributedDataParallel as DDP

    from cokit.compress.hooks import dct_topk_hook

    os.environ["TRITON_INTERPRET"] = "0"  # torch path in the workers
    register_codec(Int32Fp32)  # every rank's process registers the codec
    g = torch.Generator().manual_seed(100 + rank)
    x, y = torch.randn(64, 24, generator=g), torch.randn(64, 3, generator=g)
    out = {}
    for payload in (Int32Fp32.name, "compact"):  # compact with fp32 values carries the same selection
        torch.manual_seed(0)
        model = _Net()
        opt = DeMo(
            model.parameters(),
            lr=1e-2,
            compression_topk=4,
            compression_chunk=8,
            payload=payload,
            value_dtype=torch.float32,
            dense_fallback=False,
        )
        _steps(model, opt, x, y, 2)
        out[payload] = (
            [p.detach().clone() for p in model.parameters()],
            byte_counts(opt.comm_stats.as_dict()),
        )

        torch.manual_seed(0)
        net = DDP(_Net())
        state = DCTTopKState(topk=4, chunk=8, payload=payload, value_dtype=torch.float32)
        net.register_comm_hook(state, dct_topk_hook)
        _steps(net, torch.optim.SGD(net.parameters(), lr=0.05), x, y, 2)
        out[payload + " hook"] = (
            [p.detach().clone() for p in net.parameters()],
            byte_counts(state.comm_stats.as_dict()),
        )
    out["shapes"] = [tuple(p.shape) for p in _Net().parameters()]
    return out


@pytest.mark.distributed
def test_a_registered_user_codec_trains_on_gloo_with_demo_and_the_ddp_hook():
    world = 2
    results = run_gloo(world, _user_codec_run)
    toy = Int32Fp32.name
    for r in results:
        for key in (toy, toy + " hook", "compact", "compact hook"):
            for a, b in zip(r[key][0], results[0][key][0], strict=True):
                assert torch.equal(a, b)  # ranks agree bit for bit
        for a, b in zip(r[toy][0], r["compact"][0], strict=True):
            assert torch.equal(a, b)  # DeMo: the same selection and values as compact fp32
    # DeMo bytes from first principles: the status row + one bucket of P int32 + P fp32 in two all-gathers
    shapes = results[0]["shapes"]
    slots = payload_layout(shapes, 8, 4).payload_numel
    expected = (world - 1) * STATUS_ROW + (world - 1) * 8 * slots
    stats = results[0][toy][1]
    assert stats["step_sent_bytes"] == stats["step_received_bytes"] == expected
    dense = 2 * (world - 1) * 4 * sum(math.prod(s) for s in shapes) // world
    assert stats["step_dense_bytes"] == dense and stats["steps"] == 2
    # the hook: a tensor goes dense when the toy payload is not smaller than its all-reduce
    hook_sent = 0
    for s in shapes:
        n = payload_layout([s], 8, 4).payload_numel
        allreduce = 2 * (world - 1) * 4 * math.prod(s) // world
        hook_sent += allreduce if (world - 1) * 8 * n >= allreduce else (world - 1) * 8 * n
    hook_sent += 2 * (world - 1) * world * 4 // world  # + the per-rank non-finite flags (one bucket)
    hook_sent += (world - 1) * AGREEMENT_ROW  # + the iteration's status row
    hook = results[0][toy + " hook"][1]
    assert hook["steps"] == 2 and hook["step_sent_bytes"] == hook_sent


def _demo_int2_run(rank: int, world: int):
    import os

    os.environ["TRITON_INTERPRET"] = "0"  # torch path in the workers
    g = torch.Generator().manual_seed(100 + rank)
    x, y = torch.randn(64, 24, generator=g), torch.randn(64, 3, generator=g)
    torch.manual_seed(0)
    model = _Net()
    opt = DeMo(model.parameters(), lr=3e-3, compression_topk=4, compression_chunk=8, payload="int2")
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    buckets = opt.plan.buckets([(0, i, p) for i, p in enumerate(model.parameters())])
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "losses": losses,
        "stats": byte_counts(opt.comm_stats.as_dict()),
        "payload": sum(b.codec.nbytes for b in buckets if not b.dense),
    }


@pytest.mark.distributed
def test_demo_trains_with_the_int2_codec_on_gloo():
    world = 2
    results = run_gloo(world, _demo_int2_run)
    for r in results:
        for a, b in zip(r["params"], results[0]["params"], strict=True):
            assert torch.equal(a, b)  # ranks agree bit for bit
    assert results[0]["losses"][-1] < 0.9 * results[0]["losses"][0]
    from cokit.compress.buckets import sends_dense

    shapes = [tuple(p.shape) for p in _Net().parameters()]
    int2 = get_codec("int2")
    dense = [s for s in shapes if sends_dense(s, 8, 4, int2, torch.bfloat16, world)]
    assert dense == [(3,)]  # the 3-element bias: its payload would not be smaller
    plan = payload_layout([s for s in shapes if s not in dense], 8, 4)  # one bucket
    codec = int2(plan, torch.bfloat16)
    assert codec.nbytes == _expected_nbytes("int2", plan, torch.bfloat16) == results[0]["payload"]
    dense_numel = sum(math.prod(s) for s in dense)
    expected = (
        (world - 1) * STATUS_ROW + (world - 1) * codec.nbytes + 2 * (world - 1) * 4 * dense_numel // world
    )
    assert results[0]["stats"]["step_sent_bytes"] == expected
