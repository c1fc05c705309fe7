"""What this process must undo if it is stopped: its temporary folders and the rank
processes it started, kept in one registry so that a signal honoured anywhere — also
while the main thread is stuck inside a C++ call (a gloo collective, a store's wait)
that Python's signal handler cannot interrupt — leaves nothing behind.

:func:`track` / :func:`untrack` a folder or an object with a ``close()`` (the runtime's
:class:`~gpudiag.runtime.launch.Ranks`); :func:`clean_up` closes and removes what is
still tracked. :func:`watch_signals` starts a helper thread that learns of SIGINT and
SIGTERM through :func:`signal.set_wakeup_fd` (written by the C-level handler even while
the main thread is blocked); if the main thread has not ended the process
:data:`GRACE_S` seconds later, the thread cleans up, prints the one line the CLI prints,
and exits ``128 + signal`` itself.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

#: Seconds the main thread has to unwind on a signal before the helper thread ends the
#: process (torchrun kills a worker 30 s after its SIGTERM; Slurm, 30 s by default too).
GRACE_S = 5.0
#: The helper thread's name: it holds no lock while it waits, so forking beside it is safe
#: (:func:`gpudiag.runtime.launch.start_method` does not count it).
WATCH_THREAD = "gpudiag-signal-watch"

_lock = threading.Lock()
_tracked: dict[int, Any] = {}  # id → a Path (removed) or an object with close()


def track(item: Any) -> Any:
    """Remember ``item`` (a folder :class:`Path`, or an object with ``close()``) for
    :func:`clean_up`; returns it."""
    with _lock:
        _tracked[id(item)] = item
    return item


def untrack(item: Any) -> None:
    with _lock:
        _tracked.pop(id(item), None)


def clean_up() -> None:
    """Close every tracked object (newest first: ranks before their folders) and remove
    every tracked folder. Never raises."""
    with _lock:
        items = list(reversed(_tracked.values()))
        _tracked.clear()
    for item in items:
        with contextlib.suppress(Exception):
            if isinstance(item, Path):
                shutil.rmtree(item, ignore_errors=True)
            else:
                item.close()


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def watch_signals() -> None:
    """Start the helper thread (once per process; main thread only, with Python handlers
    for SIGINT/SIGTERM already installed, as the CLI's are)."""
    if threading.current_thread() is not threading.main_thread() or getattr(watch_signals, "started", False):
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    try:
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    except (ValueError, OSError):
        os.close(read_fd)
        os.close(write_fd)
        return
    watch_signals.started = True  # type: ignore[attr-defined]
    # a forked child (a rank) writes no signal of its own into the parent's pipe
    os.register_at_fork(after_in_child=_forget_wakeup_fd)
    # the thread blocks the signals (its mask is its creator's at start): the kernel must
    # deliver them to the main thread, whose held mask (launch.signals_held) times them
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {*_STOP_SIGNALS, signal.SIGALRM})
    try:
        threading.Thread(target=_watch, args=(read_fd,), name=WATCH_THREAD, daemon=True).start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _forget_wakeup_fd() -> None:
    with contextlib.suppress(ValueError, OSError):
        signal.set_wakeup_fd(-1)


def _watch(read_fd: int) -> None:
    while True:
        try:
            data = os.read(read_fd, 64)
        except OSError:
            return
        if not data:
            return
        stop = [b for b in data if b in _STOP_SIGNALS]
        if stop:
            break
    signum = stop[0]
    time.sleep(GRACE_S)  # (the main thread unwinds and exits meanwhile, if it can)
    clean_up()
    with contextlib.suppress(Exception):
        name = signal.Signals(signum).name
        sys.stderr.write(f"gpudiag: interrupted by {name}; stopped\n")
        sys.stderr.flush()
    os._exit(128 + signum)
