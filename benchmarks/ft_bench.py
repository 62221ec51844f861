"""Fault-tolerant training, compressed or not: torchft's own DiLoCo against cokit's SparseLoCo on
torchft, with and without a replica killed at half time and restarted later.

    python -m cokit.bench.ft_bench --seeds 0 1 2 --syncs 40 --restart-after 60 --out ft_bench.json
    python -m cokit.bench.ft_bench --methods sparseloco --seeds 0 --syncs 6 --faults none   # a smoke run

Each run starts a torchft lighthouse on loopback and three replica groups (one process each,
:mod:`cokit.bench.ft_bench_worker`) that train the protocol's char-level language model on
their own shards with the same inner AdamW and sync interval: ``diloco`` (torchft's ``DiLoCo``:
every pseudo-gradient in fp32 through an all-reduce, outer Nesterov SGD as in its paper) or
``sparseloco`` (top-k of each tile, int2 values, error feedback, through an all-gather; its
default outer step, the mean, or ``--sparseloco-outer nesterov``). Fault ``kill``: replica 2 is
SIGKILLed once replica 0 has committed half the syncs and restarted ``--restart-after`` seconds
later; it heals from a live peer. A run ends when the quorum has committed ``--syncs`` syncs.

Per run: replica 0's final held-out loss (the synced weights), its held-out curve (for the time
to reach a target loss), the bytes a replica sends per step (a sync's bytes over the steps of a
period: a ring all-reduce of the fp32 pseudo-gradients for ``diloco``, SparseLoCo's own count of
its all-gather and status row), the wall time, and under a fault the seconds until the
survivors synced without the dead replica and until the restarted one had healed. torchft's
quantized DiLoCo (``should_quantize=True``: fp8 values and an fp32 scale per row) runs only on
CUDA tensors, so it is not run here: its bytes are computed from that format (a ring all-reduce
of 3 replicas, padding left out) and its loss is not measured.
Prints a table, writes JSON and CSV atomically (``--out``; an existing file is refused unless
``--overwrite``). Runs from a source checkout.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cokit.compress.stats import ring_allreduce_bytes
from cokit.files import atomic_write_text, prepare_out_file

ROOT = Path(__file__).resolve().parents[1]
REPLICAS = 3
KILLED = 2  # the replica the fault kills and restarts
FAULTS = ("none", "kill")
WAIT_S = 900.0  # the most any one wait may take: a failure, not a hang
GRACE_S = 15.0  # how long replica 2 may take to end after replicas 0 and 1 did


def lighthouse_binary() -> str:
    """The ``torchft_lighthouse`` binary beside this interpreter (or on PATH)."""
    found = shutil.which("torchft_lighthouse") or str(Path(sys.executable).with_name("torchft_lighthouse"))
    if not Path(found).exists():
        raise SystemExit("ft_bench: the torchft_lighthouse binary is missing; pip install 'cokit[ft]'")
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(ready: Callable[[], Any], what: str, procs: list[subprocess.Popen], limit: float = WAIT_S) -> Any:
    """Poll ``ready`` until truthy; a process in ``procs`` that fails meanwhile ends the wait."""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        value = ready()
        if value:
            return value
        for p in procs:
            if p.poll() not in (None, 0):
                cmd = [str(a) for a in p.args] if isinstance(p.args, list) else [str(p.args)]
                tail = Path(cmd[-1]).read_text()[-3000:] if Path(cmd[-1]).is_file() else ""
                raise RuntimeError(
                    f"ft_bench: waiting for {what}: {cmd[:8]} exited with {p.returncode}\n{tail}"
                )
        time.sleep(0.1)
    raise RuntimeError(f"ft_bench: {what} did not happen within {limit:g} s")


def _rows(path: Path, event: str) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    lines = [line for line in path.read_text().splitlines() if line.endswith("}")]
    return [r for r in map(json.loads, lines) if r["event"] == event]


class Run:
    """One run's lighthouse and replica processes, in a folder of logs."""

    def __init__(self, folder: Path, worker_args: list[str]):
        self.folder, self.worker_args = folder, worker_args
        self.procs: list[subprocess.Popen] = []
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        cmd = [lighthouse_binary(), "--min_replicas", "2", "--quorum_tick_ms", "100"]
        cmd += ["--join_timeout_ms", "2000", "--heartbeat_timeout_ms", "2000", "--bind", f"127.0.0.1:{port}"]
        with open(folder / "lighthouse.log", "w") as out:
            self.lighthouse = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        _wait(lambda: self._listening(port), "the lighthouse to listen", [self.lighthouse], 60)

    @staticmethod
    def _listening(port: int) -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    def start(self, replica: int, name: str) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "cokit.bench.ft_bench_worker", "--lighthouse", self.url]
        cmd += ["--replica", str(replica), "--replicas", str(REPLICAS), "--log", str(self.log(name))]
        cmd += [*self.worker_args, "--out", str(self.folder / f"{name}.out")]  # the last: read on failure
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        with open(self.folder / f"{name}.out", "w") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        self.procs.append(proc)
        return proc

    def log(self, name: str) -> Path:
        return self.folder / f"{name}.jsonl"

    def close(self) -> None:
        for p in [*self.procs, self.lighthouse]:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)


