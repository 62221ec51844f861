"""``cokit bench``: the benchmarks, one subcommand each.

    cokit bench validate [--quick]     # DeMo vs AdamW vs SGD vs PowerSGD: curves, bytes, cost
    cokit bench gpu-check [--quick]    # benchmarks/gpu_check.py: kernels vs torch, speed
    cokit bench gemm [--quick]         # benchmarks/gemm_bench.py: GEMM correctness, TFLOP/s, occupancy

``validate`` writes its JSON, tables and plots to benchmarks/results/validation/ (full mode)
or benchmarks/out/validation-quick/ (--quick); see ``cokit bench validate --help``.
``gpu-check`` and ``gemm`` run the scripts in the checkout's benchmarks/ folder.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from cokit.cli import CliError


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``cokit bench`` and its subcommands."""
    p = subparsers.add_parser("bench", help="run a benchmark: validate, gpu-check, gemm",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="bench", metavar="BENCHMARK")
    p.set_defaults(func=lambda args: _usage(p))

    from cokit.validation.study import __doc__ as study_doc
    from cokit.validation.study import add_arguments

    v = sub.add_parser("validate", help="compression validation study (DeMo, AdamW, SGD, PowerSGD)",
                       description=study_doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(v)
    v.set_defaults(func=run_validate)

    g = sub.add_parser("gpu-check", help="benchmarks/gpu_check.py: every kernel vs torch, then speed")
    g.add_argument("--quick", action="store_true", help="smaller sizes")
    g.add_argument("--out", default=None, help="JSON output file (default benchmarks/out/gpu_check.json)")
    g.set_defaults(func=lambda args: _run_script("gpu_check", args))

    m = sub.add_parser("gemm", help="benchmarks/gemm_bench.py: GEMM correctness, TFLOP/s, occupancy sweep")
    m.add_argument("--quick", action="store_true", help="fewer shapes and sweep points")
    m.add_argument("--out", default=None, help="JSON output file (default benchmarks/out/gemm.json)")
    m.add_argument("--cache-dir", default=None, help="tuning cache directory (default $COKIT_CACHE_DIR)")
    m.set_defaults(func=lambda args: _run_script("gemm_bench", args))
    return p


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def run_validate(args: argparse.Namespace) -> int:
    """``cokit bench validate``: bad arguments are one-line errors; then run the study."""
    from cokit.validation.study import config_from_args, run_from_args

    cfg = None
    if not args.list_methods:
        try:
            cfg = config_from_args(args)
        except ValueError as exc:
            raise CliError(str(exc)) from None
    return run_from_args(args, cfg)


def benchmarks_dir() -> Path:
    """The checkout's benchmarks/ folder (next to the cokit package)."""
    path = Path(__file__).resolve().parents[2] / "benchmarks"
    if not path.is_dir():
        raise CliError(f"{path} not found: the benchmark scripts live in a cokit source checkout")
    return path


def _run_script(module: str, args: argparse.Namespace) -> int:
    """Import ``benchmarks/<module>.py`` (its folder on sys.path: the scripts import each other)
    and call its ``main(argv)``."""
    folder = benchmarks_dir()
    if not (folder / f"{module}.py").is_file():
        raise CliError(f"{folder / module}.py not found")
    argv = ["--quick"] if args.quick else []
    if args.out is not None:
        argv += ["--out", args.out]
    if getattr(args, "cache_dir", None) is not None:
        argv += ["--cache-dir", args.cache_dir]
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    return int(importlib.import_module(module).main(argv) or 0)
