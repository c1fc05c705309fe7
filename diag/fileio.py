"""Safe writes of user-visible files.

Every file gpudiag writes goes to a temporary file in the target folder, is fsynced and
then renamed over the target, so a failure never leaves a partial file; an existing
target is replaced only with ``force``.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from gpudiag.errors import InputError


def atomic_write(path: str | os.PathLike[str], data: bytes | str, *, force: bool = False) -> Path:
    """Write ``data`` to ``path`` atomically; refuse an existing file unless ``force``."""
    payload = data.encode("utf-8") if isinstance(data, str) else data
    with atomic_output(path, force=force) as out:
        out.write(payload)
    return Path(path)


def check_target(path: str | os.PathLike[str], *, force: bool, folder: bool = False) -> Path:
    """``path`` if gpudiag may write it: a file (or with ``folder`` a folder) that does not
    exist yet, or exists and ``force`` allows replacing, in a folder that exists."""
    target = Path(path)
    if target.exists():
        if target.is_dir() != folder:
            raise InputError(f"{target} is a folder" if target.is_dir() else f"{target} exists and is a file")
        if not force:
            raise InputError(f"{target} exists; pass --force to overwrite it")
    if not target.parent.is_dir():  # Path("x").parent is Path(".")
        raise InputError(f"folder {target.parent} does not exist")
    return target


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike[str], *, force: bool = False) -> Iterator[BinaryIO]:
    """A binary file to write ``path`` through: a temporary file in the same folder that
    is fsynced and renamed over ``path`` when the block ends, and removed if it fails."""
    target = check_target(path, force=force)
    folder = target.parent
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=folder)
    except OSError as exc:
        raise InputError(f"cannot write in {folder}: {exc.strerror}") from exc
    os.close(fd)
    try:
        # "r+b", not "w+b": the file is new and empty, and truncating it would make ext4
        # flush it on the first close of any descriptor (auto_da_alloc) — a stall in the
        # middle of a read-back instead of the fsync below, which callers can overlap.
        with open(tmp, "r+b") as out:  # out.name is the temporary path (for reading back)
            yield out
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
