"""Arming the hang watchdog in this process: the one way ``gpudiag run`` and
``gpudiag.watch(model, hang_timeout=…)`` start it (docs/hang.md).

:func:`prepare` checks the request and makes sure the flight recorder will record: before
``init_process_group`` it sets ``TORCH_FR_BUFFER_SIZE`` to :data:`BUFFER_ENTRIES` (unless
the user set one of :data:`RECORDER_NAMES`);
once a process group exists it is too late to turn the recorder on (torch reads the buffer
size when the group is made), so a recorder that records nothing is refused with an
:class:`~gpudiag.errors.InputError` naming the variable, rather than a watchdog that can
see nothing. :func:`start` starts the :class:`~gpudiag.hang.watchdog.Watchdog` thread and
stops it at process exit; :func:`stop` stops it (``watcher.close()``). A watchdog that
never fires writes nothing.
"""

from __future__ import annotations

import atexit
import os
import sys
from pathlib import Path
from typing import Any

from gpudiag.errors import InputError
from gpudiag.hang.watchdog import Watchdog, dump_record

#: The names of the flight recorder's buffer size: torch 2.11 and later read the first; the
#: second is its older NCCL-only name (deprecated: torch warns when it is set).
RECORDER_NAMES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
#: The buffer size gpudiag asks for, in entries (torch's own default).
BUFFER_ENTRIES = "2000"
#: Where the dumps go unless told (``gpudiag run -o``, ``gpudiag.watch(hang_dir=…)``).
DEFAULT_DIR = "gpudiag-hang"
#: Seconds :func:`stop` waits for the thread to end (it polls every second).
STOP_WAIT_S = 5.0


def _group() -> Any:
    """``torch.distributed`` when a default process group exists, else None."""
    try:
        import torch.distributed as dist
    except Exception:
        return None
    return dist if dist.is_available() and dist.is_initialized() else None


def records() -> bool:
    """Whether this process's flight recorder records (a group exists): a recorder that is
    on lists the groups it knows in ``pg_config`` from the moment one is made; an off one
    (buffer size 0) lists none, and a torch without the dump function records nothing."""
    import json

    try:
        raw = dump_record(None, json_format=True, collectives=False)
        record = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
    except Exception:
        return False
    return isinstance(record, dict) and bool(record.get("pg_config") or record.get("pg_status"))


def _earlier(folder: Path) -> str | None:
    """The first entry of ``folder`` the verdict would read that this job did not write —
    an earlier run's dump, ``stacks`` or ``verdict.json``, or any file whose name ends in a
    rank — or None."""
    from gpudiag.hang.reader import rank_of

    for path in sorted(folder.iterdir()) if folder.is_dir() else ():
        if path.name in ("stacks", "verdict.json"):
            return path.name
        if path.name.startswith(".") or not path.is_file():
            continue
        try:
            rank_of(path)
        except InputError:
            continue
        return path.name
    return None


def attempt_folder(folder: Path) -> Path:
    """Where this attempt's dumps go: ``folder``, or ``folder/restart<N>`` when torchrun
    restarted the job (``--max-restarts``; ``TORCHELASTIC_RESTART_COUNT`` = N ≥ 1) — the
    first attempt's dumps are in ``folder`` already, and judged with this attempt's they
    would mix two runs."""
    count = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return folder / f"restart{count}" if count.isdigit() and int(count) > 0 else folder


def prepare(
    stall_s: float, out: str | Path | None, *, by: str = "gpudiag run", confirm_s: float | None = None
) -> Watchdog:
    """A :class:`Watchdog` for a collective pending longer than ``stall_s`` seconds, its
    dumps into folder ``out`` (None: :data:`DEFAULT_DIR`, relative to the working folder;
    one that holds an earlier run's dumps, stacks or verdict: InputError), not started yet;
    ``by`` is who it says found the stall; ``confirm_s`` how long a stall must hold after
    ``stall_s`` (None: :func:`~gpudiag.hang.watchdog.confirm_window`); the folder must be
    writable (:func:`~gpudiag.hang.outdir.check`). The recorder is turned on here when no process
    group exists yet; when one exists and its recorder is off: InputError."""
    if (
        isinstance(stall_s, bool)
        or not isinstance(stall_s, (int, float))
        or not 0 < stall_s <= sys.float_info.max
    ):
        raise InputError(f"hang_timeout={stall_s!r}: expected a number of seconds above 0")
    if out is not None and not isinstance(out, (str, os.PathLike)):
        raise InputError(f"hang_dir={out!r}: expected a folder's path")
    folder = Path(DEFAULT_DIR if out is None else out)
    if (folder.exists() or folder.is_symlink()) and not folder.is_dir():  # (a link to nothing: too)
        raise InputError(f"{folder}: not a folder (where the hang dumps would go)")
    from gpudiag.hang.outdir import check

    folder = check(attempt_folder(folder))
    earlier = _earlier(folder)
    if earlier is not None:  # (read with this job's dumps it would mix two runs, or be overwritten)
        raise InputError(
            f"{folder}: holds {earlier} of an earlier run, which this job's verdict would read as its own "
            "(and its dumps would overwrite): move that folder away or name another for the dumps"
        )
    dist = _group()
    if dist is None and not any(name in os.environ for name in RECORDER_NAMES):  # (the user's own kept)
        os.environ[RECORDER_NAMES[0]] = BUFFER_ENTRIES
    elif dist is not None and not records():
        raise InputError(
            "the hang watchdog needs the flight recorder, which is off in this process "
            "(the process group exists already): set TORCH_FR_BUFFER_SIZE (e.g. =2000) in the environment "
            "before init_process_group, or launch with `torchrun … -m gpudiag run SCRIPT`"
        )
    watchdog = Watchdog(float(stall_s), folder, confirm_s=confirm_s)
    watchdog.by = by
    if dist is not None:  # (launchers other than torchrun set no RANK)
        watchdog.rank, watchdog.world_size = dist.get_rank(), dist.get_world_size()
    return watchdog


def for_watch(hang_timeout: float | None, hang_dir: str | Path | None) -> Watchdog | None:
    """The watchdog ``gpudiag.watch(hang_timeout=…, hang_dir=…)`` asks for, not started
    (None: none asked for); :func:`prepare`'s checks."""
    if hang_timeout is None:
        if hang_dir is not None:
            raise InputError("hang_dir without hang_timeout: no hang watchdog would write there")
        return None
    return prepare(hang_timeout, hang_dir, by="gpudiag.watch")


#: The watchdogs started and not stopped yet (stopped at process exit).
_ARMED: set[Watchdog] = set()


def start(watchdog: Watchdog) -> Watchdog:
    """Start ``watchdog``'s thread; it is stopped at process exit unless :func:`stop` is first."""
    if not _ARMED:
        atexit.register(_stop_all)
    _ARMED.add(watchdog)
    watchdog.connect_now()
    watchdog.start()
    return watchdog


def _stop_all() -> None:
    for watchdog in list(_ARMED):
        stop(watchdog)


def stop(watchdog: Watchdog) -> None:
    """End ``watchdog``'s thread (at its next poll) and drop its store connection. A
    watchdog already ending the job (dumping) is left to finish that."""
    _ARMED.discard(watchdog)
    if not _ARMED:
        atexit.unregister(_stop_all)
    watchdog.stopping.set()
    if watchdog.is_alive():
        watchdog.join(timeout=STOP_WAIT_S)
    if not watchdog.is_alive():
        watchdog.store = None
