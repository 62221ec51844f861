"""The demo/validation workloads: stdlib char corpus, batches, the char transformer, the runner;
and the study's digits workloads (a checkout's ``cokit.bench.study``)."""

import math

import pytest
import torch

from cokit.workloads import (
    CharCorpus,
    CharTransformer,
    CorpusConfig,
    ModelConfig,
    TextWorkload,
    TextWorkloadConfig,
)
from cokit.workloads.text import UNKNOWN_ID, VOCAB, VOCAB_SIZE, decode, encode, stdlib_sources

SMALL = CorpusConfig(max_chars=200_000)
TOY = ModelConfig.preset("toy", VOCAB_SIZE)


@pytest.fixture(scope="module")
def workload():
    return TextWorkload(TextWorkloadConfig(corpus=SMALL, model=TOY, batch_size=4, eval_batches=3))


def test_vocabulary_round_trip_and_unknown():
    text = "def f(x):\n\treturn x  # ok\n"
    ids = encode(text)
    assert ids.dtype == torch.uint8 and ids.numel() == len(text)
    assert decode(ids) == text
    odd = encode("é€\x00a")
    assert odd.tolist()[:3] == [UNKNOWN_ID] * 3 and odd[3] == VOCAB.index("a")
    assert VOCAB_SIZE == len(VOCAB) + 1 == 98


def test_sources_exclude_tests_and_packages():
    files = stdlib_sources()
    assert files == sorted(files) and len(files) > 100
    assert "os.py" in files
    for f in files:
        parts = f.split("/")
        assert not {"site-packages", "test", "tests", "__pycache__"} & set(parts), f


def test_corpus_is_deterministic_and_split_by_file():
    a = CharCorpus.build(SMALL)
    b = CharCorpus.build(CorpusConfig(max_chars=200_000))  # equal config: same object from the cache
    assert a.sha256 == b.sha256
    assert a.num_chars == 200_000
    assert not set(a.train_files) & set(a.heldout_files)
    assert 0.05 < a.heldout.numel() / a.num_chars < 0.2
    other = CharCorpus.read(CorpusConfig(max_chars=200_000, split_seed=1))
    assert other.num_chars == a.num_chars and set(other.heldout_files) != set(a.heldout_files)
    again = CharCorpus.read(SMALL)
    assert again.sha256 == a.sha256 and torch.equal(again.train, a.train)
    assert set(a.info()) >= {"files", "chars", "train_chars", "heldout_chars", "sha256", "vocab_size"}


def test_batches_depend_only_on_seed_step_rank(workload):
    x, y = workload.train_batch(seed=3, step=7, rank=1, world_size=2)
    x2, y2 = workload.train_batch(seed=3, step=7, rank=1, world_size=2)
    assert x.shape == y.shape == (4, TOY.max_seq_len) and x.dtype == torch.int64
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the next characters
    assert not torch.equal(x, workload.train_batch(3, 8, 1, 2)[0])
    assert not torch.equal(x, workload.train_batch(4, 7, 1, 2)[0])
    assert not torch.equal(x, workload.train_batch(3, 7, 0, 2)[0])


def test_each_rank_reads_its_own_shard(workload):
    train = workload.corpus.train
    shards = [workload.shard(r, 3) for r in range(3)]
    assert sum(s.numel() for s in shards) == train.numel()
    assert torch.equal(torch.cat(shards), train)
    for rank in range(3):
        x, y = workload.train_batch(0, 1, rank, 3)
        window = torch.cat([x, y[:, -1:]], dim=1).to(torch.uint8)
        hay = shards[rank]
        for row in window:  # every sampled window lies inside this rank's shard
            starts = (hay[: hay.numel() - row.numel() + 1] == row[0]).nonzero().flatten()
            assert any(torch.equal(hay[s : s + row.numel()], row) for s in starts.tolist())
    with pytest.raises(ValueError):
        workload.shard(3, 3)


def test_heldout_batches_are_fixed_and_from_heldout_text(workload):
    a, b = workload.heldout_batches(), workload.heldout_batches()
    assert len(a) == 3
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    held = decode(workload.corpus.heldout)
    assert decode(a[1][0][0]) in held


