"""Reading the study's run records (the JSONs :func:`cokit.validation.runs.run_record` writes).

The report, the plots and the held-out protocol all read runs the same way; these helpers are
their one copy, below all three (they import nothing of the study).
"""

from __future__ import annotations


def best_lr(records: list[dict]) -> float | None:
    """The lr whose seed-0 run ended with the lowest finite held-out loss (None: all failed)."""
    ok = [
        r
        for r in records
        if r.get("status") == "ok" and r["seed"] == 0 and r["summary"]["final_heldout_loss"] is not None
    ]
    return min(ok, key=lambda r: r["summary"]["final_heldout_loss"])["lr"] if ok else None


def amortized_bytes(summary: dict) -> float:
    """Bytes sent per rank per step, averaged over the run (a method that syncs every H steps
    sends nothing on the others; the median would say 0)."""
    mean = summary.get("mean_bytes_per_step")
    return float(summary["bytes_per_step"] if mean is None else mean)
