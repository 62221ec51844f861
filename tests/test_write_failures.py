"""A filesystem that refuses writes (full, read-only, failing): one clear error, whole lines.

The JSONL sink never leaves half a record (each line is one write, cut back on failure);
results files raise one :class:`cokit.files.WriteError` naming the file and its filesystem;
``cokit demo`` on a full disk ends with one line on stderr. Real full filesystems: ``/dev/full``
(ENOSPC on every write) and a small tmpfs mounted for the test (root only; skipped otherwise).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cokit import files
from cokit.files import WriteError
from cokit.telemetry import Monitor
from cokit.telemetry.sinks import JsonlSink

SMALL_FS = "64k"


def _mount_tmpfs(where: Path, size: str) -> str | None:
    """Mount a tmpfs of ``size`` on ``where``; None, or why it cannot be done here."""
    if not sys.platform.startswith("linux") or os.geteuid() != 0 or shutil.which("mount") is None:
        return "mounting a small tmpfs needs root on Linux"
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True, text=True
    )
    return None if done.returncode == 0 else f"mount is not permitted here: {done.stderr.strip()}"


@pytest.fixture
def full_fs(tmp_path):
    """A folder on its own small tmpfs (``SMALL_FS``), unmounted afterwards."""
    where = tmp_path / "small"
    where.mkdir()
    why = _mount_tmpfs(where, SMALL_FS)
    if why is not None:
        pytest.skip(why)
    try:
        yield where
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], check=True)


def _assert_whole_lines(folder: Path) -> int:
    """Every line of every .jsonl file under ``folder`` is a JSON object; returns the count."""
    count = 0
    paths = sorted(folder.rglob("*.jsonl"))
    assert paths, f"no .jsonl file under {folder}"
    for path in paths:
        data = path.read_bytes()
        assert data == b"" or data.endswith(b"\n"), f"{path} ends in a partial line"
        for n, line in enumerate(data.splitlines(), 1):
            assert isinstance(json.loads(line), dict), f"{path}:{n}"
            count += 1
    return count


def _assert_one_error(exc: BaseException) -> None:
    """Raised without a chain of earlier errors shown with it."""
    assert exc.__cause__ is None
    assert exc.__context__ is None or exc.__suppress_context__


RECORD = {"schema": "cokit.telemetry/1", "kind": "step", "step": 1, "loss": 2.5}


# ------------------------------------------------------------------------------- the sink
def test_jsonl_sink_on_dev_full_raises_one_write_error():
    if not os.path.exists("/dev/full"):
        pytest.skip("/dev/full does not exist here")
    sink = JsonlSink("/dev/full")
    try:
        with pytest.raises(WriteError) as info:
            sink.write(RECORD)
    finally:
        sink.close()
    err = info.value
    assert isinstance(err, OSError) and err.errno == errno.ENOSPC and err.filename == "/dev/full"
    assert str(err).startswith("cannot write /dev/full: No space left on device; free space on /")
    _assert_one_error(err)


def test_a_line_cut_short_is_removed_and_the_file_keeps_whole_lines(tmp_path, monkeypatch):
    """Half a line reaches the file, then the disk is full: the half line is cut off."""
    import cokit.telemetry.sinks as sinks

    path = tmp_path / "rank0.jsonl"
    sink = JsonlSink(path)
    sink.write(RECORD)
    whole = path.read_bytes()
    real_write, calls = os.write, []

    def write_half_then_fail(fd: int, data) -> int:
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(sinks.os, "write", write_half_then_fail)
    with pytest.raises(WriteError) as info:
        sink.write({**RECORD, "step": 2})
    assert len(calls) == 2 and path.read_bytes() == whole  # the half line is gone
    assert info.value.filename == str(path) and f"free space on {files.mount_point(tmp_path)}" in str(
        info.value
    )
    monkeypatch.setattr(sinks.os, "write", real_write)
    sink.write({**RECORD, "step": 3})  # space again: writing goes on, line by line
    sink.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 3]


def test_other_os_errors_are_not_called_storage_failures(tmp_path, monkeypatch):
    import cokit.telemetry.sinks as sinks

    sink = JsonlSink(tmp_path / "rank0.jsonl")

    def bad_fd(fd: int, data) -> int:
        raise OSError(errno.EBADF, os.strerror(errno.EBADF))

    monkeypatch.setattr(sinks.os, "write", bad_fd)
    with pytest.raises(OSError) as info:
        sink.write(RECORD)
    assert not isinstance(info.value, WriteError) and info.value.errno == errno.EBADF
    monkeypatch.undo()
    sink.close()


@pytest.mark.parametrize(
    "code, advice",
    [
        (errno.ENOSPC, "free space on"),
        (errno.EDQUOT, "free space on"),
        (errno.EROFS, "is mounted read-only"),
        (errno.EIO, "reported an I/O error"),
    ],
)
def test_storage_errors_say_what_to_do(tmp_path, code, advice):
    err = files.storage_error(OSError(code, os.strerror(code)), tmp_path / "x.json")
    assert isinstance(err, WriteError) and err.errno == code
    text = err.describe("pass --out <elsewhere>")
    assert text.startswith(f"cannot write {tmp_path / 'x.json'}: {os.strerror(code)}; ")
    assert advice in text and text.endswith(" or pass --out <elsewhere>")
    assert files.storage_error(PermissionError(errno.EACCES, "Permission denied"), tmp_path) is None


# ------------------------------------------------------------------- a real full filesystem
def test_monitor_on_a_full_filesystem_raises_one_error_and_leaves_whole_lines(full_fs):
    ticks = iter(range(10**6))
    monitor = Monitor(full_fs, run="full", gather=False, clock=lambda: float(next(ticks)))
    with pytest.raises(WriteError) as info:
        for step in range(1, 10**5):
            monitor.step(step, loss=1.0, lr=1e-3, padding=float(step))
    err = info.value
    assert err.errno == errno.ENOSPC and err.filename == str(monitor.folder / "rank0.jsonl")
    assert f"free space on {full_fs}" in str(err)
    _assert_one_error(err)
    monitor.close(err)  # the run is failing with err: closing adds no second error
    assert monitor.closed
    assert _assert_whole_lines(full_fs) == monitor.steps + 1  # meta + the steps recorded


def test_results_files_on_a_full_filesystem_raise_one_error_and_keep_the_old_file(full_fs):
    old = files.atomic_write_text(full_fs / "demo.json", "{}")
    with pytest.raises(WriteError) as info:
        files.atomic_write_bytes(full_fs / "demo.json", b"x" * 2**20)
    assert info.value.filename == str(full_fs / "demo.json") and f"free space on {full_fs}" in str(info.value)
    _assert_one_error(info.value)
    assert old.read_text() == "{}" and sorted(p.name for p in full_fs.iterdir()) == ["demo.json"]


@pytest.mark.distributed
def test_demo_on_a_full_disk_ends_with_one_clear_line(full_fs):
    out = full_fs / "out"
    done = subprocess.run(
        [sys.executable, "-m", "cokit", "demo", "--model", "toy", "--max-chars", "100000",
         "--batch-size", "4", "--steps", "400", "--eval-every", "100", "--quiet", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode != 0, done.stdout
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"cokit demo: error: cannot write {out}/"), lines[0]
    assert "No space left on device" in lines[0]
    assert lines[0].endswith(f"free space on {full_fs} or pass --out <a folder on another filesystem>")
    assert _assert_whole_lines(out) > 0