def test_model_shapes_params_and_seeded_init():
    cfg = ModelConfig(VOCAB_SIZE, d_model=32, n_layers=2, n_heads=4, max_seq_len=16)
    state = torch.random.get_rng_state()
    m1, m2, m3 = CharTransformer(cfg, seed=1), CharTransformer(cfg, seed=1), CharTransformer(cfg, seed=2)
    assert torch.equal(state, torch.random.get_rng_state())  # init leaves the global RNG alone
    for (n, p1), p2, p3 in zip(m1.named_parameters(), m2.parameters(), m3.parameters(), strict=True):
        assert torch.equal(p1, p2), n
        if p1.dim() == 2:
            assert not torch.equal(p1, p3), n
    dims = {p.dim() for p in m1.parameters()}
    assert dims == {1, 2}
    out = m1(torch.randint(0, VOCAB_SIZE, (3, 16)))
    assert out.shape == (3, 16, VOCAB_SIZE)
    tied = CharTransformer(
        ModelConfig(VOCAB_SIZE, d_model=32, n_layers=2, n_heads=4, max_seq_len=16, tied_head=True)
    )
    assert tied.num_params() == m1.num_params() - VOCAB_SIZE * 32
    assert tied(torch.zeros(1, 5, dtype=torch.long)).shape == (1, 5, VOCAB_SIZE)
    with pytest.raises(ValueError):
        m1(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError):
        ModelConfig(VOCAB_SIZE, d_model=30, n_heads=4)


