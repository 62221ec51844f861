"""``cokit bench``: the benchmarks, one subcommand each.

    cokit bench validate [--quick]     # DeMo vs AdamW vs SGD vs PowerSGD: curves, bytes, cost
    cokit bench gpu-check [--quick]    # cokit.bench.gpu_check: kernels vs torch, speed (needs a GPU)
    cokit bench gemm [--quick]         # cokit.bench.gemm_bench: GEMM correctness, TFLOP/s, occupancy
    cokit bench resilience [--quick]   # cokit.bench.resilience: training on shaped links (netns + tc)

``validate`` writes its JSON, tables and plots to benchmarks/results/validation/ (full mode)
or benchmarks/out/validation-quick/ (--quick); see ``cokit bench validate --help``.
``gpu-check``, ``gemm`` and ``resilience`` run the modules of ``cokit.bench``, the checkout's
benchmarks/ folder; ``gpu-check`` is ``python -m cokit.bench.gpu_check``.

The wheel leaves the benchmarks and the study's own workloads out: installed from it, only
``validate --on`` (calibration on your model) runs; the others say they need a source checkout.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from cokit._source_tree import CheckoutOnlyError, checkout_module
from cokit.cli import CliError


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``cokit bench`` and its subcommands."""
    p = subparsers.add_parser(
        "bench",
        help="run a benchmark: validate, gpu-check, gemm, resilience",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="bench", metavar="BENCHMARK")
    p.set_defaults(func=lambda args: _usage(p))

    from cokit.validation.cli import __doc__ as validate_doc
    from cokit.validation.cli import add_arguments

    v = sub.add_parser(
        "validate",
        help="compression validation study (DeMo, AdamW, SGD, PowerSGD)",
        description=validate_doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(v)
    v.set_defaults(func=run_validate)

    g = sub.add_parser(
        "gpu-check",
        help="every kernel vs torch, then speed (python -m cokit.bench.gpu_check)",
        description="Run cokit.bench.gpu_check; see python -m cokit.bench.gpu_check --help.",
    )
    g.add_argument("--quick", action="store_true", help="smaller sizes (< 3 min on one H200)")
    g.add_argument(
        "--out",
        default=None,
        help="folder for gpu_check.json and gpu_check.log (default benchmarks/out/gpu_check); "
        "checked before any phase runs and refused when it holds an earlier check's results",
    )
    g.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an earlier check's results in --out (default: refuse such a folder)",
    )
    g.add_argument(
        "--allow-cpu", action="store_true", help="without a GPU, run the torch reference path on CPU"
    )
    g.add_argument("--only", nargs="+", default=None, metavar="PHASE", help="run only these phases")
    g.set_defaults(func=lambda args: _run_module("gpu_check", args, "cokit bench gpu-check"))

    m = sub.add_parser("gemm", help="cokit.bench.gemm_bench: GEMM correctness, TFLOP/s, occupancy sweep")
    m.add_argument("--quick", action="store_true", help="fewer shapes and sweep points")
    m.add_argument(
        "--out",
        default=None,
        help="JSON output file (default benchmarks/out/gemm.json); an existing one is refused",
    )
    m.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    m.add_argument("--cache-dir", default=None, help="tuning cache directory (default $COKIT_CACHE_DIR)")
    m.set_defaults(func=lambda args: _run_module("gemm_bench", args, "cokit bench gemm"))

    about = "cokit.bench.resilience: each network policy against its static settings on shaped links"
    try:
        resilience = checkout_module("cokit.bench.resilience", "cokit bench resilience")
    except CheckoutOnlyError as exc:
        # parsed without its options (cokit.cli.main lets such a command take any) and refused
        r = sub.add_parser("resilience", help=about, description=str(exc))
        r.set_defaults(func=_refuse(exc), checkout_only=True)
        return p
    r = sub.add_parser(
        "resilience",
        help=about,
        description=resilience.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    resilience.add_arguments(r)
    r.set_defaults(func=resilience.run)
    return p


def _refuse(exc: CheckoutOnlyError) -> Callable[[argparse.Namespace], int]:
    """A command function that raises ``exc`` (a command this install does not have)."""

    def run(args: argparse.Namespace) -> int:
        raise exc

    return run


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def run_validate(args: argparse.Namespace) -> int:
    """``cokit bench validate``: bad arguments are one-line errors; then run the study."""
    from cokit.files import prepare_out_dir
    from cokit.validation.cli import config_from_args, run_from_args

    cfg = None
    if not args.list_methods:
        try:
            cfg = config_from_args(args)
            # checked before any run; no refusal of an existing folder: the study resumes
            # from the finished runs it holds (runs/*.json) by design
            prepare_out_dir(cfg.out_dir, (), overwrite=True)
        except ValueError as exc:  # OutputError is one
            raise CliError(str(exc)) from None
    return run_from_args(args, cfg)


def _run_module(module: str, args: argparse.Namespace, command: str) -> int:
    """Import ``cokit.bench.<module>`` and call its ``main(argv)`` with the given options
    (:class:`CheckoutOnlyError` from a wheel install)."""
    try:
        mod = checkout_module(f"cokit.bench.{module}", command)
    except CheckoutOnlyError:
        raise
    except ImportError as exc:
        raise CliError(f"cannot import cokit.bench.{module}: {exc}") from None
    argv = ["--quick"] if args.quick else []
    if args.out is not None:
        argv += ["--out", args.out]
    if getattr(args, "cache_dir", None) is not None:
        argv += ["--cache-dir", args.cache_dir]
    if getattr(args, "allow_cpu", False):
        argv.append("--allow-cpu")
    if getattr(args, "only", None):
        argv += ["--only", *args.only]
    if getattr(args, "overwrite", False):
        argv.append("--overwrite")
    return int(mod.main(argv) or 0)
