"""One rank of a two-rank DeMo run in which rank 1 fails after the first step.

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p \
        python tests/fault_rank.py --fault stop|kill --timeout 3 --out result.json

Rank 1 takes one step, then freezes (``stop``: SIGSTOP to itself) or dies (``kill``:
SIGKILL). Rank 0 takes a second step, which must raise ``CollectiveTimeout``; then it
retries (``ProcessGroupAborted`` expected, not a hang or SIGABRT) and writes what it saw to
``--out`` (JSON, atomically) with the wall-clock time just before the failing step, so the
test can measure how long after it this process exits. The test starts both ranks as plain
processes with torchrun's variables, like torchrun would.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import torch
import torch.distributed as dist

from cokit.compress import DeMo
from cokit.compress.comm import CollectiveTimeout, Communicator
from cokit.files import atomic_write_text


def _step(params: list[torch.nn.Parameter], opt: DeMo, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(1000 * step + rank)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()


def _attempt(fn) -> dict:
    start = time.monotonic()
    try:
        fn()
    except CollectiveTimeout as exc:
        return {"kind": type(exc).__name__, "message": str(exc), "after_s": time.monotonic() - start}
    return {"kind": None, "message": "", "after_s": time.monotonic() - start}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fault", choices=("stop", "kill"), required=True)
    ap.add_argument("--timeout", type=float, required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.environ["TRITON_INTERPRET"] = "0"  # the torch path: no interpreter in these ranks
    dist.init_process_group("gloo", init_method="env://")
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in ((64, 48), (48,))]
    opt = DeMo(params, lr=0.01, compression_topk=4, compression_chunk=16, timeout=args.timeout)
    _step(params, opt, rank, 0)  # both ranks: the layout check and one full exchange
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP if args.fault == "stop" else signal.SIGKILL)
        time.sleep(3600)  # not reached while stopped; the test kills this rank
    before = time.time()
    failed = _attempt(lambda: _step(params, opt, rank, 1))
    retried = _attempt(lambda: _step(params, opt, rank, 1))
    other = Communicator(owner="another user of the group", timeout=args.timeout)
    fresh = _attempt(lambda: other.all_reduce_mean(torch.ones(3), "all-reduce").wait())
    doc = {"before_failing_step": before, "failed": failed, "retried": retried, "fresh": fresh}
    doc["aborted"] = opt.comm.aborted
    atomic_write_text(args.out, json.dumps(doc, indent=1))
    # no destroy_process_group(): the interpreter must be able to exit with the group as is


if __name__ == "__main__":
    main()
