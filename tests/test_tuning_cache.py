"""The GEMM tuning cache survives what real machines do to it: non-UTF-8 or corrupt files,
invalid entries, an unwritable cache folder, and several processes storing at once."""

import json
import multiprocessing as mp
import warnings
from pathlib import Path

import pytest
import torch

from cokit.triton_kernels.gemm_config import GemmConfig, config_space
from cokit.triton_kernels.tuning_cache import TuningCache, autotune, validate_entry

KEY = TuningCache.key("NVIDIA H200", torch.bfloat16, 4096, 4096, 4096)  # tiled form
GOOD = GemmConfig(BLOCK_M=64, BLOCK_N=128, BLOCK_K=32, num_warps=8)


def _write(folder, entries):
    (folder / TuningCache.FILENAME).write_text(json.dumps({"version": 1, "entries": entries}))


def test_non_utf8_file_is_ignored_on_load_and_replaced_on_store(tmp_path):
    path = tmp_path / TuningCache.FILENAME
    path.write_bytes(b'{"entries": {"\xff\xfe": 1}}')
    cache = TuningCache(tmp_path)
    with pytest.warns(UserWarning, match="not UTF-8"):
        assert cache.load(KEY) is None
    with pytest.warns(UserWarning, match="not UTF-8"):
        assert cache.store(KEY, GOOD, time_ms=1.0) is True
    assert json.loads(path.read_text("utf-8"))["entries"][KEY]["config"] == GOOD.to_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the replaced file reads cleanly
        assert TuningCache(tmp_path).load(KEY) == GOOD


@pytest.mark.parametrize(
    "entry, needle",
    [
        ({"config": {**GOOD.to_dict(), "BLOCK_M": -1}}, "BLOCK_M=-1"),
        ({"config": {**GOOD.to_dict(), "BLOCK_M": 100}}, "BLOCK_M=100"),
        ({"config": {**GOOD.to_dict(), "BLOCK_N": "128"}}, "BLOCK_N='128'"),
        ({"config": {**GOOD.to_dict(), "num_warps": True}}, "num_warps=True"),
        ({"config": {**GOOD.to_dict(), "num_warps": 3}}, "num_warps=3"),
        ({"config": {**GOOD.to_dict(), "num_stages": 0}}, "num_stages=0"),
        ({"config": {**GOOD.to_dict(), "persistent": 1}}, "persistent=1"),
        ({"config": {**GOOD.to_dict(), "smem_bytes": -5}}, "smem_bytes=-5"),
        ({"config": {**GOOD.to_dict(), "BLOCK_Q": 1}}, "BLOCK_Q"),
        ({"config": {k: v for k, v in GOOD.to_dict().items() if k != "BLOCK_K"}}, "lacks BLOCK_K"),
        ({"time_ms": 1.0}, "missing 'config'"),
        ({"config": [64, 64, 32]}, "not an object"),
        ("BLOCK_M=64", "expected an object"),
        ({"config": GOOD.replace(persistent=True).to_dict()}, "form 'tiled'"),
        ({"config": GOOD.to_dict(), "time_ms": float("nan")}, "time_ms"),
        ({"config": GOOD.to_dict(), "time_ms": "fast"}, "time_ms"),
    ],
)
def test_invalid_entry_is_ignored_with_a_warning_naming_the_key(tmp_path, entry, needle):
    other = TuningCache.key("NVIDIA H200", torch.float16, 64, 64, 64)
    _write(tmp_path, {KEY: entry, other: {"config": GOOD.to_dict(), "time_ms": 0.5}})
    cache = TuningCache(tmp_path)
    with pytest.warns(UserWarning, match="bad tuning cache entry") as rec:
        assert cache.load(KEY) is None
    message = str(rec[0].message)
    assert KEY in message and needle in message, message
    assert cache.load(other) == GOOD  # the valid neighbour still loads
    # autotune does not trust it either: it tunes again and replaces the entry
    configs = config_space("cuda")[:2]
    with pytest.warns(UserWarning, match="bad tuning cache entry"):
        best, timings = autotune(configs, lambda cfg: None, lambda fn: 1.0, cache=cache, key=KEY)
    assert best == configs[0] and len(timings) == 2
    assert TuningCache(tmp_path).load(KEY) == configs[0]


