"""``cokit.dashboard``: one self-contained HTML page from telemetry JSONL.

    from cokit.dashboard import build_dashboard
    build_dashboard(["demo_out"], "demo_out/dashboard.html")

Reads ``RUN_DIR/telemetry/<run>/rank<r>.jsonl`` (schema ``cokit.telemetry/1``, written by
:class:`cokit.telemetry.Monitor`) for every RUN_DIR, overlays all their runs, and writes one
HTML file with plotly.js inline: loss against step, wall time and bytes; the step-time split
with hidden communication; bytes and compression ratio; kernel configs and blocks per SM
beside the exposed-communication fraction; per-rank step time; tuner decisions. The panels
share one step axis (zoom, reset and hover move together; :mod:`cokit.dashboard.axes` makes
the log-axis, sync-marker and first-step-outlier decisions). :func:`figures` gives the same
panels as plotly figures (for a notebook), and :func:`inline_frame` a written page as HTML a
notebook shows inline that keeps the page itself.
"""

from __future__ import annotations

import html
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from cokit.dashboard.panels import Panel, build_panels
from cokit.dashboard.reader import Telemetry, TelemetryError, check_run_dirs, load_telemetry
from cokit.dashboard.series import RunSeries, run_series

__all__ = [
    "DEFAULT_MAX_POINTS",
    "Panel",
    "Telemetry",
    "TelemetryError",
    "build_dashboard",
    "figures",
    "inline_frame",
    "load_telemetry",
    "render_html",
]

#: points per line before a long run is averaged into buckets (keeps big runs' pages small)
DEFAULT_MAX_POINTS = 2000


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def figures(
    telemetry: Telemetry | Sequence[str | os.PathLike] | str | os.PathLike,
    *,
    max_points: int = DEFAULT_MAX_POINTS,
) -> list[Panel]:
    """The dashboard's panels (each with a plotly ``figure``) for telemetry or RUN_DIRs."""
    if not isinstance(telemetry, Telemetry):
        telemetry = load_telemetry(telemetry)
    return build_panels([run_series(r) for r in telemetry.runs], max_points=max_points)


def inline_frame(page: str | os.PathLike, *, height: int = 720) -> str:
    """HTML for a notebook (``IPython.display.HTML``) that shows the dashboard page ``page``
    inline: an ``<iframe>`` whose ``srcdoc`` holds the page itself (plotly.js included), so the
    saved output still shows it after the notebook or the page's file moves, or on another
    machine; an ``IFrame`` of the file's path breaks then. ``height`` is in pixels."""
    if isinstance(height, bool) or not isinstance(height, int) or not 100 <= height <= 10_000:
        raise ValueError(f"inline_frame: height must be an integer from 100 to 10000 pixels, got {height!r}")
    path = Path(page)
    if not path.is_file():
        raise FileNotFoundError(
            f"inline_frame: no dashboard page at {path}; write one first with build_dashboard(run_dirs, out)"
        )
    text = path.read_text(encoding="utf-8")
    return (
        f'<iframe srcdoc="{html.escape(text, quote=True)}" width="100%" height="{height}" '
        'style="border: 0"></iframe>'
    )


def render_html(
    telemetry: Telemetry, *, max_points: int = DEFAULT_MAX_POINTS, title: str = "cokit dashboard"
) -> str:
    """The dashboard page for already-loaded telemetry, as one HTML string."""
    from cokit.dashboard.page import render_page

    series: list[RunSeries] = [run_series(r) for r in telemetry.runs]
    panels = build_panels(series, max_points=max_points)
    return render_page(telemetry, series, panels, max_points=max_points, title=title)


def build_dashboard(
    run_dirs: Sequence[str | os.PathLike] | str | os.PathLike,
    out: str | os.PathLike,
    *,
    overwrite: bool = False,
    max_points: int = DEFAULT_MAX_POINTS,
    title: str = "cokit dashboard",
    log: Callable[[str], None] | None = _stderr,
) -> Path:
    """Write the dashboard of ``run_dirs`` to ``out`` (atomically) and return its path.

    ``out`` is checked first (a folder, an unwritable place, or an existing file without
    ``overwrite`` raise :class:`cokit.files.OutputError` before anything is read). Unreadable
    lines are skipped and reported through ``log`` (stderr by default); no usable telemetry
    raises :class:`TelemetryError`.
    """
    from cokit.files import atomic_write_text, prepare_out_file

    if isinstance(run_dirs, (str, os.PathLike)):
        run_dirs = [run_dirs]
    check_run_dirs(run_dirs)
    path = prepare_out_file(out, overwrite=overwrite)
    telemetry = load_telemetry(run_dirs)
    if telemetry.skipped and log is not None:
        log(f"skipped {telemetry.skipped_count} unreadable telemetry line(s):")
        for s in telemetry.skipped:
            log(f"  {s.describe()}")
    atomic_write_text(path, render_html(telemetry, max_points=max_points, title=title))
    return path