def test_model_is_causal():
    m = CharTransformer(ModelConfig(VOCAB_SIZE, d_model=32, n_layers=2, n_heads=2, max_seq_len=12), seed=0)
    m.eval()
    x = torch.randint(0, VOCAB_SIZE, (2, 12))
    y = x.clone()
    y[:, 7:] = (y[:, 7:] + 5) % VOCAB_SIZE
    with torch.no_grad():
        a, b = m(x), m(y)
    torch.testing.assert_close(a[:, :7], b[:, :7], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def test_initial_loss_is_near_uniform(workload):
    model = workload.build_model(0)
    with torch.no_grad():
        loss = workload.loss(model, workload.heldout_batches()[0])
    assert abs(float(loss) - math.log(VOCAB_SIZE)) < 0.3


# ----------------------------------------------------------------------------- digits autoencoder
def _ae():
    from cokit.bench.study.digits_ae import DigitsAEWorkloadConfig

    return DigitsAEWorkloadConfig().build("cpu")


def test_autoencoder_shapes_params_and_conv_weights():
    from cokit.bench.study.digits_ae import DigitsAutoencoder

    m = DigitsAutoencoder()
    assert 20_000 <= m.num_params() <= 60_000
    x = torch.rand(5, 64) * 2 - 1
    assert m.encode(x).shape == (5, 16) and m(x).shape == (5, 64)
    four_d = {n: tuple(p.shape) for n, p in m.named_parameters() if p.dim() == 4}
    assert four_d["enc.1.weight"] == (32, 16, 3, 3)  # Conv2d: (out, in, kh, kw)
    assert four_d["dec.0.weight"] == (48, 32, 3, 3)  # ConvTranspose2d: (in, out, kh, kw)
    assert len(four_d) == 6
    small = DigitsAutoencoder(channels=(4, 8, 8), latent=3)
    assert small(x).shape == (5, 64) and small.num_params() < m.num_params()


def test_autoencoder_init_is_seeded_and_leaves_the_global_rng_alone():
    from cokit.bench.study.digits_ae import DigitsAutoencoder

    state = torch.get_rng_state()
    a, b, c = DigitsAutoencoder(seed=3), DigitsAutoencoder(seed=3), DigitsAutoencoder(seed=4)
    assert torch.equal(torch.get_rng_state(), state)
    for (name, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(p, q), name
        if not name.endswith("bias"):
            assert not torch.equal(p, r), name


def test_autoencoder_batches_are_the_digits_images_and_deterministic():
    from cokit.bench.study.digits import DigitsWorkload, DigitsWorkloadConfig

    w = _ae()
    images = DigitsWorkload(DigitsWorkloadConfig(batch_size=32))
    x = w.train_batch(1, 5, 0, 2)
    assert x.shape == (32, 64) and x.dtype == torch.float32
    assert torch.equal(x, w.train_batch(1, 5, 0, 2))
    assert torch.equal(x, images.train_batch(1, 5, 0, 2)[0])  # same images as the classifier
    assert not torch.equal(x, w.train_batch(1, 6, 0, 2))
    assert not torch.equal(x, w.train_batch(2, 5, 0, 2))
    assert float(x.min()) >= -1.0 and float(x.max()) <= 1.0
    # each rank samples from its own half of the training images (rows compared as bytes)
    part = w.digits.shard(1, 2)
    mine = {r.numpy().tobytes() for r in w.digits.train_x[part]}
    others = {r.numpy().tobytes() for r in w.digits.train_x[: part.start]} - mine
    drawn = {r.numpy().tobytes() for s in range(20) for r in w.train_batch(0, s, 1, 2)}
    assert drawn <= mine and not drawn & others and others


def test_autoencoder_heldout_split_is_fixed_and_disjoint_from_training():
    from cokit.bench.study.digits import load_digits_arrays, split_indices

    w = _ae()
    x, y = load_digits_arrays()
    tr, ho = split_indices(y, 0.25, 0)
    assert not set(tr.tolist()) & set(ho.tolist()) and len(tr) + len(ho) == len(y)
    held = torch.cat(w.heldout_batches())
    assert torch.equal(held, torch.from_numpy(x[ho])) and torch.equal(
        w.digits.train_x, torch.from_numpy(x[tr])
    )
    assert [b.shape[0] for b in w.heldout_batches()] == [128, 128, 128, 66]
    again = _ae()
    assert all(torch.equal(a, b) for a, b in zip(held.split(128), again.heldout_batches(), strict=True))


def test_autoencoder_info_reports_the_mean_image_baseline():
    w = _ae()
    info = w.info()
    base = info["mean_image_loss"]
    assert info["uniform_loss"] == base and info["model"]["params"] == w.build_model(0).num_params()
    assert info["train_examples"] == 1347 and info["heldout_examples"] == 450
    mean = w.digits.train_x.mean(0)
    by_hand = sum(float(((b - mean) ** 2).mean()) for b in w.heldout_batches()) / len(w.heldout_batches())
    assert base == pytest.approx(by_hand, rel=1e-6)
    zero = sum(float((b**2).mean()) for b in w.heldout_batches()) / len(w.heldout_batches())
    assert 0.1 < base < zero  # predicting the mean image beats predicting zeros


def test_autoencoder_config_errors():
    from cokit.bench.study.digits_ae import DigitsAEWorkloadConfig

    for bad in ({"channels": (8, 8)}, {"channels": (8, 0, 8)}, {"latent": 0}, {"batch_size": 0}):
        with pytest.raises(ValueError):
            DigitsAEWorkloadConfig(**bad)
    with pytest.raises(ValueError, match="rank 2"):
        _ae().train_batch(0, 0, 2, 2)


def test_autoencoder_trains_with_adamw():
    """60 AdamW steps (lr 1e-2, 32 images) bring the held-out loss well under the mean-image
    predictor's (0.29); the untrained model, which outputs about 0, is at about 0.72."""
    w = _ae()
    torch.manual_seed(0)
    model = w.build_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)

    def heldout() -> float:
        with torch.no_grad():
            return sum(float(w.loss(model, b)) for b in w.heldout_batches()) / len(w.heldout_batches())

    start = heldout()
    for step in range(60):
        loss = w.loss(model, w.train_batch(0, step, 0, 1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    end = heldout()
    assert start > w.mean_image_loss() and end < 0.7 * w.mean_image_loss(), (start, end)


@pytest.mark.parametrize("source", ["prose", "c"])
def test_prose_and_c_corpora_ship_with_python_and_split_by_document(source):
    from cokit.workloads.text import SOURCES, UNKNOWN_ID, CharCorpus, CorpusConfig, decode

    cfg = CorpusConfig(max_chars=300_000, source=source)
    a, b = CharCorpus.read(cfg), CharCorpus.read(cfg)
    assert a.sha256 == b.sha256 and a.num_chars == 300_000  # deterministic, nothing downloaded
    assert not set(a.train_files) & set(a.heldout_files) and a.heldout_files
    assert 0.05 < a.heldout.numel() / a.num_chars < 0.2
    assert float((a.train == UNKNOWN_ID).float().mean()) < 0.01
    text = decode(a.train[:20_000])
    if source == "prose":
        assert any(f.startswith("pydoc_data/topics/") for f in a.train_files)
        assert text.count(" the ") > 50  # English
    else:
        assert all(f.endswith(".h") for f in a.train_files) and "#define" in text
    assert a.info()["source"] == source and a.info()["text"] == SOURCES[source]
    python = CharCorpus.read(CorpusConfig(max_chars=300_000))
    assert python.sha256 != a.sha256


def test_a_corpus_source_is_checked_and_too_little_text_says_what_to_lower():
    from cokit.workloads.text import CharCorpus, CorpusConfig

    with pytest.raises(ValueError, match="source must be one of python, prose, c"):
        CorpusConfig(source="latin")
    with pytest.raises(RuntimeError, match="lower max_chars"):
        CharCorpus.read(CorpusConfig(max_chars=50_000_000, source="prose"))


# ----------------------------------------------------------------------------- digits CNN
def test_cnn_workload_shares_the_digits_batches_and_split_with_a_seeded_conv_model():
    from cokit.bench.study.digits import DigitsWorkloadConfig
    from cokit.bench.study.digits_cnn import DigitsCNN, DigitsCNNWorkloadConfig

    cnn = DigitsCNNWorkloadConfig(batch_size=16).build("cpu")
    mlp = DigitsWorkloadConfig(batch_size=16).build("cpu")
    for rank in (0, 1):
        xa, ya = cnn.train_batch(5, 3, rank, 2)
        xb, yb = mlp.train_batch(5, 3, rank, 2)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert torch.equal(cnn.heldout_batches()[0][0], mlp.heldout_batches()[0][0])
    state = torch.get_rng_state()
    a, b, c = cnn.build_model(2), cnn.build_model(2), cnn.build_model(3)
    assert torch.equal(torch.get_rng_state(), state)
    assert isinstance(a, DigitsCNN) and a(xa).shape == (16, 10)
    shapes = {n: tuple(p.shape) for n, p in a.named_parameters()}
    assert shapes["conv2.weight"] == (64, 32, 3, 3) and shapes["head.weight"] == (10, 1024)
    for (name, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(p, q), name
        assert name.endswith("bias") or not torch.equal(p, r), name
    with torch.no_grad():
        loss = cnn.loss(a, cnn.heldout_batches()[0])
    assert abs(float(loss) - math.log(10)) < 0.2  # a small classifier starts near uniform
    assert cnn.info()["model"]["kind"] == "cnn"
    with pytest.raises(ValueError, match="two positive widths"):
        DigitsCNNWorkloadConfig(channels=(4, 0))
    with pytest.raises(ValueError, match="batch_size"):
        DigitsCNNWorkloadConfig(batch_size=0)


def test_the_digits_are_scikit_learns_read_without_importing_it():
    import subprocess
    import sys

    import numpy as np
    from sklearn.datasets import load_digits

    from cokit.bench.study.digits import load_digits_arrays

    x, y = load_digits_arrays()
    data = load_digits()
    assert np.array_equal(x, (data.data.astype(np.float32) / 8.0) - 1.0) and x.dtype == np.float32
    assert np.array_equal(y, data.target) and y.dtype == np.int64
    probe = "import sys; from cokit.bench.study.digits import load_digits_arrays as f; f(); print('sklearn' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr[-2000:]
