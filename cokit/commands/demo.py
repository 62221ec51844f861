"""``cokit demo``: train one small model three times -- DeMo (compressed momentum every step),
SparseLoCo (local AdamW steps, a compressed pseudo-gradient every ``--sync-every`` steps) and
AdamW (dense all-reduce every step).

    cokit demo                        # 2 local ranks; CPU + gloo, or GPUs + NCCL/RCCL
    cokit demo --steps 400 --model small --topk 16 --payload sign --out results/demo-k16
    torchrun --nnodes 2 --nproc-per-node 8 ... -m cokit demo --device cuda   # multi-node

A character-level transformer learns to continue Python source (the standard library's own
``.py`` files: nothing to download). Every run uses the same seed, initial weights, batches
and held-out text. Progress lines come from rank 0; at the end a table gives each method's
final train and held-out loss, bytes sent per step and rank, compression ratio and time per
step, and ``demo.json``, ``demo.csv`` (one row per method and step) and ``demo.png``
(loss vs step, loss vs bytes sent) land in ``--out``, each written atomically, with the
telemetry stream of every rank and method in ``--out``/telemetry/ (``cokit dashboard --out``
draws it; ``--no-telemetry`` turns it off). ``--out`` is
created and checked for writing before training starts; a folder holding an earlier run's
results is refused unless ``--overwrite`` is given (a second run never replaces them silently).
``--overlap`` trains every method on ``cokit.overlap.Linear`` layers whose GEMM configs an online
tuner picks while training (``cokit.overlap.apply_overlap``): the telemetry records the configs in
use and the tuner's decisions, agreed by every rank (on CPU the configs change no timing).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import TYPE_CHECKING

from cokit.cli import CliError

if TYPE_CHECKING:
    from cokit.files import WriteError

METHOD_NAMES = ("demo", "sparseloco", "adamw")
#: telemetry run name of each method (``<out>/telemetry/<run>/rank<r>.jsonl``)
TELEMETRY_RUNS = {"demo": "demo-DeMo", "sparseloco": "demo-SparseLoCo", "adamw": "demo-AdamW"}
DEFAULTS = {
    "ranks": 2,
    "steps": 400,
    "model": "tiny",
    "batch_size": 16,
    "topk": 32,
    "chunk": 64,
    "decay": 0.999,
    "demo_lr": 1e-3,
    "adamw_lr": 1e-3,
    # SparseLoCo: the validation study's best configuration at >= 100x fewer bytes on text
    "sync_every": 5,
    "sparseloco_topk": 64,
    "sparseloco_payload": "int2",
    "sparseloco_lr": 1e-3,
    "eval_every": 25,
    "max_chars": 2_000_000,
}


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``cokit demo``."""
    from cokit.compress.payload import codec_names
    from cokit.train import DEFAULT_TIMEOUT_S, SCHEDULES
    from cokit.workloads.model import MODEL_PRESETS

    d = DEFAULTS
    p = subparsers.add_parser(
        "demo",
        help="train a small char transformer with DeMo, SparseLoCo and AdamW; compare loss and bytes",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--ranks",
        type=int,
        default=None,
        help=f"local processes to spawn (default {d['ranks']}; under torchrun: WORLD_SIZE)",
    )
    p.add_argument(
        "--steps", type=int, default=d["steps"], help=f"training steps per method (default {d['steps']})"
    )
    p.add_argument(
        "--model",
        choices=tuple(MODEL_PRESETS),
        default=d["model"],
        help=f"model size preset (default {d['model']}); "
        + "; ".join(
            f"{k}: d={v['d_model']} L={v['n_layers']} T={v['max_seq_len']}" for k, v in MODEL_PRESETS.items()
        ),
    )
    p.add_argument("--d-model", type=int, default=None, help="override the preset's width")
    p.add_argument("--layers", type=int, default=None, help="override the preset's number of blocks")
    p.add_argument("--heads", type=int, default=None, help="override the preset's attention heads")
    p.add_argument("--seq-len", type=int, default=None, help="override the preset's context length")
    p.add_argument(
        "--batch-size",
        type=int,
        default=d["batch_size"],
        help=f"sequences per rank per step (default {d['batch_size']})",
    )
    p.add_argument(
        "--topk", type=int, default=d["topk"], help=f"DeMo: coefficients kept per tile (default {d['topk']})"
    )
    p.add_argument(
        "--chunk",
        type=int,
        default=d["chunk"],
        help=f"DeMo and SparseLoCo: tile side target (default {d['chunk']})",
    )
    p.add_argument(
        "--decay", type=float, default=d["decay"], help=f"DeMo: momentum decay (default {d['decay']})"
    )
    p.add_argument(
        "--payload",
        choices=codec_names(),
        default="compact",
        help="DeMo wire format: compact (int16 idx + bf16 values), sign (1 bit/value), "
        "reference (int64 + fp32, DeMo's reference) (default compact)",
    )
    p.add_argument(
        "--demo-lr", type=float, default=d["demo_lr"], help=f"DeMo learning rate (default {d['demo_lr']})"
    )
    p.add_argument(
        "--sync-every",
        type=int,
        default=d["sync_every"],
        help=f"SparseLoCo: local steps per sync (default {d['sync_every']})",
    )
    p.add_argument(
        "--sparseloco-topk",
        type=int,
        default=d["sparseloco_topk"],
        help=f"SparseLoCo: pseudo-gradient values kept per tile (default {d['sparseloco_topk']})",
    )
    p.add_argument(
        "--sparseloco-payload",
        choices=codec_names(),
        default=d["sparseloco_payload"],
        help=f"SparseLoCo wire format (default {d['sparseloco_payload']}: 2-bit values)",
    )
    p.add_argument(
        "--sparseloco-lr",
        type=float,
        default=d["sparseloco_lr"],
        help=f"SparseLoCo's inner AdamW learning rate (default {d['sparseloco_lr']})",
    )
    p.add_argument(
        "--adamw-lr", type=float, default=d["adamw_lr"], help=f"AdamW learning rate (default {d['adamw_lr']})"
    )
    p.add_argument(
        "--schedule",
        choices=SCHEDULES,
        default="constant",
        help="learning-rate schedule for both (cosine decays to 10%%; default constant)",
    )
    p.add_argument(
        "--warmup",
        type=float,
        default=0.0,
        help="fraction of the steps with a linear learning-rate warm-up (default 0)",
    )
    p.add_argument(
        "--weight-decay", type=float, default=0.0, help="decoupled weight decay for both (default 0)"
    )
    p.add_argument(
        "--methods",
        default=",".join(METHOD_NAMES),
        help="comma-separated subset of demo,sparseloco,adamw to run (default all three)",
    )
    p.add_argument("--seed", type=int, default=0, help="model init and data order seed (default 0)")
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: cuda (NCCL/RCCL, one GPU per rank) when enough GPUs exist, else cpu (gloo)",
    )
    p.add_argument(
        "--eval-every",
        type=int,
        default=d["eval_every"],
        help=f"held-out evaluation and progress line every N steps (default {d['eval_every']})",
    )
    p.add_argument(
        "--max-chars",
        type=int,
        default=d["max_chars"],
        help=f"corpus size in characters (default {d['max_chars']})",
    )
    p.add_argument(
        "--out",
        default=os.path.join("results", "demo"),
        help="output folder (default results/demo); created and checked for writing before training "
        "starts. A folder that already holds demo.json, demo.csv or demo.png is refused (nothing "
        "is trained) unless --overwrite is given",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the results of an earlier run in --out (default: refuse such a folder)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        metavar="SECONDS",
        help="seconds a collective may wait for the other ranks before the run stops with "
        f"CollectiveTimeout (default {DEFAULT_TIMEOUT_S:g}: above the slowest CPU step, so a frozen or dead rank "
        "stops the others in minutes, not gloo's 30; inf: no limit but the process group's own)",
    )
    p.add_argument(
        "--triton-interpret",
        action="store_true",
        help="CPU ranks run the Triton kernels through the interpreter (slow; for checking)",
    )
    p.add_argument(
        "--no-telemetry",
        action="store_true",
        help="do not write the per-step telemetry stream (default: --out/telemetry/demo-DeMo/ and "
        "demo-AdamW/, one JSONL file per rank, for `cokit dashboard`)",
    )
    p.add_argument(
        "--sinks",
        default="jsonl",
        metavar="LIST",
        help="telemetry sinks of every rank, comma-separated from jsonl, csv, parquet, tensorboard, "
        "prometheus (default jsonl; prometheus serves rank r on $COKIT_PROMETHEUS_PORT+r, default 9464+r)",
    )
    p.add_argument(
        "--overlap",
        action="store_true",
        help="train on cokit.overlap.Linear layers whose GEMM configs an online tuner picks while training "
        "(cokit.overlap.apply_overlap; configs and decisions go to the telemetry; on CPU they change no timing)",
    )
    p.add_argument(
        "--price-per-hour",
        type=float,
        default=None,
        metavar="PRICE",
        help="print each method's time and cost per epoch (the training text once) at PRICE per rank-hour",
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=run)
    return p


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise CliError(message)


