"""cokit.overlap.streams (CPU no-ops, priorities), the starvation guard, the emulated comm side and
the persistent copy kernel (interpreter)."""

import pytest
import torch

from cokit.overlap.emulate import EmulatedComm
from cokit.overlap.guard import GuardViolation, StarvationGuard, reserved_sms
from cokit.overlap.schedules import Overlap, split_sizes
from cokit.overlap.streams import (
    CPU_PRIORITY_RANGE,
    CommStream,
    high_priority_group,
    priority_range,
    resolve_priority,
    wait_handle,
)
from cokit.triton_kernels.backend import arch_limits
from cokit.triton_kernels.gemm_config import GemmConfig
from cokit.triton_kernels.sm_copy import sm_copy, sm_copy_reference


def test_cpu_comm_stream_is_a_noop_with_the_same_api():
    cs = CommStream("cpu", priority="high")
    assert cs.is_noop and cs.stream is None and cs.priority == CPU_PRIORITY_RANGE[1]
    x = torch.ones(3)
    cs.wait_for_current()
    with cs, cs:  # re-entrant
        y = x * 2
    cs.keep_alive(x, y)
    cs.join()
    cs.synchronize()
    assert torch.equal(y, torch.full((3,), 2.0)) and "no-op" in repr(cs)


def test_priorities():
    assert priority_range("cpu") == CPU_PRIORITY_RANGE == (0, -3)
    assert resolve_priority("high", "cpu") == -3 and resolve_priority("normal", "cpu") == 0
    assert resolve_priority(-1, "cpu") == -1
    for bad in (1, -4, "urgent", 0.5, True, None):
        with pytest.raises(ValueError, match="priority"):
            resolve_priority(bad, "cpu")
    with pytest.raises(ValueError, match=r"cuda .* or cpu"):
        CommStream("meta")


def test_wait_handle():
    class Work:
        waited = 0

        def wait(self):
            Work.waited += 1

    wait_handle(None)
    wait_handle(Work())
    wait_handle([Work(), (Work(), None)])
    assert Work.waited == 3
    with pytest.raises(TypeError, match="wait"):
        wait_handle(42)


def test_high_priority_group_needs_distributed():
    with pytest.raises(RuntimeError, match="init_process_group"):
        high_priority_group()


def test_starvation_guard():
    lim = arch_limits("sm_90")  # 132 SMs
    guard = StarvationGuard(
        max_reserved_fraction=0.25, max_footprint_inflation=2.0, allow_high_priority=False
    )
    carve = GemmConfig(persistent=True, num_sms=100)  # 32 reserved <= floor(0.25 * 132) = 33
    assert reserved_sms(carve, lim) == 32 and reserved_sms(GemmConfig(), lim) == 0
    assert guard.violations(carve, limits=lim) == []
    bad = guard.violations(carve, limits=lim, comm_sms=2)  # 34 taken
    assert len(bad) == 1 and "34 of 132" in bad[0]
    cfg = GemmConfig(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_stages=2, smem_bytes=40000)
    assert "max_footprint_inflation" in guard.violations(cfg, natural_smem=16384)[0]  # 2.44x
    assert guard.violations(cfg, natural_smem=20000) == []  # exactly 2x
    assert guard.violations(cfg, limits=lim, dtype=torch.bfloat16)  # estimated need 8192 B: 4.9x
    assert "high-priority" in guard.violations(priority="high")[0]
    assert guard.violations(priority=-1) and not guard.violations(priority="normal")
    with pytest.raises(GuardViolation, match=r"starvation guard: .*34 of 132"):
        guard.check(carve, limits=lim, comm_sms=2)
    slow = StarvationGuard(max_compute_slowdown=0.2)
    assert slow.check_measured(0.1) == [] and "above max_compute_slowdown" in slow.check_measured(0.3)[0]
    assert StarvationGuard().check_measured(5.0) == []
    for kw in (
        {"max_reserved_fraction": 1.5},
        {"max_reserved_sms": -1},
        {"max_footprint_inflation": 0.5},
        {"max_compute_slowdown": -0.1},
    ):
        with pytest.raises(ValueError, match=next(iter(kw))):
            StarvationGuard(**kw)


