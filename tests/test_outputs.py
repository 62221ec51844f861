"""Results are never lost: atomic writes survive kills, output folders are checked before any
work starts, and a second run into the same folder is refused unless ``--overwrite``."""

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cokit.cli import main
from cokit.files import (
    OutputError,
    atomic_open,
    atomic_write_text,
    existing_outputs,
    prepare_out_dir,
    prepare_out_file,
    remove_stale_outputs,
)
from cokit.launch import free_port

ROOT = Path(__file__).resolve().parents[1]
TOY_ARGS = ["--model", "toy", "--max-chars", "100000", "--batch-size", "4", "--eval-every", "1", "--quiet"]
OLD = '{"run": "the previous one"}\n'


# ---------------------------------------------------------------------- atomic writes
def _kill_mid_write(tmp_path: Path, body: str) -> Path:
    """Write OLD to target.json, then run ``body`` in a subprocess that prints ``writing``
    when it is inside the write; SIGKILL it there. Returns the target."""
    target = tmp_path / "target.json"
    atomic_write_text(target, OLD)
    script = textwrap.dedent(
        """
        import os, sys, time
        from cokit.files import atomic_open, atomic_write_bytes
        target = sys.argv[1]
        """
    ) + textwrap.dedent(body)
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(target)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.strip() == "writing", line + proc.stderr.read()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    return target


def _assert_previous_file_intact(target: Path) -> None:
    assert target.read_text() == OLD  # the previous run's file, whole
    # nothing partial under the final name; at most the writer's hidden temporary file
    others = sorted(p.name for p in target.parent.iterdir() if p != target)
    assert all(n.startswith(".target.json.") and n.endswith(".tmp") for n in others), others


def test_kill_during_a_large_streamed_write_keeps_the_previous_file(tmp_path):
    """Hundreds of MB are being written (slowly, in 1 MiB pieces) when the writer is killed."""
    target = _kill_mid_write(
        tmp_path,
        """
        with atomic_open(target, "wb") as f:
            for i in range(400):
                f.write(b"x" * (1 << 20))
                f.flush()
                if i == 20:
                    print("writing", flush=True)
                time.sleep(0.01)
        """,
    )
    tmp = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert tmp and tmp[0].stat().st_size >= 20 << 20  # it was killed while writing
    _assert_previous_file_intact(target)


def test_kill_between_write_and_rename_keeps_the_previous_file(tmp_path):
    """atomic_write_bytes of a whole document, killed while syncing it (before the rename)."""
    target = _kill_mid_write(
        tmp_path,
        """
        def slow_fsync(fd):
            print("writing", flush=True)
            time.sleep(120)
        os.fsync = slow_fsync
        atomic_write_bytes(target, b'{"run": "the new one"}' * 100000)
        """,
    )
    _assert_previous_file_intact(target)


def test_in_place_write_is_what_the_kill_tests_catch(tmp_path):
    """Control: the same kill against a plain in-place write destroys the previous file."""
    target = _kill_mid_write(
        tmp_path,
        """
        with open(target, "wb") as f:
            f.write(b"x" * 4096)
            f.flush()
            print("writing", flush=True)
            time.sleep(120)
        """,
    )
    assert target.read_text() != OLD


def test_failed_write_leaves_previous_file_and_no_temporary(tmp_path):
    target = tmp_path / "r.json"
    atomic_write_text(target, OLD)
    with pytest.raises(RuntimeError, match="boom"), atomic_open(target, "w") as f:
        f.write("half of a new file")
        raise RuntimeError("boom")
    assert target.read_text() == OLD
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]
    with pytest.raises(ValueError, match="mode 'a'"), atomic_open(target, "a"):
        pass


def test_writer_syncs_the_file_and_the_folder(tmp_path, monkeypatch):
    synced: list[bool] = []  # True for a folder
    real = os.fsync

    def spy(fd):
        synced.append(stat.S_ISDIR(os.fstat(fd).st_mode))
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    atomic_write_text(tmp_path / "a" / "r.json", "{}")
    assert synced == [False, True]  # the data before the rename, the folder after it


def test_written_files_get_normal_permissions(tmp_path):
    umask = os.umask(0o022)
    try:
        path = atomic_write_text(tmp_path / "r.json", "{}")
        assert stat.S_IMODE(path.stat().st_mode) == 0o644  # not mkstemp's 0o600
        os.chmod(path, 0o640)
        atomic_write_text(path, "[]")
        assert stat.S_IMODE(path.stat().st_mode) == 0o640  # a replaced file keeps its mode
    finally:
        os.umask(umask)


# ---------------------------------------------------------------------- folder checks
def _blocked(tmp_path: Path, kind: str) -> Path:
    """An output path no one can create, root included (chmod does not stop root)."""
    if kind == "under-a-file":
        blocker = tmp_path / "file"
        blocker.write_text("not a folder")
        return blocker / "out"
    return Path("/proc") / f"cokit-test-{tmp_path.name}" / "out"