def test_store_refuses_an_entry_load_would_reject(tmp_path):
    cache = TuningCache(tmp_path)
    cache.store(KEY, GOOD)
    before = cache.path.read_bytes()
    with pytest.raises(ValueError, match="BLOCK_M=-1"):
        cache.store(KEY, GOOD.replace(BLOCK_M=-1))
    with pytest.raises(ValueError, match="form 'tiled'"):
        cache.store(KEY, GOOD.replace(persistent=True))
    with pytest.raises(ValueError, match="time_ms"):
        cache.store(KEY, GOOD, time_ms=float("inf"))
    assert cache.path.read_bytes() == before


def test_validate_entry_accepts_every_vendor_space():
    for backend in ("cuda", "hip"):
        for persistent in (False, True):
            key = TuningCache.key("dev", torch.float16, 1, 1, 1, persistent)
            for cfg in config_space(backend, persistent):
                assert validate_entry(key, {"config": cfg.to_dict(), "time_ms": 0.1}) == cfg


@pytest.mark.parametrize("kind", ["under-a-file", "proc"])
def test_unwritable_cache_dir_warns_and_keeps_the_result_in_memory(tmp_path, monkeypatch, kind):
    if kind == "under-a-file":
        blocker = tmp_path / "file"
        blocker.write_text("not a folder")
        folder = blocker / "cache"
    else:  # /proc refuses new folders, even to root (tests run as root: chmod stops nothing)
        folder = Path("/proc") / f"cokit-test-{tmp_path.name}" / "cache"
    monkeypatch.setenv("COKIT_CACHE_DIR", str(folder))
    configs = config_space("cuda")[:3]
    timed: list[GemmConfig] = []

    def bench(fn):
        fn()
        return float(len(timed))  # 1, 2, 3: the first config wins

    with pytest.warns(UserWarning, match="could not save the tuned GEMM config") as rec:
        best, timings = autotune(configs, timed.append, bench, cache=TuningCache(), key=KEY)
    message = str(rec[0].message)
    assert KEY in message and str(folder) in message and "COKIT_CACHE_DIR" in message
    assert best == configs[0] and len(timings) == 3  # tuning finished and its result came back
    # this process reuses the winner (a fresh cache object, as gemm() makes per call)
    best2, timings2 = autotune(configs, timed.append, bench, cache=TuningCache(), key=KEY)
    assert best2 == best and timings2 == {} and len(timed) == 3
    assert not folder.exists()


def _store_many(folder, worker, count, barrier):
    """Spawned writer: wait for every writer, then store ``count`` distinct keys."""
    cache = TuningCache(folder)
    barrier.wait()
    for j in range(count):
        key = TuningCache.key(f"dev{worker}", torch.float16, 2 ** (j + 4), 64, 64)  # distinct buckets
        assert cache.store(key, GOOD, time_ms=float(j), worker=worker)


@pytest.mark.timeout(600)
def test_concurrent_writers_lose_no_update(tmp_path):
    writers, each = 8, 10
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(writers)
    procs = [ctx.Process(target=_store_many, args=(tmp_path, w, each, barrier)) for w in range(writers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=500)
    assert [p.exitcode for p in procs] == [0] * writers
    entries = TuningCache(tmp_path).entries()
    assert len(entries) == writers * each
    assert sorted({e["worker"] for e in entries.values()}) == list(range(writers))
    cache = TuningCache(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert all(cache.load(k) == GOOD for k in entries)
    leftovers = sorted(p.name for p in tmp_path.iterdir())
    assert leftovers == [TuningCache.FILENAME, TuningCache.LOCK_FILENAME]  # no temp files
