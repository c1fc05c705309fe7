"""The ``gpudiag`` command line. Every command parses, calls one function, renders.

Exit codes: 0 nothing wrong, 1 a problem found, 2 bad usage or input, 3 cannot run here.
Errors are one line on stderr; ``--debug`` shows the traceback. Heavy modules (torch,
pynvml, rich) are imported inside commands, so ``gpudiag --help`` stays fast.

The package: :mod:`.group` (the click group, errors → exit codes), :mod:`.options`
(every shared option and value check, defined once), one module per family of commands
(:mod:`.hardware`, :mod:`.training`, :mod:`.checkpoints`, :mod:`.bundles`), and here the
entry point with its signal handling.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from typing import Any

from gpudiag.cli import (  # noqa: F401  (they register the commands)
    bundles,
    checkpoints,
    hang,
    hardware,
    sweep,
    training,
    transport,
)
from gpudiag.cli.group import cli
from gpudiag.errors import Interrupted

__all__ = ["cli", "main"]


def stop_on_signals() -> None:
    """SIGINT and SIGTERM raise :class:`Interrupted` in the main thread, so the command
    unwinds: ranks are terminated and reaped, temporary files and folders removed, one
    line printed, exit 130 / 143. Signals arriving while it unwinds are ignored (every
    cleanup step is bounded).

    A handler's exception raised where Python ignores exceptions (a ``__del__``, a weakref
    callback, an at-fork hook: "Exception ignored in ...") would be lost with the signal
    already ignored; :data:`sys.unraisablehook` sees it instead, arms the handler again
    and has a helper thread send the signal to the main thread anew 10 ms later, once
    that place is left (sent at once, the handler ran inside the hook itself and was lost
    again). (The runtime also blocks the signals around its forks:
    :func:`gpudiag.runtime.launch.signals_held`.)"""
    import threading
    import time

    def interrupt(signum: int, _frame: Any) -> None:
        for each in (signal.SIGINT, signal.SIGTERM):
            signal.signal(each, signal.SIG_IGN)
        raise Interrupted(signum)

    earlier = sys.unraisablehook

    def redeliver(unraisable: Any) -> None:
        if not isinstance(unraisable.exc_value, Interrupted):
            earlier(unraisable)
            return
        for each in (signal.SIGINT, signal.SIGTERM):
            signal.signal(each, interrupt)
        signum, main = unraisable.exc_value.signum, threading.main_thread().ident or 0

        def resend() -> None:
            time.sleep(0.01)
            signal.pthread_kill(main, signum)  # (the main thread's: it wakes a sleep there)

        threading.Thread(target=resend, name="gpudiag-resend-signal", daemon=True).start()

    for each in (signal.SIGINT, signal.SIGTERM):
        signal.signal(each, interrupt)
    sys.unraisablehook = redeliver
    from gpudiag.cleanup import watch_signals

    watch_signals()  # (honoured within seconds even while the main thread is inside C++)


def main() -> None:
    """Console-script entry point.

    Once the command has finished and its output is flushed, the process leaves with
    ``os._exit``: tearing down an interpreter that loaded torch takes most of a second and
    does nothing a finished command needs (its files are already closed and renamed, rank
    processes already reaped, temporary folders removed in ``finally`` blocks). Measured
    2026-11-23 (commit a210671, 2-core machine), `gpudiag gradcheck --model mlp
    --input-shape 3,8,8` three times each: 2.48 / 2.33 / 2.27 s with ``os._exit`` against
    3.07 / 3.12 / 3.15 s leaving normally.
    """
    if [a for a in sys.argv[1:3] if a != "--debug"][:1] == ["run"]:
        from gpudiag.cli.hang import run_main

        run_main()  # (the user's script, as python runs it: none of the handlers below, no os._exit)
        return
    from gpudiag.gcpause import own

    own()  # (this process is gpudiag's: its pauses may freeze what they imported)
    stop_on_signals()
    try:
        cli(prog_name="gpudiag")
        code = 0
    except Interrupted as exc:  # (arrived outside a command, e.g. while parsing)
        print(f"gpudiag: interrupted by {signal.Signals(exc.signum).name}; stopped", file=sys.stderr)
        code = exc.exit_code
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    from gpudiag.cleanup import clean_up

    clean_up()  # (what an interrupted command could not: normally nothing is left)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BrokenPipeError, ValueError):
            stream.flush()
    os._exit(code)
