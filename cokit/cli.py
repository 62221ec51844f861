"""The ``cokit`` command line: one subcommand per module in ``cokit.commands``."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from cokit._source_tree import CheckoutOnlyError
from cokit.display import PLOT_EXTRA, have_matplotlib, matplotlib_missing

# Each module defines add_parser(subparsers) and sets `func` (args -> exit code).
SUBCOMMANDS = ("info", "occupancy", "demo", "sweep", "bench", "dashboard", "telemetry", "plan")
# Commands whose figures are their output: without matplotlib they refuse to start unless the
# option (its dest) that turns the figures off is given. (`cokit demo` and `cokit bench
# validate` skip their figures with a note instead.)
NEEDS_MATPLOTLIB = {"sweep": "no_plots"}


class CliError(Exception):
    """A user error: printed as one line, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    from cokit import __version__

    parser = argparse.ArgumentParser(
        prog="cokit",
        description="Triton kernels for compressed gradients and compute/communication overlap.",
    )
    parser.add_argument("--version", action="version", version=f"cokit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(f"cokit.commands.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """``cokit``: the entry point. Figures are written to files here (no display), so the
    matplotlib backend defaults to Agg unless the user chose one (``MPLBACKEND``)."""
    os.environ.setdefault("MPLBACKEND", "Agg")
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    # a command this install lacks (checkout_only) takes any arguments: it refuses to run anyway
    if unknown and not getattr(args, "checkout_only", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command is None:
        parser.print_help()
        return 2
    try:
        flag = NEEDS_MATPLOTLIB.get(args.command)
        if flag is not None and not getattr(args, flag, False) and not have_matplotlib():
            option = "--" + flag.replace("_", "-")
            raise CliError(
                f"its plots need matplotlib, which is not installed: {PLOT_EXTRA} (or pass {option})"
            )
        return int(args.func(args) or 0)
    except (CliError, CheckoutOnlyError) as exc:
        print(f"cokit {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        if not matplotlib_missing(exc):
            raise
        print(
            f"cokit {args.command}: error: it draws with matplotlib, not installed: {PLOT_EXTRA}",
            file=sys.stderr,
        )
        return 2
