"""``gpudiag run``: the user's script, unchanged, under the hang watchdog (docs/hang.md).

It runs ``SCRIPT ARGS`` as ``python SCRIPT ARGS`` would (``sys.argv``, ``__main__``, the
script's folder first on ``sys.path``), with the flight recorder on unless the user set its
variables, and a :class:`~gpudiag.hang.watchdog.Watchdog` thread (both by :mod:`.arm`). A script that ends
normally leaves nothing behind and exits with its own code.
"""

from __future__ import annotations

import runpy
import sys
import traceback
from pathlib import Path

from gpudiag.errors import InputError


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
            watchdog.finish()
            return 0
        if isinstance(code, int):
            return code
        sys.stderr.write(f"{code}\n")
        return 1
    except Exception:
        if watchdog.ending.locked():
            # The watchdog is ending the job for a hang, and a collective of the script failed
            # as the others left ("connection closed by peer"): a consequence, not the cause —
            # the verdict says what happened. The watchdog thread ends this process.
            watchdog.join(watchdog.gather_s + 15)
            return 1
        traceback.print_exc()  # the script's own error: shown as python shows it
        return 1
    watchdog.finish()
    return 0
