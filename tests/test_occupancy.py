"""Occupancy calculator vs hand-computed cases (the arithmetic is written out), the
``cokit occupancy`` argument checks and config expansion, and the compile cache (its keys,
files and bad entries; real compiles are in test_gemm_compile.py and test_cli.py)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from cokit.cli import CliError
from cokit.commands import occupancy as occupancy_cmd
from cokit.triton_kernels import compile_cache as cc
from cokit.triton_kernels.backend import arch_limits
from cokit.triton_kernels.gemm_config import GemmConfig
from cokit.triton_kernels.occupancy import occupancy, smem_for_blocks

SM80, SM90 = arch_limits("sm_80"), arch_limits("sm_90")
GFX90A, GFX942 = arch_limits("gfx90a"), arch_limits("gfx942")


def test_sm90_bf16_128x128x64_3_stages():
    """The GEMM config 128x128x64, 8 warps, 3 stages in bf16 on sm_90: the compile-only
    build reports 98304 B of shared memory and 116 registers per thread."""
    occ = occupancy(num_warps=8, shared_bytes=98304, registers=116, limits=SM90)
    # shared: footprint = 98304 + 1024 reserved = 99328 B (776 * 128, already aligned);
    #         233472 B per SM // 99328 = 2   (3 * 99328 = 297984 > 233472)
    assert occ.blocks_by["shared memory"] == 233472 // (98304 + 1024) == 2
    # registers: 116 * 32 lanes = 3712 -> rounded up to 256: 3840 per warp;
    #            each of the 4 sub-partitions has 65536 / 4 = 16384: 16384 // 3840 = 4 warps;
    #            4 * 4 = 16 warps per SM // 8 warps per block = 2 blocks
    assert occ.blocks_by["registers"] == (4 * (16384 // 3840)) // 8 == 2
    # warps: 64 per SM // 8 = 8 blocks; hardware block limit: 32
    assert occ.blocks_by["warps"] == 64 // 8 == 8
    assert occ.blocks_by["blocks"] == 32
    assert occ.blocks_per_sm == 2
    assert occ.warps_per_sm == 2 * 8 == 16
    assert occ.occupancy == 16 / 64 == 0.25
    assert occ.limited_by == ("shared memory", "registers")
    assert occ.resident_blocks == 2 * 132


def test_sm90_smem_shaping_drops_to_one_block():
    """smem_bytes = 115840: footprint 115840 + 1024 = 116864 B (913 * 128);
    233472 // 116864 = 1 (2 * 116864 = 233728 > 233472)."""
    assert smem_for_blocks(SM90, 1) == 115840  # round_up(233472 // 2 + 1, 128) - 1024
    occ = occupancy(8, 115840, 116, SM90)
    assert occ.blocks_per_sm == 1 and occ.warps_per_sm == 8 and occ.occupancy == 8 / 64
    assert occ.limited_by == ("shared memory",)
    # one byte less than the footprint boundary still rounds up to the same 116864 B
    assert occupancy(8, 115713, 116, SM90).blocks_per_sm == 1
    # 115712 + 1024 = 116736 = 233472 / 2 exactly: two blocks still fit
    assert occupancy(8, 115712, 116, SM90).blocks_per_sm == 2


