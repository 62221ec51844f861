"""``cokit occupancy``: what GEMM configs do to occupancy, before running them.

    cokit occupancy --target sm_90 --dtype bf16 \\
        --config BLOCK_M=128,BLOCK_N=128,BLOCK_K=64,num_warps=8,num_stages=3,smem_bytes=115840
    cokit occupancy --target sm_90 --config BLOCK_M=128,BLOCK_N=128,BLOCK_K=64 \\
        --grid num_warps=4,8 --grid num_stages=3,4 --grid smem_bytes=none,115840

``--config`` is a comma-separated list of ``KEY=VALUE`` over the GemmConfig fields:
BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages, persistent (true/false), num_sms,
smem_bytes (bytes, or with a k suffix for KiB), maxnreg (cuda), waves_per_eu,
matrix_instr_nonkdim, kpack (hip). Unset fields keep the defaults. Repeat ``--config`` for
several configs; ``--grid KEY=V1,V2,...`` (repeatable, one axis each) varies fields over every
``--config``: the product is printed, one row per config (with one config, the full report
and the occupancy-shaping table follow). Without ``--target`` the live GPU is used; with
it, the kernel is compiled for that chip without a GPU.

Compiles are cached: what occupancy needs from each build (registers, shared memory, spills)
is kept in ``$COKIT_CACHE_DIR/compile/`` (default ``~/.cache/cokit/compile/``), keyed by the
Triton version, backend/arch/target, the kernel sources' hash, config, dtype and precision,
so asking again about a config skips the compiler. ``--no-cache`` compiles every config.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
import time
from typing import Any

from cokit.cli import CliError

TARGETS = ("sm_80", "sm_90", "gfx90a", "gfx942")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``cokit occupancy``."""
    p = subparsers.add_parser(
        "occupancy",
        help="occupancy (blocks/SM, limiting resource) of GEMM configs on a GPU or a named target",
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
        action="append",
        default=None,
        metavar="SPEC",
        help="GEMM config, e.g. BLOCK_M=128,BLOCK_N=128,BLOCK_K=64,num_warps=8,num_stages=3,smem_bytes=98304; "
        "repeat for several (default: the GemmConfig defaults)",
    )
    p.add_argument(
        "--grid",
        action="append",
        default=None,
        metavar="KEY=V1,V2",
        help="vary one config field over these values for every --config (repeat for more axes), "
        "e.g. --grid num_warps=4,8 --grid smem_bytes=none,96k",
    )
    p.add_argument("--dtype", default="bf16", help="input dtype: fp16, bf16, fp32 (default bf16)")
    p.add_argument("--precision", default="ieee", help="fp32 dot precision: ieee or tf32 (default ieee)")
    p.add_argument("--json", action="store_true", help="print JSON Lines (one object per config)")
    p.add_argument(
        "--no-cache", action="store_true", help="compile every config (neither read nor write the cache)"
    )
    p.set_defaults(func=run)
    return p


def expand_configs(specs: list[str] | None, grid: list[str] | None) -> list[Any]:
    """The configs of ``--config`` (each, in order) times every ``--grid`` axis, without
    duplicates; ``ValueError`` names the bad item."""
    from cokit.triton_kernels.gemm_config import parse_config_spec

    bases = [parse_config_spec(s) for s in (specs or [""])]
    axes: list[list[str]] = []
    for item in grid or []:
        key, sep, values = (s.strip() for s in item.partition("="))
        vals = [v.strip() for v in values.split(",") if v.strip()]
        if not sep or not key or not vals:
            raise ValueError(f"--grid {item!r} is not KEY=V1,V2,...; e.g. --grid num_warps=4,8")
        parse_config_spec(f"{key}={vals[0]}")  # an unknown key fails here, once
        axes.append([f"{key}={v}" for v in vals])
    out: list[Any] = []
    for base in bases:
        for combo in itertools.product(*axes):
            cfg = parse_config_spec(",".join(combo), base=base) if combo else base
            if cfg not in out:
                out.append(cfg)
    return out


