"""A real CPU measurement: a torch matmul overlapped with a gloo all-reduce, two processes.

    python -m cokit.cpu_demo [--size 768] [--numel 2000000] [--repeats 10]

Two ranks are spawned on loopback (one torch thread each); each runs the generic
:class:`~cokit.overlap.schedules.Overlap` (``a @ b`` on the calling thread, ``dist.all_reduce(...,
async_op=True)`` on gloo's work thread) and the chunked :class:`GemmCollective`
(all-reduce of the GEMM's own output), and reports every metric. Nothing here is emulated;
how much hides depends on the cores free for gloo's thread (report what it prints).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from cokit.triton_kernels._checks import check_int

__all__ = ["cpu_gloo_measurement"]


def _worker(
    rank: int, world: int, size: int, numel: int, repeats: int, warmup: int, chunks: int
) -> list[dict]:
    import torch.distributed as dist

    from cokit.overlap.schedules import GemmCollective, Overlap

    g = torch.Generator().manual_seed(rank)
    a, b = torch.randn(size, size, generator=g), torch.randn(size, size, generator=g)
    buf = torch.randn(numel, generator=g)
    ov = Overlap(
        lambda: torch.matmul(a, b),
        lambda: dist.all_reduce(buf, async_op=True),
        device="cpu",
        label=f"torch.matmul {size}^3 fp32 + gloo all_reduce of {numel * 4 / 2**20:.1f} MiB",
        comm_label=f"gloo all_reduce, {world} processes",
    )
    res = [ov.measure(repeats=repeats, warmup=warmup)]
    sched = GemmCollective(a, b, collective="all_reduce", chunks=chunks)
    res.append(
        sched.measure(
            repeats=repeats, warmup=warmup, label=f"GemmCollective all_reduce {size}^3 fp32, {chunks} chunks"
        )
    )
    return [{"text": r.format(), **r.to_dict()} for r in res]


def cpu_gloo_measurement(
    size: int = 768,
    numel: int = 2_000_000,
    repeats: int = 10,
    warmup: int = 2,
    chunks: int = 4,
    world_size: int = 2,
) -> list[list[dict[str, Any]]]:
    """Spawn ``world_size`` gloo ranks and measure; returns each rank's results (dicts with
    a printable ``text``)."""
    from cokit.launch import spawn

    for name, v in (("size", size), ("numel", numel), ("repeats", repeats), ("chunks", chunks)):
        check_int(name, v)
    return spawn(world_size, _worker, size, numel, repeats, warmup, chunks, backend="gloo")


def main(argv: list[str] | None = None) -> int:
    """Command line: print rank 0's tables (and rank 1's headline metrics)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=int, default=768, help="square matmul size (default 768)")
    p.add_argument(
        "--numel", type=int, default=2_000_000, help="fp32 elements all-reduced (default 2e6 = 7.6 MiB)"
    )
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--json", default=None, help="also write all ranks' results to this JSON file")
    args = p.parse_args(argv)
    if args.json:  # an unwritable --json fails now, not after the measurement
        from cokit.files import OutputError, prepare_out_file

        try:
            prepare_out_file(args.json, overwrite=True, flag="--json")
        except OutputError as exc:
            p.error(str(exc))
    per_rank = cpu_gloo_measurement(args.size, args.numel, args.repeats, args.warmup, args.chunks)
    for res in per_rank[0]:
        print(res["text"])
        print()
    for rank, results in enumerate(per_rank[1:], start=1):
        for res in results:
            m = res["metrics"]
            print(
                f"rank {rank}, {res['label']}: speedup {m['speedup']:.3f}, comm hidden {m['comm_hidden']:.3f}, "
                f"compute slowdown {m['compute_slowdown']:.3f}"
            )
    if args.json:
        from cokit.files import atomic_write_text

        doc = [[{k: v for k, v in r.items() if k != "text"} for r in rr] for rr in per_rank]
        atomic_write_text(args.json, json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
