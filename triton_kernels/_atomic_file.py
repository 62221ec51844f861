"""The one atomic file writer of cokit (the tuning cache here, results files in the app).

A file is written to a temporary name in its own folder, flushed and ``fsync``-ed, then
``os.replace``-d over the final name, and the folder is ``fsync``-ed so the rename itself
survives a power cut. A reader (or a crash, or a kill at any moment) sees either the old
file or the whole new one, never a partial file under the final name. It lives at the
lowest layer so that ``triton_kernels`` can use it; :mod:`cokit.files` re-exports it.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

__all__ = ["atomic_open", "atomic_write_bytes", "atomic_write_text", "fsync_dir"]

_TMP_SUFFIX = ".tmp"


def fsync_dir(folder: str | os.PathLike) -> None:
    """``fsync`` a folder so a rename inside it is durable (a no-op where folders cannot be
    opened or synced, e.g. some network file systems)."""
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)
    try:
        fd = os.open(folder, flags)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):  # EINVAL on file systems without directory sync
            os.fsync(fd)
    finally:
        os.close(fd)


def _final_mode(path: Path) -> int:
    """The permission bits the final file gets: the old file's, else 0o666 minus the umask
    (``mkstemp`` creates 0o600 files, which would hide results from other users)."""
    try:
        return path.stat().st_mode & 0o7777
    except OSError:
        return 0o666 & ~_umask()


def _umask() -> int:
    """The process umask, read without changing it where Linux shows it (os.umask both sets
    and returns it, briefly affecting other threads)."""
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "wb", **open_kw: object) -> Iterator[IO]:
    """Open a temporary file beside ``path`` for writing; on a clean exit it is flushed,
    synced and renamed over ``path`` (creating the folder). On an exception (or a kill) the
    temporary file is removed, or left under a hidden ``.<name>.*.tmp`` name after a kill,
    and ``path`` keeps its previous contents. ``mode`` is ``"wb"`` or ``"w"``."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open mode {mode!r} is invalid; allowed: 'w', 'wb'")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=_TMP_SUFFIX, dir=path.parent)
    try:
        with os.fdopen(fd, mode, **open_kw) as f:  # type: ignore[call-overload]
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, _final_mode(path))
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically and durably (see :func:`atomic_open`); returns
    the path."""
    with atomic_open(path, "wb") as f:
        f.write(data)
    return Path(path)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """:func:`atomic_write_bytes` of UTF-8 text."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def _unlink_quietly(path: str) -> None:
    """Remove a temporary file if it is still there."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
