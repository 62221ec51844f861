"""Settings and status agreement: one fixed-size row per rank and round, reports without pickle.

Every round of an exchange (a DeMo step, a SparseLoCo sync, a DDP iteration of the hook) opens
with one all-gather of a fixed-size status row per rank, waited before any collective whose size
depends on the settings: gloo ends the process (``std::terminate`` in its transport thread) when
ranks hand one collective different sizes, so sizes are agreed first. A row (:data:`ROW_BYTES`)
holds

- a 64-bit fingerprint (BLAKE2b) of everything the ranks must agree on: settings, the
  parameter layout, the wire size of every payload and the round counters;
- a 64-bit hash of which entries have a gradient this round (0 where not tracked);
- the non-finite report: how many entries are non-finite, the first of them and the global
  rank that saw it;
- event bits (:data:`FOUND_INF`, :data:`EDITED`, ...);
- local steps skipped since the last round (SparseLoCo's, for a GradScaler's inf);

followed by a fixed number of extra bytes (a network policy's measurement). Rows of agreement
groups (a mesh's sharded dimensions, a node) are gathered first and combined into the row the
exchange group sees, so every rank of the world takes the same decision.

When fingerprints differ, the ranks of that group gather every rank's description as JSON bytes
(lengths first, then the padded bytes) and all raise the same error naming the first difference;
rows sent on flag the problem (:data:`DISAGREE`) so the other groups' ranks raise too. Peer data
is parsed as JSON, never unpickled.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
from collections.abc import Callable, Sequence
from typing import Any

import torch

from cokit.compress.comm import Communicator, Pending

__all__ = [
    "DISAGREE",
    "EDITED",
    "FOUND_INF",
    "ROW_BYTES",
    "SCALED",
    "Report",
    "Round",
    "SettingsMismatch",
    "fingerprint",
    "gather_json",
    "run_round",
]

_ROW = struct.Struct("<qqiiiIq")
ROW_BYTES = _ROW.size  # 40
FOUND_INF = 1  # a GradScaler found inf/NaN in this rank's gradients
EDITED = 2  # gradients changed after their bucket was launched (overlap_backward)
SCALED = 4  # gradients still carry a GradScaler's scale (overlap_backward refuses them)
DISAGREE = 8  # ranks of an agreement group disagreed (their error names it)
_JSON_LIMIT = 64 * 2**20  # bytes of one rank's description


class SettingsMismatch(ValueError):
    """The ranks disagree on a setting, the model or a counter; raised on every rank."""


class PeerDataError(ValueError):
    """Bytes from a peer failed validation (malformed payload or report)."""


def fingerprint(*parts: str | bytes) -> int:
    """A signed 64-bit BLAKE2b digest of ``parts`` (a setting that differs is never missed by
    chance: two different descriptions collide with probability 2**-64)."""
    h = hashlib.blake2b(digest_size=8)
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return int.from_bytes(h.digest(), "little", signed=True)


def canonical(obj: Any) -> str:
    """``obj`` as canonical JSON (sorted keys, no spaces): what fingerprints hash."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


@dataclasses.dataclass(frozen=True)
class Report:
    """One rank's status beyond the fingerprint (combined over agreement groups)."""

    grads: int = 0  # hash of the entries that have a gradient (0: not tracked)
    n_bad: int = 0  # non-finite entries
    first_bad: int = -1  # the first non-finite entry (index into the round's entries)
    culprit: int = -1  # the global rank that saw it
    events: int = 0
    skipped: int = 0  # local steps skipped since the last round (SparseLoCo's inner steps)

    def pack(self, fp: int) -> bytes:
        return _ROW.pack(
            fp,
            self.grads,
            self.n_bad,
            self.first_bad,
            self.culprit,
            self.events,
            self.skipped,
        )

    @staticmethod
    def unpack(row: bytes) -> tuple[int, Report]:
        fp, *fields = _ROW.unpack(row)
        return fp, Report(*fields)

    @staticmethod
    def combine(reports: Sequence[Report]) -> Report:
        """Reports of ranks that hold shards of the same entries, as one: non-finite if any
        shard is (the lowest entry, and the rank that saw it), every event."""
        bad = [r for r in reports if r.n_bad > 0]
        first = min(bad, key=lambda r: (r.first_bad, r.culprit)) if bad else Report()
        events = 0
        for r in reports:
            events |= r.events
        return Report(
            reports[0].grads,
            sum(r.n_bad for r in reports),
            first.first_bad,
            first.culprit,
            events,
            sum(r.skipped for r in reports),
        )


@dataclasses.dataclass
class Round:
    """What the exchange group's ranks reported (index = rank in the exchange group)."""

    reports: list[Report]
    extras: torch.Tensor  # (world, extra bytes), uint8, on the CPU

    @property
    def bad(self) -> list[tuple[int, Report]]:
        """``(group rank, report)`` of every rank with a non-finite entry."""
        return [(r, rep) for r, rep in enumerate(self.reports) if rep.n_bad > 0]

    def where_bad(self, name: Callable[[int], str]) -> str:
        """Where the first non-finite entry is: ``<name> on rank R (and N more)``."""
        bad = self.bad
        first = bad[0][1]
        total = sum(rep.n_bad for _, rep in bad)
        more = f" (and {total - 1} more)" if total > 1 else ""
        return f"{name(first.first_bad)} on rank {first.culprit}{more}"

    def any_event(self, event: int) -> list[int]:
        """Group ranks whose report carries ``event``."""
        return [r for r, rep in enumerate(self.reports) if rep.events & event]


