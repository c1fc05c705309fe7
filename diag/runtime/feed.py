"""Batches from a data loader, one per step (``RunConfig.loader``): the runtime's way to
train on a real input pipeline rather than one synthetic batch.

``RunConfig.loader`` is a picklable callable ``loader(rank, world) -> iterable`` of
``(inputs, targets)`` batches — typically a ``torch.utils.data.DataLoader`` over this
process's share of the data (``rank`` and ``world`` are 0 and 1 for ``single`` and
``dp``; a DDP rank builds its own, as every process of a ``torchrun`` job builds its
``DataLoader``). It is called where the steps run, so its worker processes are children
of the process that trains, as in a user's script. With ``time_phases`` the wait for
each batch is the ``data`` phase (what the training loop spends in ``next(loader)``).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from gpudiag.errors import InputError

#: ``loader(rank, world)`` → batches ``(inputs, targets)``, one per step.
LoaderFn = Callable[[int, int], Iterable[tuple[Any, Any]]]


def _exit_on_sigterm(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


class Feed:
    """One process's batches from ``loader``; :meth:`close` stops its workers.

    A forked DDP rank is a daemonic ``multiprocessing`` process, which Python forbids to
    start children; its launcher reaps it (and its children leave with it: a DataLoader
    worker ends when its parent is gone), so the rank is marked non-daemonic before a
    loader may start workers in it."""

    def __init__(self, loader: LoaderFn, rank: int = 0, world: int = 1):
        me = multiprocessing.current_process()
        if me.daemon:
            me.daemon = False
        self._sigterm: Any = None
        if (
            threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        ):
            # A rank ends on SIGTERM (its launcher's stop): through Python, so the loader's
            # workers are stopped on the way out rather than orphaned.
            self._sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        self._batches: Iterator[tuple[Any, Any]] | None = iter(loader(rank, world))
        self.taken = 0

    def next(self) -> tuple[Any, Any]:
        """The next ``(inputs, targets)``; a loader that runs out early is bad input."""
        if self._batches is None:
            raise RuntimeError("the feed is closed")
        try:
            batch = next(self._batches)
        except StopIteration:
            raise InputError(
                f"the data loader ran out after {self.taken} batches: it must give one per step"
            ) from None
        self.taken += 1
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise InputError("the data loader must give (inputs, targets) pairs")
        return batch[0], batch[1]

    def close(self, hurry: bool = False) -> None:
        """Stop the loader's workers now: a ``DataLoader`` iterator's own shutdown (what it
        runs when released; called here because an exception's traceback may still hold
        the iterator), guarded — any other iterable is just released. ``hurry`` (the run
        is interrupted: SIGINT, SIGTERM): the workers are killed first (:func:`kill_workers`),
        since the orderly shutdown waits up to 5 s for each busy worker to finish its batch
        (then sends SIGTERM, which a worker may ignore, and waits 5 s more)."""
        batches, self._batches = self._batches, None
        if hurry:
            kill_workers(batches)
        shutdown = getattr(batches, "_shutdown_workers", None)
        if callable(shutdown):
            shutdown()
        if self._sigterm is not None:
            signal.signal(signal.SIGTERM, self._sigterm)
            self._sigterm = None

    def __enter__(self) -> Feed:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        # Not an Exception: an interruption (SystemExit from a rank's SIGTERM, KeyboardInterrupt,
        # gpudiag's Interrupted) — the process is leaving, its workers must not linger.
        self.close(hurry=kind is not None and not issubclass(kind, Exception))


def kill_workers(batches: Any) -> None:
    """SIGKILL the worker processes of a ``DataLoader`` iterator (its private ``_workers``,
    read with ``getattr``: nothing is done for any other iterable or torch version), after
    taking them off torch's SIGCHLD watch (so their deaths do not raise "DataLoader worker
    exited unexpectedly" in this process); the iterator's own shutdown then finds them gone
    and returns at once."""
    workers = getattr(batches, "_workers", None)
    if not workers:
        return
    if getattr(batches, "_worker_pids_set", False):
        try:
            from torch.utils.data._utils import signal_handling

            remove = getattr(signal_handling, "_remove_worker_pids", None)
            if not callable(remove):
                return  # cannot take them off the watch: leave them to the orderly shutdown
            remove(id(batches))
            batches._worker_pids_set = False
        except (ImportError, RuntimeError, AttributeError):
            return
    for worker in workers:
        with contextlib.suppress(Exception):
            if worker.is_alive():
                worker.kill()
    for worker in workers:
        with contextlib.suppress(Exception):
            worker.join(1.0)
