"""GPU-check phase ``train_step_overlap``: a small transformer's training step on one GPU with
``cokit.overlap.Linear`` layers, next to an EMULATED communication side.

The communication the DeMo/DDP collectives would do during backward is emulated by
:class:`cokit.overlap.EmulatedComm` (a persistent copy kernel on ``comm_sms`` SMs), sized so
that it takes about as long as the compute step. Four cases, each a median step time and its
ratio to the sequential one:

* ``sequential``: compute step, then the communication;
* ``overlapped``: the communication launched on a normal-priority side stream as backward
  starts; the layers run each shape class's default config;
* ``shaped+high``: the same on a high-priority stream, with every class on its persistent GEMM
  leaving ``comm_sms`` SMs to the communication;
* ``tuner``: the configs :func:`cokit.overlap.training.apply_overlap`'s tuner locked while training with the
  high-priority overlap (CUDA-event step times).

Target (docs/design.md §1.2): the best overlapped case at least 20% below sequential. On CPU
(``--allow-cpu``) a tiny model runs every case once as a check; its times mean nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Any

#: model sizes: (d_model, n_layers, n_heads, seq_len, batch)
SIZES = {"gpu": (1024, 6, 16, 512, 8), "gpu_quick": (1024, 4, 16, 512, 8), "cpu": (32, 1, 2, 16, 2)}
#: SMs/CUs the emulated communication occupies on a GPU
COMM_SMS = 16
TARGET_RATIO = 0.8


def phase_train_step_overlap(ctx: Any) -> dict:
    """The four cases of the module docstring; rows with median ms and ratio to sequential."""
    import torch
    import torch.nn.functional as F

    from cokit.bench.gpu_rows import fmt, print_rows
    from cokit.bench.timing import median_ms
    from cokit.overlap import CommStream, EmulatedComm
    from cokit.overlap.streams import wait_handle
    from cokit.overlap.training import apply_overlap
    from cokit.workloads.model import CharTransformer, ModelConfig

    d, layers, heads, seq, batch = ctx.pick(SIZES["gpu_quick"], SIZES["gpu"], SIZES["cpu"])
    dtype = torch.bfloat16 if ctx.on_gpu else torch.float32
    cfg = ModelConfig(vocab_size=256, d_model=d, n_layers=layers, n_heads=heads, max_seq_len=seq)
    model = CharTransformer(cfg).to(ctx.device, dtype)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    gen = torch.Generator(device=ctx.device).manual_seed(0)
    x = torch.randint(0, 256, (batch, seq), device=ctx.device, generator=gen)
    y = torch.randint(0, 256, (batch, seq), device=ctx.device, generator=gen)
    tuning = apply_overlap(model, comm_sms=COMM_SMS if ctx.on_gpu else None)
    defaults = tuning.configs()
    limits = tuning.limits

    def compute() -> None:
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    compute_ms = median_ms(compute, ctx.on_gpu, ctx.quick)
    comm_kw: dict[str, Any] = {"n_sms": COMM_SMS} if ctx.on_gpu else {}
    probe = EmulatedComm(2**24 if ctx.on_gpu else 2**16, ctx.device, **comm_kw)
    probe_ms = median_ms(probe, ctx.on_gpu, ctx.quick)
    probe.close()
    nbytes = max(int(probe.nbytes * compute_ms / max(probe_ms, 1e-6)), 2**12)
    if not ctx.on_gpu:
        nbytes = min(nbytes, 2**22)  # a check only: keep the CPU copy small
    comm = EmulatedComm(nbytes, ctx.device, **comm_kw)
    comm_ms = median_ms(lambda: wait_handle(comm()), ctx.on_gpu, ctx.quick)

    def sequential() -> None:
        compute()
        wait_handle(comm())

    def overlapped(stream: Any) -> Any:
        def run() -> None:
            stream.wait_for_current()
            with stream:
                handle = comm()
            compute()
            wait_handle(handle)
            stream.join()

        return run

    def set_configs(configs: dict) -> None:
        for c in tuning.classes:
            c.apply(configs[c.key])

    rows: list[dict[str, Any]] = []

    def case(name: str, fn: Any, note: str) -> None:
        if ctx.budget.stop():
            return
        ms = median_ms(fn, ctx.on_gpu, ctx.quick)
        rows.append({"case": name, "step_ms": ms, "note": note})

    case("sequential", sequential, "compute, then the communication")
    normal, high = CommStream(ctx.device, "normal"), CommStream(ctx.device, "high")
    case("overlapped", overlapped(normal), "normal-priority stream, default configs")
    shaped = {
        key: dataclasses.replace(cfg_, persistent=True, num_sms=limits.num_sms - COMM_SMS)
        for key, cfg_ in defaults.items()
    }
    set_configs(shaped)
    case(
        "shaped+high", overlapped(high), f"high priority, persistent GEMMs on {limits.num_sms - COMM_SMS} SMs"
    )
    set_configs(defaults)
    run_high = overlapped(high)
    tuned_steps = 0
    if not ctx.budget.stop():
        run_high()
        tuning.step()  # starts the CUDA-event clock
        limit = sum(len(c.tuner.candidates) * c.tuner.trials for c in tuning.classes)
        if not ctx.on_gpu:
            limit = min(limit, 3)  # a check that the tuner runs, not a tuning
        while tuned_steps < limit and not all(c.tuner.state == "locked" for c in tuning.classes):
            if ctx.budget.left() < 5:
                break
            run_high()
            tuning.step()
            tuned_steps += 1
        locked = all(c.tuner.state == "locked" for c in tuning.classes)
        case(
            "tuner",
            run_high,
            f"{tuned_steps} tuning steps, {'all classes locked' if locked else 'NOT all locked'}",
        )
    comm.close()
    tuning.undo()
    seq_ms = rows[0]["step_ms"] if rows else float("nan")
    for r in rows:
        r["vs_sequential"] = r["step_ms"] / seq_ms
    print(
        f"EMULATED communication: {comm.label}; compute step {fmt(compute_ms)} ms, communication alone "
        f"{fmt(comm_ms)} ms ({'about equal' if 0.7 <= comm_ms / compute_ms <= 1.4 else 'NOT equal'})"
    )
    print_rows(rows, ["case", "step_ms", "vs_sequential", "note"])
    overlapped_rows = [r for r in rows if r["case"] != "sequential"]
    best = min(overlapped_rows, key=lambda r: r["step_ms"]) if overlapped_rows else None
    if not ctx.on_gpu:
        key = "CPU check only (times mean nothing on CPU)"
    elif best is None:
        key = "no overlapped case ran (budget)"
    else:
        met = best["vs_sequential"] <= TARGET_RATIO
        key = (
            f"best {best['case']} x{best['vs_sequential']:.2f} of sequential "
            f"(target <= {TARGET_RATIO}: {'met' if met else 'missed'})"
        )
    return {
        "rows": rows,
        "compute_ms": compute_ms,
        "comm_ms": comm_ms,
        "emulated": comm.label,
        "problems": [],
        "key": key,
    }