def gather_json(
    comm: Communicator, obj: Any, what: str, wait: Callable[[Pending], torch.Tensor]
) -> list[Any]:
    """All-gather one JSON value per rank over ``comm`` (lengths, then padded UTF-8 bytes), with
    ``comm``'s timeout. A peer's bytes that do not parse raise :class:`PeerDataError`."""
    data = canonical(obj).encode()
    if len(data) > _JSON_LIMIT:
        raise ValueError(f"{comm.owner}: the {what} is {len(data)} bytes, over the {_JSON_LIMIT} limit")
    device = _device(comm)
    lengths = wait(
        comm.all_gather(torch.tensor([len(data)], dtype=torch.int64, device=device), f"{what} length")
    )
    sizes = lengths.flatten().cpu().tolist()
    for r, n in enumerate(sizes):
        if not 0 <= n <= _JSON_LIMIT:
            raise PeerDataError(f"{comm.owner}: rank {comm.global_rank(r)} announced a {what} of {n} bytes")
    padded = bytearray(max(sizes))
    padded[: len(data)] = data
    mine = (
        torch.frombuffer(padded, dtype=torch.uint8).to(device)
        if padded
        else torch.zeros(0, dtype=torch.uint8)
    )
    gathered = wait(comm.all_gather(mine, what)).cpu()
    out = []
    for r, n in enumerate(sizes):
        try:
            out.append(json.loads(gathered[r, :n].contiguous().numpy().tobytes().decode()))
        except (UnicodeDecodeError, ValueError):
            raise PeerDataError(
                f"{comm.owner}: rank {comm.global_rank(r)} sent a {what} that is not JSON: its "
                "process runs other code, or its memory is corrupt"
            ) from None
    return out


def _device(comm: Communicator) -> torch.device:
    """Where a collective of ``comm`` puts its tensors: NCCL/RCCL groups move only GPU tensors."""
    if comm.distributed and "nccl" in comm.backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def run_round(
    stages: Sequence[tuple[Communicator, int]],
    mine: Report,
    describe: Callable[[Communicator], dict[str, Any]],
    wait: Callable[[Pending], torch.Tensor],
    *,
    extra: torch.Tensor | None = None,
    device: torch.device | None = None,
    has_grad: Callable[[], list[bool]] | None = None,
    names: Callable[[int], str] | None = None,
) -> Round:
    """One agreement round: gather every stage's rows, agreement groups first and the exchange
    group last (``stages[i] = (communicator, this rank's fingerprint for it)``); raise
    :class:`SettingsMismatch` on every rank of the world when fingerprints or gradient sets
    differ anywhere, else return the exchange group's reports.

    ``describe(comm)`` is this rank's description for the mismatch report (the JSON whose
    fingerprint was sent); ``extra`` (uint8) rides on the exchange group's row only;
    ``has_grad()`` gives this rank's per-entry gradient flags and ``names(i)`` an entry's name,
    for the report of a gradient that only some ranks have.
    """
    problem: str | None = None
    report = mine
    last = len(stages) - 1
    result: Round | None = None
    for i, (comm, fp) in enumerate(stages):
        row = torch.frombuffer(bytearray(report.pack(fp)), dtype=torch.uint8)
        if i == last and extra is not None:
            row = torch.cat([row, extra.cpu()])
        what = "status exchange" if i == last else "status agreement"
        gathered = wait(comm.all_gather(row.to(device or torch.device("cpu")), what)).cpu()
        raw = gathered[:, :ROW_BYTES].contiguous().numpy().tobytes()
        parsed = [Report.unpack(raw[r * ROW_BYTES : (r + 1) * ROW_BYTES]) for r in range(gathered.shape[0])]
        fps = [fp_ for fp_, _ in parsed]
        reports = [rep for _, rep in parsed]
        if len(set(fps)) > 1:
            everyone = gather_json(comm, describe(comm), "settings report", wait)
            problem = problem or mismatch_message(comm, everyone)
        elif len({rep.grads for rep in reports}) > 1 and has_grad is not None:
            problem = problem or _mixed_message(comm, has_grad, names, wait, device)
        if problem is not None:
            report = dataclasses.replace(report, events=report.events | DISAGREE)
        if i < last:
            combined = Report.combine(reports)
            report = dataclasses.replace(combined, grads=mine.grads, events=combined.events | report.events)
        else:
            result = Round(reports, gathered[:, ROW_BYTES:])
    assert result is not None
    if problem is not None:
        raise SettingsMismatch(problem)
    others = result.any_event(DISAGREE)
    if others:
        comm = stages[last][0]
        ranks = [comm.global_rank(r) for r in others]
        raise SettingsMismatch(
            f"{comm.owner}: the ranks of the group(s) of rank(s) {ranks} disagree on their settings, "
            "model or gradients (their error says which); nothing changed"
        )
    return result


