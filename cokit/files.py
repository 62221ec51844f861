"""Where results land: atomic results files and checked output folders.

Every results file (JSON, CSV, logs, PNG plots) is written through the one atomic writer,
:mod:`cokit.triton_kernels._atomic_file` (re-exported here): a reader, a crash or a kill never
sees a half-written file, and a failed write leaves the previous file in place. A write that
the filesystem refuses (full, over quota, read-only, failing) raises :class:`WriteError`: one
exception that names the file and its filesystem and says what to do.

Output folders are checked before any work starts (:func:`prepare_out_dir`,
:func:`prepare_out_file`): the folder is created and a probe file written and removed, so an
unwritable ``--out`` fails in a second rather than after the run; and a folder that already
holds this command's results is refused unless ``overwrite`` is set, so a second run never
replaces the first one's results silently.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import io
import os
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from cokit.triton_kernels import _atomic_file
from cokit.triton_kernels._atomic_file import atomic_open, fsync_dir

__all__ = [
    "STORAGE_ERRNOS",
    "OutputError",
    "WriteError",
    "atomic_open",
    "atomic_savefig",
    "atomic_write_bytes",
    "atomic_write_text",
    "existing_outputs",
    "fsync_dir",
    "mount_point",
    "prepare_out_dir",
    "prepare_out_file",
    "remove_stale_outputs",
    "storage_error",
]


class OutputError(ValueError):
    """An output folder or file that cannot be used; the message says what to do."""


#: errors of the storage rather than of the caller: no space, over quota, file too large,
#: read-only filesystem, I/O error
STORAGE_ERRNOS = frozenset(
    code
    for code in (errno.ENOSPC, getattr(errno, "EDQUOT", None), errno.EFBIG, errno.EROFS, errno.EIO)
    if code is not None
)


def mount_point(path: str | os.PathLike) -> str:
    """The mount point of the filesystem holding ``path`` (its nearest existing folder's)."""
    p = os.path.abspath(os.fspath(path))
    while not os.path.ismount(p):
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    return p


class WriteError(OSError):
    """A file its filesystem would not take (full, over quota, read-only, failing).

    An :class:`OSError` with the original ``errno`` and ``strerror``; ``filename`` is the file.
    ``str()`` is one line: what failed, where, and what to do (:meth:`describe`).
    """

    @property
    def filesystem(self) -> str:
        """The mount point of the filesystem the file is on."""
        return mount_point(os.path.dirname(os.path.abspath(self.filename or ".")))

    def advice(self) -> str:
        """What would let the write succeed, for this errno."""
        if self.errno == errno.EROFS:
            return f"{self.filesystem} is mounted read-only: remount it writable"
        if self.errno == errno.EIO:
            return f"check the device of {self.filesystem} (it reported an I/O error)"
        return f"free space on {self.filesystem}"

    def describe(self, elsewhere: str = "write to another filesystem") -> str:
        """``cannot write <file>: <why>; <advice> or <elsewhere>`` (``elsewhere``: how the
        caller's user picks another place, e.g. ``pass --out <a folder on another disk>``)."""
        return f"cannot write {self.filename}: {self.strerror}; {self.advice()} or {elsewhere}"

    def __str__(self) -> str:
        return self.describe()


def storage_error(exc: BaseException, path: str | os.PathLike) -> WriteError | None:
    """``exc`` as a :class:`WriteError` about ``path`` when it is a storage failure
    (:data:`STORAGE_ERRNOS`), else None (the caller re-raises ``exc`` as it is)."""
    if isinstance(exc, WriteError):
        return exc
    code = exc.errno if isinstance(exc, OSError) else None
    if code is None or code not in STORAGE_ERRNOS:
        return None
    return WriteError(code, getattr(exc, "strerror", None) or os.strerror(code), os.fspath(path))


@contextlib.contextmanager
def storage_errors(path: str | os.PathLike) -> Iterator[None]:
    """Raise a storage failure in the block as one :class:`WriteError` about ``path`` (not the
    writer's chain of flush and close failures); any other error as it is."""
    try:
        yield
    except OSError as exc:
        error = storage_error(exc, path)
        if error is None:
            raise
        raise error from None


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically and durably (:func:`atomic_open`); returns the
    path. A full, read-only or failing filesystem raises one :class:`WriteError`."""
    with storage_errors(path):
        return _atomic_file.atomic_write_bytes(path, data)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """:func:`atomic_write_bytes` of UTF-8 text."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_savefig(fig: Any, path: str | os.PathLike, **savefig_kw: Any) -> Path:
    """Save a matplotlib figure atomically: render into memory, then
    :func:`atomic_write_bytes` (the format follows the suffix unless ``format`` is given)."""
    path = Path(path)
    savefig_kw.setdefault("format", path.suffix.lstrip(".") or "png")
    buf = io.BytesIO()
    fig.savefig(buf, **savefig_kw)
    return atomic_write_bytes(path, buf.getvalue())


def existing_outputs(folder: str | os.PathLike, outputs: Iterable[str]) -> list[str]:
    """Names of the files in ``folder`` that match ``outputs`` (file names or glob
    patterns such as ``heatmap_*.png``), sorted; empty when the folder is missing."""
    try:
        names = sorted(e.name for e in os.scandir(os.fspath(folder)) if not e.is_dir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    patterns = list(outputs)
    return [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]


def _probe(folder: Path, flag: str) -> None:
    """Create ``folder`` and write and remove a probe file in it, or raise OutputError."""
    if folder.exists() and not folder.is_dir():
        raise OutputError(
            f"{flag} {folder} is a file, not a folder; give a folder path (it is created when missing)"
        )
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".cokit-write-probe.", dir=folder)
        try:
            os.write(fd, b"probe")
        finally:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(probe)
    except OSError as exc:
        raise OutputError(
            f"{flag} {folder} is not writable ({exc.strerror or exc}); "
            f"choose a folder you can create and write to with {flag}"
        ) from None


def prepare_out_dir(
    folder: str | os.PathLike,
    outputs: Sequence[str],
    *,
    overwrite: bool = False,
    flag: str = "--out",
) -> Path:
    """Make ``folder`` ready for a run before any work starts; returns it as a Path.

    Creates it, proves it writable with a probe file, and refuses (``OutputError``) when it
    already holds files matching ``outputs`` (names or glob patterns) unless ``overwrite``.
    ``flag`` names the option in the messages.
    """
    folder = Path(folder)
    if not overwrite:  # checked first: a refused run changes nothing on disk
        found = existing_outputs(folder, outputs)
        if found:
            shown = ", ".join(found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
            raise OutputError(
                f"{flag} {folder} already holds results of an earlier run ({shown}); "
                f"pass --overwrite to replace them, or choose another {flag}"
            )
    _probe(folder, flag)
    return folder


def prepare_out_file(path: str | os.PathLike, *, overwrite: bool = False, flag: str = "--out") -> Path:
    """:func:`prepare_out_dir` for a single results file: ``path`` must not be a folder, its
    folder must be writable, and an existing file is refused unless ``overwrite``."""
    path = Path(path)
    if path.is_dir():
        raise OutputError(f"{flag} {path} is a folder; give a file name, e.g. {flag} {path / 'results.json'}")
    if path.exists() and not overwrite:
        raise OutputError(
            f"{flag} {path} already exists (an earlier run's results); "
            f"pass --overwrite to replace it, or choose another {flag}"
        )
    _probe(path.parent, flag)
    return path


def remove_stale_outputs(
    folder: str | os.PathLike, outputs: Iterable[str], written: Iterable[str | os.PathLike]
) -> list[Path]:
    """After an ``--overwrite`` run: remove the files in ``folder`` matching ``outputs`` that
    this run did not write (e.g. plots over axes the new run does not vary), so the folder
    holds one run's results only. Returns what was removed."""
    folder = Path(folder)
    keep = {Path(p).name for p in written}
    removed = []
    for name in existing_outputs(folder, outputs):
        if name not in keep:
            with contextlib.suppress(FileNotFoundError):
                (folder / name).unlink()
                removed.append(folder / name)
    return removed
