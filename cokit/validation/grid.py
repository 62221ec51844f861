"""The grid runner of the validation study and of ``--on`` calibration: methods x lrs x seeds
on workloads, each run on local gloo ranks, resumable, then the report.

Phases, each resumable (a run whose JSON exists with the same configuration is skipped):
1. the lr grid of every method on every workload (seed 0);
2. at their best lr, seeds 1..N-1: the configuration's headline methods, and per family the
   best configuration and the best one at >= 100x fewer bytes than dense;
3. (optional) AdamW and the best compressed configuration at >= 100x fewer bytes, at 3x the steps;
4. the report (:func:`cokit.validation.report.write_report`): tables, ``study.json`` and plots.

What runs comes from a :class:`StudyConfig`: :func:`cokit.validation.calibrate.calibration_config`
(your workload, ``--on``) builds one in every install; the study's own presets and workloads
are a source checkout's (``cokit.bench.study``).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import platform
import time
from dataclasses import dataclass, field
from typing import Any

from cokit.train import MethodSpec
from cokit.validation.records import choose_lr, extend_grid
from cokit.validation.report import write_report

#: the presets of the study's protocols: toy (seconds, for tests), quick, full
PRESETS = ("toy", "quick", "full")
DEMO_KS = (4, 8, 16, 32, 64)
DEMO_CHUNKS = (32, 64)
# DeMo with another inner update rule: label part -> (family, DeMo's update_rule name)
RULE_FAMILIES = {"rms": "demo-rms", "adam": "demo-adam", "ns": "demo-ns"}
RULE_NAMES = {"rms": "rms", "adam": "adam", "ns": "newton_schulz"}
RULE_KS = (8, 32)
# The compression target: at least this many times fewer bytes than dense (headline seeds, the
# longer horizon and the target check on cfg.target_workload)
TARGET_RATIO = 100.0
TARGET_DELTA = 0.03  # held-out loss within 3% of AdamW's mean
LONG_FACTOR = 3  # the longer horizon: this many times the workload's steps
COMPRESSED_FAMILIES = ("demo", "demo-rms", "demo-adam", "demo-ns", "sparseloco", "diloco")
#: the dense baselines: every step one fp32 all-reduce of the gradients, then the optimizer
DENSE_FAMILIES = ("adamw", "sgd", "muon")
#: an inner optimizer -> the label of its dense run (a method's own baseline)
INNER_BASELINES = {"adamw": "adamw", "muon": "muon", "sgd": "sgd-momentum"}
#: families with Muon's lr scale (~10-20x AdamW's): without a grid of their own they take each
#: other's, never AdamW's
MUON_GRIDS = ("muon", "sparseloco-muon", "dion")


# --------------------------------------------------------------------------------------------
# methods and workloads


@dataclass(frozen=True)
class MethodDef:
    """A method of the study: its label, family (for lr grids and colours) and runner options."""

    label: str
    family: str  # adamw | sgd | muon | powersgd | demo | demo-rms | demo-adam | demo-ns | sparseloco | diloco
    runner: str  # the cokit.train method name
    options: tuple[tuple[str, Any], ...] = ()
    about: str = ""

    @property
    def dense(self) -> bool:
        """Whether this is a dense baseline (one fp32 all-reduce every step, then its optimizer)."""
        return self.family in DENSE_FAMILIES

    @property
    def baseline(self) -> str:
        """The label of the dense run of this method's inner optimizer, its gap's reference: a
        dense method itself; SparseLoCo / DiLoCo their ``inner`` one's (AdamW by default, Muon
        -> ``"muon"``); PowerSGD its ``base``'s; Dion (orthonormalized updates, AdamW on the
        rest) ``"muon"``; DeMo ``"adamw"`` (its update rules act on a decoded momentum, no
        optimizer of their own runs dense)."""
        if self.dense:
            return self.label
        opts = dict(self.options)
        if self.runner == "sparseloco":
            return INNER_BASELINES[opts.get("inner", "adamw")]
        if self.runner == "powersgd":
            return INNER_BASELINES[opts.get("base", "adamw")]
        return "muon" if self.runner == "dion" else "adamw"

    def spec(self, lr: float, seed: int, steps: int) -> MethodSpec:
        """The runner spec of this method at ``lr`` (PowerSGD: 10% dense warm-up, seeded; a
        ``dense_warmup_fraction`` becomes SparseLoCo's ``dense_warmup`` steps of this run)."""
        opts = dict(self.options)
        if self.runner == "powersgd":
            opts.update(start_iter=max(2, steps // 10), seed=seed)
        fraction = opts.pop("dense_warmup_fraction", None)
        if fraction is not None:
            opts["dense_warmup"] = max(1, round(fraction * steps))
        return MethodSpec(self.runner, lr, options=opts, label=self.label)


def _infrequent_methods() -> list[tuple[str, tuple[tuple[str, Any], ...], str]]:
    """SparseLoCo (top-k pseudo-gradients, error feedback, low-bit values) and DiLoCo (dense
    pseudo-gradients, outer Nesterov): label, options, description. The lr is the inner AdamW's."""
    out: list[tuple[str, tuple[tuple[str, Any], ...], str]] = []
    for h, k, chunk, payload, dct in (
        (5, 64, 64, "int2", False),
        (10, 64, 64, "int2", False),
        (30, 64, 64, "int2", False),
        (10, 64, 64, "int2", True),
        (10, 64, 64, "sign", False),
        (10, 16, 64, "int2", False),
        # chunk 32 (32x32 tiles): DeMo's best tiles on text
        (10, 16, 32, "int2", False),
        (10, 32, 32, "int2", False),
        (5, 16, 32, "int2", False),
    ):
        label = (
            f"sparseloco-h{h}-k{k}-{payload}"
            + ("-dct" if dct else "")
            + ("" if chunk == 64 else f"-c{chunk}")
        )
        opts = (("sync_every", h), ("topk", k), ("chunk", chunk), ("payload", payload), ("dct", dct))
        about = (
            f"SparseLoCo: {h} local AdamW steps, then top-{k} per {chunk}-tile"
            + (" DCT coefficients" if dct else "")
            + f" of the error-fed pseudo-gradient, {payload} values"
        )
        out.append((label, opts, about))
    for h in (10, 30):
        dense: tuple[tuple[str, Any], ...] = (
            ("sync_every", h),
            ("topk", None),
            ("outer", "nesterov"),
            ("outer_lr", 0.7),
            ("outer_momentum", 0.9),
        )
        out.append(
            (
                f"diloco-h{h}",
                dense,
                f"DiLoCo: {h} local AdamW steps, dense pseudo-gradient "
                "all-reduce, outer Nesterov (lr 0.7, momentum 0.9)",
            )
        )
    return out


def method_catalog() -> dict[str, MethodDef]:
    """Every method the study knows, by label, in table order."""
    ms = [
        MethodDef("adamw", "adamw", "adamw", about="AdamW, dense fp32 all-reduce (baseline)"),
        MethodDef(
            "muon",
            "muon",
            "muon",
            about="Muon (cokit.compress.inner.Muon: Muon on the matrices, AdamW on embeddings, "
            "heads and vectors), dense fp32 all-reduce (the baseline of Muon-inner methods)",
        ),
        MethodDef(
            "sgd-momentum",
            "sgd",
            "sgd",
            (("momentum", 0.9),),
            about="SGD, momentum 0.9, dense fp32 all-reduce",
        ),
    ]
    for r in (1, 4):
        ms.append(
            MethodDef(
                f"powersgd-r{r}",
                "powersgd",
                "powersgd",
                (("rank", r),),
                about=f"torch DDP powerSGD_hook rank {r} (error feedback, warm start, "
                "10% dense warm-up) + AdamW",
            )
        )
    for payload in ("reference", "sign"):
        ms.append(
            MethodDef(
                f"demo-{payload}-k32-c64",
                "demo",
                "demo",
                (("compression_topk", 32), ("compression_chunk", 64), ("payload", payload)),
                about=f"DeMo k=32 chunk=64, {payload} payload",
            )
        )
    for chunk in DEMO_CHUNKS:
        for k in DEMO_KS:
            ms.append(
                MethodDef(
                    f"demo-compact-k{k}-c{chunk}",
                    "demo",
                    "demo",
                    (("compression_topk", k), ("compression_chunk", chunk), ("payload", "compact")),
                    about=f"DeMo k={k} chunk={chunk}, compact payload (int16 idx + bf16 values)",
                )
            )
    for rule, family in RULE_FAMILIES.items():
        for k in RULE_KS:
            ms.append(
                MethodDef(
                    f"demo-{rule}-k{k}-c64",
                    family,
                    "demo",
                    (
                        ("compression_topk", k),
                        ("compression_chunk", 64),
                        ("payload", "compact"),
                        ("update_rule", RULE_NAMES[rule]),
                    ),
                    about=f"DeMo k={k} chunk=64 compact, {RULE_NAMES[rule]} update rule on the "
                    "decoded direction",
                )
            )
    for label, opts, about in _infrequent_methods():
        ms.append(MethodDef(label, label.split("-")[0], "sparseloco", opts, about=about))
    return {m.label: m for m in ms}


@dataclass(frozen=True)
class WorkloadDef:
    """A workload of the study: a picklable factory, its step budget and lr grid per family."""

    name: str
    factory: Any  # TextWorkloadConfig | DigitsWorkloadConfig (has .build(device))
    steps: int
    eval_every: int
    lrs: tuple[tuple[str, tuple[float, ...]], ...]

    def grid(self, family: str, points: int) -> tuple[float, ...]:
        """The family's lr grid: all of it, or (``points == 1``) one value from its middle.
        Families without a grid of their own use AdamW's: their lr rules say AdamW's lr carries
        over (DeMo's update rules; the inner AdamW of SparseLoCo and DiLoCo); those at Muon's lr
        scale (:data:`MUON_GRIDS`) use another of theirs, and ValueError when there is none."""
        lrs = dict(self.lrs)
        if family in MUON_GRIDS:
            grid = next((lrs[f] for f in (family, *MUON_GRIDS) if f in lrs), None)
            if grid is None:
                raise ValueError(
                    f"workload {self.name!r} has no lr grid at Muon's scale for {family!r}: add a "
                    f"'muon' grid (about 10-20x AdamW's lrs)"
                )
        else:
            grid = lrs.get(family, lrs["adamw"])
        return grid if points >= len(grid) else (grid[len(grid) // 2],)


# Four points per family, half a decade apart. With three, DeMo's best lr moved between grid
# edges with k and chunk (1e-3 for small k at chunk 64, 3e-3 at chunk 32); four bracket them all.
GRID_POINTS = 4


# --------------------------------------------------------------------------------------------
# configuration


@dataclass
class StudyConfig:
    """Everything that defines a run of the grid (the study's presets or ``--on``'s grid)."""

    preset: str
    out_dir: str
    world_size: int
    workloads: list[WorkloadDef]
    methods: list[str]
    headline: list[str]
    seeds: int
    lr_points: int
    long_horizon: bool = False  # phase 3: AdamW and the best >= 100x method at 3x the steps
    verbose: bool = False
    telemetry: bool = True  # each run writes out_dir/telemetry/<workload>-<method>-lr<lr>-s<seed>/
    # --on: the report recommends the most compressed method within this of AdamW's held-out
    # loss (None: no recommendation)
    recommend_within: float | None = None
    target_workload: str | None = None  # the workload of the >= 100x target check (None: none)
    methods_by_label: dict[str, MethodDef] = field(default_factory=method_catalog, repr=False)

    def method(self, label: str) -> MethodDef:
        return self.methods_by_label[label]


# --------------------------------------------------------------------------------------------
# planning and running


_SPEC_CORE = ("name", "lr", "weight_decay", "options", "label", "schedule", "warmup")


def _spec_identity(spec: MethodSpec) -> dict[str, Any]:
    """The spec's fields that define a run: the core ones, plus any other field that differs
    from its default (so adding a defaulted field to MethodSpec keeps finished runs valid)."""
    fields = dataclasses.asdict(spec)
    defaults = dataclasses.asdict(MethodSpec(spec.name, spec.lr))
    return {k: v for k, v in fields.items() if k in _SPEC_CORE or v != defaults.get(k)}


def _key(wl: WorkloadDef, spec: MethodSpec, seed: int, world: int) -> str:
    blob = json.dumps(
        [repr(wl.factory), wl.steps, wl.eval_every, world, _spec_identity(spec), seed],
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def run_path(out_dir: str, workload: str, method: str, lr: float, seed: int) -> str:
    """Where one run's JSON lives."""
    return os.path.join(out_dir, "runs", workload, method, f"lr{lr:g}-s{seed}.json")


def telemetry_run(workload: str, method: str, lr: float, seed: int) -> str:
    """The telemetry run name of one run (its stream: ``<out>/telemetry/<name>/rank<r>.jsonl``)."""
    return f"{workload}-{method}-lr{lr:g}-s{seed}"


def make_job(cfg: Any, wl: WorkloadDef, label: str, lr: float, seed: int, **spec_fields: Any):
    """The :class:`cokit.validation.runs.Job` for one point of the study (``spec_fields``: other
    :class:`~cokit.train.MethodSpec` fields, e.g. the lr schedule, part of the run's key)."""
    from cokit.validation.runs import Job

    m = cfg.method(label)
    spec = dataclasses.replace(m.spec(lr, seed, wl.steps), **spec_fields)
    return Job(
        workload=wl.name,
        method=label,
        family=m.family,
        spec=spec,
        seed=seed,
        steps=wl.steps,
        eval_every=wl.eval_every,
        path=run_path(cfg.out_dir, wl.name, label, lr, seed),
        key=_key(wl, spec, seed, cfg.world_size),
        extra={"about": m.about},
        telemetry_dir=cfg.out_dir if cfg.telemetry else None,
        telemetry_run=telemetry_run(wl.name, label, lr, seed),
    )


def load_run(path: str, key: str | None = None) -> dict | None:
    """A run's JSON, or None when missing, unreadable or (with ``key``) from another config."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    return doc if key is None or doc.get("key") == key else None


def lr_seeds(cfg: StudyConfig, label: str) -> int:
    """How many seeds choose ``label``'s lr: every seed for a dense baseline (its mean), else seed 0."""
    return cfg.seeds if cfg.method(label).dense else 1


def chosen_lr(cfg: StudyConfig, label: str, records: list[dict]) -> float | None:
    """``label``'s lr among ``records`` (any methods): by :func:`lr_seeds` seeds' mean."""
    return choose_lr([r for r in records if r["method"] == label], lr_seeds(cfg, label))


def sweep_jobs(cfg: StudyConfig, wl: WorkloadDef) -> list:
    """Phase 1: every method at every lr of its grid, seed 0 (a dense baseline: every seed)."""
    return [
        make_job(cfg, wl, m, lr, s)
        for m in cfg.methods
        for lr in wl.grid(cfg.method(m).family, cfg.lr_points)
        for s in range(lr_seeds(cfg, m))
    ]


def edge_jobs(cfg: StudyConfig, wl: WorkloadDef, sweep_records: list[dict]) -> list:
    """Phase 1b: for each method whose chosen lr is an edge of its grid, one point beyond it
    (:func:`cokit.validation.records.extend_grid`), at the seeds of :func:`lr_seeds`."""
    jobs: list = []
    for m in cfg.methods:
        nxt = extend_grid(
            list(wl.grid(cfg.method(m).family, cfg.lr_points)), chosen_lr(cfg, m, sweep_records)
        )
        if nxt is not None:
            jobs.extend(make_job(cfg, wl, m, nxt, s) for s in range(lr_seeds(cfg, m)))
    return jobs


def lr_sweep(cfg: StudyConfig, wl: WorkloadDef, run: bool = True) -> list[dict]:
    """Phases 1 and 1b: the lr grids, then a point past every winning edge."""
    records = execute(cfg, wl, sweep_jobs(cfg, wl), "lr sweep (seed 0; dense baselines every seed)", run)
    more = edge_jobs(cfg, wl, records)
    if more:
        records += execute(cfg, wl, more, "lr sweep, one point past each winning grid edge", run)
    return records


def _best_seed0(records: list[dict], min_ratio: float = 0.0) -> dict | None:
    """The seed-0 run with the lowest finite final held-out loss among ``records`` (at least
    ``min_ratio`` times fewer bytes than dense), or None."""
    ok = [
        r
        for r in records
        if r.get("status") == "ok"
        and r["seed"] == 0
        and r["summary"]["final_heldout_loss"] is not None
        and (r["summary"]["ratio_to_dense"] or 0.0) >= min_ratio
    ]
    return min(ok, key=lambda r: r["summary"]["final_heldout_loss"]) if ok else None


def headline_methods(cfg: StudyConfig, sweep_records: list[dict]) -> list[str]:
    """The methods that get more seeds: the fixed headline ones, then per family the best
    configuration (seed 0, best lr) and the best one at >= ``TARGET_RATIO`` x fewer bytes."""
    out = list(cfg.headline)
    families = dict.fromkeys(cfg.method(m).family for m in cfg.methods)
    for fam in families:
        mine = [
            r for r in sweep_records if r["method"] in cfg.methods and cfg.method(r["method"]).family == fam
        ]
        for min_ratio in (0.0, TARGET_RATIO):
            best = _best_seed0(mine, min_ratio)
            if best is not None and best["method"] not in out:
                out.append(best["method"])
    return out


def seed_jobs(cfg: StudyConfig, wl: WorkloadDef, sweep_records: list[dict]) -> list:
    """Phase 2: the headline methods at their chosen lr (from phase 1's run JSONs), seeds
    1..seeds-1 (the dense baselines have them already)."""
    jobs: list = []
    for m in headline_methods(cfg, sweep_records):
        lr = chosen_lr(cfg, m, sweep_records)
        if lr is not None and not cfg.method(m).dense:
            jobs.extend(make_job(cfg, wl, m, lr, s) for s in range(1, cfg.seeds))
    return jobs


def long_workload(wl: WorkloadDef) -> WorkloadDef:
    """``wl`` with ``LONG_FACTOR`` times the steps (its runs live under ``runs/<name>-x3/``)."""
    return dataclasses.replace(
        wl,
        name=f"{wl.name}-x{LONG_FACTOR}",
        steps=wl.steps * LONG_FACTOR,
        eval_every=wl.eval_every * LONG_FACTOR,
    )


def long_methods(cfg: StudyConfig, sweep_records: list[dict]) -> list[str]:
    """Phase 3's methods: AdamW, dense Muon and the best compressed configuration at >=
    ``TARGET_RATIO`` x fewer bytes (seed 0 of phase 1)."""
    compressed = [
        r
        for r in sweep_records
        if r["method"] in cfg.methods and cfg.method(r["method"]).family in COMPRESSED_FAMILIES
    ]
    best = _best_seed0(compressed, TARGET_RATIO)
    out = [m for m in ("adamw", "muon") if m in cfg.methods]
    return out + ([best["method"]] if best is not None else [])


def long_jobs(cfg: StudyConfig, wl: WorkloadDef, sweep_records: list[dict]) -> list:
    """Phase 3: :func:`long_methods` at their best lr of phase 1, seed 0, ``LONG_FACTOR`` x the steps."""
    longer = long_workload(wl)
    jobs = []
    for m in long_methods(cfg, sweep_records):
        lr = chosen_lr(cfg, m, sweep_records)
        if lr is not None:
            jobs.append(make_job(cfg, longer, m, lr, 0))
    return jobs


def execute(cfg: Any, wl: WorkloadDef, jobs: list, phase: str, run: bool = True) -> list[dict]:
    """Run the jobs without a current JSON (unless ``run`` is false); return the JSONs of the
    jobs that have one. ``cfg``: a study or protocol configuration (its ``world_size`` and
    ``verbose``)."""
    from cokit.train import run_distributed
    from cokit.validation.runs import run_jobs

    docs = [load_run(j.path, j.key) for j in jobs]
    todo = [j for j, doc in zip(jobs, docs, strict=True) if doc is None]
    if not run:
        return [doc for doc in docs if doc is not None]
    print(
        f"[{wl.name}] {phase}: {len(jobs)} runs, {len(jobs) - len(todo)} already done, "
        f"{len(todo)} to run ({wl.steps} steps each, {cfg.world_size} gloo ranks)",
        flush=True,
    )
    if todo:
        run_distributed(
            run_jobs,
            todo,
            wl.factory,
            "cpu",
            cfg.verbose,
            world_size=cfg.world_size,
            device="cpu",
            # a guard against a hang only (each run's collectives time out on their own): 2 s a
            # step, 5 min at least, per run; 300 s a run failed a batch of 750-step runs of a
            # 1.28M-parameter model on a loaded 2-core machine (about 500 s each there)
            timeout=600.0 + len(todo) * max(300.0, 2.0 * wl.steps),
        )
    docs = [doc if doc is not None else load_run(j.path, j.key) for j, doc in zip(jobs, docs, strict=True)]
    return [doc for doc in docs if doc is not None]


def machine_info() -> dict[str, Any]:
    """CPU model, cores, OS and library versions of this machine."""
    import torch
    import triton

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
    }


def describe(cfg: StudyConfig) -> dict[str, Any]:
    """JSON-ready description of the configuration (for ``study.json``)."""
    wls = {}
    for wl in cfg.workloads:
        wls[wl.name] = {
            "steps": wl.steps,
            "eval_every": wl.eval_every,
            "config": repr(wl.factory),
            "lr_grids": {f: list(wl.grid(f, cfg.lr_points)) for f, _ in wl.lrs},
        }
    return {
        "preset": cfg.preset,
        "world_size": cfg.world_size,
        "device": "cpu",
        "backend": "gloo",
        "seeds": cfg.seeds,
        "lr_points": cfg.lr_points,
        "long_horizon": cfg.long_horizon
        and {
            "factor": LONG_FACTOR,
            "methods": f"adamw, muon and the best compressed method at >= {TARGET_RATIO:g}x fewer bytes",
        },
        "target": cfg.target_workload
        and {
            "workload": cfg.target_workload,
            "max_delta_vs_adamw": TARGET_DELTA,
            "min_ratio_to_dense": TARGET_RATIO,
        },
        "methods": {m: cfg.method(m).about for m in cfg.methods},
        "headline": cfg.headline,
        "workloads": wls,
        "lr_selection": "dense baselines: lowest mean final held-out loss over every seed; the "
        "others: lowest of the seed-0 run; a grid edge that wins gets one point beyond it",
        "baselines": {m: cfg.method(m).baseline for m in cfg.methods},
    }


def run_study(cfg: StudyConfig, report_only: bool = False) -> dict[str, Any]:
    """Run the missing runs of every phase, then write the report; return ``study.json``'s dict."""

    os.makedirs(cfg.out_dir, exist_ok=True)
    start = time.perf_counter()
    run = not report_only
    records = {wl.name: lr_sweep(cfg, wl, run) for wl in cfg.workloads}
    if cfg.seeds > 1:
        for wl in cfg.workloads:
            records[wl.name] += execute(
                cfg,
                wl,
                seed_jobs(cfg, wl, records[wl.name]),
                f"headline seeds 1..{cfg.seeds - 1} at the best lr",
                run,
            )
    longer: dict[str, list[dict]] = {}
    if cfg.long_horizon:
        for wl in cfg.workloads:
            jobs = long_jobs(cfg, wl, records[wl.name])
            longer[wl.name] = execute(cfg, long_workload(wl), jobs, f"{LONG_FACTOR}x the steps, seed 0", run)
    info = {
        **describe(cfg),
        "machine": machine_info(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "elapsed_s_this_invocation": round(time.perf_counter() - start, 1),
        "run_time_s_all_runs": round(sum(r.get("elapsed_s", 0.0) for rs in records.values() for r in rs), 1),
        "workload_info": _workload_info(cfg, records),
    }
    if cfg.recommend_within is not None:
        info["calibration_tolerance"] = cfg.recommend_within
    return write_report(cfg.out_dir, info, records, cfg, longer)


def _workload_info(cfg: StudyConfig, records: dict[str, list[dict]]) -> dict[str, Any]:
    """Each workload's ``info()`` and parameter count (from its run JSONs; a model is built
    only when no run recorded it)."""
    out = {}
    for wl in cfg.workloads:
        w = wl.factory.build("cpu")
        n = next((r["num_params"] for r in records.get(wl.name, []) if "num_params" in r), None)
        if n is None:
            n = sum(p.numel() for p in w.build_model(0).parameters())
        out[wl.name] = {**w.info(), "num_params": n}
    return out
