"""torch.compile with cokit's optimizers: compile the model, the step runs eagerly.

DeMo's and SparseLoCo's ``step`` are ``torch.compiler.disable``d at their first call
(collectives, the status agreement and the clock cannot be traced): a compiled model trains
without graph breaks next to them, ``torch.compile(opt.step)`` compiles nothing and steps
exactly as eager, and importing cokit does not load the compiler (``compress/eager.py``).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo as dynamo

from cokit.compress import DeMo, SparseLoCo


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.GELU(), torch.nn.Linear(40, 6))


def _batch(step: int) -> torch.Tensor:
    return torch.randn(10, 24, generator=torch.Generator().manual_seed(step))


OPTIMIZERS = {
    "DeMo": lambda params: DeMo(params, lr=1e-2, compression_topk=4, compression_chunk=8),
    "SparseLoCo": lambda params: SparseLoCo(params, sync_every=2, topk=4, chunk=8),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_compiled_model_trains_next_to_the_step_without_graph_breaks(name):
    eager = _model()
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, backend="aot_eager")
    assert dynamo.explain(compiled_model)(_batch(0)).graph_break_count == 0
    opts = [OPTIMIZERS[name](m.parameters()) for m in (eager, compiled_model)]
    for step in range(4):
        for model, opt in zip((eager, compiled), opts, strict=True):
            model(_batch(step)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    for a, b in zip(eager.parameters(), compiled_model.parameters(), strict=True):
        # aot_eager runs the same aten ops: the two runs agree to fp32 rounding of the loss path
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_compiling_the_step_compiles_nothing_and_steps_exactly_as_eager(name):
    models = [_model(), _model()]
    opts = [OPTIMIZERS[name](m.parameters()) for m in models]
    for model in models:
        model(_batch(0)).square().mean().backward()
    assert dynamo.explain(opts[1].step)().graph_count == 0  # explain steps once: do it eagerly too
    opts[0].step()
    compiled_step = torch.compile(opts[1].step)
    for step in range(1, 4):
        for model, opt, run in zip(models, opts, (opts[0].step, compiled_step), strict=True):
            opt.zero_grad()
            model(_batch(step)).square().mean().backward()
            run()
    for a, b in zip(*(m.parameters() for m in models), strict=True):
        assert torch.equal(a, b)


# A fresh interpreter: which modules an import loads, and a step whose first call is traced
# (in this process earlier tests already made each step's disabled function).
FIRST_CALL_TRACED = """
import sys
import torch
from cokit.compress import DeMo, SparseLoCo
import cokit.cli, cokit.bench.study.transfer
assert "torch._dynamo" not in sys.modules, "importing cokit loaded the compiler"
make = {"DeMo": lambda p: DeMo(p, lr=1e-2, compression_topk=4, compression_chunk=8),
        "SparseLoCo": lambda p: SparseLoCo(p, sync_every=2, topk=4, chunk=8)}[sys.argv[1]]
models = []
for _ in range(2):
    torch.manual_seed(0)
    models.append(torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.GELU(), torch.nn.Linear(40, 6)))
opts = [make(m.parameters()) for m in models]
def train(model, opt, x):
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
def batch(step):
    return torch.randn(10, 24, generator=torch.Generator().manual_seed(step))
for model, opt in zip(models, opts):  # before any compiler is loaded: the plain step
    train(model, opt, batch(0))
compiled = torch.compile(train, backend="eager")
for step in range(1, 4):  # the compiled run first: the step's first call since is traced
    compiled(models[1], opts[1], batch(step))
    train(models[0], opts[0], batch(step))
assert all(torch.equal(a, b) for a, b in zip(*(m.parameters() for m in models)))
print("ok")
"""


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_importing_cokit_loads_no_compiler_and_a_traced_first_step_runs_eagerly(name):
    import subprocess
    import sys

    from tests.helpers import ROOT, script_env

    proc = subprocess.run(
        [sys.executable, "-c", FIRST_CALL_TRACED, name],
        env=script_env(TRITON_INTERPRET="0"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout[-2000:] + proc.stderr[-4000:]
