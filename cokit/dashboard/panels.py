"""The dashboard's panels: one plotly figure each, every run overlaid in its own color.

Times are shown in milliseconds. Each run keeps one color on every panel (its legend group,
so clicking a run in one legend hides it in that figure); components of the step-time split
use their own fixed colors instead, one subplot per run.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.subplots import make_subplots

from cokit.dashboard.axes import first_step_range, log_axis, step_range, sync_steps
from cokit.dashboard.series import RunSeries, downsample

#: one color per run, in the order the runs are given
RUN_COLORS = qualitative.Plotly + qualitative.D3
#: step-time components (compute, encode, decode, exposed comm, hidden comm)
PART_COLORS = {
    "compute": "#4c78a8",
    "encode": "#f2b447",
    "decode": "#e8853a",
    "exposed": "#d6404e",
    "hidden": "rgba(120,120,120,0.9)",
}
TUNER_SYMBOLS = {
    "explore": "diamond",
    "trial": "circle-open",
    "lock": "star",
    "drift": "triangle-up",
    "reject": "x",
}
MS = 1e3


@dataclass
class Panel:
    """One section of the page: an id, a title, a short note, and the figure. ``step_axes``
    names the figure's x axes (``"xaxis"``, ``"xaxis2"``, ...) whose x is the step: the page
    links them across panels (zoom, reset, hover)."""

    key: str
    title: str
    figure: go.Figure
    note: str = ""
    step_axes: tuple[str, ...] = ()


def run_color(index: int) -> str:
    return RUN_COLORS[index % len(RUN_COLORS)]


def _shade(color: str, t: float) -> str:
    """``color`` (#rrggbb) mixed towards white by ``t`` in [0, 1): per-rank lines of one run."""
    r, g, b = (int(color[i : i + 2], 16) for i in (1, 3, 5))
    mix = [round(c + (255 - c) * t) for c in (r, g, b)]
    return "#" + "".join(f"{c:02x}" for c in mix)


def _layout(fig: go.Figure, height: int) -> go.Figure:
    fig.update_layout(
        template="plotly_white",
        height=height,
        margin={"l": 60, "r": 20, "t": 40, "b": 40},
        legend={"orientation": "v", "x": 1.01, "xanchor": "left", "y": 1, "yanchor": "top"},
        hovermode="x",
    )
    return fig


def _x_axes(fig: go.Figure) -> tuple[str, ...]:
    """The layout names of every x axis of ``fig`` (``"xaxis"``, ``"xaxis2"``, ...)."""
    return tuple(ax.plotly_name for ax in fig.select_xaxes())


def _ys(fig: go.Figure, yaxis: str = "y", *, lines_only: bool = True) -> list[np.ndarray]:
    """The y values of the traces drawn against ``yaxis`` (markers-only ones left out unless
    not ``lines_only``): what an axis decision looks at."""
    return [
        np.asarray(t.y, dtype=float)
        for t in fig.data
        if (t.yaxis or "y") == yaxis
        and t.y is not None
        and (not lines_only or "lines" in (t.mode or "lines"))
    ]


def _first_step_y(fig: go.Figure, yaxis: str = "y", *, stacked: bool = False) -> float | None:
    """Keep a first-step outlier from flattening a time plot: set the initial range of
    ``yaxis`` (``"y"``, ``"y2"``, ...) from the later points of its lines (with ``stacked``:
    the top of its stack, from 0) by :func:`first_step_range`; returns the outlier (ms) or None
    when there is none."""
    ys = _ys(fig, yaxis)
    if stacked:
        on_stack = [
            np.asarray(t.y, dtype=float) for t in fig.data if (t.yaxis or "y") == yaxis and t.stackgroup
        ]
        ys = [np.sum(on_stack, axis=0)] if on_stack else []
    found = first_step_range(ys, from_zero=stacked)
    if found is None:
        return None
    fig.layout["yaxis" + yaxis[1:]].update(range=found[0], autorange=False)
    return found[1]


def _add_note(note: str, sentence: str) -> str:
    """``note`` followed by ``sentence`` (either may be empty)."""
    return f"{note.rstrip('.')}. {sentence}" if note and sentence else note or sentence


def _first_step_note(first_ms: float | None) -> str:
    if first_ms is None:
        return ""
    return (
        f"The first step ({first_ms:.4g} ms: compile/warm-up) is above the initial y range, set from "
        "the 1st-99th percentile of the later steps; autoscale (modebar) to see and hover it."
    )


def _empty_note(fig: go.Figure, text: str, row: int | None = None, col: int | None = None) -> None:
    """A message in the middle of a (sub)plot that has nothing to draw. Placed in paper
    coordinates: plotly.js does not draw the axes of an empty subplot, so axis refs would miss."""
    x = y = 0.5
    if row is not None:
        sub = fig.get_subplot(row, col or 1)
        x, y = sum(sub.xaxis.domain) / 2, sum(sub.yaxis.domain) / 2
    fig.add_annotation(
        text=text, showarrow=False, font={"size": 15, "color": "#666"}, xref="paper", yref="paper", x=x, y=y
    )


def _line(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Drop points with no value (x or y NaN) so sparse lines stay small and connected."""
    keep = np.isfinite(y) & np.isfinite(np.asarray(x, dtype=float))
    return np.asarray(x)[keep], np.asarray(y)[keep]


def _add_line(
    fig: go.Figure,
    x: np.ndarray,
    y: np.ndarray,
    name: str,
    color: str,
    *,
    width: float = 1.6,
    dash: str | None = None,
    scale: float = 1.0,
    draw_empty: bool = False,
    row: int | None = None,
    col: int | None = None,
    **scatter: object,
) -> bool:
    """Add one line trace (``mode="lines"`` unless ``scatter`` says otherwise) of ``y * scale``
    against ``x`` in ``color``, points with no value dropped (:func:`_line`), at subplot
    (``row``, ``col``) or on a plain figure. A line with no point left is not added unless
    ``draw_empty``. Returns whether the line has any point: the panels say when nothing was."""
    px, py = _line(x, y)
    if not len(py) and not draw_empty:
        return False
    line: dict[str, object] = {"color": color, "width": width}
    if dash is not None:
        line["dash"] = dash
    scatter.setdefault("mode", "lines")
    fig.add_trace(go.Scatter(x=px, y=py * scale, name=name, line=line, **scatter), row=row, col=col)
    return bool(len(py))


# --------------------------------------------------------------------------------- panels
def loss_panel(runs: list[RunSeries], max_points: int) -> Panel:
    """Train and held-out loss against step, wall time and cumulative bytes sent."""
    fig = make_subplots(
        rows=1,
        cols=3,
        subplot_titles=("against step", "against wall time (s)", "against bytes sent per rank"),
        horizontal_spacing=0.06,
    )
    any_loss = False
    for i, r in enumerate(runs):
        color = run_color(i)
        x, (loss, held, wall, sent), _ = downsample(
            r.steps,
            [r.mean("loss"), r.mean("held_out_loss"), r.max("wall_s"), r.cumulative_sent()],
            max_points,
        )
        for col, xs in ((1, x), (2, wall), (3, sent)):
            for name, y, dash in (("train", loss, "solid"), ("held-out", held, "dash")):
                drawn = _add_line(
                    fig,
                    xs,
                    y,
                    f"{r.label} {name}",
                    color,
                    dash=dash,
                    row=1,
                    col=col,
                    legendgroup=r.label,
                    showlegend=col == 1,
                    mode="lines+markers" if name == "held-out" else "lines",
                    marker={"size": 5},
                )
                any_loss = any_loss or drawn
    note = "" if any_loss else "no loss recorded (pass loss= to Monitor.step)"
    if not any_loss:
        for col in (1, 2, 3):
            _empty_note(fig, "no loss recorded", 1, col)
    fig.update_yaxes(title_text="loss", row=1, col=1)
    fig.update_xaxes(title_text="step", row=1, col=1)
    fig.update_xaxes(title_text="wall time (s)", row=1, col=2)
    fig.update_xaxes(title_text="bytes sent (log)", type="log", row=1, col=3)
    return Panel("loss", "Training progress: loss", _layout(fig, 420), note, ("xaxis",))


def time_split_panel(runs: list[RunSeries], max_points: int) -> Panel:
    """Where a step's time goes, per run: compute, encode, decode and exposed communication
    stacked; communication hidden behind compute hatched over the compute band."""
    fig = make_subplots(
        rows=len(runs),
        cols=1,
        shared_xaxes=True,
        subplot_titles=[r.label for r in runs],
        vertical_spacing=min(0.08, 0.3 / max(len(runs), 1)),
    )
    any_comm = False
    first: float | None = None
    for row, r in enumerate(runs, 1):
        compute = r.compute_s()
        hidden = r.hidden_comm_s()
        parts = {
            "compute": compute,
            "encode": r.mean("encode_s"),
            "decode": r.mean("decode_s"),
            "exposed": r.mean("exposed_s"),
        }
        any_comm = any_comm or r.has("comm_s") or r.has("exposed_s")
        x, ys, _ = downsample(r.steps, [*parts.values(), np.minimum(hidden, compute)], max_points)
        names = {
            "compute": "compute",
            "encode": "encode",
            "decode": "decode",
            "exposed": "exposed communication",
        }
        *stacked, hid = ys  # the four parts, then the hidden band drawn over them
        for key, y in zip(parts, stacked, strict=True):
            _add_line(  # missing values are 0 here: every step keeps its place in the stack
                fig,
                x,
                np.nan_to_num(y),
                names[key],
                PART_COLORS[key],
                width=0.5,
                scale=MS,
                draw_empty=True,
                row=row,
                col=1,
                legendgroup=key,
                showlegend=row == 1,
                stackgroup=f"run{row}",
                hovertemplate=f"{names[key]} %{{y:.3g}} ms<extra>{r.label}</extra>",
            )
        if np.isfinite(hid).any():
            _add_line(
                fig,
                x,
                np.nan_to_num(hid),
                "hidden communication (overlapped with compute)",
                PART_COLORS["hidden"],
                width=0.8,
                scale=MS,
                row=row,
                col=1,
                legendgroup="hidden",
                showlegend=row == 1,
                fill="tozeroy",
                fillcolor="rgba(255,255,255,0)",
                fillpattern={"shape": "/", "fgcolor": PART_COLORS["hidden"], "size": 6, "solidity": 0.3},
                hovertemplate=f"hidden communication %{{y:.3g}} ms<extra>{r.label}</extra>",
            )
        fig.update_yaxes(title_text="ms", row=row, col=1)
        found = _first_step_y(fig, "y" + (str(row) if row > 1 else ""), stacked=True)
        first = first if found is None else max(found, first or 0.0)
    fig.update_xaxes(title_text="step", row=len(runs), col=1)
    note = (
        "Mean over ranks. Compute is the step time less encode, decode and exposed communication; "
        "the hatched band is communication that ran while computing (comm - exposed)."
    )
    if not any_comm:
        note += " No communication timing recorded."
    note = _add_note(note, _first_step_note(first))
    fig = _layout(fig, 140 + 230 * len(runs))
    return Panel("time", "Step time split", fig, note, _x_axes(fig))


def bytes_panel(runs: list[RunSeries], max_points: int) -> Panel:
    """Bytes sent per step (and the dense all-reduce it replaces) and the compression ratio.

    A run that sends on few steps (SparseLoCo: zero bytes between syncs) gets markers at its
    syncs instead of a line through the zeros, and its ratio (cumulative, as recorded) is
    drawn at the syncs only: between them it climbs with every zero-byte step and drops at the
    next sync. Each y axis is logarithmic when its values span more than :data:`LOG_SPAN`."""
    fig = make_subplots(
        rows=1,
        cols=2,
        subplot_titles=("bytes sent per step per rank (dotted: dense all-reduce)", "compression ratio"),
        horizontal_spacing=0.08,
    )
    any_bytes = False
    synced: list[str] = []
    for i, r in enumerate(runs):
        sent, dense, ratio = r.mean("sent_bytes"), r.mean("dense_bytes"), r.mean("ratio")
        syncs = sync_steps(sent)
        x, (dense_x,), _ = downsample(r.steps, [dense], max_points)
        if syncs is None:
            at, (sent_x, ratio_x), _ = downsample(r.steps, [sent, ratio], max_points)
            modes, suffix = ("lines", "lines"), ""
        else:  # the syncs' own points (averaged only beyond the points budget)
            synced.append(r.label)
            at, (sent_x, ratio_x), _ = downsample(r.steps[syncs], [sent[syncs], ratio[syncs]], max_points)
            modes, suffix = ("markers", "lines+markers"), " (syncs)"
        for xs, y, name, dash, col, mode in (
            (at, sent_x, "sent" + suffix, "solid", 1, modes[0]),
            (x, dense_x, "dense", "dot", 1, "lines"),
            (at, ratio_x, "ratio" + suffix, "solid", 2, modes[1]),
        ):
            drawn = _add_line(
                fig,
                xs,
                y,
                f"{r.label} {name}",
                run_color(i),
                dash=dash,
                row=1,
                col=col,
                legendgroup=r.label,
                showlegend=col == 1 and name != "dense",
                mode=mode,
                marker={"size": 6},
            )
            any_bytes = any_bytes or drawn
    if not any_bytes:
        for col in (1, 2):
            _empty_note(fig, "no communication stats recorded", 1, col)
    for col, title in ((1, "bytes"), (2, "dense / sent (cumulative)")):
        log = log_axis(_ys(fig, "y" if col == 1 else "y2", lines_only=False))
        fig.update_yaxes(
            title_text=title + (" (log)" if log else ""), type="log" if log else "linear", row=1, col=col
        )
    fig.update_xaxes(title_text="step")
    notes = [] if any_bytes else ["no communication stats recorded"]
    if synced:
        notes.append(
            f"{', '.join(synced)} send(s) bytes only at syncs (zero on most steps): markers at the syncs, "
            "the ratio at the syncs only"
        )
    fig = _layout(fig, 400)
    return Panel("bytes", "Bytes and compression", fig, "; ".join(notes), _x_axes(fig))


def occupancy_panel(runs: list[RunSeries], max_points: int) -> Panel:
    """On one step axis: the kernel configs in use and their blocks per SM, the tuner's
    decisions, the share of each step spent blocked on communication, and the train loss."""
    fig = make_subplots(
        rows=5,
        cols=1,
        shared_xaxes=True,
        row_heights=[0.26, 0.18, 0.14, 0.21, 0.21],
        subplot_titles=(
            "kernel config in use",
            "blocks per SM",
            "tuner decisions",
            "exposed communication / step time",
            "train loss",
        ),
        vertical_spacing=0.05,
    )
    any_kernel = any_decision = False
    on_cpu: list[str] = []
    dashes = ("solid", "dash", "dot", "dashdot", "longdash")
    for i, r in enumerate(runs):
        color = run_color(i)
        for j, k in enumerate(r.kernels):
            any_kernel = True
            segs = k.segments()
            idx = [i for _, _, i in segs] + [segs[-1][2]]
            xs = [first for first, _, _ in segs] + [segs[-1][1]]
            hover = [
                f"{k.name}, steps {a}-{b}<br>{k.labels[i]}<br>blocks/SM {k.blocks_per_sm[i]:g}, "
                f"limiter {k.limiter[i]}<br>smem/block {k.smem_per_block[i]:g}, reserved SMs {k.reserved_sms[i]:g}"
                for a, b, i in [*segs, segs[-1]]
            ]
            common = {
                "legendgroup": r.label,
                "line": {"color": color, "dash": dashes[j % len(dashes)], "shape": "hv", "width": 1.6},
                "hovertext": hover,
                "hoverinfo": "text",
            }
            fig.add_trace(
                go.Scatter(
                    x=xs,
                    y=[f"{k.name}: {k.labels[i]}" for i in idx],
                    name=f"{r.label} {k.name}",
                    mode="lines+markers",
                    marker={"size": 4},
                    showlegend=True,
                    **common,
                ),
                row=1,
                col=1,
            )
            fig.add_trace(
                go.Scatter(
                    x=xs,
                    y=[k.blocks_per_sm[i] for i in idx],
                    name=f"{r.label} {k.name} blocks/SM",
                    mode="lines",
                    showlegend=False,
                    **common,
                ),
                row=2,
                col=1,
            )
        if r.decisions:
            any_decision = True
            fig.add_trace(
                go.Scatter(
                    x=[d.step for d in r.decisions],
                    y=[d.event for d in r.decisions],
                    name=f"{r.label} tuner",
                    legendgroup=r.label,
                    showlegend=False,
                    mode="markers",
                    marker={
                        "color": color,
                        "size": 7,
                        "symbol": [TUNER_SYMBOLS.get(d.event, "square") for d in r.decisions],
                    },
                    hovertext=[f"{d.event} at step {d.step}<br>{d.reason}" for d in r.decisions],
                    hoverinfo="text",
                ),
                row=3,
                col=1,
            )
        x, (frac, loss), _ = downsample(r.steps, [r.exposed_fraction(), r.mean("loss")], max_points)
        for row, y, name, template in (
            (4, frac, "exposed fraction", "exposed %{y:.1%}"),
            (5, loss, "train loss", "loss %{y:.4g}"),
        ):
            _add_line(
                fig,
                x,
                y,
                f"{r.label} {name}",
                color,
                width=1.4,
                row=row,
                col=1,
                legendgroup=r.label,
                showlegend=not r.kernels and row == 4,
                hovertemplate=template + "<extra>" + r.label + "</extra>",
            )
        if r.kernels and str(r.run.meta.get("device", "")).startswith("cpu"):
            on_cpu.append(r.label)
    notes = []
    if not any_kernel:
        notes.append("no kernel configs recorded")
        _empty_note(fig, "no kernel configs recorded", 1, 1)
        _empty_note(fig, "no kernel configs recorded", 2, 1)
    if not any_decision:
        _empty_note(fig, "no tuner decisions recorded", 3, 1)
    if on_cpu:
        notes.append(
            f"{', '.join(on_cpu)} ran on CPU: there the GEMM configs change no timing (the torch path "
            "runs them); the configs and decisions are the real records, the step times are not theirs"
        )
    fig.update_yaxes(title_text="blocks/SM", rangemode="tozero", row=2, col=1)
    fig.update_yaxes(type="category", row=3, col=1)
    fig.update_yaxes(title_text="fraction", range=[0, 1], tickformat=".0%", row=4, col=1)
    fig.update_yaxes(title_text="loss", row=5, col=1)
    fig.update_yaxes(type="category", row=1, col=1)
    fig.update_xaxes(title_text="step", row=5, col=1)
    return Panel(
        "occupancy",
        "Overlap: kernel configs, occupancy, tuner, exposed communication",
        _layout(fig, 900),
        "; ".join(notes),
        _x_axes(fig),
    )


def ranks_panel(runs: list[RunSeries], max_points: int) -> Panel:
    """Step time of every rank (one line each, lighter shades of the run's color) and the
    slowest rank per step, to spot stragglers."""
    fig = make_subplots(
        rows=2,
        cols=1,
        shared_xaxes=True,
        row_heights=[0.7, 0.3],
        subplot_titles=("step time per rank", "slowest rank"),
        vertical_spacing=0.1,
    )
    notes = []
    for i, r in enumerate(runs):
        color = run_color(i)
        n = len(r.ranks)
        x, ys, _ = downsample(r.steps, list(r.per_rank["step_s"]), max_points)
        for k, (rank, y) in enumerate(zip(r.ranks, ys, strict=True)):
            _add_line(
                fig,
                x,
                y,
                f"{r.label} rank {rank}",
                _shade(color, 0.55 * k / max(n, 1)),
                width=1.3,
                scale=MS,
                draw_empty=True,
                row=1,
                col=1,
                legendgroup=r.label,
                hovertemplate=f"rank {rank} %{{y:.3g}} ms<extra>{r.label}</extra>",
            )
        if len(r.slowest_rank):
            ranks, counts = np.unique(r.slowest_rank, return_counts=True)
            top = int(ranks[np.argmax(counts)])
            source = "rank 0's summary records" if r.slowest_from_summary else "the rank files"
            notes.append(
                f"{r.label}: rank {top} slowest on {counts.max() / counts.sum():.0%} of steps (from {source})"
            )
            fig.add_trace(
                go.Scatter(
                    x=r.summary_steps,
                    y=r.slowest_rank,
                    name=f"{r.label} slowest rank",
                    legendgroup=r.label,
                    showlegend=False,
                    mode="markers",
                    marker={"color": color, "size": 4, "symbol": "line-ew-open"},
                    hovertemplate="slowest rank %{y}<extra>" + r.label + "</extra>",
                ),
                row=2,
                col=1,
            )
    if not notes:
        _empty_note(fig, "one rank per run: no stragglers to show", 2, 1)
    outlier = _first_step_note(_first_step_y(fig))
    fig.update_yaxes(title_text="ms", row=1, col=1)
    fig.update_yaxes(title_text="rank", dtick=1, row=2, col=1)
    fig.update_xaxes(title_text="step", row=2, col=1)
    fig = _layout(fig, 520)
    return Panel(
        "ranks", "Per-rank step time (stragglers)", fig, _add_note("; ".join(notes), outlier), _x_axes(fig)
    )


def tuner_panel(runs: list[RunSeries], max_points: int) -> Panel:
    """The tuner's decisions as markers on each run's step time."""
    fig = go.Figure()
    total = 0
    for i, r in enumerate(runs):
        color = run_color(i)
        step_ms = r.mean("step_s") * MS
        x, (y,), _ = downsample(r.steps, [step_ms], max_points)
        _add_line(
            fig,
            x,
            y,
            f"{r.label} step time",
            color,
            width=1,
            draw_empty=True,
            legendgroup=r.label,
            opacity=0.5,
        )
        if not r.decisions:
            continue
        total += len(r.decisions)
        at = {int(s): v for s, v in zip(r.steps, step_ms, strict=True)}
        for event in sorted({d.event for d in r.decisions}):
            ds = [d for d in r.decisions if d.event == event]
            fig.add_trace(
                go.Scatter(
                    x=[d.step for d in ds],
                    y=[at.get(d.step, np.nan) for d in ds],
                    name=f"{r.label} {event}",
                    legendgroup=r.label,
                    mode="markers",
                    marker={
                        "color": color,
                        "size": 11,
                        "symbol": TUNER_SYMBOLS.get(event, "square"),
                        "line": {"width": 1, "color": "#222"},
                    },
                    hovertext=[
                        f"{d.event} at step {d.step} (rank {', '.join(map(str, d.ranks))})"
                        f"<br>{d.reason}" + (f"<br>{d.candidate}" if d.candidate else "")
                        for d in ds
                    ],
                    hoverinfo="text",
                )
            )
    note = f"{total} decision(s)" if total else "no tuner decisions recorded"
    if not total:
        _empty_note(fig, "no tuner decisions recorded")
    outlier = _first_step_note(_first_step_y(fig))
    note = _add_note(note, outlier)
    fig.update_yaxes(title_text="step time (ms)")
    fig.update_xaxes(title_text="step")
    return Panel("tuner", "Tuner decisions", _layout(fig, 400), note, ("xaxis",))


PANELS = (loss_panel, time_split_panel, bytes_panel, occupancy_panel, ranks_panel, tuner_panel)


#: spikelines of a step axis: the hovered step, drawn across its subplot
STEP_SPIKES = {
    "showspikes": True,
    "spikemode": "across",
    "spikesnap": "cursor",
    "spikethickness": 1,
    "spikedash": "dot",
    "spikecolor": "#888",
}


def link_step_axes(panels: list[Panel], runs: list[RunSeries]) -> list[float] | None:
    """Give every step axis of ``panels`` the same initial range (first to last step of all
    runs, :func:`step_range`) and spikelines; returns that range. The page's script keeps them
    together on zoom, reset and hover."""
    shared = step_range([r.steps for r in runs])
    for p in panels:
        for name in p.step_axes:
            p.figure.layout[name].update(STEP_SPIKES)
            if shared is not None:
                p.figure.layout[name].update(range=shared, autorange=False)
    return shared


def build_panels(runs: list[RunSeries], *, max_points: int = 2000) -> list[Panel]:
    """Every panel of the page, in order, their step axes linked (:func:`link_step_axes`)."""
    panels = [make(runs, max_points) for make in PANELS]
    link_step_axes(panels, runs)
    return panels
