"""One replica group (one process) of a SparseLoCo run on torchft, for tests/test_ft.py.

    python tests/ft_worker.py --lighthouse http://127.0.0.1:PORT --replica N --log out.jsonl \
        [--stop-file F] [--hang-after S --hang mid|in] [--topk K] [--hidden D] \
        [--host ADDR] [--quorum-timeout S] [--go-file F]

It hosts its replica group's TCPStore at ``--host``, builds a torchft Manager over a
``QuorumGloo`` and a small model with SparseLoCo wrapped in ``FaultTolerant``, and trains
until it has committed the sync number written in ``--stop-file`` (none: forever). Every
committed sync appends one JSON line to ``--log``: the sync count, the quorum, the sha256 of
the weights' bytes, heals, dropped rounds and the wall-clock time. ``--hang-after S``
freezes it after its S-th sync: ``mid`` one local step later (in the middle of a period),
``in`` once it holds the quorum of the next sync (the round in flight); it writes a ``hang``
line first, so the test knows when to SIGKILL it. Before it takes a sync's quorum it writes a
``quorum`` line (so the test knows it waits there). A refused join writes a ``refused`` line and
exits with code 3; any other error of the fault-tolerant optimizer (no quorum within
``--quorum-timeout``) an ``error`` line, code 4. ``--host``: the address the replica group's
store and manager are reached at (its namespace's, on the netbed). ``--go-file``: build the
model and wait for that file before joining (a replica started ahead, warm, to join at once).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import time
from pathlib import Path
from typing import NoReturn

import torch

from cokit.compress import SparseLoCo
from cokit.compress.ft import FaultTolerant, JoinRefused
from cokit.compress.ft_group import QuorumGloo, replica_manager


def _log(path: Path, **row: object) -> None:
    with open(path, "a") as f:
        f.write(json.dumps({**row, "t": time.time(), "pid": os.getpid()}) + "\n")


def _weights(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _fail(path: Path, replica: int, exc: BaseException) -> NoReturn:
    """Log the error that stopped this replica and exit with code 4."""
    _log(path, event="error", replica=replica, error=f"{type(exc).__name__}: {exc}")
    os._exit(4)


def _stop_at(path: Path | None) -> int | None:
    if path is None or not path.exists():
        return None
    text = path.read_text().strip()
    return int(text) if text else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lighthouse", required=True)
    ap.add_argument("--replica", type=int, required=True)
    ap.add_argument("--log", type=Path, required=True)
    ap.add_argument("--stop-file", type=Path)
    ap.add_argument("--hang-after", type=int, help="freeze after this many syncs of this process")
    ap.add_argument("--hang", choices=("mid", "in"), default="mid")
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--sync-every", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument("--pace", type=float, default=0.02)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--quorum-timeout", type=float, default=60.0)
    ap.add_argument("--go-file", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=args.timeout)
    group = QuorumGloo(timeout=timeout)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, args.hidden), torch.nn.Tanh(), torch.nn.Linear(args.hidden, 4)
    )
    opt = SparseLoCo(
        model.named_parameters(),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2),
        sync_every=args.sync_every,
        topk=args.topk,
        chunk=16,
        timeout=args.timeout,
    )
    if args.go_file is not None:
        _log(args.log, event="ready", replica=args.replica)
        while not args.go_file.exists():
            time.sleep(0.02)
    manager, _store = replica_manager(
        group,
        args.lighthouse,
        f"replica_{args.replica}",
        timeout=timeout,
        quorum_timeout=datetime.timedelta(seconds=args.quorum_timeout),
        host=args.host,
    )
    ft = FaultTolerant(manager, opt, group)
    _log(args.log, event="start", replica=args.replica)
    local = 0
    hang_next = False
    mine = 0  # syncs committed by this process
    hang_local: int | None = None  # "mid": the local step to freeze at
    while True:
        if hang_local is not None and local >= hang_local:
            _log(args.log, event="hang", replica=args.replica, sync=opt.syncs)
            while True:
                time.sleep(1)
        if ft.sync_next:
            _log(args.log, event="quorum", replica=args.replica, sync=opt.syncs)
        try:
            ft.zero_grad()
        except JoinRefused as exc:
            _log(args.log, event="refused", replica=args.replica, error=str(exc))
            manager.shutdown(wait=False)
            os._exit(3)
        except (TimeoutError, RuntimeError) as exc:
            _fail(args.log, args.replica, exc)
        if hang_next and args.hang == "in" and ft.sync_next:
            _log(args.log, event="hang", replica=args.replica, sync=opt.syncs)
            while True:
                time.sleep(1)
        g = torch.Generator().manual_seed(1_000_003 * args.replica + local)
        x = torch.randn(8, 16, generator=g)
        loss = (model(x) - x[:, :4]).square().mean()
        loss.backward()
        syncs = opt.syncs
        try:
            ft.step()
        except (TimeoutError, RuntimeError) as exc:
            _fail(args.log, args.replica, exc)
        local += 1
        if opt.syncs > syncs:
            q = ft.quorum
            assert q is not None
            _log(
                args.log,
                event="sync",
                replica=args.replica,
                sync=opt.syncs,
                world=q.world_size,
                quorum=q.quorum_id,
                weights=_weights(model),
                heals=ft.heals,
                dropped=ft.dropped_rounds,
                error=str(ft.last_error) if ft.last_error else None,
            )
            mine += 1
            if args.hang_after is not None and mine >= args.hang_after:
                hang_next = args.hang == "in"
                hang_local = local + 1 if args.hang == "mid" else None
            stop = _stop_at(args.stop_file)
            if stop is not None and opt.syncs >= stop:
                break
        time.sleep(args.pace)
    _log(args.log, event="done", replica=args.replica, sync=opt.syncs)
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
