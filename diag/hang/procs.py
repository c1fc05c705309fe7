"""This rank's processes, read from ``/proc`` (Linux; elsewhere every answer is empty):
the script's descendants, ended with the rank when the watchdog ends a hung job
(:func:`end_descendants`); the bytes they have written to storage, which tell a slow
writer from a stuck rank (:func:`written_bytes`, ``/proc/PID/io`` ``write_bytes``: counted
when a page is dirtied, so a checkpoint being written grows it at once; pipes and sockets
do not count); and whether a process is alive (:func:`alive`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterable

#: Seconds the descendants get between SIGTERM and SIGKILL.
TERM_GRACE_S = 2.0


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, session id) of ``pid``, or None when it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = raw[raw.rfind(")") + 2 :].split()  # (the name in parentheses may hold spaces)
    try:
        return fields[0], int(fields[1]), int(fields[3])
    except (IndexError, ValueError):
        return None


def descendants(pid: int | None = None) -> list[int]:
    """Every live process below ``pid`` (this one by default), children first; with
    ``pid`` a session leader (each rank is, under torchrun), also the processes of its
    session that were re-parented when their parent ended (a double fork)."""
    pid = os.getpid() if pid is None else pid
    children: dict[int, list[int]] = {}
    session: list[int] = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    leader = _leads_session(pid)
    for name in names:
        if not name.isdigit() or int(name) == pid:
            continue
        stat = _stat(int(name))
        if stat is None or stat[0] in "ZX":
            continue
        children.setdefault(stat[1], []).append(int(name))
        if leader and stat[2] == pid:
            session.append(int(name))
    found: list[int] = []
    todo = list(children.get(pid, ()))
    while todo:
        child = todo.pop(0)
        if child not in found:
            found.append(child)
            todo.extend(children.get(child, ()))
    return found + [p for p in session if p not in found]


def _leads_session(pid: int) -> bool:
    try:
        return os.getsid(pid) == pid
    except OSError:
        return False


def alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    stat = _stat(pid)
    return stat is not None and stat[0] not in "ZX"


def end_descendants(grace_s: float = TERM_GRACE_S) -> list[int]:
    """SIGTERM every descendant of this process, SIGKILL those still alive after
    ``grace_s`` seconds; the pids signalled."""
    pids = descendants()
    _signal(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    _signal([p for p in pids if alive(p)], signal.SIGKILL)
    return pids


def _signal(pids: Iterable[int], signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signum)


def written_bytes(pids: Iterable[int]) -> int | None:
    """The bytes ``pids`` have written to storage so far (``write_bytes`` summed), or None
    when none can be read."""
    total, read = 0, False
    for pid in pids:
        try:
            with open(f"/proc/{pid}/io", "rb") as f:
                for line in f:
                    if line.startswith(b"write_bytes:"):
                        total += int(line.split()[1])
                        read = True
        except (OSError, ValueError):
            continue
    return total if read else None
