"""Safe writes of user-visible files, and bounded reads of the small files users give.

Every file gpudiag writes goes to a temporary file in the target folder, is fsynced and
then renamed over the target, so a failure never leaves a partial file. gpudiag writes
only regular files and folders: a target that is a symbolic link, a device node, a FIFO
or a socket is refused, with or without ``force``; an existing regular target is
replaced only with ``force`` (and a folder only when the caller recognises it as its
own, e.g. an earlier bundle), never the current folder or one of its parents.

Temporary names carry the writer's pid (``.NAME.gpudiag-PID-XXXX.tmp``): the temporary
is removed on every exit path of the process that made it (an exception, Ctrl-C,
SIGTERM through the CLI's handler), and one left by a run that was killed outright
(SIGKILL, power loss) is removed by the next run that writes the same target.

Permissions are those ``open()`` and ``mkdir`` — and so ``torch.save`` and ``cp`` — give
a new file or folder: 0666 (a folder, or an executable, 0777) less the process's umask, so
``-rw-r--r--`` under the usual umask 0022 (:func:`new_mode`). A target replaced with
``force`` gets the same: the output is a new file renamed over the old one, so it does not
keep the old file's mode, as ``torch.save`` and ``cp`` writing into the existing file would.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from gpudiag.errors import InputError

_TAG = "gpudiag"


def atomic_write(path: str | os.PathLike[str], data: bytes | str, *, force: bool = False) -> Path:
    """Write ``data`` to ``path`` atomically; refuse an existing file unless ``force``."""
    payload = data.encode("utf-8") if isinstance(data, str) else data
    with atomic_output(path, force=force) as out:
        out.write(payload)
    return Path(path)


#: The most :func:`read_bounded` reads by default (64 MiB, as ``bench --compare`` does):
#: a rules, baseline or result file is kilobytes; ``/dev/zero`` is refused, not read.
MAX_INPUT_BYTES = 64 << 20


def read_bounded(path: str | os.PathLike[str], what: str, limit: int = MAX_INPUT_BYTES) -> bytes:
    """The bytes of a small input file ``path`` (``what`` names it in errors: "rules file"),
    at most ``limit`` bytes: larger, or not a regular file (a FIFO would block, a device
    such as ``/dev/zero`` never ends; a folder), or unreadable → :class:`InputError`
    (exit 2), one line. What is not a regular file is refused unread (:func:`open_regular`)."""
    with open_regular(path, what) as stream:
        if os.fstat(stream.fileno()).st_size > limit:
            raise InputError(f"{what} {path}: larger than {limit >> 20} MiB, refused")
        try:
            data = stream.read(limit + 1)
        except OSError as exc:
            raise InputError(f"{what} {path}: cannot read it ({exc.strerror or exc})") from None
    if data is None or len(data) > limit:
        raise InputError(f"{what} {path}: larger than {limit >> 20} MiB, refused")
    return data


def open_regular(path: str | os.PathLike[str], what: str) -> BinaryIO:
    """``path`` opened for reading in binary, when it is a regular file; else (a FIFO, a
    device such as ``/dev/zero``, a socket, a folder) or unreadable → :class:`InputError`
    (exit 2), one line, and nothing read: the file is opened without blocking and checked
    by its descriptor (no race with a file swapped in between)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise InputError(f"{what} {path}: cannot read it ({exc.strerror or exc})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):  # (before fdopen, which refuses a folder itself)
        os.close(fd)
        kind = _KINDS.get(stat.S_IFMT(mode), "special file")
        raise InputError(f"{what} {path}: a {kind}, not a file; refused unread")
    return os.fdopen(fd, "rb")


#: What a file that is not a regular one is, in words, by its ``stat.S_IFMT``.
_KINDS = {
    stat.S_IFDIR: "folder",
    stat.S_IFIFO: "FIFO",
    stat.S_IFCHR: "device",
    stat.S_IFBLK: "device",
    stat.S_IFSOCK: "socket",
}


def check_target(
    path: str | os.PathLike[str],
    *,
    force: bool,
    folder: bool = False,
    replaceable: Callable[[Path], str | None] | None = None,
) -> Path:
    """``path`` if gpudiag may write it: a regular file (or with ``folder`` a folder) that
    does not exist yet, or exists and ``force`` allows replacing, in a folder that exists.

    ``replaceable(target)`` is asked about an existing target before ``force`` replaces
    it: None to allow, or the reason it is not gpudiag's to replace.
    """
    target = Path(path)
    if target.name in ("", ".", ".."):
        raise InputError(f"{path!s}: name a new file or folder, not {path!s} itself")
    if target.is_symlink():
        raise InputError(f"{target} is a symbolic link: gpudiag writes only regular files; choose another")
    if target.exists():
        kind = _kind(target)
        if kind not in ("file", "folder"):
            raise InputError(f"{target} is a {kind}, not a regular file: gpudiag will not write over it")
        if (kind == "folder") != folder:
            raise InputError(f"{target} is a folder" if not folder else f"{target} exists and is a file")
        if not force:
            raise InputError(f"{target} exists; pass --force to overwrite it")
        here = Path.cwd().resolve()
        if kind == "folder" and target.resolve() in (here, *here.parents):
            raise InputError(f"{target} is the current folder or a parent of it: gpudiag will not replace it")
        reason = replaceable(target) if replaceable is not None else None
        if reason:
            raise InputError(f"{target}: {reason}; --force replaces only what gpudiag wrote")
    if not target.parent.is_dir():  # Path("x").parent is Path(".")
        raise InputError(f"folder {target.parent} does not exist")
    return target


def _kind(path: Path) -> str:
    """What ``path`` is, in words (``ls -l``'s first column)."""
    mode = path.stat().st_mode
    for test, name in (
        (stat.S_ISREG, "file"),
        (stat.S_ISDIR, "folder"),
        (stat.S_ISCHR, "device node"),
        (stat.S_ISBLK, "device node"),
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISSOCK, "socket"),
    ):
        if test(mode):
            return name
    return "special file"


