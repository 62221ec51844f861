"""cokit.overlap.schedules on real gloo process groups (world 2 and 3): every schedule returns the
same tensor as its sequential version, and both match a reference built from all ranks' data.
Each spawn costs seconds, so one worker runs many checks.

Which comparisons are bitwise, and why (docs/design.md §2):

* CPU GEMMs of different shapes are NOT bitwise equal: BLAS picks its blocking from the row
  count, so ``gemm(a)[3:9]`` and ``gemm(a[3:9])`` may differ in the last bits (seen: 2.9e-6 on
  AVX-512). Chunked-vs-whole results are compared against a bound derived from the
  reduction length instead: two fp32 evaluations of a length-K dot product each lie within
  ``gamma_K * (|a| @ |b|)`` of the exact value (``gamma_K = K u / (1 - K u)``, u = 2^-24), the
  W-term sum of the ranks' products adds ``gamma_W`` of the same magnitude, and a bf16 output
  adds one bf16 ulp (at most 2^-7 |y|) of rounding.
* Bitwise holds for the Triton path (the gloo children run the interpreter) when the config is
  fixed and every chunk boundary is a multiple of BLOCK_M: each output tile is then computed by
  a program with the same inputs, the same block shapes and the same K loop, whether the rows
  are chunked or not; a 2-term sum (world 2) is commutative, so the all-reduce keeps it.
* The same op on the same shapes (``x @ y`` twice) is bitwise.
"""

import math

import pytest
import torch

from distributed import run_gloo

pytestmark = pytest.mark.distributed


