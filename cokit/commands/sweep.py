"""``cokit sweep``: measure compute/communication overlap over configs, sizes and collectives.

    cokit sweep                                   # CPU: 2 gloo ranks, tiny sizes, < 1 minute
    cokit sweep --collectives all_reduce --sizes 4096,8192 --chunks 1,2,4 \\
        --num-warps 4,8 --smem-bytes none,98304 --num-sms none,116 --priority high,normal
    cokit sweep --collectives emulated --comm-sms 8,16,32   # one GPU: EMULATED communication

Each point is a square GEMM (size x size x size) whose size x size product is all-reduced or
reduce-scattered in chunks (tensor-parallel row-linear), or whose A operand is all-gathered
in chunks first (all_gather), or, with ``emulated``, a GEMM next to a memory-bound copy
kernel on --comm-sms SMs (one GPU; labelled EMULATED everywhere). Every point is timed alone,
sequential and overlapped (--warmup + --repeats rounds); rows hold the medians, spreads and
the metrics of docs/design.md §1.2 (speedup, reduction, fraction of ideal gain, comm hidden,
compute slowdown).

Axes are comma lists. --num-warps / --smem-bytes (bytes, k suffix = KiB, 'none' = natural) /
--num-sms ('none' = tiled form; a number = persistent GEMM on that many SMs, the rest left to
communication) override the base --config. On CPU these knobs and --priority change nothing
(torch/gloo path): they are recorded and the output says so; a CPU sweep varies --sizes,
--chunks and --collectives.

A line per point is printed as it finishes: [n/N] <setting> ... <T_ovl> ms (eta N s).
Rows carry the GEMM config's occupancy (blocks_per_sm, limiter, smem_per_block,
reserved_sms; on a GPU from the compiled kernel, through the compile cache of `cokit
occupancy`; empty on CPU, where no SM is occupied: occupancy_source says which). A point whose
overlapped time is below compute alone or communication alone (a speedup above the ideal
(T_comp + T_comm) / max(T_comp, T_comm)) is timing noise: its 'noise' column says why, the
table marks it NOISE, the heatmaps mark it, and it is never the best point.

Writes <out>/sweep.csv, <out>/sweep.json and PNGs: speedup heatmaps (median and IQR over
repeats per cell) over num_warps x smem_bytes and reserved SMs x message size (when those
vary), over chunks x message size per collective, and a timeline bar chart of the best point
within the physical bounds, each written atomically. --out is
created and checked for writing before anything runs; a folder that already holds a sweep's
results (sweep.csv, sweep.json, heatmap_*.png, timeline_best.png) is refused unless
--overwrite is given, which replaces them and removes the earlier plots this sweep does not
draw. Under torchrun the current ranks are used; otherwise --world-size ranks are spawned on
this machine (gloo on CPU, NCCL/RCCL on GPUs).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

from cokit.cli import CliError


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``cokit sweep``."""
    p = subparsers.add_parser(
        "sweep",
        help="sweep overlap of GEMM and collectives over configs x sizes x collectives (CSV, JSON, PNG)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--collectives",
        default=None,
        metavar="LIST",
        help="comma list of all_reduce, reduce_scatter, all_gather, emulated (default: "
        "all_reduce,reduce_scatter,all_gather with >= 2 ranks; emulated on one GPU)",
    )
    p.add_argument(
        "--sizes",
        default=None,
        metavar="LIST",
        help="square GEMM sizes; message = size x size elements (default CPU 256,512; GPU 4096,8192)",
    )
    p.add_argument(
        "--chunks", default=None, metavar="LIST", help="pipeline chunks (default CPU 1,2; GPU 1,2,4)"
    )
    p.add_argument(
        "--config",
        default="",
        metavar="SPEC",
        help="base GemmConfig, e.g. BLOCK_M=128,BLOCK_N=128,BLOCK_K=64,num_warps=8,num_stages=3 "
        "(see `cokit occupancy --help`)",
    )
    p.add_argument(
        "--num-warps", default=None, metavar="LIST", help="num_warps values (default: the base config's)"
    )
    p.add_argument(
        "--smem-bytes",
        default=None,
        metavar="LIST",
        help="per-block shared memory: bytes, k suffix for KiB, none = natural (occupancy shaping)",
    )
    p.add_argument(
        "--num-sms",
        default=None,
        metavar="LIST",
        help="persistent GEMM program counts (SMs left to the GEMM); none = tiled form",
    )
    p.add_argument(
        "--priority",
        default="high",
        metavar="LIST",
        help="comm stream priorities: high, normal or integers (default high)",
    )
    p.add_argument(
        "--comm-sms",
        default=None,
        metavar="LIST",
        help="emulated only: SMs the emulated copy kernel runs on (default: all)",
    )
    p.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="ranks to spawn (default: 2 on CPU, the GPU count with >= 2 GPUs, else 1)",
    )
    p.add_argument(
        "--backend",
        default=None,
        choices=("gloo", "nccl"),
        help="process-group backend (default: nccl on GPUs, gloo on CPU)",
    )
    p.add_argument("--dtype", default=None, help="fp16, bf16 or fp32 (default: fp32 on CPU, bf16 on GPU)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds per point (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="discarded rounds per point (default 1)")
    p.add_argument(
        "--out",
        default="sweep_out",
        help="output directory (default ./sweep_out); refused when it holds an earlier sweep's "
        "results, unless --overwrite",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an earlier sweep's results in --out (default: refuse such a folder)",
    )
    p.add_argument("--no-plots", action="store_true", help="write CSV/JSON only")
    p.add_argument(
        "--no-telemetry",
        action="store_true",
        help="do not write OUT/telemetry/sweep/rank<r>.jsonl (one line per point; cokit dashboard OUT)",
    )
    p.set_defaults(func=run)
    return p


def _items(name: str, text: str) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise CliError(f"--{name} is empty; give a comma-separated list")
    return items


def _smems(text: str) -> list[int | None]:
    from cokit.triton_kernels.gemm_config import parse_smem_bytes

    out: list[int | None] = []
    for item in _items("smem-bytes", text):
        try:
            v = parse_smem_bytes(item)
        except ValueError:
            raise CliError(f"--smem-bytes: {item!r} is not a byte count (k suffix for KiB) or none") from None
        if v is not None and v < 1:
            raise CliError(f"--smem-bytes: {item!r} must be >= 1")
        out.append(v)
    return out


def _ints(name: str, text: str, *, allow_none: bool = False) -> list[int | None]:
    out: list[int | None] = []
    for item in _items(name, text):
        low = item.lower()
        if allow_none and low == "none":
            out.append(None)
            continue
        try:
            v = int(low, 0)
        except ValueError:
            raise CliError(
                f"--{name}: {item!r} is not an integer{' or none' if allow_none else ''}"
            ) from None
        if v < 1:
            raise CliError(f"--{name}: {item!r} must be >= 1")
        out.append(v)
    return out


def run(args: argparse.Namespace) -> int:
    """Build the grid, run it on the ranks, write the records and plots, print a table."""
    import torch

    from cokit.files import remove_stale_outputs
    from cokit.launch import in_torchrun
    from cokit.overlap.schedules import _config_backend
    from cokit.overlap.sweep import SWEEP_COLLECTIVES, check_point, sweep_points
    from cokit.sweeps import NOISE_RULE, OUTPUTS, default_plots, sweep_main, write_csv, write_json
    from cokit.triton_kernels.backend import device_limits
    from cokit.triton_kernels.gemm_config import parse_config_spec, parse_dtype

    on_gpu = torch.cuda.is_available()
    n_gpus = torch.cuda.device_count() if on_gpu else 0
    if args.world_size is not None and args.world_size < 1:
        raise CliError(f"--world-size {args.world_size} is invalid; allowed: an integer >= 1")
    if in_torchrun():
        world = int(os.environ["WORLD_SIZE"])
    else:
        world = (
            args.world_size
            if args.world_size is not None
            else (2 if not on_gpu else (n_gpus if n_gpus >= 2 else 1))
        )
    backend = args.backend or ("nccl" if on_gpu and world > 1 else "gloo")
    if backend == "nccl" and not in_torchrun() and n_gpus < world:
        raise CliError(f"--backend nccl with {world} ranks needs {world} GPUs; found {n_gpus}")
    default_cols = "emulated" if world == 1 else "all_reduce,reduce_scatter,all_gather"
    collectives = _items("collectives", args.collectives or default_cols)
    for c in collectives:
        if c not in SWEEP_COLLECTIVES:
            raise CliError(f"--collectives: {c!r} is unknown; allowed: {', '.join(SWEEP_COLLECTIVES)}")
    if "emulated" in collectives and world > 1:
        raise CliError("--collectives emulated is a one-device study; use --world-size 1")
    gpu_run = on_gpu and (backend == "nccl" or world == 1)
    sizes = _ints("sizes", args.sizes or ("4096,8192" if gpu_run else "256,512"))
    chunks = _ints("chunks", args.chunks or ("1,2,4" if gpu_run else "1,2"))
    try:
        dtype = parse_dtype(args.dtype or ("bf16" if gpu_run else "fp32"))
        base = parse_config_spec(args.config)
    except ValueError as exc:
        raise CliError(f"--config/--dtype: {exc}") from None
    warps = _ints("num-warps", args.num_warps) if args.num_warps else [base.num_warps]
    smems = _smems(args.smem_bytes) if args.smem_bytes else [base.smem_bytes]
    sms = _ints("num-sms", args.num_sms, allow_none=True) if args.num_sms else [base.num_sms]
    comm_sms = _ints("comm-sms", args.comm_sms) if args.comm_sms else [None]
    if args.comm_sms and "emulated" not in collectives:
        raise CliError("--comm-sms applies to --collectives emulated only")
    priorities: list[str | int] = []
    for item in _items("priority", args.priority):
        if item in ("high", "normal"):
            priorities.append(item)
        else:
            try:
                priorities.append(int(item))
            except ValueError:
                raise CliError(
                    f"--priority: {item!r} is invalid; allowed: high, normal or an integer"
                ) from None
    from cokit.overlap.streams import resolve_priority

    for pr in priorities:
        try:
            resolve_priority(pr, "cuda" if gpu_run else "cpu")
        except ValueError as exc:
            raise CliError(f"--priority: {exc}") from None
    for name, v, lo in (("repeats", args.repeats, 1), ("warmup", args.warmup, 0)):
        if v < lo:
            raise CliError(f"--{name} {v} is invalid; allowed: an integer >= {lo}")

    limits = device_limits() if gpu_run else None
    cfg_backend = _config_backend(torch.device("cuda" if gpu_run else "cpu"))
    configs = []
    for w in warps:
        for s in smems:
            for n in sms:
                cfg = base.replace(
                    num_warps=w, smem_bytes=s, num_sms=n, persistent=n is not None or base.persistent
                )
                try:
                    cfg.validate(cfg_backend, limits, dtype=dtype if not gpu_run else None)
                except ValueError as exc:
                    raise CliError(f"config {cfg.spec()}: {exc}") from None
                configs.append(cfg)
    try:
        points = sweep_points(configs, sizes, collectives, chunks, priorities, comm_sms)
        for p in points:
            check_point(p, world)
    except ValueError as exc:
        raise CliError(str(exc)) from None

    lead = not in_torchrun() or int(os.environ["RANK"]) == 0  # only rank 0 prints and writes
    if lead:  # before anything runs: an unusable --out fails now, not after the sweep
        _prepare_out(args.out, args.overwrite)
    if lead:
        print(
            f"cokit sweep: {len(points)} point(s) x {args.warmup}+{args.repeats} rounds on {world} rank(s), "
            f"backend {backend if world > 1 else '-'}, device {'GPU' if gpu_run else 'CPU'}, dtype {dtype}"
        )
    if lead and not gpu_run:
        print(
            "note: CPU run -- num_warps / smem_bytes / num_sms / priority are recorded but change nothing here "
            "(torch GEMM + gloo); only sizes, chunks and collectives vary what runs."
        )
    if lead and "emulated" in collectives:
        print(
            "note: 'emulated' communication is a copy kernel / copy on one device, not a collective (EMULATION)."
        )
    sys.stdout.flush()  # before the ranks start: their progress lines come after these
    t0 = time.time()
    try:
        rows = sweep_main(
            points,
            world_size=world,
            backend=backend,
            dtype=str(dtype).removeprefix("torch."),
            repeats=args.repeats,
            warmup=args.warmup,
            progress=lead,
            telemetry_dir=None if args.no_telemetry else args.out,
        )
    except (RuntimeError, ValueError) as exc:
        raise CliError(f"sweep failed: {str(exc).strip().splitlines()[-1]}") from None
    if rows is None:  # torchrun rank > 0: rank 0 holds every rank's rows and writes them
        return 0
    out = args.out
    csv_path = write_csv(rows, os.path.join(out, "sweep.csv"))
    from cokit.overlap.sweep import CPU_OCCUPANCY

    meta = {
        "world_size": world,
        "backend": backend,
        "device": "gpu" if gpu_run else "cpu",
        "dtype": str(dtype),
        "repeats": args.repeats,
        "warmup": args.warmup,
        "torch": torch.__version__,
        "seconds": round(time.time() - t0, 2),
        "occupancy": (
            "from each config's compiled kernel on the live GPU (compile cache), see occupancy_source"
            if gpu_run
            else CPU_OCCUPANCY
        ),
        "noise_rule": NOISE_RULE,
        "noise_rows": {
            "rank0": sum(1 for r in rows if r.get("noise") and r.get("rank", 0) == 0),
            "all_ranks": sum(1 for r in rows if r.get("noise")),
        },
    }
    json_path = write_json(rows, os.path.join(out, "sweep.json"), meta)
    _print_rows([r for r in rows if r.get("rank", 0) == 0])
    files = [csv_path, json_path]
    if not args.no_plots:
        files += default_plots(rows, out)
    if not args.no_telemetry:
        files.append(Path(out) / "telemetry")
    if args.overwrite:  # the folder holds this sweep's results only
        remove_stale_outputs(out, OUTPUTS, files)
        if args.no_telemetry:  # an earlier sweep's telemetry would pass for this one's
            shutil.rmtree(Path(out) / "telemetry" / "sweep", ignore_errors=True)
    print(f"done in {time.time() - t0:.1f} s; wrote:")
    for f in files:
        print(f"  {f}")
    errors = [r for r in rows if r.get("error")]
    if errors:
        print(f"{len(errors)} point(s) failed; see the 'error' column", file=sys.stderr)
        return 1
    return 0


def _prepare_out(out: str, overwrite: bool) -> None:
    """Create ``--out`` and prove it writable; refuse an earlier sweep's results unless
    ``--overwrite`` (one-line errors)."""
    from cokit.files import OutputError, prepare_out_dir
    from cokit.sweeps import OUTPUTS

    try:
        prepare_out_dir(out, OUTPUTS, overwrite=overwrite)
    except OutputError as exc:
        raise CliError(str(exc)) from None


def _print_rows(rows: list[dict]) -> None:
    from cokit.overlap.sweep import best_row
    from cokit.sweeps import describe_point

    cols = [
        ("collective", "collective"),
        ("size", "size"),
        ("chunks", "chunks"),
        ("num_warps", "warps"),
        ("smem_bytes", "smem"),
        ("num_sms", "sms"),
        ("priority", "prio"),
        ("compute_ms", "T_comp"),
        ("communicate_ms", "T_comm"),
        ("sequential_ms", "T_seq_meas"),
        ("overlapped_ms", "T_ovl"),
        ("speedup", "speedup"),
        ("comm_hidden", "hidden"),
        ("compute_slowdown", "slowdown"),
        ("blocks_per_sm", "blk/SM"),
        ("limiter", "limiter"),
        ("noise", "flag"),
    ]

    def cell(k: str, v: object) -> str:
        if k == "noise":
            return "NOISE" if v else ""
        if isinstance(v, float):
            return f"{v:.3f}"
        return "-" if v is None or v == "" else str(v)

    table = [[h for _, h in cols]] + [[cell(k, r.get(k)) for k, _ in cols] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
    print("rank 0 (times: medians in ms; T_seq_meas = both run back to back, unchunked):")
    for row in table:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
    for r in rows:
        if r.get("error"):
            print(f"  error at {r['collective']} size {r['size']} chunks {r['chunks']}: {r['error']}")
    noisy = [r for r in rows if r.get("noise")]
    if noisy:
        print(
            f"NOISE: {len(noisy)} point(s) break the physical bounds of overlap (timing noise; never 'best'):"
        )
        for r in noisy:
            print(f"  {describe_point(r)}: {r['noise']}")
    best = best_row(rows)
    if best is not None:
        print(
            f"best within the physical bounds: {describe_point(best)}, speedup {float(best['speedup']):.3f}"
        )
    elif any(not r.get("error") for r in rows):
        print("no point within the physical bounds: no best point (and no timeline_best.png)")