def test_split_sizes():
    assert split_sizes(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert split_sizes(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    with pytest.raises(ValueError, match="more than the 3"):
        split_sizes(3, 4)
    with pytest.raises(ValueError, match="chunks"):
        split_sizes(3, 0)


@pytest.mark.parametrize(
    "n, dtype, n_sms, passes",
    [
        (1, torch.float32, 1, 1),
        (1000, torch.float16, 3, 2),
        (70001, torch.bfloat16, 2, 1),
        (4097, torch.int32, 5, 1),
        (33, torch.int8, 64, 1),
    ],
)
def test_sm_copy_matches_reference(n, dtype, n_sms, passes):
    src = (torch.randn(n) * 100).to(dtype)
    dst = torch.full((n,), -7).to(dtype)  # poisoned
    out = sm_copy(src, dst, n_sms=n_sms, passes=passes)
    assert out is dst and torch.equal(out, sm_copy_reference(src))


def test_sm_copy_small_blocks_and_2d():
    src = torch.randn(37, 29)
    assert torch.equal(sm_copy(src, block=64, n_sms=3), src)
    assert sm_copy(torch.empty(0)).numel() == 0


@pytest.mark.parametrize(
    "kw, err, match",
    [
        ({"src": torch.randn(4, 4).t()}, ValueError, "contiguous"),
        ({"src": torch.zeros(4, dtype=torch.bool)}, TypeError, "dtype"),
        ({"dst": torch.empty(5)}, ValueError, "dst must be"),
        ({"n_sms": 0}, ValueError, "n_sms"),
        ({"passes": 0}, ValueError, "passes"),
        ({"block": 100}, ValueError, "block"),
        ({"num_warps": 3}, ValueError, "num_warps"),
        ({"smem_bytes": 1024}, ValueError, "GPU only"),
    ],
)
def test_sm_copy_bad_input(kw, err, match):
    args = {"src": torch.randn(4), **kw}
    src = args.pop("src")
    with pytest.raises(err, match=match):
        sm_copy(src, **args)


def test_emulated_comm_on_cpu_overlaps_a_matmul():
    comm = EmulatedComm(1 << 20, "cpu", passes=2)
    assert comm.kind == "thread-copy" and comm.label.startswith("EMULATED")
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    ov = Overlap(lambda: a @ b, comm, device="cpu", priority="normal")
    assert ov.emulated and not ov.uses_group and "EMULATED" in ov.comm_label
    out = ov()
    assert torch.equal(out, a @ b) and comm.verify()
    res = ov.measure(repeats=2, warmup=0)
    assert res.emulated and "EMULATED" in res.format() and res.metrics.t_comp > 0
    assert res.flat()["emulated"] is True
    comm.close()
    with pytest.raises(ValueError, match="not available on cpu"):
        EmulatedComm(1024, "cpu", kind="copy-kernel")
    with pytest.raises(ValueError, match="nbytes"):
        EmulatedComm(0, "cpu")
    with pytest.raises(ValueError, match="n_sms applies"):
        EmulatedComm(1024, "cpu", n_sms=4)


def test_overlap_checks_arguments():
    with pytest.raises(TypeError, match="callables"):
        Overlap(1, lambda: None, device="cpu")
    with pytest.raises(TypeError, match="GemmConfig"):
        Overlap(lambda: None, lambda: None, device="cpu", config={"num_warps": 4})
    with pytest.raises(ValueError, match="num_warps"):
        Overlap(lambda: None, lambda: None, device="cpu", config=GemmConfig(num_warps=3))
    with pytest.raises(ValueError, match="priority"):
        Overlap(lambda: None, lambda: None, device="cpu", priority="max")
    with pytest.raises(GuardViolation, match="high-priority"):
        Overlap(lambda: None, lambda: None, device="cpu", guard=StarvationGuard(allow_high_priority=False))
    with pytest.raises(TypeError, match="CommStream"):
        Overlap(lambda: None, lambda: None, device="cpu", stream=object())
