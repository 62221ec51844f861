"""``cokit occupancy``: what a GEMM config does to occupancy, before running it.

    cokit occupancy --target sm_90 --dtype bf16 \\
        --config BLOCK_M=128,BLOCK_N=128,BLOCK_K=64,num_warps=8,num_stages=3,smem_bytes=115840

``--config`` is a comma-separated list of ``KEY=VALUE`` over the GemmConfig fields:
BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages, persistent (true/false), num_sms,
smem_bytes (bytes, or with a k suffix for KiB), maxnreg (cuda), waves_per_eu,
matrix_instr_nonkdim, kpack (hip). Unset fields keep the defaults. Without ``--target`` the
live GPU is used; with it, the kernel is compiled for that chip without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from cokit.cli import CliError

TARGETS = ("sm_80", "sm_90", "gfx90a", "gfx942")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``cokit occupancy``."""
    p = subparsers.add_parser(
        "occupancy",
        help="occupancy (blocks/SM, limiting resource) of a GEMM config on a GPU or a named target",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--target",
        default=None,
        help=f"chip to compile for without a GPU: {', '.join(TARGETS)} (default: the live GPU)",
    )
    p.add_argument(
        "--config",
        default="",
        metavar="SPEC",
        help="GEMM config, e.g. BLOCK_M=128,BLOCK_N=128,BLOCK_K=64,num_warps=8,num_stages=3,smem_bytes=98304",
    )
    p.add_argument("--dtype", default="bf16", help="input dtype: fp16, bf16, fp32 (default bf16)")
    p.add_argument("--precision", default="ieee", help="fp32 dot precision: ieee or tf32 (default ieee)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Parse the config, compile it, print its occupancy."""
    import torch

    from cokit.triton_kernels.backend import arch_limits, device_limits, interpreter_enabled
    from cokit.triton_kernels.gemm import PRECISIONS
    from cokit.triton_kernels.gemm_config import parse_config_spec, parse_dtype

    try:
        config = parse_config_spec(args.config)
        dtype = parse_dtype(args.dtype)
    except ValueError as exc:
        raise CliError(f"--config/--dtype: {exc}") from None
    if args.precision not in PRECISIONS:
        raise CliError(f"--precision {args.precision!r} is invalid; allowed: {', '.join(PRECISIONS)}")
    if args.target is not None:
        if args.target not in TARGETS:
            raise CliError(f"--target {args.target!r} is unknown; allowed: {', '.join(TARGETS)}")
        limits = arch_limits(args.target)
    elif torch.cuda.is_available():
        limits = device_limits()
    else:
        raise CliError(f"no GPU here; pass --target ({', '.join(TARGETS)}) to compile for a named chip")
    if limits.backend == "hip" and args.precision == "tf32" and dtype == torch.float32:
        raise CliError("--precision tf32 is not available on AMD GPUs; allowed there: ieee")
    try:
        config.validate(limits.backend, limits)
    except ValueError as exc:
        raise CliError(f"--config: {exc}") from None
    if interpreter_enabled():
        raise CliError(
            f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')} is set: compiling needs it unset "
            "(run `env -u TRITON_INTERPRET cokit occupancy ...`)"
        )

    from cokit.triton_kernels.gemm import gemm_occupancy
    from cokit.triton_kernels.occupancy import describe, shaping_table

    try:
        occ, built, used = gemm_occupancy(config, args.target, dtype, precision=args.precision)
    except ValueError as exc:  # e.g. smem_bytes below what the compiled kernel uses
        raise CliError(f"--config: {exc}") from None
    spills = getattr(built, "spills", None)
    shaping = shaping_table(occ, limits, used)
    if args.json:
        out = {
            "target": limits.target_name,
            "device": limits.name,
            "dtype": args.dtype,
            "precision": args.precision,
            "config": config.to_dict(),
            "kernel_shared_bytes": used,
            "spills": spills,
            **occ.to_dict(),
            "occupancy": occ.occupancy,
            "shaping": [{"blocks_per_sm": b, "smem_bytes": s} for b, s in shaping],
        }
        json.dump(out, sys.stdout, indent=1)
        print()
        return 0
    form = "persistent" if config.persistent else "tiled"
    print(f"kernel          GEMM {form}, {args.dtype}, precision {args.precision}")
    print(f"config          {config.spec()}")
    print(describe(occ, limits, used_shared=used, spills=spills))
    if shaping:
        unit = "CU" if limits.backend == "hip" else "SM"
        print(f"occupancy shaping (smem_bytes for fewer blocks/{unit}):")
        for blocks, smem in shaping:
            print(f"  {blocks:3d} blocks/{unit}  smem_bytes={smem}")
    return 0
