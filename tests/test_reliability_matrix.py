"""The reliability matrix: every front end against every fault, on real gloo.

Front ends: DeMo (its reference payload, one tensor per collective; compact payloads in many
buckets; overlapped with backward), SparseLoCo and the DDP hook. Faults, brought in by the last rank at one step (tests/matrix_rank.py): a frozen peer
(SIGSTOP), a dead peer (SIGKILL), a setting that differs from the start or changes mid-run, a
NaN gradient under nonfinite="error" and "skip", a GradScaler's inf, a malformed payload (a
codec of another wire length, an index outside its tile, a NaN value) and a permanent
partition (network namespaces, links cut). Each rank is a process of its own, forked from one
that imported torch and the front ends once (tests/matrix_rank.py ``--zygote``: a fresh
interpreter per rank cost 3 s of imports, and the matrix 400 s), and ends through the
interpreter's own exit. In every cell:

- every live rank raises an exception that names the cause, or (skip cells) every rank skips
  and the replicas stay bit-identical and train on;
- each process exits by itself within timeout + 5 s of the fault, with exit code 0 (no
  SIGABRT, no core);
- where the error is raised, the parameters are those of before the faulty step.

``COKIT_MATRIX_TABLE=<path>`` writes the matrix as a markdown table (cells, outcome, seconds
from the fault to the last exit).
"""

from __future__ import annotations

import concurrent.futures
import os
from pathlib import Path

import pytest

from cokit.bench import netbed
from tests.matrix_cells import TIMEOUT, cell_timeout, exit_bound, live_ranks, run_cell
from tests.matrix_rank import FAULTS, FRONTS

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SKIPS = {"nan-skip", "scaler-inf"}
# what the error of each fault must say (lower case; {bad}: the faulty rank), for every live rank
CAUSES = {
    "stop": (f"did not complete within {TIMEOUT:g} s",),
    "kill": ("did not complete",),
    "partition": ("did not complete",),
    "mismatch-start": ("the ranks disagree", "topk"),
    "mismatch-mid": ("the ranks disagree",),
    "nan-error": ("non-finite gradient", "on rank {bad}"),
    "wrong-length": ("the ranks disagree", "payload wire sizes"),
    "bad-index": ("rank {bad} sent a malformed payload", "outside the tile"),
    "nan-value": ("rank {bad} sent a malformed payload", "non-finite value"),
    "scaler-inf": ("gradscaler's scale", "overlap_backward=false"),  # demo-overlap only
}
# what a malformed payload's error says the round had changed, per front end (lower case)
PEER_CHANGED = {
    "demo-reference": "error-feedback buffers already took this step's gradient",
    "demo-bucketed": "error-feedback buffers already took this step's gradient",
    "demo-overlap": "error-feedback buffers already took this step's gradient",
    "sparseloco": "the sync was not applied",
    "hook": "no parameter changed",
}
WORLD3 = [
    (front, fault) for front in FRONTS for fault in ("mismatch-mid", "nan-error", "nan-skip", "bad-index")
]


def _cells() -> list[tuple[str, str, int]]:
    return [(front, fault, 2) for front in FRONTS for fault in FAULTS] + [(f, x, 3) for f, x in WORLD3]


@pytest.fixture(scope="module")
def matrix(tmp_path_factory) -> dict[tuple[str, str, int], dict]:
    tmp = tmp_path_factory.mktemp("matrix")
    cells = _cells()
    plain = [c for c in cells if c[1] != "partition"]
    results: dict[tuple[str, str, int], dict] = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
        futures = {
            pool.submit(run_cell, tmp, front, fault, world, None): (front, fault, world)
            for front, fault, world in plain
        }
        for future in concurrent.futures.as_completed(futures):
            results[futures[future]] = future.result()
    ok, why = netbed.available()
    for front, fault, world in (c for c in cells if c[1] == "partition"):
        if not ok:
            results[(front, fault, world)] = {"skip": why}
            continue
        with netbed.Testbed(netbed.LinkProfile("matrix-partition", rate="1gbit"), world) as bed:
            results[(front, fault, world)] = run_cell(tmp, front, fault, world, bed)
    table = os.environ.get("COKIT_MATRIX_TABLE")
    if table:
        Path(table).write_text(_table(results))
    return results


def _table(results: dict) -> str:
    lines = [
        "| front end | fault | world | outcome on the live ranks | s from fault to last exit |",
        "|---|---|---|---|---|",
    ]
    for (front, fault, world), cell in sorted(
        results.items(), key=lambda kv: (FRONTS.index(kv[0][0]), FAULTS.index(kv[0][1]), kv[0][2])
    ):
        if "skip" in cell:
            lines.append(f"| {front} | {fault} | {world} | not run: {cell['skip']} | |")
            continue
        live = live_ranks(fault, world)
        records = [cell["ranks"][r]["record"] or {} for r in live]
        kinds = sorted(
            {r.get("error") or ("skipped" if r.get("skipped") else r.get("outcome", "?")) for r in records}
        )
        started = [r.get("fault_started") for r in records if r.get("fault_started")]
        exits = [cell["ranks"][r]["exited"] for r in live if cell["ranks"][r]["exited"]]
        took = f"{max(exits) - min(started):.1f}" if started and exits else "?"
        lines.append(f"| {front} | {fault} | {world} | {', '.join(kinds)} | {took} |")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("cell", _cells(), ids=lambda c: f"{c[0]}-{c[1]}-w{c[2]}")
def test_every_live_rank_reports_the_fault_and_every_process_exits_cleanly(matrix, cell):
    front, fault, world = cell
    result = matrix[cell]
    if "skip" in result:
        pytest.skip(result["skip"])
    live = live_ranks(fault, world)
    skips = fault in SKIPS and not (front == "demo-overlap" and fault == "scaler-inf")
    digests = []
    for r in live:
        rank = result["ranks"][r]
        record, log = rank["record"], rank["log"]
        assert rank["returncode"] == 0, f"rank {r} exit code {rank['returncode']}:\n{log}"
        assert record is not None, f"rank {r} wrote no result:\n{log}"
        for bad in ("terminate called", "SIGABRT", "core dumped", "EnforceNotMet"):
            assert bad not in log, f"rank {r}: {bad}:\n{log}"
        bound = exit_bound(cell_timeout(fault), rank["load"])
        assert rank["exited"] - record["fault_started"] < bound, (r, record)
        if skips:
            assert record["outcome"] == "completed", (r, record)
            assert record["skipped"] >= 1, (r, record)
            digests.append((record["after_fault"], record["after_next"]))
            continue
        assert record["outcome"] == "raised", f"rank {r} did not raise: {record}"
        message = record["message"].lower()
        for needle in CAUSES[fault]:
            assert needle.format(bad=world - 1) in message, (r, record["message"])
        if fault in ("bad-index", "nan-value"):
            assert PEER_CHANGED[front] in message, (r, record["message"])
        assert record["unchanged"], f"rank {r}: the parameters changed before the error: {record}"
    if skips:  # replicas bit-identical after the skip, and after the next step, which trained
        assert len(set(digests)) == 1, digests
        after_skip, after_next = digests[0]
        assert after_skip != after_next