def umask() -> int:
    """The process's umask, read without changing it where Linux says it (``Umask:`` in
    /proc/self/status, Linux 4.7+); elsewhere set and restored at once."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def new_mode(*, folder: bool = False) -> int:
    """The mode ``open()`` (0666) or ``mkdir`` (0777, also for an executable file) gives a
    new file or folder under this process's umask: 0644 and 0755 under umask 0022."""
    return (0o777 if folder else 0o666) & ~umask()


def temporary_prefix(target: Path) -> str:
    """The name every temporary for ``target`` starts with, this process's pid in it."""
    return f".{target.name}.{_TAG}-{os.getpid()}-"


def remove_stale_temporaries(target: Path) -> list[Path]:
    """Remove the temporaries (``.tmp`` files and folders, ``.old`` folders) that a
    gpudiag process no longer running left beside ``target``; what was removed.

    Only entries this user owns, named by :func:`temporary_prefix` with a pid that is
    gone, are touched: a run writing the same target right now keeps its own.
    """
    name = re.compile(rf"\.{re.escape(target.name)}\.{_TAG}-(\d+)-[^/]*\.(tmp|old)")
    removed = []
    for entry in target.parent.glob(f".{glob.escape(target.name)}.{_TAG}-*"):
        match = name.fullmatch(entry.name)
        if not match or _running(int(match[1])) or entry.is_symlink():
            continue
        with contextlib.suppress(OSError):
            if entry.lstat().st_uid != os.getuid():
                continue
            if entry.is_dir():
                shutil.rmtree(entry)
            else:
                entry.unlink()
            removed.append(entry)
    return removed


def _running(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def temporary_folder(target: Path, suffix: str = ".tmp") -> Path:
    """A new private folder (0700, ``mkdtemp``) beside ``target`` for staging it, named
    for cleanup; a caller that renames it into place gives it :func:`new_mode` first."""
    remove_stale_temporaries(target)
    try:
        return Path(tempfile.mkdtemp(prefix=temporary_prefix(target), suffix=suffix, dir=target.parent))
    except OSError as exc:
        raise InputError(f"cannot write in {target.parent}: {exc.strerror}") from exc


def write_folder(target: Path, files: dict[str, bytes], executable: frozenset[str] = frozenset()) -> Path:
    """Write ``target`` as a folder of ``files`` (relative name → bytes) whole: staged in a
    :func:`temporary_folder` beside it, then renamed into place; an existing ``target`` (the
    caller checked it may be replaced) is moved aside only once the new one is complete.
    Modes as ``mkdir``/``open`` give them; names in ``executable`` also get the x bits."""
    staging = temporary_folder(target)
    try:
        for name, data in files.items():
            dest = staging / name
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(data)
            if name in executable:
                dest.chmod(new_mode(folder=True))  # 0777 less the umask, as mkdir
        staging.chmod(new_mode(folder=True))  # mkdtemp made it 0700
        if target.exists():
            old = temporary_folder(target, ".old")
            os.replace(target, old / target.name)
            os.replace(staging, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike[str], *, force: bool = False) -> Iterator[BinaryIO]:
    """A binary file to write ``path`` through: a temporary file in the same folder that
    is fsynced and renamed over ``path`` when the block ends, and removed if it fails.
    The file gets the mode ``open()`` would give it (:func:`new_mode`), not mkstemp's 0600."""
    target = check_target(path, force=force)
    folder = target.parent
    remove_stale_temporaries(target)
    try:
        fd, tmp = tempfile.mkstemp(prefix=temporary_prefix(target), suffix=".tmp", dir=folder)
    except OSError as exc:
        raise InputError(f"cannot write in {folder}: {exc.strerror}") from exc
    try:
        try:
            os.fchmod(fd, new_mode())
        finally:
            os.close(fd)
        # "r+b", not "w+b": the file is new and empty, and truncating it would make ext4
        # flush it on the first close of any descriptor (auto_da_alloc) — a stall in the
        # middle of the caller's work instead of the fsync below, which callers can overlap.
        with open(tmp, "r+b") as out:  # out.name is the temporary path (for reading back)
            yield out
            out.flush()
            os.fsync(out.fileno())
        check_target(target, force=force)  # (still not a FIFO or a link: it may have changed)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