def _resolve(args: argparse.Namespace) -> tuple[int, str, bool, list[str], int]:
    """Validate the arguments; return (world size, device, running under torchrun, methods,
    GPUs torch sees)."""
    from cokit.train import in_torchrun

    torchrun = in_torchrun()
    cores = os.cpu_count() or 1
    if torchrun:
        world = int(os.environ["WORLD_SIZE"])
        _check(
            args.ranks is None or args.ranks == world,
            f"--ranks {args.ranks} disagrees with torchrun's WORLD_SIZE={world}; leave --ranks out",
        )
    else:
        world = int(DEFAULTS["ranks"]) if args.ranks is None else args.ranks  # type: ignore[call-overload]
        _check(
            1 <= world <= cores * 4, f"--ranks must be in [1, {cores * 4}] (4 per CPU core here), got {world}"
        )
    _check(args.steps >= 1, f"--steps must be >= 1, got {args.steps}")
    _check(
        args.price_per_hour is None or (math.isfinite(args.price_per_hour) and args.price_per_hour >= 0),
        f"--price-per-hour must be a finite number >= 0, got {args.price_per_hour}",
    )
    _check(args.eval_every >= 1, f"--eval-every must be >= 1, got {args.eval_every}")
    _check(args.batch_size >= 1, f"--batch-size must be >= 1, got {args.batch_size}")
    _check(args.chunk >= 1, f"--chunk must be >= 1, got {args.chunk}")
    _check(
        1 <= args.topk <= args.chunk**2,
        f"--topk must be in [1, chunk*chunk = {args.chunk**2}], got {args.topk}",
    )
    _check(0.0 <= args.decay <= 1.0, f"--decay must be in [0, 1], got {args.decay}")
    _check(args.sync_every >= 1, f"--sync-every must be >= 1, got {args.sync_every}")
    _check(
        1 <= args.sparseloco_topk <= args.chunk**2,
        f"--sparseloco-topk must be in [1, chunk*chunk = {args.chunk**2}], got {args.sparseloco_topk}",
    )
    for flag in ("demo_lr", "adamw_lr", "sparseloco_lr"):
        v = getattr(args, flag)
        _check(math.isfinite(v) and v > 0, f"--{flag.replace('_', '-')} must be a positive number, got {v}")
    _check(0.0 <= args.warmup < 1.0, f"--warmup must be in [0, 1), got {args.warmup}")
    _check(
        args.timeout > 0,  # NaN fails too
        f"--timeout must be a number of seconds > 0 (inf for no limit), got {args.timeout}",
    )
    _check(
        math.isfinite(args.weight_decay) and args.weight_decay >= 0,
        f"--weight-decay must be >= 0, got {args.weight_decay}",
    )
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    _check(
        bool(methods) and all(m in METHOD_NAMES for m in methods) and len(set(methods)) == len(methods),
        f"--methods must be a comma-separated subset of {','.join(METHOD_NAMES)}, got {args.methods!r}",
    )
    for flag in ("d_model", "layers", "heads", "seq_len"):
        v = getattr(args, flag)
        _check(v is None or v >= 1, f"--{flag.replace('_', '-')} must be >= 1, got {v}")

    gpus = torch_gpus()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if torchrun else world  # ranks on this node
    device = args.device
    if device == "auto":
        device = "cuda" if gpus >= local else "cpu"
    if device == "cuda":
        _check(gpus > 0, "--device cuda: torch sees no GPU here; use --device cpu")
        _check(local <= gpus, f"--device cuda: {local} ranks on this node need {local} GPUs, found {gpus}")
        _check(not args.triton_interpret, "--triton-interpret applies to --device cpu only")
    return world, device, torchrun, methods, gpus


