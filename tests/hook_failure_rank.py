"""One rank of a DDP run with the DCT/top-k hook whose last rank freezes (tests/test_hook_failures.py).

    python tests/hook_failure_rank.py --freeze status|payload --rank 0 --world 2 \
        --init file:///tmp/x/store --timeout 3 --out /tmp/x/rank0.json

Every rank trains :data:`CLEAN_STEPS` steps with a patient timeout (a loaded machine's slow rank
is no fault); then the live ranks shorten it to ``--timeout`` and the last rank freezes
(SIGSTOP to itself) at the next step: before it (``status``: the live ranks' hooks wait in the
status exchange, inside the hook) or inside the hook after the status exchange (``payload``:
their payload collectives fail in DDP's futures). A live rank records the failing step's error
and how long it took, then the error of the step after it, and writes both to ``--out`` (JSON,
atomically) with the wall-clock time just before the failing step; then it exits without
destroying the group, as a failed run would. The test kills the frozen rank.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from cokit.compress.comm import Communicator
from cokit.compress.hooks import DCTTopKState, dct_topk_hook
from cokit.files import atomic_write_text

CLEAN_STEPS = 2  # DDP rebuilds its buckets (a collective of its own) in the second step
PATIENT_S = 60.0


def _step(net: DDP, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(16, 24, generator=g), torch.randn(16, 8, generator=g)
    torch.nn.functional.mse_loss(net(x), y).backward()


def _attempt(fn) -> dict[str, Any]:
    start = time.monotonic()
    try:
        fn()
    except Exception as exc:
        return {"kind": type(exc).__name__, "message": str(exc), "after_s": time.monotonic() - start}
    return {"kind": None, "message": "", "after_s": time.monotonic() - start}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--freeze", choices=("status", "payload"), required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--init", required=True)
    ap.add_argument("--timeout", type=float, required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.environ["TRITON_INTERPRET"] = "0"  # the torch path: no interpreter in these ranks
    torch.set_num_threads(1)
    rank, world = args.rank, args.world
    dist.init_process_group("gloo", init_method=args.init, rank=rank, world_size=world)
    torch.manual_seed(0)  # the same weights on every rank
    net = DDP(torch.nn.Sequential(torch.nn.Linear(24, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8)))
    state = DCTTopKState(topk=4, chunk=16, timeout=PATIENT_S)
    net.register_comm_hook(state, dct_topk_hook)
    for step in range(CLEAN_STEPS):
        _step(net, rank, step)
    frozen = rank == world - 1
    if frozen and args.freeze == "status":
        os.kill(os.getpid(), signal.SIGSTOP)
    if frozen:  # after its status row went out: inside the hook, before the payload

        def freeze(*_: Any) -> None:
            os.kill(os.getpid(), signal.SIGSTOP)

        Communicator.all_reduce_sum = freeze  # type: ignore[method-assign]
    else:
        state.exchange.comm.timeout = datetime.timedelta(seconds=args.timeout)
    before = time.time()
    failed = _attempt(lambda: _step(net, rank, CLEAN_STEPS))
    after = _attempt(lambda: _step(net, rank, CLEAN_STEPS + 1))
    doc = {"before_failing_step": before, "failed": failed, "next": after}
    atomic_write_text(args.out, json.dumps(doc, indent=1))
    # no destroy_process_group(): the interpreter must be able to exit with the group as is


if __name__ == "__main__":
    main()
