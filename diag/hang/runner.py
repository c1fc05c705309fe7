"""``gpudiag run``: the user's script, unchanged, under the hang watchdog (docs/hang.md).

It runs ``SCRIPT ARGS`` as ``python SCRIPT ARGS`` would (:mod:`.script`: ``sys.argv``, a
fresh ``__main__``, the script's folder first on ``sys.path``) with a
:class:`~gpudiag.hang.watchdog.Watchdog` thread (armed by :mod:`.arm`). gpudiag installs
no signal handler in this process and never leaves through ``os._exit`` unless it ends a
hung job: the script's handlers, ``KeyboardInterrupt``, ``sys.excepthook``, threads,
``atexit`` and the interpreter's finalisation behave as without gpudiag, and its exit
code is the script's. A script that ends normally waits (after its non-daemon threads,
before its ``atexit`` handlers, where Python would start to finalise) until every rank's
script has ended — its exit would otherwise turn the others' wait into gloo's "connection
closed", which names nobody.
"""

from __future__ import annotations

import sys
import threading
import types
from pathlib import Path

from gpudiag.hang import live, script
from gpudiag.hang.watchdog import Watchdog


def _join_threads() -> None:
    """Wait for the script's non-daemon threads, as Python does when the main thread ends."""
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()


def _raised_at(tb: types.TracebackType | None) -> str | None:
    """The user's line where an exception was raised (its traceback's innermost user frame)."""
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    return live.user_line(tuple(f for frame in reversed(frames) for f in live.stack_frames(frame)[:1]))


def run_script(path: Path, args: list[str], watchdog: Watchdog) -> None:
    """Run the script at ``path`` with ``args`` under ``watchdog``; return when it ended
    normally (every rank's script ended too), so that Python exits 0 as it would. A
    ``SystemExit`` and the script's unhandled exceptions go on to the interpreter's top
    level (:func:`.script.hand_back`)."""
    from gpudiag.hang.arm import start

    filename = str(path.resolve())
    try:
        module, code = script.load(path)
    except SyntaxError as exc:
        script.hand_back(exc, filename)
    sys.argv = [str(path), *args]
    sys.path.insert(0, str(path.resolve().parent))
    start(watchdog)
    try:
        script.execute(module, code)
    except SystemExit as exc:
        if exc.code is None or exc.code == 0:
            _finished(watchdog)
        else:
            watchdog.left()
        raise
    except BaseException as exc:
        if watchdog.ending.locked():
            # The watchdog is ending the job for a hang, and a collective of the script failed
            # as the others left ("connection closed by peer"): a consequence, not the cause —
            # the verdict says what happened. The watchdog thread ends this process.
            watchdog.join(watchdog.gather_s + 15)
        watchdog.failed(exc, _raised_at(exc.__traceback__))
        watchdog.left()
        script.hand_back(exc, filename)
    _finished(watchdog)


def _finished(watchdog: Watchdog) -> None:
    """The script ended normally: its threads end, then every rank's script (``finish``)."""
    _join_threads()
    watchdog.finish()
