"""Tables, JSON, CSV and plots for :class:`cokit.train.RunResult` lists."""

from __future__ import annotations

import contextlib
import csv
import datetime
import io
import json
import math
import os
from collections.abc import Sequence
from itertools import accumulate
from typing import Any

from cokit.display import human_bytes, human_duration, pyplot
from cokit.files import atomic_savefig, atomic_write_text
from cokit.train import RunResult

CSV_FIELDS = (
    "method",
    "step",
    "train_loss",
    "heldout_loss",
    "bytes_sent",
    "cum_bytes_sent",
    "dense_bytes",
    "step_s",
    "opt_s",
    "wall_s",
)


def summary_table(results: Sequence[RunResult], uniform_loss: float | None = None) -> str:
    """One row per method: final losses, bytes per step, compression ratio, time per step."""
    header = (
        "method",
        "train loss",
        "held-out loss",
        "bytes/step/rank",
        "compression",
        "time/step",
        "opt/step",
    )
    rows = []
    for r in results:
        s = r.summary()
        ratio = s["compression_ratio"]
        rows.append(
            (
                s["method"],
                f"{s['final_train_loss']:.3f}",
                f"{s['final_heldout_loss']:.3f}",
                human_bytes(s["bytes_per_step"]),
                "inf" if math.isinf(ratio) else f"{ratio:.1f}x",
                f"{s['time_per_step_s'] * 1e3:.0f} ms",
                f"{s['opt_time_per_step_s'] * 1e3:.0f} ms",
            )
        )
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]

    def fmt(cells: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    lines = [fmt(header), fmt(tuple("-" * w for w in widths)), *(fmt(row) for row in rows)]
    by_name = {r.spec.name: r.summary() for r in results}
    for name in ("demo", "sparseloco"):
        if name in by_name and "adamw" in by_name and by_name[name]["bytes_per_step"] > 0:
            times = by_name["adamw"]["bytes_per_step"] / by_name[name]["bytes_per_step"]
            lines.append(f"{name} sends {times:.0f}x fewer bytes per step than adamw's dense all-reduce")
    if uniform_loss is not None:
        lines.append(
            f"(uniform guess: {uniform_loss:.3f} nats/char; train loss = mean of the last 10% of steps; "
            "times are medians; compression = dense all-reduce bytes / bytes sent)"
        )
    return "\n".join(lines)


def cost_per_epoch(
    results: Sequence[RunResult], price_per_hour: float, steps_per_epoch: int, world_size: int
) -> list[dict[str, Any]]:
    """Per method: the mean step (after the first; syncs included), an epoch's time and its
    cost at ``price_per_hour`` per rank (a GPU, or a CPU process here)."""
    rows = []
    for r in results:
        steps = r.step_s[1:] or r.step_s
        step_s = sum(steps) / len(steps) if steps else 0.0
        epoch_s = step_s * steps_per_epoch
        rows.append(
            {
                "method": r.spec.display,
                "mean_step_s": step_s,
                "steps_per_epoch": steps_per_epoch,
                "epoch_s": epoch_s,
                "cost_per_epoch": epoch_s / 3600 * world_size * price_per_hour,
            }
        )
    return rows


def cost_table(rows: Sequence[dict[str, Any]], price_per_hour: float, world_size: int) -> str:
    """The cost rows as lines of text."""
    steps = rows[0]["steps_per_epoch"] if rows else 0
    lines = [
        f"cost per epoch ({steps:,} steps: the training text once over {world_size} ranks) "
        f"at {price_per_hour:g} per rank-hour:"
    ]
    width = max((len(r["method"]) for r in rows), default=0)
    for r in rows:
        lines.append(
            f"  {r['method'].ljust(width)}  {r['mean_step_s'] * 1e3:7.1f} ms/step  "
            f"{human_duration(r['epoch_s']):>9}  {r['cost_per_epoch']:,.4g}"
        )
    return "\n".join(lines)


def csv_rows(results: Sequence[RunResult]) -> list[dict[str, Any]]:
    """One dict per (method, step); step 0 carries only the initial held-out loss."""
    rows: list[dict[str, Any]] = []
    for r in results:
        evals = dict(r.evals)
        rows.append(
            {
                **dict.fromkeys(CSV_FIELDS, ""),
                "method": r.spec.display,
                "step": 0,
                "heldout_loss": evals.get(0, ""),
                "cum_bytes_sent": 0,
            }
        )
        for i, cum in enumerate(accumulate(r.bytes_sent)):
            rows.append(
                {
                    "method": r.spec.display,
                    "step": i + 1,
                    "train_loss": r.train_loss[i],
                    "heldout_loss": evals.get(i + 1, ""),
                    "bytes_sent": r.bytes_sent[i],
                    "cum_bytes_sent": cum,
                    "dense_bytes": r.dense_bytes[i],
                    "step_s": r.step_s[i],
                    "opt_s": r.opt_s[i],
                    "wall_s": r.wall_s[i],
                }
            )
    return rows


def _smooth(xs: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= window:
            acc -= xs[i - window]
        out.append(acc / min(i + 1, window))
    return out


def plot_runs(
    path: str, results: Sequence[RunResult], uniform_loss: float | None = None, title: str = ""
) -> None:
    """Two panels: loss vs step (train smoothed, held-out markers) and loss vs cumulative
    bytes sent per rank (log x)."""
    plt = pyplot()
    fig, (ax_step, ax_bytes) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, r in enumerate(results):
        c = colors[i % len(colors)]
        window = max(1, r.steps // 40)
        steps = list(range(1, r.steps + 1))
        train = _smooth(r.train_loss, window)
        cum = list(accumulate(r.bytes_sent))
        ev_steps = [s for s, _ in r.evals]
        ev_loss = [v for _, v in r.evals]
        name = r.spec.display
        ax_step.plot(steps, train, color=c, alpha=0.45, lw=1, label=f"{name} train")
        ax_step.plot(ev_steps, ev_loss, "o-", color=c, ms=3, lw=1.5, label=f"{name} held-out")
        pos = [(cum[s - 1], v) for s, v in r.evals if s > 0 and cum[s - 1] > 0]
        if any(cum):
            ax_bytes.plot(
                [x for x in cum if x > 0],
                [t for x, t in zip(cum, train, strict=True) if x > 0],
                color=c,
                alpha=0.45,
                lw=1,
                label=f"{name} train",
            )
        if pos:
            ax_bytes.plot(*zip(*pos, strict=True), "o-", color=c, ms=3, lw=1.5, label=f"{name} held-out")
    for ax in (ax_step, ax_bytes):
        if uniform_loss is not None:
            ax.axhline(uniform_loss, color="gray", ls=":", lw=1, label="uniform guess")
        ax.set_ylabel("loss (nats/char)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax_step.set_xlabel("step")
    ax_step.set_title("loss vs step")
    ax_bytes.set_xscale("log")
    ax_bytes.set_xlabel("cumulative bytes sent per rank")
    ax_bytes.set_title("loss vs bytes sent")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    try:
        atomic_savefig(fig, path, dpi=110)
    finally:
        plt.close(fig)


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def output_names(stem: str = "demo") -> tuple[str, str, str]:
    """The files :func:`write_outputs` writes: ``<stem>.json``, ``.csv`` and ``.png``."""
    return (f"{stem}.json", f"{stem}.csv", f"{stem}.png")


def write_outputs(
    out_dir: str,
    info: dict[str, Any],
    results: Sequence[RunResult],
    stem: str = "demo",
    title: str = "",
    plot: bool = True,
) -> list[str]:
    """Write ``<stem>.json`` (info, summaries, every series), ``<stem>.csv`` and ``<stem>.png``
    into ``out_dir``, each atomically (see :mod:`cokit.files`); return their paths. Without
    ``plot`` the figure is not drawn and an earlier run's ``<stem>.png`` is removed."""
    from cokit import __version__

    paths = [os.path.join(out_dir, name) for name in output_names(stem)]
    doc = {
        "cokit_version": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": info,
        "summary": [r.summary() for r in results],
        "methods": [r.to_dict() for r in results],
    }
    atomic_write_text(paths[0], json.dumps(_jsonable(doc), indent=1))
    buf = io.StringIO(newline="")
    writer = csv.DictWriter(buf, fieldnames=CSV_FIELDS)
    writer.writeheader()
    writer.writerows(csv_rows(results))
    atomic_write_text(paths[1], buf.getvalue())
    if not plot:
        with contextlib.suppress(FileNotFoundError):
            os.remove(paths[2])  # it would describe another run
        return paths[:2]
    uniform = info.get("workload", {}).get("uniform_loss")
    plot_runs(paths[2], results, uniform, title=title)
    return paths