def _workload_config(args: argparse.Namespace):
    from cokit.workloads import CorpusConfig, ModelConfig, TextWorkloadConfig
    from cokit.workloads.text import VOCAB_SIZE

    overrides = {
        k: v
        for k, v in (
            ("d_model", args.d_model),
            ("n_layers", args.layers),
            ("n_heads", args.heads),
            ("max_seq_len", args.seq_len),
        )
        if v is not None
    }
    try:
        model = ModelConfig.preset(args.model, VOCAB_SIZE, **overrides)
        corpus = CorpusConfig(max_chars=args.max_chars)
        return TextWorkloadConfig(corpus=corpus, model=model, batch_size=args.batch_size)
    except ValueError as exc:
        raise CliError(str(exc)) from None


def _specs(args: argparse.Namespace, methods: list[str]) -> list:
    from cokit.train import MethodSpec

    specs = {
        "demo": MethodSpec(
            "demo",
            args.demo_lr,
            args.weight_decay,
            label="demo",
            options={
                "compression_topk": args.topk,
                "compression_chunk": args.chunk,
                "compression_decay": args.decay,
                "payload": args.payload,
            },
            schedule=args.schedule,
            warmup=args.warmup,
            timeout=args.timeout,
        ),
        "sparseloco": MethodSpec(
            "sparseloco",
            args.sparseloco_lr,
            args.weight_decay,
            label="sparseloco",
            options={
                "sync_every": args.sync_every,
                "topk": args.sparseloco_topk,
                "chunk": args.chunk,
                "payload": args.sparseloco_payload,
            },
            schedule=args.schedule,
            warmup=args.warmup,
            timeout=args.timeout,
        ),
        "adamw": MethodSpec(
            "adamw",
            args.adamw_lr,
            args.weight_decay,
            label="adamw",
            schedule=args.schedule,
            warmup=args.warmup,
            timeout=args.timeout,
        ),
    }
    return [specs[m] for m in methods]


