"""No abort at exit: cokit frees the process groups that torch's function defaults hold past
``destroy_process_group`` (``cokit.compress.teardown``), so a script whose last collective's
Python callback still runs on gloo's thread exits cleanly; and the exit stress benchmark's
core (``cokit.bench.exit_stress``), a few runs: the amp_fp16 example and the DeMo, SparseLoCo
and DDP-hook workers (without the release, those workers abort: ``--no-release``)."""

from __future__ import annotations

import signal
import sys
import types

import pytest
import torch.distributed as dist

from cokit.bench import exit_stress
from cokit.bench.exit_stress import WORKER_DONE, classify
from cokit.compress.teardown import release_captured_groups


@pytest.mark.parametrize(
    ("returncode", "output", "timed_out", "outcome"),
    [
        (0, f"{WORKER_DONE}\n", False, "ok"),
        (-signal.SIGABRT, WORKER_DONE, False, "abort"),
        (134, WORKER_DONE, False, "abort"),
        (0, f"{WORKER_DONE}\nterminate called without an active exception\n", False, "abort"),
        (1, f"{WORKER_DONE}\n  exitcode  : -6 (pid: 7)\n", False, "abort"),
        (1, f"{WORKER_DONE}\nValueError: bad\n", False, "failed"),
        (0, "no success line\n", False, "failed"),
        (None, "", True, "hang"),
    ],
)
def test_a_run_is_classified_by_its_exit_code_and_output(returncode, output, timed_out, outcome):
    assert classify(returncode, output, WORKER_DONE, timed_out=timed_out) == outcome


def test_process_groups_held_as_torch_distributed_defaults_are_released(monkeypatch):
    """Defaults (positional, keyword-only, methods, static methods) holding a group become
    None in torch.distributed modules; other values, and modules outside it, are untouched."""
    group = dist.ProcessGroup(dist.HashStore(), 0, 1)

    def collective(tensor, op=None, group=group):
        return group

    def keyword(*, group=group, other=3):
        return group

    class Holder:
        def __init__(self, process_group=group):
            self.process_group = process_group

        @staticmethod
        def make(group=group):
            return group

    def elsewhere(group=group):
        return group

    inside = types.ModuleType("torch.distributed._exit_stress_probe")
    outside = types.ModuleType("exit_stress_probe_elsewhere")
    for module, fns in ((inside, (collective, keyword, Holder)), (outside, (elsewhere,))):
        for fn in fns:
            fn.__module__ = module.__name__
            setattr(module, fn.__name__, fn)
        monkeypatch.setitem(sys.modules, module.__name__, module)

    assert release_captured_groups() >= 4
    assert collective.__defaults__ == (None, None)
    assert keyword.__kwdefaults__ == {"group": None, "other": 3}
    assert Holder().process_group is None and Holder.make() is None
    assert elsewhere() is group
    assert release_captured_groups() == 0  # nothing left to release


def test_the_examples_and_workers_exit_cleanly_under_torchrun():
    """One run each, two at a time: exit 0, their success line, no abort; the workers end with
    their last collective's Python callback still running on gloo's thread."""
    cases = ["amp_fp16-sparseloco", "demo", "sparseloco", "hook"]
    results = exit_stress.run_stress(cases, 1, timeout_s=240, jobs=2)
    summary = exit_stress.summarize(results, cases)
    assert all(s["ok"] == s["runs"] == 1 for s in summary.values()), (
        exit_stress.table(summary) + "\n" + "\n".join(r.tail for r in results if r.outcome != "ok")
    )
