"""The fault-tolerance benchmark (cokit.bench.ft_bench): its summary on made-up runs and its flags.
A short real run is not a test: three replicas that start seconds apart on a loaded machine may
find the others done (a toy model runs its syncs in a second) and wait out a quorum timeout."""

from __future__ import annotations

import pytest

from cokit.bench import ft_bench


def _row(method: str, fault: str, seed: int, heldout: float, curve: list, **extra: float) -> dict:
    return {
        "method": method,
        "fault": fault,
        "seed": seed,
        "heldout": heldout,
        "curve": curve,
        "bytes_per_step": 100.0 if method == "diloco" else 5.0,
        "fp8_diloco_bytes_per_step": 25.0,
        "wall_s": 10.0,
        **extra,
    }


def test_summary_compares_with_the_same_method_without_a_fault_and_times_the_dense_target() -> None:
    rows = [
        _row("diloco", "none", 0, 2.0, [[1.0, 3.0], [2.0, 2.0]]),
        _row("diloco", "none", 1, 2.2, [[1.0, 3.0], [2.5, 2.05], [3.0, 2.2]]),
        _row("sparseloco", "none", 0, 2.0, [[0.5, 2.5], [1.5, 2.0]]),
        _row("sparseloco", "none", 1, 2.0, [[0.5, 2.5], [1.0, 2.0]]),
        _row("sparseloco", "kill", 0, 2.2, [[3.0, 2.2]], continue_s=1.5, heal_s=2.0, rejoined=False),
    ]
    summary = {(s["method"], s["fault"]): s for s in ft_bench.summarize(rows)}
    assert set(summary) == {("diloco", "none"), ("sparseloco", "none"), ("sparseloco", "kill")}
    dense, sparse, killed = (
        summary["diloco", "none"],
        summary["sparseloco", "none"],
        summary["sparseloco", "kill"],
    )
    assert dense["target"] == pytest.approx(2.1)  # each seed's: its no-fault dense run's final loss
    assert dense["time_to_target_s"] == pytest.approx((2.0 + 2.5) / 2)
    assert killed["time_to_target_s"] is None  # never reached on one seed: no mean
    assert sparse["time_to_target_s"] == pytest.approx((1.5 + 1.0) / 2)
    assert killed["vs_no_fault_pct"] == pytest.approx(10.0)
    assert dense["fewer_than_fp8_diloco"] == 0.25 and sparse["fewer_than_fp8_diloco"] == 5.0
    assert killed["rejoined"] == 0 and dense["rejoined"] is None
    assert killed["continue_s"] == 1.5 and killed["heal_s"] == 2.0 and killed["seeds"] == 1
    assert sparse["heldout_sd"] == 0.0 and dense["heldout_sd"] == pytest.approx(0.1414, abs=1e-4)
    table = ft_bench.table(ft_bench.summarize(rows))
    assert table.count("\n") == 2 + 3 - 1 and "| sparseloco | kill | 1 | 2.2000" in table


def test_time_to_target_is_none_when_never_reached() -> None:
    assert ft_bench.time_to([[1.0, 3.0], [2.0, 2.5]], 2.0) is None
    assert ft_bench.time_to([[1.0, 3.0], [2.0, 1.9]], 2.0) == 2.0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--syncs", "1"], "--syncs must be >= 2"),
        (["--restart-after", "-1"], "--restart-after >= 0"),
        (["--methods", "dion"], "invalid choice"),
    ],
)
def test_bad_flags_are_refused(argv: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        ft_bench.main(argv)
    assert message in capsys.readouterr().err