def test_sm80_register_limited():
    """4 warps, 49152 B shared, 248 registers (bf16 128x128x32, 4 stages, on sm_80)."""
    occ = occupancy(4, 49152, 248, SM80)
    # shared: (49152 + 1024) = 50176 = 392 * 128; 167936 // 50176 = 3
    assert occ.blocks_by["shared memory"] == 167936 // 50176 == 3
    # registers: 248 * 32 = 7936 = 31 * 256 per warp; 16384 // 7936 = 2 warps per sub-partition;
    #            2 * 4 = 8 warps // 4 = 2 blocks
    assert occ.blocks_by["registers"] == (4 * (16384 // 7936)) // 4 == 2
    assert occ.blocks_per_sm == 2 and occ.limited_by == ("registers",)
    assert occ.occupancy == 8 / 64


def test_sm80_registers_are_per_sub_partition():
    """200 registers: 200 * 32 = 6400 = 25 * 256 per warp. Counting the whole SM would give
    65536 // 6400 = 10 warps (5 blocks of 2 warps); each sub-partition holds only
    16384 // 6400 = 2 warps, so 4 * 2 = 8 warps -> 4 blocks of 2 warps."""
    occ = occupancy(2, 8192, 200, SM80)
    assert occ.blocks_by["registers"] == 4
    # shared: 8192 + 1024 = 9216 = 72 * 128; 167936 // 9216 = 18
    assert occ.blocks_by["shared memory"] == 18
    assert occ.blocks_per_sm == 4 and occ.warps_per_sm == 8


def test_gfx942_bf16_128x128x64_2_stages():
    """4 waves, 32768 B LDS, 188 VGPRs (bf16 128x128x64, 2 stages, on gfx942)."""
    occ = occupancy(4, 32768, 188, GFX942)
    # LDS: 32768 (64 * 512, aligned, no reserve); 65536 // 32768 = 2
    assert occ.blocks_by["shared memory"] == 65536 // 32768 == 2
    # VGPRs: 188 -> granule of 8: 192 per lane; a SIMD has 512 per lane: 512 // 192 = 2 waves;
    #        4 SIMDs * 2 = 8 waves // 4 waves per block = 2 blocks
    assert occ.blocks_by["registers"] == (4 * (512 // 192)) // 4 == 2
    # waves: 32 per CU (8 per SIMD) // 4 = 8
    assert occ.blocks_by["warps"] == 32 // 4 == 8
    assert occ.blocks_per_sm == 2 and occ.warps_per_sm == 8
    assert occ.occupancy == 8 / 32 == 0.25
    assert occ.limited_by == ("shared memory", "registers")
    assert occ.resident_blocks == 2 * 304


def test_gfx942_lds_shaping():
    """smem_bytes = 40960 (40 KiB): 65536 // 40960 = 1 block per CU."""
    occ = occupancy(4, 40960, 188, GFX942)
    assert occ.blocks_per_sm == 1 and occ.limited_by == ("shared memory",)
    # smallest aligned request for 1 block: round_up(65536 // 2 + 1, 512) = 33280
    assert smem_for_blocks(GFX942, 1) == 33280
    assert occupancy(4, 33280, 188, GFX942).blocks_per_sm == 1
    assert occupancy(4, 32768, 188, GFX942).blocks_per_sm == 2


def test_gfx90a_register_limited():
    """8 waves, 16384 B LDS, 96 VGPRs: LDS 65536 // 16384 = 4; VGPRs 512 // 96 = 5 waves per
    SIMD -> 20 per CU // 8 = 2 blocks; waves 32 // 8 = 4."""
    occ = occupancy(8, 16384, 96, GFX90A)
    assert occ.blocks_by == {"shared memory": 4, "registers": 2, "warps": 4, "blocks": 32}
    assert occ.blocks_per_sm == 2 and occ.occupancy == 16 / 32


def test_kernels_that_cannot_launch_get_zero_blocks():
    # 512 VGPRs: 1 wave per SIMD, 4 per CU < 8 waves of one block
    occ = occupancy(8, 16384, 512, GFX942)
    assert occ.blocks_per_sm == 0 and occ.limited_by == ("registers",)
    # more shared memory than a block may have
    occ = occupancy(4, 300_000, 64, SM90)
    assert occ.blocks_per_sm == 0 and occ.limited_by == ("shared memory",)
    # 32 wavefronts of 64 = 2048 threads > 1024
    assert occupancy(32, 0, 32, GFX942).blocks_per_sm == 0


def test_unknown_registers_are_not_counted():
    occ = occupancy(1, 0, None, SM80)
    assert "registers" not in occ.blocks_by
    # shared: 0 + 1024 reserved = 1024; 167936 // 1024 = 164; blocks limit 32 wins
    assert occ.blocks_by["shared memory"] == 164
    assert occ.blocks_per_sm == 32 and occ.limited_by == ("blocks",)


def test_occupancy_argument_errors():
    with pytest.raises(ValueError, match="num_warps=0 is invalid"):
        occupancy(0, 0, 32, SM90)
    with pytest.raises(ValueError, match="shared_bytes=-1 is invalid"):
        occupancy(4, -1, 32, SM90)
    with pytest.raises(ValueError, match="blocks=0 is invalid; allowed: 1 to 32"):
        smem_for_blocks(SM90, 0)
    with pytest.raises(ValueError, match="unknown target 'sm_75'"):
        arch_limits("sm_75")


# ---------------------------------------------------------------------- CLI argument checks
def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="cokit")
    occupancy_cmd.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["occupancy", *argv])
    return args.func(args)


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--target", "sm_90", "--config", "BLOCK_M=96"], "BLOCK_M=96 is invalid"),
        (["--target", "sm_90", "--config", "blocks=3"], "unknown config key 'blocks'"),
        (["--target", "sm_90", "--config", "waves_per_eu=2"], "waves_per_eu is an AMD"),
        (["--target", "gfx942", "--config", "maxnreg=128"], "maxnreg is an NVIDIA"),
        (["--target", "gfx942", "--config", "smem_bytes=100000"], "above the device limit of 65536"),
        (["--target", "sm_75"], "--target 'sm_75' is unknown; allowed: sm_80, sm_90, gfx90a, gfx942"),
        (["--target", "sm_90", "--dtype", "int8"], "dtype 'int8' is not supported"),
        (["--target", "sm_90", "--precision", "fp64"], "--precision 'fp64' is invalid"),
        (["--target", "gfx942", "--dtype", "fp32", "--precision", "tf32"], "tf32 is not available on AMD"),
        (["--target", "sm_90"], "TRITON_INTERPRET=1 is set"),  # tests run under the interpreter
        ([], "no GPU here; pass --target"),
    ],
)
def test_cli_errors_are_one_line(argv, match, monkeypatch):
    if not argv and torch.cuda.is_available():
        pytest.skip("checks the no-GPU message")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # as in CPU test runs; GPU runs leave it unset
    with pytest.raises(CliError, match=match) as info:
        _cli(argv)
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------------- many configs per call
def test_repeated_configs_are_all_kept_and_grids_expand():
    a, b = "BLOCK_M=64,BLOCK_N=64,BLOCK_K=32", "BLOCK_M=128,BLOCK_N=128,BLOCK_K=64"
    configs = occupancy_cmd.expand_configs([a, b], None)
    assert [(c.BLOCK_M, c.BLOCK_K) for c in configs] == [(64, 32), (128, 64)]
    configs = occupancy_cmd.expand_configs([a, b], ["num_warps=4,8", "smem_bytes=none,96k"])
    assert len(configs) == 8
    assert [(c.BLOCK_M, c.num_warps, c.smem_bytes) for c in configs[:4]] == [
        (64, 4, None),
        (64, 4, 98304),
        (64, 8, None),
        (64, 8, 98304),
    ]
    # duplicates (a grid value equal to the base's) appear once, in first-seen order
    assert len(occupancy_cmd.expand_configs([a, a], ["num_warps=4,4"])) == 1
    assert len(occupancy_cmd.expand_configs(None, None)) == 1  # the defaults
    for grid, match in (
        (["num_warps"], "not KEY=V1,V2"),
        (["num_warps="], "not KEY=V1,V2"),
        (["blocks=1,2"], "unknown config key 'blocks'"),
        (["num_warps=4,x"], "num_warps='x' is invalid"),
    ):
        with pytest.raises(ValueError, match=match):
            occupancy_cmd.expand_configs([a], grid)