@pytest.mark.parametrize("kind", ["under-a-file", "proc"])
def test_prepare_out_dir_rejects_unwritable_folders(tmp_path, kind):
    path = _blocked(tmp_path, kind)
    with pytest.raises(OutputError, match="is not writable") as exc:
        prepare_out_dir(path, ("r.json",))
    assert str(path) in str(exc.value) and "--out" in str(exc.value)
    with pytest.raises(OutputError, match="is not writable"):
        prepare_out_file(path / "r.json")


def test_prepare_out_dir_checks_and_refuses_earlier_results(tmp_path):
    out = tmp_path / "new" / "deep"
    assert prepare_out_dir(out, ("r.json",)) == out and out.is_dir()
    assert list(out.iterdir()) == []  # the probe is gone
    (out / "notes.txt").write_text("mine")
    prepare_out_dir(out, ("r.json", "plot_*.png"))  # unrelated files do not count
    (out / "plot_a.png").write_bytes(b"png")
    with pytest.raises(OutputError, match=r"already holds results of an earlier run \(plot_a.png\)") as exc:
        prepare_out_dir(out, ("r.json", "plot_*.png"), flag="--dir")
    assert "--overwrite" in str(exc.value) and "--dir" in str(exc.value)
    assert prepare_out_dir(out, ("r.json", "plot_*.png"), overwrite=True) == out
    assert existing_outputs(out, ("plot_*.png", "r.json")) == ["plot_a.png"]
    (out / "plot_b.png").write_bytes(b"png")
    assert remove_stale_outputs(out, ("plot_*.png",), [out / "plot_b.png"]) == [out / "plot_a.png"]
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "plot_b.png"]
    with pytest.raises(OutputError, match="is a file, not a folder"):
        prepare_out_dir(out / "notes.txt", ())


def test_prepare_out_file(tmp_path):
    path = tmp_path / "sub" / "r.json"
    assert prepare_out_file(path) == path and path.parent.is_dir() and not path.exists()
    path.write_text("{}")
    with pytest.raises(OutputError, match=r"already exists.*--overwrite"):
        prepare_out_file(path)
    assert prepare_out_file(path, overwrite=True) == path
    with pytest.raises(OutputError, match="is a folder"):
        prepare_out_file(tmp_path)


# ---------------------------------------------------------------------- commands
@pytest.fixture
def no_training(monkeypatch):
    """Make any start of training / sweeping fail the test loudly."""
    import cokit.sweeps
    import cokit.train

    def started(*args, **kwargs):
        raise AssertionError("the run started although --out is unusable")

    monkeypatch.setattr(cokit.train, "run_distributed", started)
    monkeypatch.setattr(cokit.sweeps, "sweep_main", started)


@pytest.mark.parametrize("kind", ["under-a-file", "proc"])
def test_demo_with_unwritable_out_fails_before_training(tmp_path, capsys, no_training, kind):
    out = _blocked(tmp_path, kind)
    assert main(["demo", "--steps", "400", "--out", str(out), *TOY_ARGS]) == 2
    cap = capsys.readouterr()
    assert f"--out {out} is not writable" in cap.err and len(cap.err.strip().splitlines()) == 1
    assert "cokit demo:" not in cap.out  # not even the header of the run


@pytest.mark.parametrize("kind", ["under-a-file", "proc"])
def test_sweep_with_unwritable_out_fails_before_sweeping(tmp_path, capsys, no_training, kind):
    out = _blocked(tmp_path, kind)
    assert main(["sweep", "--sizes", "32", "--chunks", "1", "--out", str(out)]) == 2
    cap = capsys.readouterr()
    assert f"--out {out} is not writable" in cap.err and "cokit sweep: error:" in cap.err
    assert "point(s)" not in cap.out


def _gpu_check_phases(calls):
    from cokit.bench import gpu_check

    def phase(ctx):
        calls.append(ctx.out)
        return {"key": "ran"}

    return [gpu_check.Phase("probe", phase, 5, 5)]


@pytest.mark.parametrize("kind", ["under-a-file", "proc"])
def test_gpu_check_with_unwritable_out_fails_before_any_phase(tmp_path, capsys, monkeypatch, kind):
    from cokit.bench import gpu_check

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    out = _blocked(tmp_path, kind)
    calls: list = []
    assert gpu_check.main(["--allow-cpu", "--out", str(out)], phases=_gpu_check_phases(calls)) == 2
    assert calls == []
    assert f"--out {out} is not writable" in capsys.readouterr().err


def _torchrun_env(monkeypatch):
    """One in-process rank (torchrun's variables): the cheapest real demo run."""
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1")):
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))


