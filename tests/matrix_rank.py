"""One rank of one cell of the reliability matrix (tests/test_reliability_matrix.py).

    python tests/matrix_rank.py --front demo --fault nan-error --rank 0 --world 2 \
        --init file:///tmp/x/store --timeout 3 --out /tmp/x/rank0.json

A cell is a front end (DeMo with its reference payload, one tensor per collective; DeMo with
compact payloads in several buckets; DeMo overlapped with backward; SparseLoCo; the DDP hook) trained on a small model, and a fault that the last rank brings in at step
:data:`FAULT_STEP` (a sync step of SparseLoCo). The rank records what it saw (the exception,
whether the parameters changed, checksums of the parameters after a skipped step and after the
next one) in ``--out`` (JSON, atomically) and exits by itself; the test checks how and when.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

from cokit.files import atomic_write_text

FRONTS = ("demo-reference", "demo-bucketed", "demo-overlap", "sparseloco", "hook")
OTHERS = ("powersgd",)  # the study's PowerSGD method (DDP + torch's powerSGD_hook): faults only
# a mismatch whose faulty rank then freezes, before the report of what differs
OTHER_FAULTS = ("stop-in-report",)
FAULTS = (
    "stop",
    "kill",
    "mismatch-start",
    "mismatch-mid",
    "nan-error",
    "nan-skip",
    "scaler-inf",
    "wrong-length",
    "bad-index",
    "nan-value",
    "partition",
)
FAULT_STEP = 2  # steps 0 and 1 are clean; SparseLoCo syncs every 3 steps, so step 2 syncs


def _model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same weights on every rank
    return torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.Tanh(), torch.nn.Linear(48, 8))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 24, generator=g), torch.randn(16, 8, generator=g)


def _weights(cell: Cell) -> list[torch.Tensor]:
    """The weights a fault must leave alone: the parameters; for SparseLoCo theta_global, the
    weights every rank shares (a sync step's local inner step runs before its sync)."""
    state = cell.opt.state
    if cell.front == "sparseloco" and all("global" in state[p] for p in cell.params):
        return [state[p]["global"] for p in cell.params]
    return cell.params  # (before SparseLoCo's first step, theta_global is the parameters)


def _digest(params: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for p in params:
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _patched(owner: Any, name: str, make: Callable[[Any], Any]) -> Any:
    """A context that replaces ``owner.name`` by ``make(original)`` inside it."""
    return mock.patch.object(owner, name, make(getattr(owner, name)))


def _corrupt(what: str) -> Callable[[Any], Any]:
    """A ``PayloadCodec.to_wire`` that sends one bad slot: an index outside its tile, or NaN."""

    def make(original: Callable) -> Callable:
        def to_wire(codec, indices, values):
            wires = original(codec, indices, values)
            idx, vals = codec.decode([w.reshape(1, -1) for w in wires])
            idx, vals = idx[0].clone(), vals[0].clone()
            if what == "bad-index":
                idx[0] = codec.plan.tilings[0].tile_numel + 44
            else:
                vals[0] = math.nan
            return original(codec, idx, vals)

        return to_wire

    return make


def _longer(original: Callable) -> Callable:
    """A codec ``wire_layout`` 8 bytes longer than the others' (another version of the codec)."""
    from cokit.compress.payload import Wire

    def wire_layout(codec):
        wires = list(original(codec))
        last = wires[-1]
        return [*wires[:-1], Wire(last.name, last.dtype, last.numel + 8 // last.dtype.itemsize)]

    return wire_layout


class Cell:
    """A front end on the cell's model: ``step(rank, step)`` takes one training step."""

    def __init__(self, front: str, fault: str, rank: int, world: int, timeout: float):
        from cokit.compress import DeMo, SparseLoCo
        from cokit.compress.hooks import DCTTopKState, dct_topk_hook

        self.front, self.fault, self.rank = front, fault, rank
        self.bad = rank == world - 1
        odd = fault in ("mismatch-start", "stop-in-report") and self.bad
        nonfinite = (
            "skip" if fault in ("nan-skip",) or (fault == "scaler-inf" and front == "hook") else "error"
        )
        self.model = _model()
        self.params = list(self.model.parameters())
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if fault in ("scaler-inf",) else None
        self.state: Any = None
        if front.startswith("demo"):
            self.opt: Any = DeMo(
                self.params,
                lr=1e-2,
                compression_topk=8 if odd else 4,
                compression_chunk=16,
                timeout=timeout,
                nonfinite=nonfinite,
                payload="reference" if front == "demo-reference" else "compact",
                bucket_cap_mb=0.002,
                overlap_backward=front == "demo-overlap",
            )
            self.forward: Callable = self.model
        elif front == "sparseloco":
            self.opt = SparseLoCo(
                self.params,
                lambda ps: torch.optim.AdamW(ps, lr=1e-2),
                sync_every=3,
                topk=8 if odd else 4,
                chunk=16,
                timeout=timeout,
                nonfinite=nonfinite,
            )
            self.forward = self.model
        elif front == "powersgd":
            from cokit.train import MethodSpec
            from cokit.validation.methods import EngineSlot, PowerSGDMethod

            slot = EngineSlot(self.model)
            spec = MethodSpec("powersgd", 1e-2, timeout=timeout, options={"rank": 2, "start_iter": 2})
            self.method = PowerSGDMethod(spec, slot, None)
            self.opt = self.method.optimizer
            self.forward = slot
        else:  # the DDP hook; "skip" hands NaN gradients for a GradScaler to skip on every rank
            from torch.nn.parallel import DistributedDataParallel as DDP

            ddp = DDP(self.model)
            self.state = DCTTopKState(topk=8 if odd else 4, chunk=16, timeout=timeout, nonfinite=nonfinite)
            ddp.register_comm_hook(self.state, dct_topk_hook)
            self.opt = torch.optim.AdamW(self.params, lr=1e-2)
            self.forward = ddp
            if fault == "nan-skip":
                self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)

    def skipped(self) -> int:
        """Steps skipped so far, by the front end's own count (GradScaler skips: its scale)."""
        if self.state is not None:
            return self.state.skipped_steps
        return getattr(self.opt, "skipped_steps", 0) + getattr(self.opt, "skipped_syncs", 0)

    def step(self, step: int) -> None:
        x, y = _batch(self.rank, step)
        faulty = step == FAULT_STEP and self.bad
        if faulty and self.fault in ("nan-error", "nan-skip"):
            x[0, 0] = math.nan
        if faulty and self.fault == "scaler-inf":
            x[0, 0] = math.inf
        if faulty and self.fault == "mismatch-mid":
            if self.state is not None:
                self.state.topk = 8  # the hook's k changed on one rank
            else:
                self.opt.param_groups[0]["lr"] *= 0.5  # an LR scheduler stepped on one rank only
        loss = torch.nn.functional.mse_loss(self.forward(x), y)
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            loss.backward()
            self.opt.step()
        self.opt.zero_grad()


def run_cell(
    rank: int, world: int, front: str, fault: str, timeout: float, started: str | None = None
) -> dict:
    """Train the cell; what this rank saw (see the module docstring)."""
    from cokit.compress.payload import CompactCodec, Int2Codec, PayloadCodec, ReferenceCodec

    os.environ["TRITON_INTERPRET"] = "0"  # the torch path: these cells test the distributed logic
    out: dict[str, Any] = {"front": front, "fault": fault, "rank": rank, "outcome": "completed"}
    bad = rank == world - 1
    codec = {"sparseloco": Int2Codec, "demo-reference": ReferenceCodec}.get(front, CompactCodec)
    patches = contextlib.ExitStack()
    if fault == "wrong-length" and bad:  # another version of the codec on one rank, from the start
        patches.enter_context(_patched(codec, "wire_layout", _longer))
        patches.enter_context(_patched(codec, "encode", _padded))
    if fault == "stop-in-report" and bad:
        from cokit.compress import agreement

        patches.enter_context(_patched(agreement, "gather_json", _frozen))
    with patches:
        cell = Cell(front, fault, rank, world, timeout)
        # the step after the fault, and for SparseLoCo the next sync
        last = FAULT_STEP + (4 if front == "sparseloco" else 2)
        before = _digest(_weights(cell))
        step = 0
        try:
            for step in range(last):
                if step == FAULT_STEP and started:  # the partition cell: the test cuts the links now
                    _handshake(started, rank)
                if step == FAULT_STEP and bad and fault in ("stop", "kill"):
                    os.kill(os.getpid(), signal.SIGSTOP if fault == "stop" else signal.SIGKILL)
                out["fault_started"] = time.time()  # the start of the step that raised, or the last
                before = _digest(_weights(cell))
                corrupt = step == FAULT_STEP and bad and fault in ("bad-index", "nan-value")
                with (
                    _patched(PayloadCodec, "to_wire", _corrupt(fault))
                    if corrupt
                    else contextlib.nullcontext()
                ):
                    cell.step(step)
                if step == FAULT_STEP:
                    out["after_fault"] = _digest(cell.params)
                out["after_next"] = _digest(cell.params)
        except Exception as exc:
            out.update(outcome="raised", error=type(exc).__name__, message=str(exc), step=step)
            out["unchanged"] = _digest(_weights(cell)) == before
        out["skipped"] = cell.skipped()
        out["scale"] = cell.scaler.get_scale() if cell.scaler is not None else None
    out["finished"] = time.time()
    return out


def _frozen(original: Callable) -> Callable:
    def gather_json(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGSTOP)
        return original(*args, **kwargs)

    return gather_json


def _handshake(path: str, rank: int, limit_s: float = 120.0) -> None:
    """Tell the test this rank reached the faulty step, then wait until it cut the links."""
    with open(f"{path}.rank{rank}", "w"):
        pass
    deadline = time.monotonic() + limit_s
    while not os.path.exists(f"{path}.cut"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the test did not cut the links within {limit_s:g} s")
        time.sleep(0.02)


def _padded(original: Callable) -> Callable:
    def encode(codec, indices, values):
        wires = original(codec, indices, values)
        extra = codec.wire[-1].numel - wires[-1].numel()
        return [*wires[:-1], torch.cat([wires[-1], wires[-1].new_zeros(extra)])]

    return encode


def zygote() -> dict:
    """Start ranks for the test (tests/matrix_cells.py) as forks of this process, which imported
    torch and every front end once, instead of fresh interpreters (about 3 s of imports each).

    Requests come on stdin, a JSON object per line: ``{"argv": [...], "log": path, "env": {...},
    "netns": name or null}``.
    This process answers ``pid <pid>`` on stdout for each start, and ``exit <pid> <code>``
    when a rank ends (``code`` as ``Popen.returncode``: minus the signal). In the forked child
    this returns the request; the rank then runs :func:`main` and ends like a process of its own,
    through the interpreter's exit. At the end of stdin, ranks still there are killed."""
    import select

    from cokit.compress import DeMo, SparseLoCo, agreement  # noqa: F401 (imported once, here)
    from cokit.compress.hooks import DCTTopKState  # noqa: F401
    from cokit.compress.payload import CompactCodec  # noqa: F401
    from cokit.validation.methods import PowerSGDMethod  # noqa: F401

    children: set[int] = set()
    pending = b""
    while True:
        readable, _, _ = select.select([0], [], [], 0.02)
        chunk = os.read(0, 65536) if readable else b""
        if readable and not chunk:  # the test ended
            for pid in children:
                os.kill(pid, signal.SIGKILL)
            for pid in children:
                os.waitpid(pid, 0)
            raise SystemExit(0)
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                return request
            children.add(pid)
            print(f"pid {pid}", flush=True)
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                print(f"exit {pid} {os.waitstatus_to_exitcode(status)}", flush=True)


def become_rank(request: dict) -> None:
    """In a child of :func:`zygote`: the request's output file, environment and arguments."""
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.environ.update(request["env"])
    if request["netns"]:  # the testbed's namespace for this rank (before any socket)
        from cokit.bench import netbed

        netbed._enter_namespace((request["netns"],), 0)
    sys.argv = [sys.argv[0], *request["argv"]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--front", choices=FRONTS + OTHERS, required=True)
    ap.add_argument("--fault", choices=FAULTS + OTHER_FAULTS, required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--init", required=True)
    ap.add_argument("--timeout", type=float, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--started", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=args.init, rank=args.rank, world_size=args.world)
    out = run_cell(args.rank, args.world, args.front, args.fault, args.timeout, args.started)
    atomic_write_text(args.out, json.dumps(out))
    # no destroy_process_group(): the interpreter must be able to exit with the group as it is


if __name__ == "__main__":
    if sys.argv[1:] == ["--zygote"]:
        become_rank(zygote())
    main()
