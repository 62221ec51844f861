"""Communication timing (where a step's time goes): the timer against a fake clock, then real gloo runs of
DeMo, the DDP hook and the overlap schedules (exposed <= step time, bytes per collective add
up to the step's bytes)."""

from __future__ import annotations

import os
import time

import pytest
import torch
from distributed import run_gloo

from cokit.compress.stats import CommStats
from cokit.compress.timing import StepTimer, empty_timing


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _FakeWork:
    """A collective whose completion the test decides (its future's callbacks fire then)."""

    def __init__(self) -> None:
        self.future: torch.futures.Future = torch.futures.Future()

    def get_future(self) -> torch.futures.Future:
        return self.future


def test_timer_against_fake_clock():
    clock = _Clock()
    timer = StepTimer(clock)
    with timer.span("encode"):
        clock.now = 0.5
    a, b = _FakeWork(), _FakeWork()
    rec_a = timer.launched("a", 100, 100, timer.mark())  # t=0.5
    timer.watch(rec_a, a)
    clock.now = 1.0
    rec_b = timer.launched("b", 30, 30, timer.mark())  # t=1.0
    timer.watch(rec_b, b)
    clock.now = 2.0
    b.future.set_result(None)  # b completes at 2.0, before anyone waits on it
    clock.now = 3.0
    start = timer.mark()  # wait on a from 3.0 ...
    clock.now = 3.5
    a.future.set_result(None)  # ... it completes at 3.5 ...
    clock.now = 4.0
    timer.waited(rec_a, start, timer.mark())  # ... and the wait returns at 4.0
    timer.waited(rec_b, timer.mark(), timer.mark())  # a late wait on b: no time
    with timer.span("decode"):
        clock.now = 4.25
    timing = timer.take()
    got = timing.resolve()
    assert got["encode_s"] == 0.5 and got["decode_s"] == 0.25
    assert got["exposed_s"] == 1.0  # blocked on a from 3.0 to 4.0
    # a: launched 0.5, seen complete by its wait at 4.0; b: 1.0 to its callback at 2.0
    assert [(c["what"], c["comm_s"], c["exposed_s"]) for c in got["collectives"]] == [
        ("a", 3.5, 1.0),
        ("b", 1.0, 0.0),
    ]
    assert got["comm_s"] == 3.5  # the union [0.5, 4.0]: b ran inside a
    assert [c["sent_bytes"] for c in got["collectives"]] == [100, 30]
    assert timer.take().resolve() == empty_timing()  # take() started the next step empty


def test_union_of_disjoint_collectives_and_discard():
    clock = _Clock()
    timer = StepTimer(clock)
    for start, end in ((0.0, 1.0), (2.0, 2.5), (0.5, 1.5)):
        clock.now = start
        record = timer.launched("c", 1, 1, timer.mark())
        timer.waited(record, start, end)  # blocked from launch to completion
    got = timer.take().resolve()
    assert got["comm_s"] == 2.0  # [0, 1.5] and [2, 2.5]
    assert got["exposed_s"] == 2.5  # the three waits, summed
    timer.launched("dropped", 1, 1, timer.mark())
    timer.discard()
    assert timer.take().resolve()["collectives"] == []


def test_a_blocked_window_does_not_count_codec_work_inside_it():
    """The DDP hook blocks from backward's end to the last assembly; decodes run inside."""
    clock = _Clock()
    timer = StepTimer(clock)
    clock.now = 1.0
    with timer.span("decode"):  # [1, 1.5] on a communication thread
        clock.now = 1.5
    clock.now = 2.0
    with timer.span("decode"):  # [2, 2.25]
        clock.now = 2.25
    timer.blocked(0.5, 3.0)  # DDP waited from 0.5 to 3.0
    got = timer.take().resolve()
    assert got["decode_s"] == 0.75 and got["exposed_s"] == 1.75


def test_a_span_inside_a_span_of_the_same_kind_counts_once():
    """The hook's decode span holds the exchange core's validation span: decode time once."""
    clock = _Clock()
    timer = StepTimer(clock)
    with timer.span("decode"):
        clock.now = 1.0
        with timer.span("decode"):
            clock.now = 1.5
        with timer.span("encode"):  # another kind counts on its own
            clock.now = 1.75
        clock.now = 2.0
    assert timer.take().resolve()["decode_s"] == 2.0
    with timer.span("decode"):  # the outer span closed: the next one counts again
        clock.now = 2.5
    got = timer.take().resolve()
    assert got["decode_s"] == 0.5


def test_comm_stats_records_timing_and_loads_old_checkpoints():
    clock = _Clock()
    timer = StepTimer(clock)
    stats = CommStats()
    for step in range(2):
        with timer.span("encode"):
            clock.now += 1.0
        record = timer.launched("x", 10, 10, timer.mark())
        clock.now += 2.0
        timer.waited(record, clock.now - 0.5, clock.now)
        stats.record(10, 10, 40, timer.take(), world_size=4, group_size=2)
        assert stats.step_encode_s == 1.0 and stats.step_exposed_s == 0.5 and stats.step_comm_s == 2.0
        assert stats.total_encode_s == step + 1.0
    saved = stats.as_dict()
    assert saved["world_size"] == 4 and saved["group_size"] == 2 and saved["total_comm_s"] == 4.0
    assert saved["step_collectives"] == [
        {"what": "x", "sent_bytes": 10, "received_bytes": 10, "comm_s": 2.0, "exposed_s": 0.5}
    ]
    again = CommStats.from_dict(saved)
    assert again.total_exposed_s == 1.0 and again.total_sent_bytes == 20 and again.steps == 2
    old = {k: v for k, v in saved.items() if not k.endswith("_s") and "size" not in k}  # before timing
    assert CommStats.from_dict(old).total_sent_bytes == 20


