"""One replica group (one process) of a DeMo run on torchft, for tests/test_ft_demo.py.

    python tests/ft_demo_worker.py --lighthouse http://127.0.0.1:PORT --replica N --log out.jsonl \
        [--stop-file F] [--hang-after S] [--topk K] [--hidden D]

As tests/ft_worker.py, with DeMo (adam update rule) wrapped in ``FaultTolerant``: every step is a
round. Every committed round appends a ``sync`` line to ``--log`` whose ``sync`` is torchft's
committed step (the same number on every replica, a healed one included) and whose ``weights``
is the sha256 of the parameters' bytes. ``--hang-after S`` freezes it once it holds the quorum
of the round after its S-th (the round in flight), after a ``hang`` line. It trains until
torchft's committed step reaches the number in ``--stop-file``; a refused join writes a
``refused`` line and exits with code 3.
"""

from __future__ import annotations

import argparse
import datetime
import os
import time
from pathlib import Path

import torch
from ft_worker import _log, _stop_at, _weights

from cokit.compress import DeMo
from cokit.compress.ft import FaultTolerant, JoinRefused
from cokit.compress.ft_group import QuorumGloo, replica_manager


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lighthouse", required=True)
    ap.add_argument("--replica", type=int, required=True)
    ap.add_argument("--log", type=Path, required=True)
    ap.add_argument("--stop-file", type=Path)
    ap.add_argument("--hang-after", type=int, help="freeze inside the round after this many rounds")
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument("--pace", type=float, default=0.02)
    args = ap.parse_args()
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=args.timeout)
    group = QuorumGloo(timeout=timeout)
    manager, _store = replica_manager(group, args.lighthouse, f"replica_{args.replica}", timeout=timeout)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, args.hidden), torch.nn.Tanh(), torch.nn.Linear(args.hidden, 4)
    )
    opt = DeMo(
        model.named_parameters(),
        lr=1e-2,
        compression_decay=0.9,
        compression_topk=args.topk,
        compression_chunk=8,
        update_rule="adam",
        timeout=args.timeout,
    )
    ft = FaultTolerant(manager, opt, group)
    _log(args.log, event="start", replica=args.replica)
    local = 0
    while True:
        try:
            ft.zero_grad()
        except JoinRefused as exc:
            _log(args.log, event="refused", replica=args.replica, error=str(exc))
            manager.shutdown(wait=False)
            os._exit(3)
        if args.hang_after is not None and ft.rounds >= args.hang_after:
            _log(args.log, event="hang", replica=args.replica, sync=manager.current_step())
            while True:
                time.sleep(1)
        g = torch.Generator().manual_seed(1_000_003 * args.replica + local)
        x = torch.randn(8, 16, generator=g)
        loss = (model(x) - x[:, :4]).square().mean()
        loss.backward()
        rounds = ft.rounds
        ft.step()
        local += 1
        if ft.rounds > rounds:
            q = ft.quorum
            assert q is not None
            _log(
                args.log,
                event="sync",
                replica=args.replica,
                sync=manager.current_step(),
                world=q.world_size,
                quorum=q.quorum_id,
                weights=_weights(model),
                heals=ft.heals,
                dropped=ft.dropped_rounds,
                steps=opt._steps,  # DeMo's counter: committed rounds only
                error=str(ft.last_error) if ft.last_error else None,
            )
            stop = _stop_at(args.stop_file)
            if stop is not None and manager.current_step() >= stop:
                break
        time.sleep(args.pace)
    _log(args.log, event="done", replica=args.replica, sync=manager.current_step())
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
