"""Overlap benchmark: one-GPU study of a GEMM next to an EMULATED communication kernel.

    python benchmarks/overlap_bench.py [--quick] [--budget-s 180] [--out benchmarks/out/overlap.json]

On a GPU (CUDA or ROCm), with one device and no peer, the communication side is emulated
(:class:`cokit.overlap.emulate.EmulatedComm`): a persistent copy kernel on a chosen number of SMs
(each program holding a whole SM), sized so that it takes about as long as the GEMM, or a
device-to-host copy. For a few settings of num_warps x smem_bytes (natural / shaped to one
block per SM) x num_sms (tiled / persistent leaving the copy's SMs free) x stream priority
(high / normal) it measures compute alone, copy alone, both back to back and overlapped, and
prints the speedup over sequential (T_comp + T_comm) / T_ovl and the % of the ideal gain
((T_seq - T_ovl) / min(T_comp, T_comm)). Every row is labelled EMULATED.

Without a GPU it runs the real CPU measurement instead (cokit.cpu_demo: a torch matmul
overlapped with a gloo all-reduce between two processes) and says so; no GPU numbers.
Never asserts on time; stops adding points when the time budget is spent.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch

from cokit.bench.timing import Budget
from cokit.files import OutputError, prepare_out_file
from cokit.files import atomic_write_text as atomic_write

# where the CPU measurement lives (moved from cokit.overlap to the app layer; either works)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return "-" if v is None else str(v)


def _print(rows: list[dict], cols: list[str]) -> None:
    table = [cols] + [[_fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(t[i]) for t in table) for i in range(len(cols))]
    for t in table:
        print("  ".join(c.ljust(w) for c, w in zip(t, widths, strict=True)))


def _gpu_study(rows: list[dict], device: torch.device, quick: bool, budget: Budget) -> None:
    import triton.testing

    from cokit.overlap.emulate import EmulatedComm
    from cokit.overlap.guard import StarvationGuard
    from cokit.overlap.schedules import Overlap
    from cokit.triton_kernels.backend import device_limits, kernel_path
    from cokit.triton_kernels.gemm import gemm, warmup_gemm
    from cokit.triton_kernels.gemm_config import GemmConfig
    from cokit.triton_kernels.occupancy import smem_for_blocks

    limits = device_limits(device)
    backend = kernel_path(device)
    S = 4096 if quick else 8192
    dtype = torch.bfloat16
    a = torch.randn(S, S, device=device, dtype=dtype)
    b = torch.randn(S, S, device=device, dtype=dtype)
    out = torch.empty(S, S, device=device, dtype=dtype)
    base = GemmConfig(
        BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, GROUP_M=8, num_warps=8, num_stages=2 if backend == "hip" else 4
    )
    comm_sms = max(1, limits.num_sms // 8)
    guard = StarvationGuard(max_reserved_fraction=0.25)

    t_gemm = triton.testing.do_bench(lambda: gemm(a, b, config=base, out=out), warmup=10, rep=50)
    probe = EmulatedComm(256 << 20, device, n_sms=comm_sms, exclusive_sms=True)
    t_copy = triton.testing.do_bench(probe, warmup=5, rep=30)
    passes = max(1, round(t_gemm / max(t_copy, 1e-6)))
    probe.passes = passes  # the timed probe becomes the emulated comm (no second 2 x 256 MiB of buffers)
    comms = [probe]
    if not quick:
        comms.append(EmulatedComm(256 << 20, device, kind="d2h"))
    print(
        f"[overlap] GEMM {S}^3 bf16 {t_gemm:.3f} ms; EMULATED comm: copy kernel on {comm_sms} SMs, "
        f"{passes} pass(es) of 256 MiB ({t_copy:.3f} ms per pass)"
    )
    settings = []
    for warps in (4, 8) if not quick else (8,):
        cfg0 = base.replace(num_warps=warps)
        natural = int(warmup_gemm(cfg0, dtype, S, S, S, device=device).metadata.shared)
        shaped = smem_for_blocks(limits, 1)
        smems = [None] + ([shaped] if shaped >= natural else [])
        for smem in smems:
            for num_sms in (None, limits.num_sms - comm_sms):
                for prio in ("high", "normal"):
                    cfg = cfg0.replace(smem_bytes=smem, persistent=num_sms is not None, num_sms=num_sms)
                    settings.append((cfg, prio, natural))
    repeats, warmup = (5, 2) if quick else (10, 3)
    points = [(comm, setting) for comm in comms for setting in settings]
    for i, (comm, (cfg, prio, natural)) in enumerate(points):
        if budget.stop(len(points) - i):
            rows.append(
                dict(kind="overlap_emulated", skipped=f"time budget spent ({len(points) - i} point(s) left)")
            )
            return
        row: dict[str, Any] = dict(
            kind="overlap_emulated",
            emulated=True,
            comm=comm.label,
            num_warps=cfg.num_warps,
            smem_bytes=cfg.smem_bytes or f"natural ({natural})",
            num_sms=cfg.num_sms or "all (tiled)",
            priority=prio,
        )
        try:
            bad = guard.violations(
                cfg,
                limits=limits,
                natural_smem=natural,
                priority=prio,
                comm_sms=comm.n_sms if comm.kind == "copy-kernel" else None,
            )
            row["guard"] = "; ".join(bad) or "ok"
            ov = Overlap(
                lambda cfg=cfg: gemm(a, b, config=cfg, out=out),
                comm,
                device=device,
                priority=prio,
                config=cfg,
                label="gemm+emulated",
            )
            res = ov.measure(repeats=repeats, warmup=warmup)
            m = res.metrics
            row.update(
                T_comp=m.t_comp,
                T_comm=m.t_comm,
                T_seq=m.t_seq,
                T_ovl=m.t_ovl,
                speedup=m.speedup,
                pct_of_ideal=100 * m.fraction_of_ideal_gain,
                comm_hidden=m.comm_hidden,
                compute_slowdown=m.compute_slowdown,
                speedup_iqr=res.metric_spread["speedup"].iqr,
            )
        except Exception as exc:  # one failing point must not hide the others
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        rows.append(row)


def _cpu(rows: list[dict], quick: bool, tiny: bool = False) -> None:
    from cokit.cpu_demo import cpu_gloo_measurement

    if tiny:  # gpu_check --allow-cpu: only shows that the path runs
        sizes: dict[str, int] = dict(size=128, numel=65_536, repeats=2, warmup=1, chunks=2)
    else:
        sizes = dict(
            size=512 if quick else 768,
            numel=1_000_000 if quick else 2_000_000,
            repeats=5 if quick else 10,
            warmup=2,
        )
    per_rank = cpu_gloo_measurement(**sizes)
    for rank, results in enumerate(per_rank):
        for res in results:
            m = res["metrics"]
            rows.append(
                dict(
                    kind="overlap_cpu_gloo",
                    rank=rank,
                    label=res["label"],
                    emulated=False,
                    T_comp=m["t_comp"],
                    T_comm=m["t_comm"],
                    T_seq=m["t_seq"],
                    T_ovl=m["t_ovl"],
                    speedup=m["speedup"],
                    pct_of_ideal=100 * m["fraction_of_ideal_gain"],
                    comm_hidden=m["comm_hidden"],
                    compute_slowdown=m["compute_slowdown"],
                )
            )
            if rank == 0:
                print(res["text"])


def flag_bounds(rows: list[dict]) -> None:
    """Set each measured row's ``noise`` column: why it breaks the physical bounds of overlap
    (:func:`cokit.overlap.sweep.bound_violations`: ``T_ovl`` below compute or communication
    alone, a speedup above ``(T_comp + T_comm) / max(T_comp, T_comm)``), or ''."""
    from cokit.overlap.sweep import bound_violations

    for r in rows:
        times = {
            "compute_ms": r.get("T_comp"),
            "communicate_ms": r.get("T_comm"),
            "overlapped_ms": r.get("T_ovl"),
        }
        r["noise"] = "; ".join(bound_violations({**times, "speedup": r.get("speedup")}))


def run(
    report: dict,
    quick: bool = False,
    budget_s: float = 240.0,
    budget: Budget | None = None,
    tiny: bool = False,
    raise_errors: bool = False,
) -> list[dict]:
    """Run the study; add a summary to ``report['overlap']`` and return the rows.

    ``budget`` (default: ``budget_s`` from now) stops adding points once spent; ``tiny``
    shrinks the CPU measurement; ``raise_errors`` lets a failure of the whole study propagate
    (gpu_check reports it as a FAILED phase) instead of becoming an error row."""
    t0 = time.time()
    budget = budget if budget is not None else Budget(budget_s)
    rows: list[dict] = []
    summary: dict[str, Any] = {"quick": quick, "budget_s": budget.seconds}
    if not torch.cuda.is_available():
        summary["note"] = (
            "no GPU: ran the real CPU measurement (torch matmul + gloo all-reduce, 2 processes) "
            "instead of the one-GPU emulated study"
        )
        print(f"[overlap] {summary['note']}")
        try:
            _cpu(rows, quick, tiny)
        except Exception as exc:
            if raise_errors:
                raise
            rows.append(dict(kind="overlap_cpu_gloo", error=f"{type(exc).__name__}: {exc}"[:500]))
    else:
        device = torch.device("cuda", torch.cuda.current_device())
        summary.update(
            device=torch.cuda.get_device_name(device),
            note="communication is EMULATED (copy kernel on a few SMs / device-to-host copy)",
        )
        try:
            _gpu_study(rows, device, quick, budget)
        except Exception as exc:
            if raise_errors:
                raise
            rows.append(dict(kind="overlap_emulated", error=f"{type(exc).__name__}: {exc}"[:500]))
    good = [r for r in rows if r.get("speedup") is not None]
    for r in rows:
        r.setdefault("bench", "overlap")
    flag_bounds(good)
    physical = [r for r in good if not r["noise"]]
    if physical:  # a point beyond the physical bounds of overlap is noise: never the best
        best = max(physical, key=lambda r: r["speedup"])
        summary["best"] = {
            k: best.get(k)
            for k in (
                "num_warps",
                "smem_bytes",
                "num_sms",
                "priority",
                "comm",
                "label",
                "speedup",
                "pct_of_ideal",
            )
        }
    summary["errors"] = sum(1 for r in rows if r.get("error"))
    summary["points"] = len(good)
    summary["noise_points"] = len(good) - len(physical)
    summary["cut"] = budget.cut
    summary["seconds"] = round(time.time() - t0, 1)
    report["overlap"] = summary
    _print(
        rows,
        [
            "kind",
            "rank",
            "num_warps",
            "smem_bytes",
            "num_sms",
            "priority",
            "T_comp",
            "T_comm",
            "T_ovl",
            "speedup",
            "pct_of_ideal",
            "comm_hidden",
            "compute_slowdown",
            "guard",
            "noise",
            "error",
        ],
    )
    print(f"[overlap] done in {summary['seconds']} s")
    return rows


def main(argv: list[str] | None = None) -> int:
    """Command line: run, print, write JSON."""
    import argparse

    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument(
        "--quick", action="store_true", help="fewer settings, smaller GEMM (about 1 minute on a GPU)"
    )
    p.add_argument("--budget-s", type=float, default=240.0, help="stop adding points after this many seconds")
    p.add_argument(
        "--out",
        default=os.path.join("benchmarks", "out", "overlap.json"),
        help="JSON output file; its folder is checked for writing before anything runs, and an "
        "existing file (an earlier run's) is refused unless --overwrite",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    args = p.parse_args(argv)
    try:
        out = prepare_out_file(args.out, overwrite=args.overwrite)
    except OutputError as exc:
        print(f"overlap_bench: error: {exc}", file=sys.stderr, flush=True)
        return 2
    report: dict = {}
    rows = run(report, quick=args.quick, budget_s=args.budget_s)
    atomic_write(out, json.dumps({"summary": report["overlap"], "rows": rows}, indent=1, default=str))
    print(f"[overlap] wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