# ---------------------------------------------------------------------- real gloo runs
def _check_steps(
    steps: list[tuple[float, dict]], rank: int, what: str, threaded_decode: bool = False
) -> None:
    """``threaded_decode``: decodes run on communication threads (the DDP hook), possibly
    during backward, so only encode + exposed (the calling thread's) must fit the step."""
    for n, (wall_s, s) in enumerate(steps):
        where = f"rank {rank}, {what} step {n}"
        assert 0.0 <= s["step_exposed_s"] <= wall_s, f"{where}: exposed {s['step_exposed_s']} > step {wall_s}"
        assert s["step_comm_s"] > 0.0, where
        assert s["step_encode_s"] > 0.0 and s["step_decode_s"] > 0.0, where
        own = s["step_encode_s"] + s["step_exposed_s"] + (0.0 if threaded_decode else s["step_decode_s"])
        assert own <= wall_s, where
        collectives = s["step_collectives"]
        assert sum(c["sent_bytes"] for c in collectives) == s["step_sent_bytes"], where
        assert sum(c["received_bytes"] for c in collectives) == s["step_received_bytes"], where
        assert all(c["comm_s"] >= 0.0 and c["exposed_s"] >= 0.0 for c in collectives), where
        assert s["group_size"] == s["world_size"], where


def _demo_steps(rank: int, world: int, overlap: bool):
    os.environ["TRITON_INTERPRET"] = "0"  # the torch path: fast, same timing code
    from cokit.compress import DeMo

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = DeMo(model.parameters(), lr=1e-3, compression_topk=8, overlap_backward=overlap)
    g = torch.Generator().manual_seed(rank)
    out = []
    for _ in range(4):
        x = torch.randn(16, 32, generator=g)
        start = time.perf_counter()
        model(x).square().mean().backward()
        opt.step()
        wall = time.perf_counter() - start
        opt.zero_grad()
        out.append((wall, opt.comm_stats.as_dict()))
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_demo_times_its_steps(world):
    for overlap in (False, True):
        for rank, steps in enumerate(run_gloo(world, _demo_steps, overlap)):
            _check_steps(steps, rank, f"DeMo(overlap_backward={overlap})")
            whats = {c["what"] for c in steps[-1][1]["step_collectives"]}
            assert {"status exchange", "payload all-gather"} <= whats
            assert steps[0][1]["world_size"] == world


def _hook_steps(rank: int, world: int):
    os.environ["TRITON_INTERPRET"] = "0"
    from torch.nn.parallel import DistributedDataParallel as DDP

    from cokit.compress.hooks import DCTTopKState, dct_topk_hook

    torch.manual_seed(0)
    net = DDP(torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4)))
    state = DCTTopKState(topk=8, chunk=32)
    net.register_comm_hook(state, dct_topk_hook)
    g = torch.Generator().manual_seed(rank)
    out = []
    for _ in range(4):
        x = torch.randn(16, 32, generator=g)
        start = time.perf_counter()
        net(x).square().mean().backward()
        wall = time.perf_counter() - start
        net.zero_grad()
        out.append((wall, state.comm_stats.as_dict()))
    return out


@pytest.mark.distributed
def test_hook_times_its_iterations():
    for rank, steps in enumerate(run_gloo(2, _hook_steps)):
        _check_steps(steps, rank, "DDP hook", threaded_decode=True)
        assert [s["steps"] for _, s in steps] == [1, 2, 3, 4]


def _schedule_runs(rank: int, world: int):
    os.environ["TRITON_INTERPRET"] = "0"
    from cokit.overlap.schedules import AllGatherGemm, GemmCollective

    torch.manual_seed(rank)
    out = {}
    a, b = torch.randn(96, 64), torch.randn(64, 48)
    for collective in ("all_reduce", "reduce_scatter"):
        sched = GemmCollective(a, b, collective=collective, chunks=3)
        for phase in ("run_sequential", "run_overlapped", "run_communicate"):
            start = time.perf_counter()
            getattr(sched, phase)()
            out[collective, phase] = (time.perf_counter() - start, sched.comm_stats.as_dict())
    gather = AllGatherGemm(torch.randn(24, 64), b, chunks=2)
    start = time.perf_counter()
    gather.run_overlapped()
    out["all_gather", "run_overlapped"] = (time.perf_counter() - start, gather.comm_stats.as_dict())
    return out


@pytest.mark.distributed
def test_schedules_time_their_collectives():
    world = 2
    for rank, runs in enumerate(run_gloo(world, _schedule_runs)):
        for (collective, phase), (wall, s) in runs.items():
            where = f"rank {rank}, {collective} {phase}"
            assert 0.0 <= s["step_exposed_s"] <= wall and s["step_comm_s"] > 0.0, where
            assert s["step_encode_s"] == 0.0 == s["step_decode_s"], where
            full = 96 * 48 * 4 if collective != "all_gather" else 24 * 64 * 4  # fp32 bytes per rank
            expected = {
                "all_reduce": 2 * (world - 1) * full // world,
                "reduce_scatter": (world - 1) * full // world,
                "all_gather": (world - 1) * full,
            }[collective]
            assert s["step_sent_bytes"] == expected, where
            n = 1 if phase == "run_sequential" else (3 if collective != "all_gather" else 2)
            assert len(s["step_collectives"]) == n, where
