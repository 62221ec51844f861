"""``cokit info``: backend, devices, chip limits, versions and which kernels are active."""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform

KERNEL_FAMILIES = {
    "dct": "tiled DCT-II encode / DCT-III decode (cokit::dct_encode_multi, cokit::dct_decode_multi)",
    "topk": "per-chunk top-k (cokit::chunk_topk)",
    "error_feedback": "fused error feedback encode/decode (cokit::ef_encode, cokit::ef_decode)",
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("info", help="show backend, devices, limits and versions", description=__doc__)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.set_defaults(func=run)


def collect() -> dict:
    """Everything ``cokit info`` reports, as a dict."""
    import torch

    from cokit import __version__
    from cokit.triton_kernels import backend

    triton_version = None
    if backend.triton_available():
        import triton

        triton_version = triton.__version__
    devices = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            devices.append(dataclasses.asdict(backend.device_limits(i)))
    cpu_path = backend.kernel_path("cpu")
    gpu_path = backend.kernel_path("cuda") if torch.cuda.is_available() else None
    return {
        "versions": {
            "cokit": __version__,
            "torch": torch.__version__,
            "triton": triton_version,
            "python": platform.python_version(),
        },
        "paths": {"cpu tensors": cpu_path, "gpu tensors": gpu_path or "no GPU visible"},
        "kernels": {
            name: {"what": what, "cpu": cpu_path, "gpu": gpu_path} for name, what in KERNEL_FAMILIES.items()
        },
        "devices": devices,
        "targets": {name: dataclasses.asdict(lim) for name, lim in backend.KNOWN_TARGETS.items()},
    }


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*map(str, r)) for r in rows]
    return "\n".join(line.rstrip() for line in lines)


def run(args: argparse.Namespace) -> int:
    info = collect()
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    v = info["versions"]
    print(
        f"cokit {v['cokit']}  torch {v['torch']}  triton {v['triton'] or 'not installed'}  python {v['python']}"
    )
    print(
        f"kernel path: CPU tensors -> {info['paths']['cpu tensors']}, GPU tensors -> {info['paths']['gpu tensors']}"
    )
    if info["paths"]["cpu tensors"] == "torch":
        print("  (set TRITON_INTERPRET=1 before importing cokit to run the Triton kernels on CPU tensors)")
    print()
    print(
        _table(
            [[n, k["cpu"], k["gpu"] or "-", k["what"]] for n, k in info["kernels"].items()],
            ["kernel", "cpu", "gpu", "what"],
        )
    )
    print()
    limit_cols = [
        "name",
        "source",
        "warp_size",
        "num_sms",
        "max_shared_per_block",
        "max_shared_per_sm",
        "registers_per_sm",
        "max_warps_per_sm",
    ]
    rows = [[d[c] for c in limit_cols] for d in info["devices"]]
    rows += [[t[c] for c in limit_cols] for t in info["targets"].values()]
    print("devices (live) and targets (table):" if info["devices"] else "no GPU visible; target table:")
    print(_table(rows, limit_cols))
    return 0
