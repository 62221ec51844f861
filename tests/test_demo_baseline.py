"""The CPU benchmark's re-implementation of bloc97's DeMo step: faithful enough to time
against (its update agrees with cokit's DeMo on one step), and its command line."""

from __future__ import annotations

import json

import pytest

from cokit.bench import demo_baseline as bench
from cokit.compress import DeMo


def test_chunk_side_follows_bloc97s_divisor_rule():
    assert bench._chunk_side(768, 64) == 64  # divides
    assert bench._chunk_side(100, 64) == 50  # largest divisor below 64
    assert bench._chunk_side(7, 64) == 7  # none above: the whole side
    assert bench._chunk_side(97, 64) == 1  # prime: 1 is the largest divisor below 64


def test_reference_update_agrees_with_cokit_demo(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the CPU torch path, as the benchmark times it
    ours, ref = bench.make_params(64, 1), bench.make_params(64, 1)
    before = [p.detach().clone() for p in ours]
    DeMo(ours, lr=1e-3, compression_topk=8, compression_chunk=32, payload="reference").step()
    bench.ReferenceDeMo(ref, lr=1e-3, topk=8, chunk=32).step()
    for a, b, p0 in zip(ours, ref, before, strict=True):
        step_a, step_b = (a - p0).sign(), (b - p0).sign()
        assert (step_a == step_b).float().mean() > 0.99, tuple(a.shape)
        assert (step_b != 0).float().mean() > 0.5  # it really moved


def test_command_writes_json(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    out = tmp_path / "r.json"
    assert bench.main(["--sizes", "1M", "--steps", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert rows[0]["size"] == "1M" and rows[0]["cokit_ms"] > 0 and rows[0]["reference_ms"] > 0
    assert "cokit/ref" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench.main(["--sizes", "1M", "--out", str(out)])  # exists: refused without --overwrite
