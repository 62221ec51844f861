"""``cokit info``: backend, devices, chip limits, versions and which kernels are active."""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys

KERNEL_FAMILIES = {
    "dct": "tiled DCT-II encode / DCT-III decode (cokit::dct_encode_multi, cokit::dct_decode_multi)",
    "topk": "per-chunk top-k (cokit::chunk_topk)",
    "error_feedback": "fused error feedback encode/decode (cokit::ef_encode, cokit::ef_decode)",
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("info", help="show backend, devices, limits and versions", description=__doc__)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument(
        "--kernels",
        nargs="*",
        metavar="TARGET",
        help="compile every shipped kernel config for these targets (default sm_80 sm_90 gfx942; "
        "no GPU needed, a few minutes) and print registers, stack, spills, shared memory, occupancy "
        "and 128-bit vs narrower global accesses",
    )
    p.set_defaults(func=run)


def kernel_resources(targets: list[str]) -> list[dict]:
    """Compile-only resource reports of every shipped kernel config for ``targets``, built in a
    subprocess without ``TRITON_INTERPRET`` (the interpreter replaces the compiler)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "cokit.triton_kernels.compile_only", *targets]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"compile-only builds failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


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


def _print_kernels(targets: list[str], as_json: bool) -> int:
    from cokit.triton_kernels.backend import arch_limits
    from cokit.triton_kernels.compile_only import resource_rows, spill_problems
    from cokit.triton_kernels.roofline import estimates

    for t in targets:
        arch_limits(t)  # an unknown target fails here, with the known ones named
    print(f"compiling every shipped kernel config for {', '.join(targets)} ...", file=sys.stderr, flush=True)
    rows = kernel_resources(targets)
    if as_json:
        for row, est in zip(rows, estimates(rows), strict=True):
            row["estimate"] = {k: est[k] for k in ("blocks_per_sm", "limited_by", "roofline_ms_per_1e9")}
        print(json.dumps(rows, indent=2))
        return 0
    table = resource_rows(rows)
    print(_table(table[1:], table[0]))
    problems = spill_problems(rows)
    print()
    print("spills: none" if not problems else "spills:\n  " + "\n  ".join(problems))
    print()
    print(_estimate_table(estimates(rows)))
    return 0


def _estimate_table(est: list[dict]) -> str:
    """The static estimate: blocks per SM, bytes per element, roofline ms per 1e9 elements."""
    chips = list(dict.fromkeys(chip for e in est for chip in e["roofline_ms_per_1e9"]))
    header = [
        "kernel",
        "target",
        "warps/stages",
        "blocks/SM (limit)",
        "B/elem",
        *[f"{c} ms/1e9" for c in chips],
    ]
    rows = []
    for e in est:
        ms = e["roofline_ms_per_1e9"]
        rows.append(
            [
                e["name"],
                e["target"],
                f"{e['num_warps']}/{e['num_stages'] if e['num_stages'] is not None else '-'}",
                f"{e['blocks_per_sm']} ({e['limited_by']})",
                "-" if e["bytes_per_element"] is None else f"{e['bytes_per_element']:.3g}",
                *["" if c not in ms else ("-" if ms[c] is None else f"{ms[c]:.3g}") for c in chips],
            ]
        )
    note = (
        "static estimate: blocks per SM/CU from registers, shared memory and warps; HBM bytes per "
        "tensor element; the memory roofline (data-sheet bandwidth) per 1e9 elements. A bound, not "
        "a measurement: `python -m cokit.bench.gpu_check --quick` measures GB/s on a GPU."
    )
    return note + "\n" + _table(rows, header)


def run(args: argparse.Namespace) -> int:
    if args.kernels is not None:
        return _print_kernels(args.kernels or ["sm_80", "sm_90", "gfx942"], args.json)
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
