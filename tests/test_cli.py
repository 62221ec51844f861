"""The cokit command line."""

import json

import pytest

from cokit.cli import main


def test_info_prints_paths_and_limits(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "kernel path: CPU tensors -> interpreter" in out
    assert "232448" in out and "gfx942" in out


def test_info_json(capsys):
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["paths"]["cpu tensors"] == "interpreter"
    assert info["targets"]["sm_80"]["max_shared_per_block"] == 166912
    assert set(info["kernels"]) == {"dct", "topk", "error_feedback"}


def test_unknown_flag_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["info", "--bogus"])
    assert exc.value.code == 2