def test_demo_second_run_refuses_without_overwrite(tmp_path, capsys, monkeypatch):
    _torchrun_env(monkeypatch)
    argv = ["demo", "--steps", "2", "--methods", "adamw", "--out", str(tmp_path), *TOY_ARGS]
    assert main(argv) == 0
    first = {n: (tmp_path / n).read_bytes() for n in ("demo.json", "demo.csv", "demo.png")}
    inode = (tmp_path / "demo.json").stat().st_ino
    capsys.readouterr()

    import cokit.train

    real = cokit.train.run_distributed
    monkeypatch.setattr(cokit.train, "run_distributed", lambda *a, **k: pytest.fail("trained again"))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "already holds results of an earlier run" in err and "--overwrite" in err
    assert {n: (tmp_path / n).read_bytes() for n in first} == first  # untouched

    monkeypatch.setattr(cokit.train, "run_distributed", real)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    assert main([*argv, "--overwrite", "--steps", "3"]) == 0
    doc = json.loads((tmp_path / "demo.json").read_text())
    assert doc["config"]["steps"] == 3 and (tmp_path / "demo.json").stat().st_ino != inode
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_sweep_second_run_refuses_without_overwrite_and_replaces_with_it(tmp_path, capsys, monkeypatch):
    import cokit.sweeps

    (tmp_path / "sweep.json").write_text('{"meta": {"earlier": true}, "rows": []}')
    (tmp_path / "heatmap_warps_smem.png").write_bytes(b"an earlier sweep's plot")
    (tmp_path / "notes.txt").write_text("not a sweep output")
    real = cokit.sweeps.sweep_main
    monkeypatch.setattr(cokit.sweeps, "sweep_main", lambda *a, **k: pytest.fail("swept again"))
    argv = ["sweep", "--world-size", "1", "--collectives", "emulated", "--sizes", "32", "--chunks", "1"]
    argv += ["--repeats", "1", "--warmup", "0", "--out", str(tmp_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "heatmap_warps_smem.png, sweep.json" in err and "--overwrite" in err
    assert json.loads((tmp_path / "sweep.json").read_text())["meta"] == {"earlier": True}

    monkeypatch.setattr(cokit.sweeps, "sweep_main", real)
    assert main([*argv, "--overwrite"]) == 0, capsys.readouterr()
    assert json.loads((tmp_path / "sweep.json").read_text())["meta"]["world_size"] == 1
    names = {p.name for p in tmp_path.iterdir()}
    assert "heatmap_warps_smem.png" not in names  # the earlier plot this sweep does not draw
    assert {"sweep.csv", "notes.txt", "telemetry"} <= names
    rows = json.loads((tmp_path / "sweep.json").read_text())["rows"]
    # the best point's timeline is drawn only from a point within the physical bounds
    assert ("timeline_best.png" in names) == any(not r.get("noise") for r in rows)


def test_gpu_check_second_run_refuses_without_overwrite(tmp_path, capsys, monkeypatch):
    from cokit.bench import gpu_check

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    calls: list = []
    argv = ["--allow-cpu", "--out", str(tmp_path)]
    assert gpu_check.main(argv, phases=_gpu_check_phases(calls)) == 0 and len(calls) == 1
    first = (tmp_path / "gpu_check.json").read_bytes()
    capsys.readouterr()
    assert gpu_check.main(argv, phases=_gpu_check_phases(calls)) == 2 and len(calls) == 1
    err = capsys.readouterr().err
    assert "gpu_check.json" in err and "--overwrite" in err
    assert (tmp_path / "gpu_check.json").read_bytes() == first
    assert gpu_check.main([*argv, "--overwrite"], phases=_gpu_check_phases(calls)) == 0
    assert len(calls) == 2 and json.loads((tmp_path / "gpu_check.json").read_text())["complete"] is True


def test_bench_commands_refuse_an_existing_out_before_running(tmp_path, capsys, monkeypatch):
    """``cokit bench gpu-check`` / ``gemm`` and the compress_bytes script: same policy."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    (tmp_path / "gpu_check.json").write_text("{}")
    assert main(["bench", "gpu-check", "--allow-cpu", "--out", str(tmp_path)]) == 2
    assert "already holds results" in capsys.readouterr().err
    gemm_out = tmp_path / "gemm.json"
    gemm_out.write_text("{}")
    assert main(["bench", "gemm", "--quick", "--out", str(gemm_out)]) == 2
    assert "already exists" in capsys.readouterr().err and gemm_out.read_text() == "{}"
    from cokit.bench import compress_bytes

    (tmp_path / "compress_bytes.json").write_text("{}")
    assert compress_bytes.main(["--out", str(tmp_path)]) == 2
    assert "--overwrite" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["demo", "sweep"])
def test_help_documents_the_overwrite_policy(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--overwrite" in out and "refused" in out


def test_validation_study_with_unwritable_out_fails_before_any_run(tmp_path, capsys, monkeypatch):
    """The study resumes from the runs its folder holds (no refusal), but an unusable folder
    is still found before the first run."""
    import cokit.validation.cli

    monkeypatch.setattr(cokit.validation.cli, "run_from_args", lambda *a: pytest.fail("study started"))
    out = _blocked(tmp_path, "under-a-file")
    assert main(["bench", "validate", "--quick", "--out", str(out)]) == 2
    assert f"--out {out} is not writable" in capsys.readouterr().err