def run(args: argparse.Namespace) -> int:
    """Parse and check every config, compile (or read from the cache), print occupancy."""
    import torch

    from cokit.triton_kernels.backend import arch_limits, device_limits, interpreter_enabled
    from cokit.triton_kernels.gemm import PRECISIONS
    from cokit.triton_kernels.gemm_config import parse_dtype

    try:
        configs = expand_configs(args.config, args.grid)
        dtype = parse_dtype(args.dtype)
    except ValueError as exc:
        raise CliError(f"--config/--grid/--dtype: {exc}") from None
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
    for config in configs:  # every config is checked before anything compiles
        try:
            config.validate(limits.backend, limits)
        except ValueError as exc:
            prefix = "--config" if len(configs) == 1 else f"--config {config.spec()}"
            raise CliError(f"{prefix}: {exc}") from None
    if interpreter_enabled():
        raise CliError(
            f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')} is set: compiling needs it unset "
            "(run `env -u TRITON_INTERPRET cokit occupancy ...`)"
        )

    from cokit.triton_kernels.compile_cache import CompileCache, gemm_occupancy_cached

    cache = CompileCache(enabled=not args.no_cache)
    rows: list[_Row] = []
    t_all = time.perf_counter()
    for config in configs:
        t0 = time.perf_counter()
        try:
            occ, facts, hit = gemm_occupancy_cached(
                config, args.target, dtype, precision=args.precision, cache=cache
            )
        except ValueError as exc:  # e.g. smem_bytes below what the compiled kernel uses
            if len(configs) == 1:
                raise CliError(f"--config: {exc}") from None
            rows.append(_Row(config, None, None, False, time.perf_counter() - t0, str(exc)))
            continue
        rows.append(_Row(config, occ, facts, hit, time.perf_counter() - t0))
    total_s = time.perf_counter() - t_all
    bad = [r for r in rows if r.error]

    if args.json:
        for r in rows:
            print(json.dumps(_record(args, limits, r)))
    else:
        _print_report(args, limits, configs, rows)
        hits = sum(1 for r in rows if r.cached)
        where = f"compile cache {cache.dir}" if cache.enabled else "compile cache off"
        print(
            f"{len(rows)} config(s) in {total_s:.2f} s: {hits} from the cache, "
            f"{len(rows) - hits - len(bad)} compiled ({where})"
        )
    sys.stdout.flush()
    if bad:
        raise CliError(
            f"{len(bad)} of {len(rows)} configs cannot launch as given (see their 'error'); "
            f"first: {bad[0].config.spec()}: {bad[0].error}"
        )
    return 0


@dataclasses.dataclass
class _Row:
    """One config's result: occupancy and kernel facts, or why it cannot launch."""

    config: Any
    occ: Any
    facts: Any
    cached: bool
    seconds: float
    error: str | None = None


def _unit(limits: Any) -> str:
    return "CU" if limits.backend == "hip" else "SM"


def _record(args: argparse.Namespace, limits: Any, r: _Row) -> dict[str, Any]:
    """One JSON object: the config, the kernel's use, the occupancy and how it was obtained."""
    from cokit.triton_kernels.occupancy import shaping_table

    out: dict[str, Any] = {
        "target": limits.target_name,
        "device": limits.name,
        "dtype": args.dtype,
        "precision": args.precision,
        "config": r.config.to_dict(),
    }
    if r.error is not None:
        return {**out, "error": r.error}
    occ, facts = r.occ, r.facts
    return {
        **out,
        "kernel_shared_bytes": facts.shared_bytes,
        "registers_per_thread": facts.registers,
        "spills": facts.spills,
        **occ.to_dict(),
        "occupancy": occ.occupancy,
        "shaping": [
            {"blocks_per_sm": b, "smem_bytes": s} for b, s in shaping_table(occ, limits, facts.shared_bytes)
        ],
        "compile": {"cached": r.cached, "seconds": round(r.seconds, 4)},
    }


def _print_report(args: argparse.Namespace, limits: Any, configs: list[Any], rows: list[_Row]) -> None:
    """The table (one row per config) and, for a single config, the full report."""
    from cokit.triton_kernels.occupancy import describe, shaping_table

    unit = _unit(limits)
    form = "/".join(sorted({"persistent" if c.persistent else "tiled" for c in configs}))
    print(
        f"kernel          GEMM {form}, {args.dtype}, precision {args.precision}; "
        f"target {limits.target_name} ({limits.name}, {limits.num_sms} {unit}s)"
    )
    head = ["config", "regs", "spills", "smem used", "smem/block", f"blocks/{unit}", f"warps/{unit}"]
    head += ["occupancy", "limited by", "compile"]
    table = [head]
    for r in rows:
        if r.error is not None:
            table.append([r.config.spec(), *["-"] * 7, "cannot launch (below)", "-"])
            continue
        occ, facts = r.occ, r.facts
        table.append(
            [
                r.config.spec(),
                "-" if facts.registers is None else str(facts.registers),
                "-" if facts.spills is None else str(facts.spills),
                str(facts.shared_bytes),
                str(occ.shared_bytes),
                str(occ.blocks_per_sm),
                f"{occ.warps_per_sm}/{occ.max_warps_per_sm}",
                f"{occ.occupancy:.1%}",
                ", ".join(occ.limited_by),
                f"{'cached' if r.cached else 'compiled'} {r.seconds:.2f} s",
            ]
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    left = (0, 8, 9)
    for row in table:
        cells = [
            c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        print("  ".join(cells).rstrip())
    for r in rows:
        if r.error is not None:
            print(f"error: {r.config.spec()}: {r.error}")
    if len(rows) == 1 and rows[0].error is None:
        r = rows[0]
        print()
        print(f"config          {r.config.spec()}")
        print(describe(r.occ, limits, used_shared=r.facts.shared_bytes, spills=r.facts.spills))
        shaping = shaping_table(r.occ, limits, r.facts.shared_bytes)
        if shaping:
            print(f"occupancy shaping (smem_bytes for fewer blocks/{unit}):")
            for blocks, smem in shaping:
                print(f"  {blocks:3d} blocks/{unit}  smem_bytes={smem}")
