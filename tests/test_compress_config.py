"""Launch configs of the compression kernels: validation, the per-vendor spaces and their
pruning, device-fit checks, and tuning through the shared JSON cache (fake timer, no GPU)."""

import dataclasses
import json
import warnings

import pytest
import torch

from cokit.triton_kernels import compress_config as cc
from cokit.triton_kernels import tiling
from cokit.triton_kernels.backend import arch_limits
from cokit.triton_kernels.tuning_cache import TuningCache, autotune, entry_kind, validate_entry

H200 = arch_limits("sm_90")


def test_config_round_trip_and_spec():
    cfg = cc.KernelConfig(num_warps=8, num_stages=1, dot_precision="tf32x3")
    assert cfg.spec() == "w8s1-tf32x3"
    assert cfg.launch_options() == {"num_warps": 8, "num_stages": 1}
    assert cc.KernelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


@pytest.mark.parametrize(
    "fields, needle",
    [
        ({"num_warps": 3, "num_stages": 1, "dot_precision": "ieee"}, "num_warps=3"),
        ({"num_warps": True, "num_stages": 1, "dot_precision": "ieee"}, "num_warps=True"),
        ({"num_warps": 4, "num_stages": 0, "dot_precision": "ieee"}, "num_stages=0"),
        ({"num_warps": 4, "num_stages": 1, "dot_precision": "fp64"}, "dot_precision='fp64'"),
        ({"num_warps": 4, "num_stages": 1}, "lacks dot_precision"),
        ({"num_warps": 4, "num_stages": 1, "dot_precision": "ieee", "BLOCK_M": 64}, "BLOCK_M"),
    ],
)
def test_bad_config_is_rejected_with_the_field(fields, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        cc.KernelConfig.from_dict(fields)


def test_vendor_spaces_and_defaults():
    for kernel in cc.KERNELS:
        for mode, two_d, rows, width in tiling.compile_blocks():
            cuda = cc.config_space(kernel, "cuda", (rows, width), two_d=two_d)
            hip = cc.config_space(kernel, "hip", (rows, width), two_d=two_d)
            assert {c.dot_precision for c in cuda} == {"tf32x3"} and {c.dot_precision for c in hip} == {
                "ieee"
            }
            # what compiles without spills (tests/test_compile_targets.py): on NVIDIA the
            # fused 2-D encode spills at 4 warps and at 16, the fused 1-D decode at 4; on AMD
            # every kernel is VGPR- and SGPR-clean at 4 and 8 waves, the decode starts at 8
            cuda_warps = {
                ("ef_encode", "2d"): [8],
                ("ef_encode", "1d"): [4, 8],
                ("ef_decode", "1d"): [8, 16],
            }.get((kernel, mode), [4, 8, 16])
            hip_warps = {"ef_decode": [8, 4]}.get(kernel, [4, 8])
            assert [c.num_warps for c in cuda] == cuda_warps and [c.num_warps for c in hip] == hip_warps
            assert cuda == cc.config_space(kernel, "cuda", (rows, width), 90, two_d)
            # per chip: sm_80's mma.sync spills at tf32x3, so it takes the hand-split bf16x6,
            # first at 4 warps (2 blocks per SM) except for the fused 1-D decode (8 or 16
            # warps); AMD is ieee everywhere
            sm80_warps = [8, 16] if (kernel, mode) == ("ef_decode", "1d") else [4, 8, 16]
            assert cc.config_space(kernel, "cuda", (rows, width), 80, two_d) == [
                cc.KernelConfig(w, 1, "bf16x6") for w in sm80_warps
            ]
            assert {c.dot_precision for c in cc.config_space(kernel, "hip", (rows, width), "gfx942")} == {
                "ieee"
            }
        assert cc.interpreter_config(kernel) == cc.KernelConfig(4, 1, "ieee")
    with pytest.raises(ValueError, match="unknown compression kernel"):
        cc.config_space("gemm", "cuda", (64, 64))
    with pytest.raises(ValueError, match="backend 'xla'"):
        cc.config_space("dct_encode", "xla", (64, 64))
    with pytest.raises(ValueError, match="BLOCK_W=48"):
        cc.config_space("dct_encode", "cuda", (64, 48))


def test_large_blocks_get_more_warps_or_a_clear_error():
    # a 128x128 block needs more registers per thread than 4 or 8 warps give
    big = cc.config_space("dct_encode", "cuda", (128, 128))
    assert [c.num_warps for c in big] == [16]
    # the fused encode's 128x128 build stages 256 KiB in shared memory (compiled for sm_90):
    # more than any NVIDIA chip has
    assert cc.estimate_shared_bytes("ef_encode", (128, 128), "cuda") == 262144
    with pytest.raises(ValueError, match="use a smaller chunk"):
        cc.config_space("ef_encode", "cuda", (128, 128))
    with pytest.raises(ValueError, match="use a smaller chunk"):
        cc.config_space("ef_encode", "hip", (256, 256))


def test_check_fits_names_the_limit():
    cfg = cc.KernelConfig(4, 1, "tf32x3")
    cc.check_fits("dct_encode", cfg, (64, 64), H200)
    with pytest.raises(ValueError, match="registers per thread"):
        cc.check_fits("dct_encode", cfg, (128, 128), H200)
    with pytest.raises(ValueError, match="does not compile on hip"):
        cc.check_fits("dct_encode", cfg, (64, 64), arch_limits("gfx942"))
    with pytest.raises(ValueError, match="num_warps=32 is not allowed on hip"):
        cc.check_fits("dct_encode", cc.KernelConfig(32, 1, "ieee"), (64, 64), arch_limits("gfx942"))
    small = dataclasses.replace(H200, max_threads_per_block=128)
    with pytest.raises(ValueError, match="256 threads per block exceed the limit of 128"):
        cc.check_fits("dct_encode", cc.KernelConfig(8, 1, "tf32x3"), (64, 64), small)
    with pytest.raises(ValueError, match="shared memory"):
        cc.check_fits("ef_encode", cc.KernelConfig(16, 1, "ieee"), (128, 128), arch_limits("gfx942"))


def test_cpu_selects_the_interpreter_config(tmp_path):
    cfg = cc.select_config("dct_encode", (64, 64), torch.device("cpu"), cache_dir=tmp_path)
    assert cfg == cc.interpreter_config("dct_encode")
    assert not (tmp_path / TuningCache.FILENAME).exists()


def _select(tmp_path, tune, bench, name="Fake GPU"):
    return cc.select_config(
        "dct_encode",
        (64, 64),
        torch.device("cpu"),
        tune,
        cache_dir=tmp_path,
        bench=bench,
        limits=H200,
        device_name=name,
    )


def test_tuning_times_every_config_and_stores_the_winner(tmp_path, monkeypatch):
    monkeypatch.setattr(cc, "_SELECTED", {})
    ran = []
    times = {4: 2.0, 8: 1.0, 16: 1.5}
    cfg = _select(tmp_path, ran.append, lambda fn: (fn(), times[ran[-1].num_warps])[1])
    assert cfg.num_warps == 8 and [c.num_warps for c in ran] == [4, 8, 16]
    key = cc.cache_key("dct_encode", "Fake GPU", (64, 64))
    assert entry_kind(key) == "compress"
    entries = json.loads((tmp_path / TuningCache.FILENAME).read_text())["entries"]
    assert entries[key]["config"] == cfg.to_dict() and entries[key]["time_ms"] == 1.0
    assert cc.selected_configs("dct_encode") == {"2d|64x64": "w8s1-tf32x3"}
    # a new process (empty memo) reads the winner back without timing anything
    monkeypatch.setattr(cc, "_SELECTED", {})
    assert _select(tmp_path, lambda c: pytest.fail("tuned again"), lambda fn: 0.0) == cfg
    # the same file keeps GEMM entries working next to compression entries
    assert TuningCache(tmp_path).load(key) == cfg


def test_without_tune_the_default_is_used_and_nothing_stored(tmp_path, monkeypatch):
    monkeypatch.setattr(cc, "_SELECTED", {})
    cfg = _select(tmp_path, None, lambda fn: pytest.fail("timed"))
    assert cfg == cc.config_space("dct_encode", "cuda", (64, 64))[0]
    assert cc.selected_configs("dct_encode") == {"2d|64x64": f"{cfg.spec()} (default)"}
    assert not (tmp_path / TuningCache.FILENAME).exists()


@pytest.mark.parametrize(
    "entry, needle",
    [
        ({"config": {"num_warps": 3, "num_stages": 1, "dot_precision": "tf32x3"}}, "num_warps=3"),
        ({"config": {"num_warps": 4, "num_stages": 1}}, "lacks dot_precision"),
        ({"time_ms": 1.0}, "missing 'config'"),
        ({"config": {"num_warps": 4, "num_stages": 1, "dot_precision": "ieee"}, "time_ms": -1}, "time_ms"),
    ],
)
def test_invalid_entry_is_ignored_with_a_warning_and_retuned(tmp_path, monkeypatch, entry, needle):
    monkeypatch.setattr(cc, "_SELECTED", {})
    key = cc.cache_key("dct_encode", "Fake GPU", (64, 64))
    doc = {"version": 1, "entries": {key: entry}}
    (tmp_path / TuningCache.FILENAME).write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=needle):
        validate_entry(key, entry)
    with pytest.warns(UserWarning, match="bad tuning cache entry") as rec:
        cfg = _select(tmp_path, lambda c: None, lambda fn: 1.0)
    assert key in str(rec[0].message)
    assert cfg == cc.config_space("dct_encode", "cuda", (64, 64))[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the re-tuned entry replaced the bad one
        assert TuningCache(tmp_path).load(key) == cfg


def test_stored_config_outside_the_space_is_ignored(tmp_path, monkeypatch):
    monkeypatch.setattr(cc, "_SELECTED", {})
    key = cc.cache_key("dct_encode", "Fake GPU", (64, 64))
    TuningCache(tmp_path).store(key, cc.KernelConfig(4, 1, "ieee"))  # valid, but not shipped for cuda
    with pytest.warns(UserWarning, match="not in this version's space"):
        cfg = _select(tmp_path, lambda c: None, lambda fn: 1.0)
    assert cfg.dot_precision == "tf32x3"


def test_autotune_skips_configs_that_fail(tmp_path):
    configs = cc.config_space("dct_encode", "cuda", (64, 64))

    def run(cfg):
        if cfg.num_warps != 8:
            raise RuntimeError("out of resources")

    best, timings = autotune(configs, run, lambda fn: (fn(), 1.0)[1])
    assert best.num_warps == 8 and list(timings) == ["w8s1-tf32x3"]