def test_cli_checks_every_config_before_compiling(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    argv = ["--target", "sm_90", "--config", "BLOCK_M=64", "--config", "BLOCK_M=96"]
    with pytest.raises(CliError, match=r"--config BLOCK_M=96.*BLOCK_M=96 is invalid"):
        _cli(argv)
    with pytest.raises(CliError, match="--grid 'num_warps' is not KEY=V1,V2"):
        _cli(["--target", "sm_90", "--grid", "num_warps"])


# ---------------------------------------------------------------------- compile cache
FACTS = cc.KernelFacts("_gemm_kernel", "sm_90", 8, 98304, 116, 0)


class _Builder:
    def __init__(self, facts=FACTS):
        self.calls = 0
        self.facts = facts

    def __call__(self):
        self.calls += 1
        return self.facts


def test_compile_cache_builds_once_then_reads_disk(tmp_path):
    key = cc.gemm_cache_key(GemmConfig(), "sm_90", "bf16")
    build = _Builder()
    facts, hit = cc.CompileCache(tmp_path).get_or_build(key, build)
    assert (facts, hit, build.calls) == (FACTS, False, 1)
    files = list((tmp_path / "compile").glob("*.json"))
    assert len(files) == 1 and not list((tmp_path / "compile").glob(".*"))  # no temp file left
    doc = json.loads(files[0].read_text())
    assert doc["schema"] == cc.SCHEMA and doc["key"] == key and doc["facts"]["registers"] == 116
    # a new cache object (a second process): read from disk, no build
    facts, hit = cc.CompileCache(tmp_path).get_or_build(key, build)
    assert (facts, hit, build.calls) == (FACTS, True, 1)
    # disabled: always builds, never writes
    off = tmp_path / "off"
    facts, hit = cc.CompileCache(off, enabled=False).get_or_build(key, build)
    assert (hit, build.calls) == (False, 2) and not off.exists()


def test_compile_cache_dir_follows_cokit_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("COKIT_CACHE_DIR", str(tmp_path / "c"))
    assert cc.CompileCache().dir == tmp_path / "c" / "compile"


def test_compile_cache_key_covers_what_changes_the_build(monkeypatch):
    base = GemmConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)
    key = cc.gemm_cache_key(base, "sm_90", "bf16")
    assert key["triton"] and key["backend"] == "cuda" and key["arch"] == "90" and key["target"] == "sm_90"
    assert key["source"] == cc.kernel_source_hash() and len(key["source"]) == 64
    digest = cc.CompileCache.digest
    others = [
        cc.gemm_cache_key(base, "sm_80", "bf16"),
        cc.gemm_cache_key(base, "gfx942", "bf16"),
        cc.gemm_cache_key(base, "sm_90", "fp16"),
        cc.gemm_cache_key(base, "sm_90", "fp32", precision="tf32"),
        cc.gemm_cache_key(base.replace(num_warps=4), "sm_90", "bf16"),
        cc.gemm_cache_key(base.replace(num_stages=4), "sm_90", "bf16"),
        cc.gemm_cache_key(base.replace(persistent=True, num_sms=100), "sm_90", "bf16"),
    ]
    assert len({digest(k) for k in [key, *others]}) == 1 + len(others)
    # smem_bytes changes the launch footprint, not the binary: same build
    assert cc.gemm_cache_key(base.replace(smem_bytes=115840), "sm_90", "bf16") == key
    monkeypatch.setattr(cc, "TRITON_VERSION_STRING", "0.0.0-other")
    assert digest(cc.gemm_cache_key(base, "sm_90", "bf16")) != digest(key)
    monkeypatch.undo()
    monkeypatch.setattr(cc, "kernel_source_hash", lambda: "f" * 64)
    assert digest(cc.gemm_cache_key(base, "sm_90", "bf16")) != digest(key)