def run(args: argparse.Namespace) -> int:
    """Validate, train each method on every rank, then report and write the results.

    A write that the filesystem under ``--out`` refuses (full, over quota, read-only,
    failing), on any rank or here, ends the demo with one line naming the file (exit 2).
    """
    try:
        return _run(args)
    except (RuntimeError, OSError) as exc:
        error = _storage_failure(exc)
        if error is None:
            raise
        raise CliError(error.describe("pass --out <a folder on another filesystem>")) from None


def _storage_failure(exc: BaseException) -> WriteError | None:
    """The :class:`cokit.files.WriteError` behind ``exc`` (raised here, or on a spawned rank),
    or None when ``exc`` is something else."""
    from cokit.files import storage_error
    from cokit.launch import RankFailed

    if isinstance(exc, RankFailed):
        if exc.error is None:
            return None
        exc = exc.error
    filename = getattr(exc, "filename", None)
    return storage_error(exc, filename) if isinstance(filename, str) else None


def _run(args: argparse.Namespace) -> int:
    world, device, torchrun, methods, gpus = _resolve(args)
    sinks = _sinks(args.sinks)  # checked before anything is read or written
    cfg = _workload_config(args)
    specs = _specs(args, methods)
    rank0 = not torchrun or int(os.environ["RANK"]) == 0

    from cokit.train import backend_for, run_distributed, run_methods
    from cokit.workloads import TextWorkload

    try:
        workload = TextWorkload(cfg)  # read the corpus once here: errors surface before launching
    except (ValueError, RuntimeError) as exc:
        raise CliError(str(exc)) from None
    try:
        workload.check_world(world)
    except ValueError as exc:
        raise CliError(f"{exc}; raise --max-chars") from None
    if rank0:  # only rank 0 writes; the folder is checked before any training
        _prepare_out(args)
    n_params = workload.build_model(args.seed).num_params()
    m = cfg.model
    backend = backend_for(device)
    if rank0:
        print(
            f"cokit demo: {world} ranks ({device}, {backend}{', torchrun' if torchrun else ''}); "
            f"model {args.model} d={m.d_model} L={m.n_layers} T={m.max_seq_len} ({n_params:,} params); "
            f"{args.steps} steps x {cfg.batch_size} seqs per rank; "
            f"corpus {workload.corpus.num_chars:,} chars of stdlib source",
            flush=True,
        )
        if args.device == "auto" and device == "cpu" and gpus > 0:
            print(
                f"note: {gpus} GPU(s) for {world} ranks: running on CPU "
                "(--device cuda needs one GPU per rank)",
                flush=True,
            )
        print("methods: " + "; ".join(_describe(s) for s in specs), flush=True)
        if args.overlap:
            print(
                "overlap: nn.Linear -> cokit.overlap.Linear, GEMM configs tuned online per shape class"
                + (" (on CPU the configs change no timing; the records are real)" if device == "cpu" else ""),
                flush=True,
            )

    telemetry = None if args.no_telemetry else args.out
    runs = [TELEMETRY_RUNS[m] for m in methods]
    start = time.perf_counter()
    results = run_distributed(
        run_methods,
        specs,
        cfg,
        args.steps,
        args.seed,
        args.eval_every,
        device,
        not args.quiet,
        telemetry,
        runs,
        args.overlap,
        sinks,
        world_size=world,
        device=device,
        interpret=args.triton_interpret,
    )
    if results is None:  # a torchrun rank other than 0
        return 0
    elapsed = time.perf_counter() - start

    from cokit.display import NO_MATPLOTLIB, have_matplotlib
    from cokit.train_report import cost_per_epoch, cost_table, summary_table, write_outputs

    info = {
        "world_size": world,
        "device": device,
        "backend": backend,
        "torchrun": torchrun,
        "steps": args.steps,
        "seed": args.seed,
        "eval_every": args.eval_every,
        "model_preset": args.model,
        "num_params": n_params,
        "triton_interpret": args.triton_interpret,
        "overlap": args.overlap,
        "elapsed_s": elapsed,
        "workload": workload.info(),
    }
    print()
    print(summary_table(results, uniform_loss=info["workload"]["uniform_loss"]))
    if args.price_per_hour is not None:
        tokens = cfg.batch_size * workload.seq_len * world  # predicted per step, all ranks
        steps_per_epoch = math.ceil(workload.corpus.train.numel() / tokens)
        costs = cost_per_epoch(results, args.price_per_hour, steps_per_epoch, world)
        info["cost_per_epoch"] = {"price_per_hour": args.price_per_hour, "rows": costs}
        print(cost_table(costs, args.price_per_hour, world))
    title = (
        f"cokit demo: {world} ranks, {args.model} model ({n_params:,} params), {args.steps} steps, "
        f"demo topk={args.topk} chunk={args.chunk} payload={args.payload}"
    )
    plots = have_matplotlib()
    paths = write_outputs(args.out, info, results, stem="demo", title=title, plot=plots)
    print(f"\ntotal {elapsed:.0f} s; wrote {', '.join(paths)}")
    if not plots:
        print(f"demo.png not drawn: {NO_MATPLOTLIB}")
    _remove_stale_telemetry(args.out, runs if telemetry is not None else [])
    if telemetry is not None:
        folder = os.path.join(args.out, "telemetry")
        print(
            f"telemetry: {folder} ({', '.join(runs)}; {', '.join(sinks)} per rank; "
            f"see `cokit dashboard {args.out}`)"
        )
    return 0


