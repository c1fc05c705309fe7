"""``gpudiag run``: the user's script, unchanged, under the hang watchdog (docs/hang.md).

It runs ``SCRIPT ARGS`` as ``python SCRIPT ARGS`` would (``sys.argv``, ``__main__``, the
script's folder first on ``sys.path``), with the flight recorder on unless the user set its
variables, and a :class:`~gpudiag.hang.watchdog.Watchdog` thread (both by :mod:`.arm`). A script that ends
normally leaves nothing behind and exits with its own code. As under ``python SCRIPT``, the
script's non-daemon threads are waited for and its ``atexit`` handlers run when it ends
(:func:`_python_exit`: gpudiag's command line leaves with ``os._exit``, which skips both).
"""

from __future__ import annotations

import atexit
import runpy
import sys
import threading
import traceback
from pathlib import Path

from gpudiag.errors import InputError
from gpudiag.hang.watchdog import Watchdog


def _join_threads() -> None:
    """Wait for the script's non-daemon threads, as Python does when the main thread ends."""
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()


def _python_exit(code: int) -> int:
    """What Python does once a script's main thread has ended, before it exits: wait for the
    script's non-daemon threads, then run the ``atexit`` handlers (the watchdog's own stop
    among them); ``code`` returned."""
    _join_threads()
    run_handlers = getattr(atexit, "_run_exitfuncs", None)  # (CPython's; what its exit calls)
    if run_handlers is not None:
        run_handlers()
    return code


def run_script(script: str, args: list[str], stall_s: float, out: Path) -> int:
    """Run ``script`` under the watchdog; its exit code (the watchdog ends a hung job with 1)."""
    path = Path(script)
    if not path.is_file():
        raise InputError(f"{script}: no such script")
    if out.exists() and not out.is_dir():
        raise InputError(f"-o {out}: not a folder")
    from gpudiag.hang.arm import prepare, start

    watchdog = start(prepare(stall_s, out))
    sys.argv = [script, *args]
    sys.path.insert(0, str(path.resolve().parent))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        if code is None or code == 0:
            return _finished(watchdog)
        if isinstance(code, int):
            return _python_exit(code)
        sys.stderr.write(f"{code}\n")
        return _python_exit(1)
    except Exception:
        if watchdog.ending.locked():
            # The watchdog is ending the job for a hang, and a collective of the script failed
            # as the others left ("connection closed by peer"): a consequence, not the cause —
            # the verdict says what happened. The watchdog thread ends this process.
            watchdog.join(watchdog.gather_s + 15)
            return 1
        traceback.print_exc()  # the script's own error: shown as python shows it
        return _python_exit(1)
    return _finished(watchdog)


def _finished(watchdog: Watchdog) -> int:
    """The script ended normally: its threads end, every rank ends (``finish``), then its
    ``atexit`` handlers run; 0."""
    _join_threads()
    watchdog.finish()
    return _python_exit(0)
