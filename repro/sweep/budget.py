"""``--quick``'s total deadline per node: every phase of the node's sweep (its own checks,
the intra-node all-reduce, the collectives between nodes) shares one budget, so a Slurm
prolog never runs past it.

- A phase that cannot fit in what is left is **skipped**, with a note ``skipped: --quick
  budget``; a local check that is still running when the local share is spent is
  **stopped** (``SIGALRM``, as ``timeout(1)`` does; its ranks are reaped as on any
  exception) and recorded the same way — skipped, not failed.
- The node's own checks may use the budget less a share kept for the between-node phase
  (:data:`BETWEEN_SHARE`) and for writing (:data:`WRITE_RESERVE_S`); the collectives
  between nodes get at most what is left (each deadline capped), and the pairwise link
  test stops starting rounds once the node with the least left has too little.

The default, :data:`QUICK_BUDGET_S`, counts from the moment the sweep starts (Python and
torch already imported: ~3 s on this 2-core machine), so ``timeout 60 gpudiag sweep
--quick`` has room to spare. ``GPUDIAG_SWEEP_BUDGET=SECONDS`` sets another (with
``--quick``; the tests shrink it to a few seconds)."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

from gpudiag.errors import InputError
from gpudiag.runtime.deadline import alarm_free

QUICK_BUDGET_S = 50.0
BUDGET_VARIABLE = "GPUDIAG_SWEEP_BUDGET"
BETWEEN_SHARE = 0.25  # of the budget, kept from the local phase for the between-node phase
WRITE_RESERVE_S = 2.0  # kept for gathering and writing at the end (seconds)
MIN_PHASE_S = 0.5  # a phase with less than this left is not started
SKIPPED = "skipped: --quick budget"


class BudgetSpent(BaseException):
    """The budget of the running phase ran out (raised by :func:`hard_stop`). A
    BaseException, like :class:`~gpudiag.errors.Interrupted`, so no ``except Exception``
    of a check turns it into a failure; every ``finally`` (rank reaping) still runs."""


class Budget:
    """The node's total: ``seconds`` from creation (None: unbounded, without --quick)."""

    def __init__(self, seconds: float | None):
        self.seconds = seconds
        self.start = time.monotonic()

    @classmethod
    def for_quick(cls, quick: bool, environ: Any = None) -> Budget:
        """:data:`QUICK_BUDGET_S` (or ``$GPUDIAG_SWEEP_BUDGET``) with --quick, else none."""
        env = os.environ if environ is None else environ
        if not quick:
            return cls(None)
        text = env.get(BUDGET_VARIABLE, "").strip()
        if not text:
            return cls(QUICK_BUDGET_S)
        try:
            seconds = float(text)
        except ValueError:
            seconds = math.nan
        if not math.isfinite(seconds) or seconds <= 0:
            raise InputError(f"{BUDGET_VARIABLE}={text!r}: expected a number of seconds > 0")
        return cls(seconds)

    @property
    def bounded(self) -> bool:
        return self.seconds is not None

    def left(self) -> float:
        """Seconds left in the whole budget (inf when unbounded)."""
        if self.seconds is None:
            return math.inf
        return self.start + self.seconds - time.monotonic()

    def local_left(self, alone: bool) -> float:
        """Seconds left for the node's own phase: the budget less the between-node share
        (none when ``alone``: no between-node phase) and the writing reserve."""
        if self.seconds is None:
            return math.inf
        keep = WRITE_RESERVE_S + (0.0 if alone else BETWEEN_SHARE * self.seconds)
        return self.left() - keep

    def cap(self, timeout: float) -> float:
        """``timeout`` no longer than what is left for the between-node phase (≥ a little,
        so a collective is given a chance rather than a zero deadline)."""
        return min(timeout, max(MIN_PHASE_S, self.left() - WRITE_RESERVE_S))

    def skip_note(self, what: str, left: float) -> str:
        return f"{what} {SKIPPED} ({max(0.0, left):.1f} s left of {self.seconds:g} s)"


_RETRY_S = 0.02


#: Functions a stop must not land in: cleanup (a ``with`` block's exit, ``Ranks.close``
#: reaping ranks, removing a folder) would be cut short and leave processes or files.
_CLEANUP = frozenset({"__exit__", "close", "_reap", "rmtree", "cleanup", "__del__"})


def _importing(frame: Any) -> bool:
    """Whether ``frame`` or a caller is inside Python's import machinery or cleanup code
    (:data:`_CLEANUP`). An exception raised in an import leaves a module half made —
    measured: a check stopped while it imported ``torch._dynamo`` made the next import of
    it abort the process ("Fatal Python error: Aborted"), 1 run in 4 — so the stop waits
    until the import, or the cleanup, is over."""
    while frame is not None:
        code = frame.f_code
        if code.co_name in _CLEANUP or code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def hard_stop(seconds: float) -> Iterator[None]:
    """Raise :class:`BudgetSpent` in the main thread after ``seconds`` (``SIGALRM``); no
    limit when ``seconds`` is infinite, outside the main thread, or where a timer is
    already set. The checks' own in-process deadlines (``runtime.deadline``) stand aside
    while this one runs (one timer per process); this one bounds them. Never inside an
    import or a cleanup (:func:`_importing`): then a little later."""
    if not (math.isfinite(seconds) and alarm_free()):
        yield
        return

    def expire(_signum: int, frame: Any) -> None:
        if _importing(frame):  # not in the middle of an import or a cleanup: again in a moment
            signal.setitimer(signal.ITIMER_REAL, _RETRY_S)
            return
        signal.setitimer(signal.ITIMER_REAL, 0)
        raise BudgetSpent()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
