"""The dense fallback in the gradient dtype and the exchange-scaling benchmark (bytes vs world size).

Byte counts are checked against first-principles numbers computed here from the codec
layouts (8-byte aligned sections of int16 indices, bf16 values / sign bits / per-tile
scales) and the ring volumes ``2 (W-1)/W n b`` (all-reduce) and ``(W-1) p`` (all-gather).
"""

import json
import math

import pytest
import torch

from cokit.bench import exchange_scaling as es
from cokit.compress.buckets import compressed_nbytes, make_buckets, sends_dense
from cokit.compress.payload import CompactCodec, SignCodec
from cokit.compress.traffic import AGREEMENT_ROW, STATUS_ROW

SETTINGS = [{"compression_chunk": 64, "compression_topk": 8}]
SMALL = ((64, 128), (128,), ())  # 8321 elements; tiles: 2 of 64x64, 2 of 1x64, one scalar
SMALL_N = 64 * 128 + 128 + 1


def ring_allreduce(nbytes, w):
    return 2 * (w - 1) * nbytes // w


def aligned(n):
    return -(-n // 8) * 8


def compact_bytes(slots):
    return aligned(2 * slots) + aligned(2 * slots)  # int16 indices, bf16 values


def sign_bytes(slots, tiles):
    return aligned(2 * slots) + aligned(-(-slots // 8)) + aligned(2 * tiles)  # indices, bits, scales


# ----------------------------------------------------------------------------- sends_dense


def test_hand_counted_payloads_match_the_codecs():
    for shape in [(64, 128), (128,)]:  # 2 tiles, 8 slots each
        assert compressed_nbytes(shape, 64, 8, CompactCodec, torch.bfloat16) == compact_bytes(16) == 64
        assert compressed_nbytes(shape, 64, 8, SignCodec, torch.bfloat16) == sign_bytes(16, 2) == 48


def test_sends_dense_flips_where_the_ring_volumes_cross():
    # (48, 80): tiles 48x40, 2 of them, 16 slots -> 64 bytes compact; 3840 elements.
    shape, p, n = (48, 80), 64, 48 * 80
    assert compressed_nbytes(shape, 64, 8, CompactCodec, torch.bfloat16) == p
    for itemsize in (4, 2):
        flip = math.ceil(2 * n * itemsize / p)  # W p >= 2 n b  <=>  (W-1) p >= 2 (W-1)/W n b
        assert flip == {4: 480, 2: 240}[itemsize]
        assert not sends_dense(shape, 64, 8, CompactCodec, torch.bfloat16, flip - 1, dense_itemsize=itemsize)
        assert sends_dense(shape, 64, 8, CompactCodec, torch.bfloat16, flip, dense_itemsize=itemsize)


def test_bf16_falls_back_earlier_than_fp32_and_the_default_is_fp32():
    shapes = [(64, 128), (128,), (30, 42), (7,), (3, 5, 7), (512, 512), (1, 96)]
    flipped_earlier = 0
    for shape in shapes:
        for codec in (CompactCodec, SignCodec):
            for w in (2, 3, 4, 8, 16, 100, 256, 512, 1024, 5000):
                fp32 = sends_dense(shape, 64, 8, codec, torch.bfloat16, w, dense_itemsize=4)
                bf16 = sends_dense(shape, 64, 8, codec, torch.bfloat16, w, dense_itemsize=2)
                assert sends_dense(shape, 64, 8, codec, torch.bfloat16, w) == fp32
                assert bf16 or not fp32  # dense in fp32 -> dense in bf16
                flipped_earlier += bf16 and not fp32
                # today's formula, kept as the default
                old = (w - 1) * compressed_nbytes(shape, 64, 8, codec, torch.bfloat16) >= 2 * (w - 1) * 4 * (
                    math.prod(shape)
                ) / w
                assert fp32 == old, (shape, codec.name, w)
    assert flipped_earlier > 10


@pytest.mark.parametrize("bad", [3, 0, -2, True, 4.0, "4", None])
def test_bad_dense_itemsize_is_refused_with_the_fix(bad):
    with pytest.raises(
        ValueError, match=r"dense_itemsize must be the gradient dtype's element size .*element_size"
    ):
        sends_dense((64, 128), 64, 8, CompactCodec, torch.bfloat16, 8, dense_itemsize=bad)


def test_make_buckets_uses_each_entry_itemsize():
    shapes = [(64, 128), (64, 128)]
    # W = 512: 512 * 64 >= 2 * 8192 * 2 (bf16 goes dense), < 2 * 8192 * 4 (fp32 stays compressed)
    args = ([0, 0], shapes, SETTINGS, CompactCodec, torch.bfloat16, 2**30, True, 512)
    buckets = make_buckets(*args, dense_itemsizes=[2, 4])
    assert [(b.dense, b.members) for b in buckets] == [(True, [0]), (False, [1])]
    default = make_buckets(*args)
    assert [(b.dense, b.members) for b in default] == [(False, [1, 0])]
    assert [(b.dense, b.members) for b in make_buckets(*args, dense_itemsizes=[4, 4])] == [(False, [1, 0])]


def test_make_buckets_refuses_bad_itemsizes_before_building_anything():
    args = ([0, 0], [(64, 128), (8,)], SETTINGS, CompactCodec, torch.bfloat16, 2**30, True, 4)
    with pytest.raises(ValueError, match="dense_itemsizes has 1 entries for 2 shapes"):
        make_buckets(*args, dense_itemsizes=[2])
    with pytest.raises(ValueError, match=r"dense_itemsizes\[1\] must be the gradient dtype's element size"):
        make_buckets(*args, dense_itemsizes=[2, 3])


# ----------------------------------------------------------------------------- the benchmark


def _setup(codec=CompactCodec, k=8):
    return es.Setup(codec, k)


@pytest.mark.parametrize(
    "codec,bucket",
    [(CompactCodec, compact_bytes(32)), (SignCodec, sign_bytes(32, 4))],
    ids=["compact", "sign"],
)
def test_traffic_matches_a_first_principles_count(codec, bucket):
    assert bucket == {CompactCodec: 128, SignCodec: 80}[codec]  # one bucket of 4 tiles, 32 slots
    alone = {CompactCodec: 64, SignCodec: 48}[codec]
    for w, itemsize in [(4, 4), (4, 2), (16, 4), (16, 2), (8, 2)]:
        t = es.exchange_traffic(SMALL, _setup(codec), w, itemsize)
        # the 1-D (128,) tensor goes dense once W * payload >= 2 * 128 * itemsize
        one_d_dense = w * alone >= 2 * 128 * itemsize
        dense_elems = 1 + (128 if one_d_dense else 0)
        payload = alone if one_d_dense else bucket  # (64, 128) alone, or both in one bucket
        assert t.compressed == (w - 1) * payload
        assert t.dense == ring_allreduce(dense_elems * itemsize, w)
        assert t.status == (w - 1) * STATUS_ROW  # the fixed-size status row
        assert t.dense_tensors == 1 + one_d_dense
        assert t.sent == t.received == t.compressed + t.dense + t.status


def test_flat_and_hierarchical_rows_first_principles():
    model = es.Model("small", "test", SMALL)
    assert model.params == SMALL_N
    (row,) = es.flat_rows(model, _setup(), [4])
    assert row["fp32"]["dense_sent"] == ring_allreduce(SMALL_N * 4, 4) == 49926
    assert row["bf16"]["dense_sent"] == ring_allreduce(SMALL_N * 2, 4)
    assert row["fp32"]["cokit"]["sent"] == 3 * 128 + ring_allreduce(4, 4) + 3 * STATUS_ROW == 558
    assert row["fp32"]["ratio"] == pytest.approx(49926 / 558)

    (h,) = es.hierarchical_rows(model, _setup(), [8], local=2)  # 4 nodes of 2
    assert (h["nodes"], h["local"]) == (4, 2)
    f = h["fp32"]
    # intra: gradient average, parameter broadcast, status agreement (one row)
    row_intra = AGREEMENT_ROW
    assert (
        f["intra_sent"]
        == ring_allreduce(SMALL_N * 4, 2) + SMALL_N * 4 + row_intra
        == 33284 + SMALL_N * 4 + 40
    )
    # inter: the dense bucket (0) is local rank 0's, the compressed one (1) local rank 1's, the
    # busier; plus the status exchange over the 4 nodes
    assert f["inter"]["sent"] == 3 * 128 + 3 * STATUS_ROW
    assert f["flat_dense_sent"] == ring_allreduce(SMALL_N * 4, 8)
    assert f["two_level_dense_inter_sent"] == ring_allreduce(math.ceil(SMALL_N / 2) * 4, 4) == 24966
    assert es.hierarchical_rows(model, _setup(), [2, 4, 6, 10], local=4) == []  # < 2 nodes or not a multiple


def test_crossovers_are_where_the_formula_says():
    shape, p, n = (48, 80), 64, 3840
    model = es.Model("one", "test", (shape,))
    cross = es.crossovers(model, _setup(), local=8)
    for dtype, b in es.DTYPES.items():
        c = cross[dtype]
        assert c["payload_bytes_per_rank"] == p and c["dense_bytes"] == n * b
        w = 2 * n * b / p
        assert c["flat_crossover_w"] == w == {4: 480, 2: 240}[b]
        assert c["flat_first_dense_w"] == c["flat_all_dense_w"] == w
        # without the fallback the all-gather costs less below the crossover, as much at it
        below = es.exchange_traffic(model.shapes, _setup(), int(w) - 1, b, fallback=False)
        at = es.exchange_traffic(model.shapes, _setup(), int(w), b, fallback=False)
        assert below.compressed < es.dense_allreduce(n, b, int(w) - 1)
        assert at.compressed == es.dense_allreduce(n, b, int(w))
        # with it, the tensor goes dense exactly there
        assert [
            r[dtype]["cokit"]["dense_tensors"] for r in es.flat_rows(model, _setup(), [int(w) - 1, int(w)])
        ] == [
            0,
            1,
        ]
        # hierarchical (each local rank sends p / L across nodes), against the flat dense
        # all-reduce: (x-1) p / L = 2 (xL-1)/(xL) n b
        x = c["hier_vs_flat_dense_w"] / 8
        assert (x - 1) * p / 8 == pytest.approx(2 * (8 * x - 1) / (8 * x) * n * b, rel=1e-9)
        assert c["hier_vs_flat_dense_w"] > 50 * w  # moved by about L^2
        # ... and against a two-level dense all-reduce ((x-1) p / L = 2 (x-1)/x n b / L): by L
        assert c["hier_vs_two_level_dense_w"] == 8 * w
        assert c["hier_all_dense_w"] == 8 * w


def test_named_models_are_the_real_parameter_shapes():
    from cokit.workloads.model import CharTransformer, ModelConfig
    from cokit.workloads.text import VOCAB_SIZE

    toy = es.named_model("toy")
    real = CharTransformer(ModelConfig.preset("toy", VOCAB_SIZE))
    assert toy.shapes == tuple(tuple(p.shape) for p in real.parameters())
    gpt = es.named_model("gpt-50m")
    assert 45e6 < gpt.params < 55e6 and len(gpt.shapes) == 125
    with pytest.raises(ValueError, match="unknown model 'nope'; known: gpt-50m"):
        es.named_model("nope")


@pytest.mark.parametrize(
    "text,shape", [("512x2048", (512, 2048)), ("768", (768,)), ("scalar", ()), ("2X3x4", (2, 3, 4))]
)
def test_parse_shape(text, shape):
    assert es.parse_shape(text) == shape


@pytest.mark.parametrize("text", ["", "3x", "ax3", "0x4", "-1", "3.5"])
def test_parse_shape_refuses_bad_text(text):
    with pytest.raises(ValueError, match="is not sizes joined by 'x'"):
        es.parse_shape(text)


def test_main_writes_json_and_markdown(tmp_path, capsys):
    out = tmp_path / "res"
    argv = ["--shapes", "64x128", "128", "scalar", "--world-sizes", "16", "4", "--local-size", "2"]
    argv += ["--topk", "8", "--out", str(out)]
    assert es.main(argv) == 0
    report = json.loads((out / es.JSON_NAME).read_text())
    md = (out / es.MD_NAME).read_text()
    assert md in capsys.readouterr().out
    assert report["settings"]["world_sizes"] == [4, 16]
    assert [(r["payload"], r["world"]) for r in report["flat"]] == [
        ("compact", 4),
        ("compact", 16),
        ("sign", 4),
        ("sign", 16),
    ]
    assert report["flat"][0]["fp32"]["cokit"]["sent"] == 558
    assert [(r["payload"], r["world"], r["nodes"]) for r in report["hierarchical"]] == [
        ("compact", 4, 2),
        ("compact", 16, 8),
        ("sign", 4, 2),
        ("sign", 16, 8),
    ]
    assert report["model"]["params"] == SMALL_N and report["model"]["shapes"] == [[64, 128], [128], []]
    assert "| compact | 8 | 4 | 0.0999 | 0.00112 | 89.5x | 1/3 |" in md  # MB sent + received
    assert md.count("\n| sign | 8 | fp32 |") == 1
    # a second run refuses to replace the first one's results
    assert es.main(argv) == 2
    assert "already holds results" in capsys.readouterr().err
    assert es.main([*argv, "--overwrite"]) == 0


def test_main_default_model_matches_the_reported_scaling(tmp_path):
    argv = [
        "--world-sizes",
        "2",
        "8",
        "64",
        "256",
        "--payloads",
        "compact",
        "--topk",
        "32",
        "--out",
        str(tmp_path),
    ]
    assert es.main(argv) == 0
    report = json.loads((tmp_path / es.JSON_NAME).read_text())
    assert report["model"]["name"] == "gpt-50m" and "GPT-like" in report["model"]["description"]
    ratios = {r["world"]: r["fp32"]["ratio"] for r in report["flat"]}
    assert ratios[2] > 100 and 25 < ratios[8] < 35 and 3.5 < ratios[64] < 4.5  # ~124x, 31x, 4x reported
    last = report["flat"][-1]
    assert last["fp32"]["cokit"]["dense_tensors"] == report["model"]["tensors"]  # all dense at W = 256
    assert last["bf16"]["ratio_vs_fp32_fallback"] == pytest.approx(0.5, rel=1e-3)  # fp32 dense vs bf16 DDP
    (cross,) = report["crossovers"]
    assert cross["bf16"]["flat_all_dense_w"] * 2 == cross["fp32"]["flat_all_dense_w"] == 256


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--world-sizes", "1", "4"], "--world-sizes must all be >= 2"),
        (["--world-sizes", "0"], "must be a positive integer"),
        (["--shapes", "3xq"], "is not sizes joined by 'x'"),
        (["--local-size", "1"], "--local-size must be >= 2"),
        (["--bucket-cap-mb", "0"], "--bucket-cap-mb must be a positive number"),
        (["--payloads", "zip"], "invalid choice"),
        (["--shapes", "0"], "is not sizes joined by 'x'"),
    ],
)
def test_main_refuses_bad_arguments_before_writing(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        es.main([*argv, "--out", str(tmp_path / "res")])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "res").exists()


def test_nothing_to_compress_and_no_fallback_have_no_crossover(tmp_path):
    scalars = es.Model("s", "test", ((), ()))
    assert set(es.crossovers(scalars, _setup(), 8)["fp32"].values()) == {None}
    (row,) = es.flat_rows(scalars, _setup(), [4])
    assert (
        row["fp32"]["cokit"]["dense"] == ring_allreduce(2 * 4, 4) and row["fp32"]["cokit"]["compressed"] == 0
    )
    assert es.main(["--shapes", "scalar", "--world-sizes", "2", "--out", str(tmp_path)]) == 0

    from cokit.compress.payload import ReferenceCodec

    ref = es.crossovers(es.Model("one", "test", ((48, 80),)), es.Setup(ReferenceCodec, 8), 8)["bf16"]
    assert ref["flat_first_dense_w"] is ref["flat_all_dense_w"] is ref["hier_all_dense_w"] is None
    assert ref["payload_bytes_per_rank"] == 16 * (8 + 4)  # int64 indices, fp32 values, 16 slots
    t = es.exchange_traffic([(48, 80)], es.Setup(ReferenceCodec, 8), 4096, 2)
    assert (t.dense_tensors, t.compressed) == (0, 4095 * 192)  # reference: no fallback at any W