def test_compile_cache_rebuilds_bad_entries(tmp_path):
    key = cc.gemm_cache_key(GemmConfig(), "sm_90", "bf16")
    cache = cc.CompileCache(tmp_path)
    path = cache.path(key)
    path.parent.mkdir(parents=True)
    for bad in (
        "{not json",
        json.dumps({"schema": "other/9", "key": key, "facts": FACTS.to_dict()}),
        json.dumps({"schema": cc.SCHEMA, "key": {**key, "dtype": "fp16"}, "facts": FACTS.to_dict()}),
        json.dumps({"schema": cc.SCHEMA, "key": key, "facts": {**FACTS.to_dict(), "registers": "116"}}),
        json.dumps({"schema": cc.SCHEMA, "key": key, "facts": {"name": "k"}}),
    ):
        path.write_text(bad)
        build = _Builder()
        with pytest.warns(UserWarning, match="compile cache entry"):
            facts, hit = cc.CompileCache(tmp_path).get_or_build(key, build)
        assert (facts, hit, build.calls) == (FACTS, False, 1)
        assert json.loads(path.read_text())["facts"] == FACTS.to_dict()  # replaced


def test_compile_cache_unwritable_folder_warns_and_keeps_facts_in_memory(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    cache = cc.CompileCache(blocker)  # <file>/compile cannot be created
    key = cc.gemm_cache_key(GemmConfig(), "sm_90", "bf16")
    build = _Builder()
    with pytest.warns(UserWarning, match="could not write the compile cache"):
        assert cache.get_or_build(key, build) == (FACTS, False)
    assert cache.get_or_build(key, build) == (FACTS, True) and build.calls == 1


def test_shaped_occupancy_applies_smem_bytes_like_with_shared_memory():
    # the numbers of test_sm90_bf16_128x128x64_3_stages and the shaping test above
    assert cc.shaped_occupancy(FACTS, None, SM90).blocks_per_sm == 2
    occ = cc.shaped_occupancy(FACTS, 115840, SM90)
    assert occ.blocks_per_sm == 1 and occ.shared_bytes == 115840 and occ.limited_by == ("shared memory",)
    with pytest.raises(
        ValueError, match=r"smem_bytes=70000 is below the 98304 B .* allowed: 98304 to 232448"
    ):
        cc.shaped_occupancy(FACTS, 70000, SM90)
    with pytest.raises(ValueError, match="above the device limit of 232448"):
        cc.shaped_occupancy(FACTS, 300000, SM90)


def test_gemm_occupancy_cached_uses_the_cache_without_compiling(tmp_path, monkeypatch):
    """A stored entry answers without the compiler (which the interpreter would refuse)."""
    config = GemmConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3, smem_bytes=115840)
    cache = cc.CompileCache(tmp_path)
    cache.store(cc.gemm_cache_key(config, "sm_90", "bf16"), FACTS)

    def no_compile(*a, **k):
        raise AssertionError("compiled despite a cache entry")

    monkeypatch.setattr(cc, "_build_facts", no_compile)
    occ, facts, hit = cc.gemm_occupancy_cached(config, "sm_90", "bf16", cache=cache)
    assert hit and facts == FACTS and occ.blocks_per_sm == 1
