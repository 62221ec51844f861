"""What ``gpu_check`` and its phase modules (``gpu_tp_phase``, ``gpu_train_step_phase``) share:
the relative error of a result and the printed table of rows. A leaf module, so that the
phases need not import ``gpu_check``, which imports them."""

from __future__ import annotations

from typing import Any


def rel_err(out: Any, ref: Any) -> float:
    """``|out - ref| / |ref|`` (Frobenius norms, in float64)."""
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def fmt(v: Any) -> str:
    """A table cell: floats to 4 significant digits (NaN as 'nan'), None as '-'."""
    if isinstance(v, float):
        if v != v:
            return "nan"
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.0f}"
    return "-" if v is None else str(v)


def print_rows(rows: list[dict], cols: list[str]) -> None:
    """A left-aligned table of ``cols`` ('-' for missing cells)."""
    table = [cols] + [[fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(t[i]) for t in table) for i in range(len(cols))]
    for t in table:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(t, widths, strict=True)))
