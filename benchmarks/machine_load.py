"""The load gate of the speed benchmarks: no headline ratio from a busy machine.

A speed ratio measured while other jobs share the CPUs says more about them than about the
code (on the 2-core machine, a test run beside a benchmark moved AdamW's after/before ratio,
the same code in both trees, to 0.86). So a benchmark that reports speed ratios reads the
load average before any work and after its last round:

* busy (the 1-minute load average, less the benchmark's own busy processes, above
  ``max_fraction`` x the CPU cores; default 0.5): it refuses to run, saying why, unless the
  caller allows a busy machine (``--allow-busy``);
* allowed busy: it runs, and its results say ``"headline": false`` with the reason; the
  table is printed under a NOT A HEADLINE banner. The readings are recorded in any case.

``read_load`` takes the reading functions as arguments, so the gate's logic is tested with
injected readings (``tests/test_machine_load.py``), never with real timing.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable
from typing import Any

#: busy above this fraction of the CPU cores (1-minute load average)
DEFAULT_MAX_FRACTION = 0.5


@dataclasses.dataclass(frozen=True)
class LoadReading:
    """One reading of the load averages (1, 5 and 15 minutes) on ``cores`` CPUs; ``own``:
    processes of the benchmark itself that were busy over the last minute (counted out)."""

    load1: float
    load5: float
    load15: float
    cores: int
    own: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def read_load(
    own: int = 0,
    *,
    getloadavg: Callable[[], tuple[float, float, float]] | None = None,
    cpu_count: Callable[[], int | None] | None = None,
) -> LoadReading:
    """The load averages now and the core count (default ``os.getloadavg``, ``os.cpu_count``)."""
    load1, load5, load15 = (getloadavg or os.getloadavg)()
    cores = (cpu_count or os.cpu_count)()
    return LoadReading(float(load1), float(load5), float(load15), int(cores or 1), own)


def busy_reason(reading: LoadReading, max_fraction: float = DEFAULT_MAX_FRACTION) -> str | None:
    """Why the machine is too busy for a headline figure, or None when it is quiet enough:
    busy when ``load1 - own > max_fraction * cores``."""
    limit = max_fraction * reading.cores
    others = reading.load1 - reading.own
    if others <= limit:
        return None
    mine = f" (less {reading.own} busy process(es) of this benchmark)" if reading.own else ""
    return (
        f"the 1-minute load average is {reading.load1:.2f}{mine} on {reading.cores} cores, above "
        f"{max_fraction:g} x {reading.cores} = {limit:.2f}: other work shares the CPUs, so its speed "
        "ratios would measure that work too"
    )


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """``--max-load FRACTION`` (> 0, else a usage error) and ``--allow-busy``."""
    ap.add_argument(
        "--max-load",
        type=_max_load,
        default=DEFAULT_MAX_FRACTION,
        metavar="FRACTION",
        help=f"busy above this 1-minute load average per core (default {DEFAULT_MAX_FRACTION})",
    )
    ap.add_argument(
        "--allow-busy",
        action="store_true",
        help="run on a busy machine anyway; the results are then marked as no headline (with why)",
    )


def _max_load(text: str) -> float:
    """``--max-load``'s value: a float > 0 (argparse reports the error as a usage error)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (a fraction of the CPU cores), got {text}")
    return value


class LoadGate:
    """The gate of one benchmark run: :meth:`start` before any work (refuses a busy machine
    unless allowed), :meth:`finish` after the last round; :meth:`record` is what the results
    file keeps, :meth:`banner` what the printed table says above itself."""

    def __init__(
        self,
        prog: str,
        max_fraction: float = DEFAULT_MAX_FRACTION,
        allow_busy: bool = False,
        reader: Callable[[int], LoadReading] | None = None,
    ) -> None:
        if not max_fraction > 0:
            raise ValueError(f"{prog}: --max-load must be > 0, got {max_fraction}")
        self.prog = prog
        self.max_fraction = max_fraction
        self.allow_busy = allow_busy
        self.reader = reader or (lambda own: read_load(own))
        self.readings: dict[str, LoadReading] = {}
        self.reasons: list[str] = []

    @classmethod
    def from_args(cls, prog: str, args: argparse.Namespace, **kw: Any) -> LoadGate:
        return cls(prog, args.max_load, args.allow_busy, **kw)

    def _read(self, when: str, own: int) -> str | None:
        reading = self.reader(own)
        self.readings[when] = reading
        reason = busy_reason(reading, self.max_fraction)
        if reason is not None:
            self.reasons.append(f"{when}: {reason}")
        return reason

    def start(self) -> bool:
        """Read the load before any work. False (and the refusal on stderr) when the machine
        is busy and a busy machine is not allowed: the caller stops there."""
        reason = self._read("start", 0)
        if reason is None:
            return True
        if not self.allow_busy:
            print(
                f"{self.prog}: refusing to measure speed ratios: {reason}. Rerun on a quiet machine, "
                "raise --max-load, or pass --allow-busy to record them marked as no headline.",
                file=sys.stderr,
            )
            return False
        print(f"{self.prog}: busy machine allowed (--allow-busy): {reason}", flush=True)
        return True

    def finish(self, own: int = 1) -> None:
        """Read the load after the last round (``own``: the benchmark's processes that were busy
        over the last minute; one when its workers take turns)."""
        self._read("end", own)

    @property
    def headline(self) -> bool:
        """True when every reading was quiet: the ratios may be quoted as the result."""
        return not self.reasons

    def banner(self) -> str | None:
        """The line above a table that is no headline, or None."""
        if self.headline:
            return None
        return "NOT A HEADLINE (busy machine): " + "; ".join(self.reasons)

    def record(self) -> dict[str, Any]:
        """The results file's ``load`` entry: the readings, the limit and the verdict."""
        return {
            "max_fraction": self.max_fraction,
            "readings": {when: r.to_dict() for when, r in self.readings.items()},
            "headline": self.headline,
            "not_headline_because": self.reasons,
        }