def _mixed_message(
    comm: Communicator,
    has_grad: Callable[[], list[bool]],
    names: Callable[[int], str] | None,
    wait: Callable[[Pending], torch.Tensor],
    device: torch.device | None,
) -> str:
    """Which entry has a gradient on some ranks only (the layouts agree, so sizes match)."""
    flags = torch.tensor(has_grad(), dtype=torch.uint8, device=device or torch.device("cpu"))
    gathered = wait(comm.all_gather(flags, "gradient set report")).cpu().bool()
    mixed = (gathered.any(0) & ~gathered.all(0)).nonzero().flatten().tolist()
    entry = mixed[0] if mixed else 0
    ranks = [comm.global_rank(r) for r in gathered[:, entry].nonzero().flatten().tolist()]
    label = names(entry) if names is not None else f"entry {entry}"
    return (
        f"{comm.owner}: parameter {label} has a gradient on ranks {ranks} only; every rank must "
        "produce the same set of gradients (use zero_grad(set_to_none=False) or make unused "
        "parameters take part in the loss)"
    )


# ----------------------------------------------------------------------------- mismatch text
def mismatch_message(comm: Communicator, everyone: list[Any]) -> str:
    """The first thing the ranks of ``comm`` disagree on, with each rank's value (global ranks;
    the same text on every rank of the group). Descriptions are dicts with optional keys
    ``settings`` (flat), ``groups`` (a list of flat dicts), ``layout`` (a list of
    ``[name, description]``), ``derived`` (flat: what follows from the others, such as payload
    sizes) and ``counters`` (flat)."""
    ranks = [comm.global_rank(r) for r in range(len(everyone))]
    diff = _first_difference(everyone, ranks) or "their settings fingerprints differ"
    return (
        f"{comm.owner}: the ranks disagree: {diff}; nothing changed. Every rank must use the same "
        "settings and change them the same way (e.g. step an LR scheduler on every rank)"
    )


def _first_difference(everyone: list[Any], ranks: list[int]) -> str | None:
    if not all(isinstance(d, dict) for d in everyone):
        bad = next(r for r, d in zip(ranks, everyone, strict=True) if not isinstance(d, dict))
        return f"rank {bad} sent a settings report of another shape"

    def part(key: str) -> list[Any]:
        return [d.get(key) for d in everyone]

    for key, values in _flat_differences(part("settings")):
        return f"setting {key!r} is " + per_rank(values, ranks)
    groups = part("groups")
    if _differ(counts := [len(g or []) for g in groups]):
        return "the number of param groups is " + per_rank(counts, ranks)
    for gi in range(len(groups[0] or [])):
        for key, values in _flat_differences([g[gi] for g in groups]):
            return f"param group {gi} setting {key!r} is " + per_rank(values, ranks)
    layouts = part("layout")
    if _differ(counts := [len(lay or []) for lay in layouts]):
        return (
            "the number of parameters is "
            + per_rank(counts, ranks)
            + ": every rank must build the same model"
        )
    for n in range(len(layouts[0] or [])):
        entries = [lay[n] for lay in layouts]
        if _differ(entries):
            name = entries[0][0] if isinstance(entries[0], list) and entries[0] else f"#{n}"
            described = [(e[1] if len(e) == 2 else e[1:]) if isinstance(e, list) else e for e in entries]
            return (
                f"parameter {name} is "
                + per_rank(described, ranks)
                + ": every rank must build the same model"
            )
    for key, values in _flat_differences(part("derived")):
        return (
            f"{key!r} is " + per_rank(values, ranks) + " although the settings agree: the ranks run "
            "different versions of cokit or of a payload codec"
        )
    for key, values in _flat_differences(part("counters")):
        return (
            f"counter {key!r} is " + per_rank(values, ranks) + ": resume every rank from the same checkpoint"
        )
    return None


def _flat_differences(dicts: list[Any]) -> list[tuple[str, list[Any]]]:
    dicts = [d if isinstance(d, dict) else {} for d in dicts]
    keys = list(dict.fromkeys(k for d in dicts for k in d))
    return [(k, vals) for k in keys if _differ(vals := [d.get(k) for d in dicts])]


def _differ(values: Sequence[object]) -> bool:
    return len({canonical(v) for v in values}) > 1


def per_rank(values: Sequence[object], ranks: list[int]) -> str:
    """``0.01 on ranks [0, 2], 0.02 on rank [1]`` (``values[j]`` is rank ``ranks[j]``'s; at most
    8 ranks listed per value)."""
    by_value: dict[str, list[int]] = {}
    for r, v in zip(ranks, values, strict=True):
        by_value.setdefault(repr(v), []).append(r)
    parts = []
    for v, rs in by_value.items():
        listed = ", ".join(map(str, rs[:8])) + (f", ... ({len(rs)} ranks)" if len(rs) > 8 else "")
        parts.append(f"{v} on rank{'s' if len(rs) > 1 else ''} [{listed}]")
    return ", ".join(parts)
