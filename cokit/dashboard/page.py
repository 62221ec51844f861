"""The dashboard page: a header describing the runs, then the panels, in one HTML file.

plotly.js is embedded once, inline, so the file opens offline from disk (no server, no CDN);
each panel is a ``<section class="panel" id="panel-KEY">`` holding one plot div. A small
script (:data:`LINK_JS`) links the panels' step axes: zooming or resetting one step axis moves
all the others, and hovering a step shows that step on every panel.
"""

from __future__ import annotations

import html
import json
import time
from typing import Any

import plotly.io as pio
import plotly.offline

from cokit.dashboard.panels import Panel, run_color
from cokit.dashboard.reader import Telemetry
from cokit.dashboard.series import RunSeries

PLOT_CONFIG = {"displaylogo": False, "responsive": True, "toImageButtonOptions": {"format": "png"}}

CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0 24px 40px; color: #222;
       background: #fff; }
h1 { font-size: 22px; margin: 18px 0 4px; }
h2 { font-size: 17px; margin: 0 0 2px; }
.sub { color: #555; margin: 0 0 12px; font-size: 13px; }
table.runs { border-collapse: collapse; font-size: 13px; margin: 8px 0 16px; }
table.runs th, table.runs td { border-bottom: 1px solid #ddd; padding: 4px 10px 4px 0; text-align: left;
       vertical-align: top; }
.swatch { display: inline-block; width: 12px; height: 12px; border-radius: 2px; margin-right: 6px;
       vertical-align: -1px; }
.warn { color: #a33; font-size: 13px; }
.panel { margin: 18px 0 8px; padding-top: 8px; border-top: 1px solid #eee; }
.note { color: #555; font-size: 13px; margin: 0 0 4px; min-height: 1em; }
code { font-size: 12px; }
"""

#: Links the step axes of the page's figures (``STEP_AXES``: plot div id -> its step axes and
#: their subplots; ``STEP_RANGE``: the shared initial range). A relayout of a step axis (zoom,
#: pan, reset) is applied to every step axis of every figure; a reset (autorange) returns all
#: of them to the shared range. No feedback loop: a figure already at the target range is left
#: alone, and the event of a figure this script moved is not passed on. Hovering a step on one
#: figure hovers it on the others (without their hover events).
LINK_JS = """
(function () {
  const LINK = window.cokitStepAxes = %(axes)s;
  const RANGE = window.cokitStepRange = %(range)s;
  const plots = () => Object.keys(LINK).map(id => document.getElementById(id)).filter(Boolean);
  const moving = new Set();
  const same = (a, b) => Math.abs(a - b) <= 1e-9 * Math.max(1, Math.abs(a), Math.abs(b));
  function stepRange(gd, ev) {
    for (const ax of LINK[gd.id].axes) {
      if (ev[ax + '.autorange']) return 'auto';
      if (Array.isArray(ev[ax + '.range'])) return ev[ax + '.range'].map(Number);
      if ((ax + '.range[0]') in ev && (ax + '.range[1]') in ev)
        return [Number(ev[ax + '.range[0]']), Number(ev[ax + '.range[1]'])];
    }
    return null;
  }
  function moveAll(range) {
    if (range === 'auto' && RANGE) range = RANGE;
    for (const gd of plots()) {
      const update = {};
      for (const ax of LINK[gd.id].axes) {
        const cur = gd.layout[ax] || {};
        if (range === 'auto') {
          if (!cur.autorange) update[ax + '.autorange'] = true;
        } else if (!(Array.isArray(cur.range) && same(cur.range[0], range[0]) && same(cur.range[1], range[1]))) {
          update[ax + '.range'] = range.slice();
        }
      }
      if (Object.keys(update).length) {
        moving.add(gd);
        Plotly.relayout(gd, update).finally(() => moving.delete(gd));
      }
    }
  }
  let hovering = false;
  function hoverAll(gd, ev) {
    const pt = ev && ev.points && ev.points[0];
    if (hovering || !pt || typeof pt.x !== 'number' || !pt.xaxis || !LINK[gd.id].axes.includes(pt.xaxis._name)) return;
    hovering = true;
    try {
      for (const other of plots()) if (other !== gd) Plotly.Fx.hover(other, {xval: pt.x}, LINK[other.id].subplots, true);
    } finally { hovering = false; }
  }
  function unhoverAll(gd) {
    if (hovering) return;
    hovering = true;
    try { for (const other of plots()) if (other !== gd) Plotly.Fx.unhover(other); } finally { hovering = false; }
  }
  for (const gd of plots()) {
    gd.on('plotly_relayout', ev => {
      if (moving.has(gd)) return;
      const range = stepRange(gd, ev || {});
      if (range) moveAll(range);
    });
    gd.on('plotly_hover', ev => hoverAll(gd, ev));
    gd.on('plotly_unhover', () => unhoverAll(gd));
  }
})();
"""


def _flat(config: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if not isinstance(config, dict):
        return [(prefix, config)] if prefix else []
    out: list[tuple[str, Any]] = []
    for k, v in config.items():
        out.extend(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else [(f"{prefix}{k}", v)])
    return out


def _settings_html(config: Any) -> str:
    """The run's settings (meta "config", nested keys dotted): the first few, the rest folded."""
    items = [f"{k}={json.dumps(v) if isinstance(v, list) else v}" for k, v in _flat(config)]
    if not items:
        return "-"
    head = html.escape(", ".join(items[:4]))
    if len(items) <= 4:
        return f"<code>{head}</code>"
    rest = html.escape(", ".join(items[4:]))
    return f"<details><summary><code>{head}, ...</code></summary><code>{rest}</code></details>"


def _steps_text(s: RunSeries) -> str:
    if not len(s.steps):
        return "0"
    return f"{len(s.steps)} ({int(s.steps[0])}-{int(s.steps[-1])})"


def header_html(telemetry: Telemetry, series: list[RunSeries], max_points: int) -> str:
    """The runs table: who ran what, where, with which settings, and how it ended."""
    rows = []
    for i, s in enumerate(series):
        meta = s.run.meta
        world = {r.world_size for r in s.run.ranks.values() if r.world_size is not None}
        ends = [r.end for r in s.run.ranks.values() if r.end is not None]
        if len(ends) == len(s.run.ranks):
            wall = max(float(e.get("wall_s") or 0.0) for e in ends)
            ended = f"ended, {wall:.1f} s"
        else:
            ended = f"no end record on {len(s.run.ranks) - len(ends)} rank(s) (running, or stopped early)"
        versions = ", ".join(f"{k} {meta[k]}" for k in ("torch", "triton") if meta.get(k) is not None)
        cells = [
            f'<span class="swatch" style="background:{run_color(i)}"></span>{html.escape(s.label)}',
            ", ".join(map(str, s.ranks)) + (f" of {max(world)}" if world else ""),
            _steps_text(s),
            html.escape(str(meta.get("method") or "-")),
            html.escape(str(meta.get("device") or "-")),
            html.escape(f"{meta.get('host') or '-'}, {meta.get('started') or '-'}"),
            html.escape(versions or "-"),
            _settings_html(meta.get("config")),
            html.escape(ended),
            f"<code>{html.escape(str(s.run.folder))}</code>",
        ]
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    heads = (
        "run",
        "ranks",
        "steps",
        "method",
        "device",
        "host, started",
        "versions",
        "settings",
        "status",
        "folder",
    )
    table = (
        '<table class="runs"><tr>'
        + "".join(f"<th>{h}</th>" for h in heads)
        + "</tr>"
        + "".join(rows)
        + "</table>"
    )
    extra = []
    long = [s.label for s in series if len(s.steps) > max_points]
    if long:
        extra.append(
            f"<p class='sub'>Lines of {html.escape(', '.join(long))} are averaged over consecutive steps "
            f"to at most {max_points} points each (markers are not).</p>"
        )
    if telemetry.skipped_count:
        items = "".join(f"<li>{html.escape(s.describe())}</li>" for s in telemetry.skipped)
        extra.append(
            f"<div class='warn'>{telemetry.skipped_count} unreadable line(s) skipped:<ul>{items}</ul></div>"
        )
    return table + "".join(extra)


def step_links(panels: list[Panel]) -> dict[str, dict[str, list[str]]]:
    """Plot div id -> the figure's step axes (layout names) and their subplots (``"x2y2"``):
    what :data:`LINK_JS` moves and hovers."""
    links = {}
    for p in panels:
        if not p.step_axes:
            continue
        subplots = []
        for name in p.step_axes:
            x = "x" + name[len("xaxis") :]
            subplots.append(x + (p.figure.layout[name].anchor or "y"))
        links[f"plot-{p.key}"] = {"axes": list(p.step_axes), "subplots": subplots}
    return links


def render_page(
    telemetry: Telemetry, series: list[RunSeries], panels: list[Panel], *, max_points: int, title: str
) -> str:
    """The whole HTML document as a string."""
    sections = []
    for p in panels:
        div = pio.to_html(
            p.figure,
            full_html=False,
            include_plotlyjs=False,
            div_id=f"plot-{p.key}",
            config=PLOT_CONFIG,
            default_width="100%",
            default_height=f"{p.figure.layout.height or 450}px",
        )
        sections.append(
            f'<section class="panel" id="panel-{p.key}"><h2>{html.escape(p.title)}</h2>'
            f'<p class="note">{html.escape(p.note)}</p>{div}</section>'
        )
    made = time.strftime("%Y-%m-%d %H:%M:%S")
    sub = (
        f"{len(series)} run(s), {sum(len(s.ranks) for s in series)} rank file(s); built {made} "
        "by <code>cokit dashboard</code>; works offline."
    )
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>{CSS}</style>"
        f"<script type='text/javascript'>{plotly.offline.get_plotlyjs()}</script></head><body>"
        f"<h1>{html.escape(title)}</h1><p class='sub'>{sub}</p>"
        f"{header_html(telemetry, series, max_points)}"
        + "".join(sections)
        + f"<script id='cokit-step-link'>{link_script(panels)}</script></body></html>\n"
    )


def link_script(panels: list[Panel]) -> str:
    """:data:`LINK_JS` filled with the panels' step axes and their shared initial range."""
    shared = next(
        (
            list(p.figure.layout[p.step_axes[0]].range)
            for p in panels
            if p.step_axes and p.figure.layout[p.step_axes[0]].range
        ),
        None,
    )
    return LINK_JS % {"axes": json.dumps(step_links(panels)), "range": json.dumps(shared)}
