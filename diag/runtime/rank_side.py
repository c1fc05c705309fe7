"""The rank's side of a launch (:mod:`gpudiag.runtime.launch`): join the process group,
run the rank function, write the result or the traceback, leave with the launcher.

Forked ranks call :func:`rank_main` directly; fresh interpreters reach it through
``python -m gpudiag.runtime.rank_process``, which loads the job file this module reads.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import shutil
import signal
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpudiag.gcpause import own, paused

Payload = bytes | Sequence[bytes | memoryview]


RankFn = Callable[..., Payload]


#: The real ``os._exit``, kept before anything can replace it (``deadline.contained`` does,
#: while the user's model runs in the launcher): a rank leaves through this one.
_exit_now = os._exit


_PARENT_POLL_S = 0.5


JOB_FILE = "job.pt"


def _load_job(folder: str) -> tuple[RankFn, tuple[Any, ...]]:
    """The ``(fn, args)`` :func:`_write_job` wrote. The file is this launch's own, in a
    folder only this user can write (``mkdtemp``), hence ``weights_only=False``."""
    import torch

    fn, args = torch.load(Path(folder) / JOB_FILE, weights_only=False)
    return fn, tuple(args)


@dataclass(frozen=True)
class RankSpec:
    """Where a rank fits: its number, the group, the launch folder, the log prefix (None:
    inherit the parent's streams) and the pid of the process that launched it."""

    rank: int
    world_size: int
    backend: str
    folder: str
    timeout: float
    logs: str | None
    parent: int

    def argv(self) -> list[str]:
        return [
            str(self.rank),
            str(self.world_size),
            self.backend,
            self.folder,
            repr(self.timeout),
            self.logs or "",
            str(self.parent),
        ]

    @classmethod
    def from_argv(cls, argv: Sequence[str]) -> RankSpec:
        rank, world, backend, folder, timeout, logs, parent = argv
        return cls(int(rank), int(world), backend, folder, float(timeout), logs or None, int(parent))


def rank_main(spec: RankSpec, fn: RankFn | None = None, args: tuple[Any, ...] = ()) -> None:
    """Body of a rank process: join the group, run, write the result or the traceback.
    ``fn`` None: a fresh interpreter, which loads ``fn`` and ``args`` from the launch's
    job file."""
    code = 0
    rank, world_size, backend, folder = spec.rank, spec.world_size, spec.backend, spec.folder
    # Ctrl-C reaches the whole process group: the launcher stops its ranks itself. A forked
    # rank must not keep the CLI's handler either: SIGTERM ends it at once.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # (a forked rank starts with them and SIGALRM blocked: see launch.signals_held)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGALRM})
    try:
        _leave_with_parent(spec.parent, folder)
        if spec.logs is not None:
            _log_to(f"{spec.logs}-rank{rank}.log", rank, world_size, backend)
        own()  # (a rank process is gpudiag's: see gpudiag.gcpause)
        with paused(freeze=True):  # (a fresh interpreter's torch import: see gpudiag.gcpause)
            import torch
            import torch.distributed as dist

        forked = fn is not None
        if forked:
            # A fresh interpreter starts with Python's warning filters; a forked rank would
            # inherit the caller's (pytest's or -W error), where a harmless DDP warning
            # would crash the rank. Python's defaults, roughly: the noisy categories off.
            warnings.resetwarnings()
            for quiet in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
                warnings.simplefilter("ignore", quiet)  # as Python's own default filters
        if fn is None:
            fn, args = _load_job(folder)
        # A forked rank cannot use the parent's OpenMP thread pool (GNU OpenMP hangs in the
        # first parallel region once the parent has used it): one thread there. A fresh
        # interpreter gets its share of the cores.
        torch.set_num_threads(1 if forked else max(1, (os.cpu_count() or 1) // world_size))
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank)})
        dist.init_process_group(
            backend,
            init_method=f"file://{folder}/store",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=spec.timeout),
        )
        payload = fn(rank, world_size, *args)
        # The result is safe on disk before the group is torn down: a peer that leaves
        # first can make gloo's teardown abort, and that must not lose the answer.
        _write(Path(folder) / f"rank{rank}.out", payload)
        leave_group(dist)
    except BaseException as exc:
        code = 1
        summary = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
        _write(Path(folder) / f"rank{rank}.err", (summary + "\n" + traceback.format_exc()).encode())
        if spec.logs is not None:
            traceback.print_exc()
            sys.stderr.flush()
    finally:
        # Leave without running the parent's atexit handlers and finalizers (forked child).
        _exit_now(code)


def _leave_with_parent(parent: int, folder: str) -> None:
    """A daemon thread that ends this rank once the process that launched it is gone
    (killed, say, before it could reap its ranks), removing the launch's folder it would
    have removed: no rank and no file outlives the launcher."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_PARENT_POLL_S)
        shutil.rmtree(folder, ignore_errors=True)
        _exit_now(1)

    threading.Thread(target=watch, name="gpudiag-parent-watch", daemon=True).start()


def _log_to(path: str, rank: int, world_size: int, backend: str) -> None:
    """Send this rank's stdout and stderr (file descriptors 1 and 2, so NCCL's own
    output too) to ``path``."""
    if backend == "nccl":
        os.environ.setdefault("NCCL_DEBUG", "INFO")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(ValueError, OSError):
            stream.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # Python-level writes too, whatever sys.stdout was replaced by (a test runner's capture).
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 (lives as long as the rank)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    print(
        f"gpudiag rank {rank} of {world_size}: backend {backend}, pid {os.getpid()}, "
        f"NCCL_DEBUG={os.environ.get('NCCL_DEBUG', '')}",
        flush=True,
    )


def leave_group(dist: Any) -> None:
    """Tear the process group down together: a barrier first, so no rank closes its
    connections while a peer is still using them (gloo aborts the process on that)."""
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _write(path: Path, data: Payload) -> None:
    """Write the payload (bytes or chunks) under a temporary name, then rename it, so the
    parent never reads half a result."""
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as out:
        for chunk in [data] if isinstance(data, bytes) else data:
            out.write(chunk)  # large chunks go straight to write(2), uncopied
    os.replace(tmp, path)