def _ended(p: subprocess.Popen) -> Callable[[], bool]:
    return lambda: p.poll() is not None


def run_once(method: str, seed: int, fault: str, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """One run (module docstring): its measurements as a JSON-ready row."""
    worker_args = ["--method", method, "--seed", str(seed), "--syncs", str(args.syncs)]
    worker_args += ["--sync-every", str(args.sync_every), "--preset", args.preset, "--lr", str(args.lr)]
    worker_args += ["--topk", str(args.topk), "--chunk", str(args.chunk), "--timeout", str(args.timeout)]
    worker_args += ["--sparseloco-outer", args.sparseloco_outer]
    run = Run(folder, worker_args)
    row: dict[str, Any] = {"method": method, "seed": seed, "fault": fault}
    try:
        procs = [run.start(r, f"r{r}") for r in range(REPLICAS)]
        if fault == "kill":
            half = args.syncs // 2
            _wait(lambda: len(_rows(run.log("r0"), "sync")) >= half, "replica 0 to reach half time", procs)
            procs[KILLED].send_signal(signal.SIGKILL)
            procs[KILLED].wait(timeout=30)
            killed = time.time()
            live = procs[:KILLED]
            after = _wait(
                lambda: [
                    r for r in _rows(run.log("r0"), "sync") if r["t"] > killed and r["world"] == REPLICAS - 1
                ],
                "the survivors to sync without the killed replica",
                live,
            )
            row["continue_s"] = after[0]["t"] - killed
            time.sleep(args.restart_after)  # the replacement arrives a while later
            back = run.start(KILLED, f"r{KILLED}b")
            procs = [*live, back]
            _wait(
                lambda: _rows(run.log(f"r{KILLED}b"), "sync") or all(p.poll() is not None for p in live),
                "the restarted replica to heal and sync (or the survivors to finish)",
                procs,
            )
            healed = _rows(run.log(f"r{KILLED}b"), "sync")
            row["rejoined"] = bool(healed)
            if healed:
                row["heal_s"] = healed[0]["t"] - _rows(run.log(f"r{KILLED}b"), "start")[0]["t"]
            else:  # it came after the end: nobody is left to form a quorum with
                back.kill()
                procs = live
        for p in procs[:KILLED]:  # replicas 0 and 1 train from start to end
            _wait(_ended(p), "replicas 0 and 1 to finish", procs)
        for p in procs[KILLED:]:  # the last ends at the same sync, or is behind with nobody left
            try:  # to form a quorum with (it would wait out its quorum timeout): not needed then
                p.wait(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=30)
        syncs = _rows(run.log("r0"), "sync")
        start = _rows(run.log("r0"), "start")[0]
        curve = [(r["t"] - start["t"], r["heldout"]) for r in syncs if "heldout" in r]
        if not curve:
            raise RuntimeError(f"ft_bench: replica 0 logged no held-out loss; its log: {run.log('r0')}")
        row.update(
            params=start["params"],
            fp8_diloco_bytes_per_step=ring_allreduce_bytes(start["fp8_payload"], REPLICAS) / args.sync_every,
            heldout=curve[-1][1],
            curve=curve,
            wall_s=syncs[-1]["t"] - start["t"],
            bytes_per_step=sum(r["bytes"] for r in syncs) / (len(syncs) * args.sync_every),
            worlds=sorted({r["world"] for r in syncs}),
        )
        return row
    finally:
        run.close()


def time_to(curve: list[list[float]], target: float) -> float | None:
    """The first time (s) a held-out loss <= ``target`` was seen, or None."""
    return next((t for t, loss in curve if loss <= target), None)


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Seed means per (method, fault); loss against the same method without a fault, and time to
    the target of each seed: the final loss of that seed's no-fault ``diloco`` run (without one,
    of the seed's best no-fault run)."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["method"], r["fault"]), []).append(r)
    clean = {m: statistics.fmean(r["heldout"] for r in rs) for (m, f), rs in groups.items() if f == "none"}
    targets: dict[int, float] = {}
    for r in sorted(
        (r for r in rows if r["fault"] == "none"), key=lambda r: (r["method"] != "diloco", r["heldout"])
    ):
        targets.setdefault(r["seed"], r["heldout"])  # diloco's first, else the best
    out = []
    for (method, fault), rs in sorted(groups.items()):
        loss = statistics.fmean(r["heldout"] for r in rs)
        reached = [time_to(r["curve"], targets[r["seed"]]) if r["seed"] in targets else None for r in rs]
        entry: dict[str, Any] = {
            "method": method,
            "fault": fault,
            "seeds": len(rs),
            "heldout": loss,
            "heldout_sd": statistics.stdev([r["heldout"] for r in rs]) if len(rs) > 1 else 0.0,
            "vs_no_fault_pct": 100 * (loss / clean[method] - 1) if method in clean else None,
            "bytes_per_step": statistics.fmean(r["bytes_per_step"] for r in rs),
            "fewer_than_fp8_diloco": statistics.fmean(
                r["fp8_diloco_bytes_per_step"] / r["bytes_per_step"] for r in rs
            ),
            "wall_s": statistics.fmean(r["wall_s"] for r in rs),
            "target": statistics.fmean(targets[r["seed"]] for r in rs)
            if all(r["seed"] in targets for r in rs)
            else None,
            "time_to_target_s": _all_reached(reached),
            "rejoined": sum(bool(r.get("rejoined")) for r in rs) if fault == "kill" else None,
            "continue_s": _mean(rs, "continue_s"),
            "heal_s": _mean(rs, "heal_s"),
        }
        out.append(entry)
    return out


def _all_reached(times: list[float | None]) -> float | None:
    """The mean time to target, or None unless every seed reached it."""
    reached = [t for t in times if t is not None]
    return statistics.fmean(reached) if times and len(reached) == len(times) else None


def _mean(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return statistics.fmean(values) if values else None


def table(summary: list[dict[str, Any]]) -> str:
    """The summary as a markdown table."""

    def fmt(v: Any, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    lines = [
        "| method | fault | seeds | held-out loss | vs no fault | bytes/step | x fewer than fp8 DiLoCo "
        "| wall s | to target s | continue s | rejoined | heal s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        lines.append(
            f"| {s['method']} | {s['fault']} | {s['seeds']} | {s['heldout']:.4f} ± {s['heldout_sd']:.4f} "
            f"| {fmt(s['vs_no_fault_pct'], '+.2f')}% | {s['bytes_per_step']:.0f} | {s['fewer_than_fp8_diloco']:.1f} "
            f"| {s['wall_s']:.1f} "
            f"| {fmt(s['time_to_target_s'], '.1f')} | {fmt(s['continue_s'], '.1f')} | {fmt(s['rejoined'], 'd')} "
            f"| {fmt(s['heal_s'], '.1f')} |"
        )
    return "\n".join(lines)


def _csv(rows: list[dict[str, Any]]) -> str:
    keys = [k for k in rows[0] if k != "curve"] if rows else []
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=keys, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--methods", nargs="+", choices=("diloco", "sparseloco"), default=["diloco", "sparseloco"]
    )
    ap.add_argument("--faults", nargs="+", choices=FAULTS, default=list(FAULTS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--syncs", type=int, default=40, help="syncs the quorum commits (>= 2)")
    ap.add_argument("--sync-every", type=int, default=5)
    ap.add_argument("--preset", default="toy", help="model size (cokit.workloads.model.MODEL_PRESETS)")
    ap.add_argument("--lr", type=float, default=3e-3, help="the inner AdamW's learning rate")
    ap.add_argument("--sparseloco-outer", choices=("average", "nesterov"), default="average")
    ap.add_argument("--topk", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=10.0, help="each collective's timeout (s)")
    ap.add_argument("--restart-after", type=float, default=60.0, help="seconds from the kill to the restart")
    ap.add_argument("--out", default="ft_bench.json")
    ap.add_argument("--overwrite", action="store_true")
    ap.add_argument(
        "--logs", help="keep the replicas' and the lighthouse's logs in this folder (default: removed)"
    )
    args = ap.parse_args(argv)
    if args.syncs < 2 or args.sync_every < 1 or args.restart_after < 0 or args.timeout <= 0:
        ap.error("--syncs must be >= 2, --sync-every >= 1, --restart-after >= 0 and --timeout > 0")
    out = prepare_out_file(args.out, overwrite=args.overwrite)
    load = os.getloadavg()
    rows = []
    plan = [(m, s, f) for s in args.seeds for f in args.faults for m in args.methods]  # methods interleaved
    with tempfile.TemporaryDirectory(prefix="cokit-ft-bench-") as tmp:
        tmp = args.logs or tmp
        for i, (method, seed, fault) in enumerate(plan, 1):
            folder = Path(tmp) / f"{method}-{seed}-{fault}"
            folder.mkdir(parents=True, exist_ok=args.logs is not None)
            print(f"[{i}/{len(plan)}] {method} seed {seed} fault {fault} ...", flush=True)
            rows.append(run_once(method, seed, fault, args, folder))
            print(f"    held-out {rows[-1]['heldout']:.4f} in {rows[-1]['wall_s']:.1f} s", flush=True)
    summary = summarize(rows)
    print(table(summary))
    result = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "overwrite")},
        "load_average": {"before": load, "after": os.getloadavg()},
        "summary": summary,
        "runs": rows,
    }
    atomic_write_text(out, json.dumps(result, indent=1) + "\n")
    atomic_write_text(out.with_suffix(".csv"), _csv(summary))
    print(f"wrote {out} and {out.with_suffix('.csv')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
