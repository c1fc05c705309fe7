"""Containing the user's code while it runs in this process: the single-device
reference and the dp runs, which execute the model here rather than in ranks (whose
deadline is the launcher's, see :mod:`gpudiag.runtime.launch`).

``with contained(seconds, "the single run"):`` is :func:`deadline` plus an ``os._exit``
that raises :class:`ProcessExit` instead of ending gpudiag without a word.

``with deadline(seconds, "the single run"):`` raises :class:`PhaseTimeout` in the main
thread once ``seconds`` have passed (``SIGALRM`` through ``setitimer``, the mechanism
behind ``timeout(1)``), so a forward that sleeps, waits on a lock or loops in Python is
stopped and named. Code stuck inside one C call (a CUDA kernel that never returns) is
interrupted only when it returns to Python. Outside the main thread, or where a timer is
already set by someone else, the block runs without one.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any, NoReturn

from gpudiag.errors import EXIT_PROBLEM, GpudiagError


class PhaseTimeout(GpudiagError):
    """Work in this process did not finish by its deadline (exit 1: a problem found)."""

    exit_code = EXIT_PROBLEM


def alarm_free() -> bool:
    """Whether this thread may arm ``SIGALRM`` (``setitimer(ITIMER_REAL)``): the main
    thread (the only one that runs signal handlers), on a platform that has it, with no
    timer armed already (one per process)."""
    return (
        hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
        and signal.getitimer(signal.ITIMER_REAL)[0] == 0
    )


@contextlib.contextmanager
def deadline(seconds: float, what: str) -> Iterator[None]:
    """Stop the block with :class:`PhaseTimeout` after ``seconds`` (``what`` names it)."""
    if not (seconds > 0 and alarm_free()):
        yield
        return

    def expire(_signum: int, _frame: Any) -> None:
        raise PhaseTimeout(
            f"{what} did not finish within {seconds:g} s (--timeout): the model's forward or backward "
            "hangs in this process; stopped"
        )

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class ProcessExit(SystemExit):
    """The user's code called ``os._exit(code)`` inside :func:`contained`."""

    def __init__(self, code: int):
        super().__init__(code)
        self.via = "os._exit"


@contextlib.contextmanager
def contained(seconds: float, what: str) -> Iterator[None]:
    """Run the user's code in this process under a :func:`deadline`, with ``os._exit``
    turned into :class:`ProcessExit` for the length of the block (the ``os`` module's
    attribute; the launcher's rank code keeps a reference to the real one). Only this
    process is contained: a child forked inside the block (a DataLoader's worker, a
    ``multiprocessing`` process) leaves through the real ``os._exit``, as fork children do."""
    real_exit = os._exit
    owner = os.getpid()

    def refuse_exit(status: int) -> NoReturn:
        if os.getpid() != owner:
            real_exit(status)
        raise ProcessExit(status)

    os._exit = refuse_exit
    try:
        with deadline(seconds, what):
            yield
    finally:
        os._exit = real_exit
