"""The folder the hang dumps go into (``gpudiag run -o``, ``hang_dir=``), written safely.

:func:`check` runs before the job: the folder (or, when it does not exist yet, the
nearest folder above it) must be one this process can write into — tried by creating and
removing a hidden probe, since ``os.access`` says yes to root on a read-only mount — else
:class:`~gpudiag.errors.InputError` (exit 2, before the script runs). A path that is a
link to a folder is resolved there, once. Nothing is left behind: a job that never hangs
writes nothing.

:class:`Folder` writes at dump time through directory descriptors opened with
``O_NOFOLLOW``: every file is created under a fresh hidden name (``O_EXCL``), fsynced and
renamed over its final name, so a symbolic link planted in the folder (``fr_rank0.pkl ->
/elsewhere``) is replaced, never written through, and ``stacks`` must be a real folder.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from gpudiag.errors import InputError

_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)


def check(folder: Path) -> Path:
    """``folder`` as it will be written (absolute, a link to a folder resolved), after
    trying that it can be written; InputError naming it and why not."""
    given = folder
    if folder.is_symlink() and folder.is_dir():
        folder = folder.resolve()
    folder = Path(os.path.abspath(folder))  # (the script may change its working folder)
    existing = folder
    while not existing.exists() and not existing.is_symlink() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise InputError(f"{given}: {_shown(existing)} is not a folder (where the hang dumps would go)")
    probe = existing / f".gpudiag-probe-{os.getpid()}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise InputError(
            f"{given}: cannot write in {_shown(existing)} ({reason}): name a folder you can write"
        ) from None
    return folder


def _shown(path: Path) -> str:
    """``path`` relative to the working folder when it is inside it (as the user named it)."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


class Folder:
    """``path`` opened for writing at dump time (made when missing, never through a link
    at its last step); use as a context manager."""

    def __init__(self, path: Path):
        self.path = path
        self.fd = -1

    def __enter__(self) -> Folder:
        with contextlib.suppress(FileExistsError):
            self.path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(self.path)
        self.fd = os.open(self.path, _DIR_FLAGS)
        return self

    def __exit__(self, *_exc: object) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def sub(self, name: str) -> Folder:
        """The real folder ``name`` inside this one (made when missing), opened."""
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, dir_fd=self.fd)
        sub = Folder(self.path / name)
        sub.fd = os.open(name, _DIR_FLAGS, dir_fd=self.fd)
        return sub

    def write(self, name: str, data: bytes) -> None:
        """``name`` holds ``data``: a fresh hidden file, fsynced, renamed over ``name``."""
        temp = f".{name}.{os.getpid()}.tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp, dir_fd=self.fd)  # (a leftover of this pid's, never a link followed)
        fd = os.open(temp, flags, 0o644, dir_fd=self.fd)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.rename(temp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=self.fd)
            raise