def _data(rank, seed, *shape, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    return torch.randn(*shape, generator=g).to(dtype)


def _gamma(n):
    u = 2.0**-24
    return n * u / (1 - n * u)


def gemm_bound(pairs, out_dtype=torch.float32):
    """Largest |difference| two correct evaluations of ``sum_r a_r @ b_r`` may show, per element."""
    (a0, b0) = pairs[0]
    K, W = a0.shape[1], len(pairs)
    mag = sum(a.double().abs() @ b.double().abs() for a, b in pairs)
    bound = 2 * (_gamma(K) + _gamma(W)) * mag
    if out_dtype == torch.bfloat16:
        exact = sum(a.double() @ b.double() for a, b in pairs)
        bound = bound + 2.0**-7 * (exact.abs() + bound)
    return bound


def _checks(rank, world, exact_reduce):
    import torch.distributed as dist

    from cokit.overlap.guard import GuardViolation, StarvationGuard
    from cokit.overlap.schedules import AllGatherGemm, GemmCollective, Overlap, all_gather_gemm, gemm_all_reduce
    from cokit.overlap.streams import high_priority_group
    from cokit.triton_kernels.backend import kernel_path
    from cokit.triton_kernels.gemm import gemm
    from cokit.triton_kernels.gemm_configs import GemmConfig

    W = world
    out = {"path": kernel_path(torch.device("cpu"))}

    def bitwise(name, got, want):
        out[name] = bool(torch.equal(got, want))

    def close(name, got, want, bound):
        diff = (got.double() - want.double()).abs()
        out[name] = bool(got.shape == want.shape and torch.isfinite(got).all() and (diff <= bound).all())

    hp = high_priority_group()  # gloo: an ordinary group that says so
    out["hp_group"] = (hp.backend, hp.high_priority)
    cfg = GemmConfig(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=1)

    # GEMM + all-reduce (row-parallel linear): uneven chunks, explicit config, high-priority group
    a, b = _data(rank, 1, 50, 40), _data(rank, 2, 40, 30)
    pairs = [(_data(r, 1, 50, 40), _data(r, 2, 40, 30)) for r in range(W)]
    ref = sum(x.double() @ y.double() for x, y in pairs)
    bound = gemm_bound(pairs)
    for chunks in (1, 3):
        s = GemmCollective(a, b, collective="all_reduce", chunks=chunks, config=cfg, group=hp)
        ovl, seq = s.run().output, s.run(overlap=False).output
        if chunks == 1 and exact_reduce:
            bitwise("ar1_vs_seq", ovl, seq)  # the same GEMM and the same 2-term sum
        else:
            close(f"ar{chunks}_vs_seq", ovl, seq, bound)  # 17/17/16-row chunks: other BLAS blocking
        close(f"ar{chunks}_vs_ref", ovl, ref, bound)
    close("ar_functional", gemm_all_reduce(a, b, chunks=2, config=cfg), seq, bound)

    # chunk boundaries on BLOCK_M multiples, fixed config, Triton path: bitwise (module docstring)
    a64, b64 = _data(rank, 14, 4 * 32, 40), _data(rank, 15, 40, 30)
    for chunks in (2, 4):
        s = GemmCollective(a64, b64, collective="all_reduce", chunks=chunks, config=cfg)
        ovl, seq = s.run().output, s.run_sequential()
        if exact_reduce:
            bitwise(f"ar_aligned{chunks}_vs_seq", ovl, seq)
        else:
            close(f"ar_aligned{chunks}_vs_seq", ovl, seq,
                  gemm_bound([(_data(r, 14, 128, 40), _data(r, 15, 40, 30)) for r in range(W)]))

    # GEMM + reduce-scatter: this rank's rows of the summed product
    M = 8 * W
    a = _data(rank, 3, M, 24)
    b24 = _data(rank, 4, 24, 20)
    pairs = [(_data(r, 3, M, 24), _data(r, 4, 24, 20)) for r in range(W)]
    rows = slice(rank * M // W, (rank + 1) * M // W)
    full, bound = sum(x.double() @ y.double() for x, y in pairs)[rows], gemm_bound(pairs)[rows]
    s = GemmCollective(a, b24, collective="reduce_scatter", chunks=2)
    ovl = s.run().output
    close("rs_vs_seq", ovl, s.run_sequential(), bound)
    close("rs_vs_ref", ovl, full, bound)

    # all-gather rows of A, then GEMM (sequence-parallel column-linear); fp32 and bf16
    for dtype in (torch.float32, torch.bfloat16):
        shard, bb = _data(rank, 5, 7, 40, dtype=dtype), _data(0, 6, 40, 30, dtype=dtype)
        gathered = torch.cat([_data(r, 5, 7, 40, dtype=dtype) for r in range(W)])
        s = AllGatherGemm(shard, bb, operand="a", chunks=3)
        ovl = s.run().output
        tag = str(dtype).removeprefix("torch.")
        bound = gemm_bound([(gathered, bb)], out_dtype=dtype)
        close(f"aga_{tag}_vs_seq", ovl, s.run_sequential(), bound)
        close(f"aga_{tag}_vs_ref", ovl, gathered.double() @ bb.double(), bound)

    # FSDP style: all-gather columns of B (a row-shard of a Linear weight, transposed)
    w_shard = _data(rank, 7, 9, 40)  # (n, K) rows of the weight
    A = _data(0, 8, 20, 40)
    s = AllGatherGemm(w_shard.t(), A, operand="b", chunks=2)
    ovl = s.run().output
    weight = torch.cat([_data(r, 7, 9, 40) for r in range(W)])
    bound = gemm_bound([(A, weight.t())])
    close("agb_vs_seq", ovl, s.run_sequential(), bound)
    close("agb_vs_ref", ovl, A.double() @ weight.t().double(), bound)
    close("agb_functional", all_gather_gemm(w_shard.t(), A, operand="b", chunks=3), ovl, bound)

    # generic Overlap: a matmul next to an async all-reduce of another tensor
    x, y = _data(rank, 9, 32, 32), _data(rank, 10, 32, 32)
    base = _data(rank, 11, 1000)
    reduced = []

    def communicate():
        t = base.clone()
        reduced.append(t)
        return dist.all_reduce(t, async_op=True)

    ov = Overlap(lambda: x @ y, communicate, device="cpu")
    o1 = ov()
    r1 = reduced[-1]
    o2 = ov.run(overlap=False).output
    bitwise("ov_compute", o1, o2)  # the same matmul on the same shapes
    bitwise("ov_comm", r1, reduced[-1])  # the same all-reduce of the same tensor
    summands = [_data(r, 11, 1000) for r in range(W)]
    close("ov_comm_ref", r1, sum(t.double() for t in summands), 2 * _gamma(W) * sum(t.double().abs() for t in summands))

    # a real measurement through run(measure=True)
    s = GemmCollective(_data(rank, 12, 64, 64), _data(rank, 13, 64, 64), chunks=2, config=cfg)
    res = s.run(measure=True, repeats=2, warmup=1)
    if exact_reduce:
        bitwise("measured_output", res.output, s.run_sequential())  # 32-row chunks = BLOCK_M
    else:
        close("measured_output", res.output, s.run_sequential(),
              gemm_bound([(_data(r, 12, 64, 64), _data(r, 13, 64, 64)) for r in range(W)]))
    t = res.timings
    out["timings"] = (t.world_size, t.rank, t.timer, t.emulated, t.times["compute"].n,
                      all(math.isfinite(v.median) and v.median > 0 for v in t.times.values()),
                      t.info["chunks"], t.info["collective"])

    # bad input: clear errors, raised before any collective
    errors = {}
    for name, fn in {
        "rs_rows": lambda: GemmCollective(_data(rank, 1, 10, 8), _data(rank, 1, 8, 4), collective="reduce_scatter",
                                          chunks=2),
        "chunks": lambda: GemmCollective(_data(rank, 1, 3, 8), _data(rank, 1, 8, 4), chunks=5),
        "inner": lambda: GemmCollective(_data(rank, 1, 4, 8), _data(rank, 1, 7, 4)),
        "collective": lambda: GemmCollective(_data(rank, 1, 4, 8), _data(rank, 1, 8, 4), collective="all_to_all"),
        "operand": lambda: AllGatherGemm(_data(rank, 1, 4, 8), _data(rank, 1, 8, 4), operand="c"),
        "priority": lambda: GemmCollective(_data(rank, 1, 4, 8), _data(rank, 1, 8, 4), priority=5),
        "guard": lambda: GemmCollective(_data(rank, 1, 4, 8), _data(rank, 1, 8, 4),
                                        guard=StarvationGuard(allow_high_priority=False)),
        "dtype": lambda: GemmCollective(_data(rank, 1, 4, 8), _data(rank, 1, 8, 4, dtype=torch.float16)),
    }.items():
        try:
            fn()
            errors[name] = None
        except (ValueError, TypeError) as exc:
            errors[name] = (type(exc).__name__, isinstance(exc, GuardViolation), str(exc))
    out["errors"] = errors
    return out


def _worker(rank, world):
    return _checks(rank, world, exact_reduce=True)


def _worker3(rank, world):
    return _checks(rank, world, exact_reduce=False)


@pytest.fixture(scope="module")
def world2():
    return run_gloo(2, _worker)


def test_schedules_equal_sequential_and_reference_world2(world2):
    for rank, res in enumerate(world2):
        bad = [k for k, v in res.items() if v is False]
        assert not bad, f"rank {rank}: {bad}"
        checked = [k for k, v in res.items() if v is True]
        assert len(checked) == 20, checked
        assert res["hp_group"] == ("gloo", False)
        assert res["path"] == "interpreter"  # the bitwise claims are about the Triton path


def test_real_measurement_world2(world2):
    for rank, res in enumerate(world2):
        assert res["timings"] == (2, rank, "monotonic (time.perf_counter)", False, 2, True, 2, "all_reduce")


def test_bad_input_world2(world2):
    err = world2[0]["errors"]
    assert err["rs_rows"][0] == "ValueError" and "world_size=2 x chunks=2" in err["rs_rows"][2]
    assert "more than the 3" in err["chunks"][2]
    assert "a.shape[1] must equal b.shape[0]" in err["inner"][2]
    assert "all_reduce, reduce_scatter" in err["collective"][2]
    assert "operand" in err["operand"][2]
    assert "priority=5" in err["priority"][2]
    assert err["guard"][1] is True and "high-priority" in err["guard"][2]
    assert "share dtype" in err["dtype"][2]


def test_schedules_world3():
    for rank, res in enumerate(run_gloo(3, _worker3)):
        bad = [k for k, v in res.items() if v is False]
        assert not bad, f"rank {rank}: {bad}"
        assert res["timings"][0] == 3
        assert "world_size=3 x chunks=2" in res["errors"]["rs_rows"][2]
