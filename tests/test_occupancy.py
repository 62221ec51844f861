"""Occupancy calculator vs hand-computed cases (the arithmetic is written out), and the
``cokit occupancy`` argument checks (the compiling runs are in test_gemm_compile.py)."""

from __future__ import annotations

import argparse

import pytest
import torch

from cokit.cli import CliError
from cokit.commands import occupancy as occupancy_cmd
from cokit.triton_kernels.backend import arch_limits
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