def _sinks(text: str) -> list[str]:
    """The --sinks names, checked (known, their packages installed) before any training."""
    from cokit.telemetry.sinks import require

    names = list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    _check(bool(names), "--sinks names no sink; give e.g. jsonl or jsonl,csv,parquet")
    for name in names:
        try:
            require(name)
        except (ValueError, ImportError) as exc:
            raise CliError(f"--sinks: {exc}") from None
    return names


def _remove_stale_telemetry(out: str, runs: list[str]) -> None:
    """Remove the telemetry of demo runs this run did not write (an earlier run's, in a folder
    reused with --overwrite, or of methods left out or --no-telemetry), so the folder's
    telemetry matches its demo.json."""
    import shutil

    for run in set(TELEMETRY_RUNS.values()) - set(runs):
        shutil.rmtree(os.path.join(out, "telemetry", run), ignore_errors=True)


def _prepare_out(args: argparse.Namespace) -> None:
    """Create ``--out`` and prove it writable; refuse an earlier run's results unless
    ``--overwrite`` (one-line errors)."""
    from cokit.files import OutputError, prepare_out_dir
    from cokit.train_report import output_names

    try:
        prepare_out_dir(args.out, output_names("demo"), overwrite=args.overwrite)
    except OutputError as exc:
        raise CliError(str(exc)) from None


def torch_gpus() -> int:
    """GPUs torch can use here (0 without CUDA/ROCm)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _describe(spec) -> str:
    if spec.name == "demo":
        o = spec.options
        return (
            f"demo lr={spec.lr:g} topk={o['compression_topk']} chunk={o['compression_chunk']} "
            f"decay={o['compression_decay']:g} payload={o['payload']}"
        )
    if spec.name == "sparseloco":
        o = spec.options
        return (
            f"sparseloco inner AdamW lr={spec.lr:g}, sync every {o['sync_every']} steps: "
            f"top-{o['topk']} per {o['chunk']}-tile, payload={o['payload']}"
        )
    return f"{spec.name} lr={spec.lr:g} (dense all-reduce of fp32 grads)"


if __name__ == "__main__":  # torchrun -m cokit.commands.demo also works
    from cokit.cli import main

    sys.exit(main(["demo", *sys.argv[1:]]))
