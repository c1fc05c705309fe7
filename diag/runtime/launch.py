"""Start ranks bounded and reaped, or join a group that ``torchrun`` started.

``launch(fn, world_size, ...)`` runs ``fn(rank, world_size, *args)`` once per rank inside
an initialised ``torch.distributed`` process group and returns the bytes of every rank,
rank order. ``fn`` returns bytes, or a list of byte chunks to be joined (written one
after the other, without copying them first: see :func:`gpudiag.runtime.wire.pack`).

- Local launch: one process per rank. ``fork`` when the parent holds no CUDA context and
  runs no other thread (no fresh interpreter, no second torch import: ranks start in
  milliseconds); otherwise a fresh interpreter per rank (``python -m
  gpudiag.runtime.rank_process``), which neither re-imports the parent's ``__main__`` nor
  needs the parent's modules to be importable by name. Such ranks get ``fn`` and
  ``args`` from one file per launch, written once with ``torch.save`` and cloudpickle
  (tensors as the file's records, whatever their number or size; functions and classes
  defined in ``__main__``, a notebook or a function travel by value), in the launch's
  private folder, never through ``/dev/shm``. ``GPUDIAG_RANK_START=subprocess`` asks for
  fresh interpreters even where forking would do. The rendezvous is a FileStore in that
  folder, so no port is chosen and concurrent runs cannot collide; gloo/nccl pick free
  ephemeral ports for their own connections. :func:`start` returns once the ranks are
  started; :func:`launch` also waits.
- Results come back as files the ranks write, mapped back as one writable private
  ``mmap`` per rank (a ``bytearray`` when empty; slice either for bytes), never as
  shared-memory tensors.
- Every wait has a deadline. A rank that raises → :class:`RankFailure` ``rank-crashed``
  with its traceback; no answer by the deadline → ``rank-hung``. Either way every rank
  process is terminated and reaped before the error is raised; a rank whose launcher is
  gone (killed before it could reap) leaves within a second.
- Inside :func:`rank_logs` each rank's stdout and stderr go to a file per rank (with
  ``NCCL_DEBUG=INFO`` for NCCL ranks, unless set): the per-rank logs of a bug report.
- Under ``torchrun`` (``RANK``, ``WORLD_SIZE`` and ``MASTER_ADDR`` set) nothing is
  launched: this process joins the group (``env://``) as its rank, runs ``fn`` and
  all-gathers the results, so multi-node runs use torch.distributed's own launcher.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import mmap
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from gpudiag.cleanup import WATCH_THREAD, track, untrack
from gpudiag.codes import lookup
from gpudiag.errors import EXIT_PROBLEM, GpudiagError, InputError
from gpudiag.findings import Finding
from gpudiag.runtime.rank_side import JOB_FILE, RankFn, RankSpec, leave_group, rank_main

Result = bytearray | mmap.mmap  # what a rank's payload comes back as (see _read)
_POLL_S = 0.02
_GRACE_S = 2.0
_SETTLE_S = 0.3
#: The environment variable that picks how ranks start: ``auto`` (default) or ``subprocess``.
START_VARIABLE = "GPUDIAG_RANK_START"
#: Where ranks write their logs while :func:`rank_logs` is active (None: inherit the parent's).
_log_folder: Path | None = None
_launches = itertools.count(1)  # numbers the launches inside one rank_logs() block


@contextlib.contextmanager
def rank_logs(folder: str | os.PathLike[str]) -> Iterator[Path]:
    """While active, every launched rank writes its stdout and stderr to
    ``folder/launch<N>-rank<R>.log``, NCCL ranks with ``NCCL_DEBUG=INFO`` (unless set)."""
    global _log_folder, _launches
    previous, _log_folder = _log_folder, Path(folder)
    counted, _launches = _launches, itertools.count(1)
    try:
        _log_folder.mkdir(parents=True, exist_ok=True)
        yield _log_folder
    finally:  # (an enclosing block numbers its launches on from where it was)
        _log_folder, _launches = previous, counted


class RankFailure(GpudiagError):
    """A rank crashed or stopped answering (exit 1). ``code`` is the finding code."""

    exit_code = EXIT_PROBLEM

    def __init__(self, code: str, rank: int, message: str, detail: str = ""):
        super().__init__(message)
        self.code = lookup(code).name
        self.rank = rank
        self.detail = detail

    def to_finding(self, simulated: bool = False) -> Finding:
        """The ``rank-crashed`` / ``rank-hung`` finding, carrying the rank's traceback.
        ``simulated``: the ranks were CPU processes over gloo, where no link and no NCCL
        exist, so a hang is never put on them."""
        if self.code == "rank-crashed":
            fix = "read the rank's traceback below; rerun with the same seed to reproduce"
        elif simulated:
            fix = (
                "not a link or NCCL fault: these ranks are CPU processes over gloo; ranks that wait in "
                "different collectives did different work — a parameter used on some ranks only (pass "
                "find_unused_parameters=True), rank-dependent control flow, or a forward slower than "
                "--timeout"
            )
        else:
            fix = (
                "a rank stuck in a collective usually means a peer-to-peer or network path "
                "that stalls: rerun with NCCL_P2P_DISABLE=1 and NCCL_DEBUG=INFO"
            )
        return Finding(self.code, "error", str(self), {"rank": self.rank, "detail": self.detail}, fix=fix)


def torchrun_env(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process was started by torchrun (or another env:// launcher)."""
    env = os.environ if env is None else env
    return all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def torchrun_world(env: Mapping[str, str] | None = None) -> int | None:
    """The torchrun job's world size (``WORLD_SIZE``); None outside torchrun."""
    env = os.environ if env is None else env
    return int(env["WORLD_SIZE"]) if torchrun_env(env) else None


def local_index(rank: int, env: Mapping[str, str] | None = None) -> int:
    """Which of this machine's devices rank ``rank`` uses: torchrun's ``LOCAL_RANK`` (one
    process per GPU on every node), else the rank itself (ranks launched here)."""
    env = os.environ if env is None else env
    return int(env.get("LOCAL_RANK", rank)) if torchrun_env(env) else rank


def start_method(backend: str) -> str:
    """``fork`` for CPU ranks when this process holds no CUDA context and runs no other
    thread; else ``subprocess`` (a fresh interpreter per rank). A CUDA context does not
    survive a fork, and a child forked while another thread is inside torch can inherit a
    lock held forever (measured: the ranks hung until their deadline), as in a notebook,
    whose kernel runs threads of its own. ``GPUDIAG_RANK_START=subprocess`` forces fresh
    interpreters."""
    import torch

    wanted = os.environ.get(START_VARIABLE, "auto").strip().lower() or "auto"
    if wanted not in ("auto", "subprocess"):
        raise InputError(f"{START_VARIABLE}={wanted!r}: expected auto or subprocess")
    others = [t for t in threading.enumerate() if t.name != WATCH_THREAD and t is not threading.main_thread()]
    forkable = "fork" in mp.get_all_start_methods() and not others
    if wanted == "auto" and forkable and backend == "gloo" and not torch.cuda.is_initialized():
        return "fork"
    return "subprocess"


def launch(
    fn: RankFn,
    world_size: int,
    *,
    backend: str = "gloo",
    timeout: float = 120.0,
    args: tuple[Any, ...] = (),
    method: str | None = None,
) -> list[Result]:
    """Run ``fn(rank, world_size, *args)`` on every rank; the bytes each returned.

    ``method`` forces a start method (``fork`` or ``subprocess``; default: the cheapest
    safe one, see :func:`start_method`). Unless the method is ``fork``, ``fn`` and
    ``args`` must pickle with cloudpickle (:class:`UnpicklableJob` otherwise, before any
    rank starts).
    """
    with start(fn, world_size, backend=backend, timeout=timeout, args=args, method=method) as ranks:
        return ranks.wait()


class Ranks:
    """Ranks started by :func:`start`. ``wait()`` returns their bytes (or raises
    :class:`RankFailure`); leaving the ``with`` block terminates and reaps every rank
    still running and removes their folder, whatever happened in between."""

    def __init__(
        self, procs: list[Any], folder: Path | None, deadline: float, timeout: float, results: Any = None
    ):
        self.procs, self.folder, self.deadline, self.timeout = procs, folder, deadline, timeout
        self._results: list[Result] | None = results

    def wait(self) -> list[Result]:
        if self._results is None:
            assert self.folder is not None
            self._results = _wait(self.procs, self.folder, self.deadline, self.timeout)
        return self._results

    def close(self) -> None:
        _reap(self.procs)
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
        untrack(self)

    def __enter__(self) -> Ranks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start(
    fn: RankFn,
    world_size: int,
    *,
    backend: str = "gloo",
    timeout: float = 120.0,
    args: tuple[Any, ...] = (),
    method: str | None = None,
) -> Ranks:
    """Start the ranks of :func:`launch` and return at once, so this process can work
    while they run; use the result as a context manager. Under torchrun this process is
    a rank itself, so ``fn`` runs here before ``start`` returns."""
    if torchrun_env():
        return Ranks([], None, 0.0, timeout, _join_torchrun(fn, backend, timeout, args))
    method = method or start_method(backend)
    if method not in ("fork", "subprocess"):
        raise ValueError(f"unknown start method {method!r}: expected fork or subprocess")
    logs = None if _log_folder is None else str(_log_folder / f"launch{next(_launches)}")
    with signals_held():  # (a signal now would leave the folder unnamed: delivered below)
        folder = Path(tempfile.mkdtemp(prefix="gpudiag-ranks-"))
        ranks = track(Ranks([], folder, time.monotonic() + timeout, timeout))
    try:
        if method == "subprocess":
            _write_job(folder / JOB_FILE, fn, args)
        for rank in range(world_size):
            spec = RankSpec(rank, world_size, backend, str(folder), timeout, logs, os.getpid())
            if method == "fork":
                proc: Any = mp.get_context("fork").Process(
                    target=rank_main, args=(spec, fn, args), name=f"gpudiag-rank{rank}", daemon=True
                )
                with signals_held():  # (delivered here, once the rank is in the list to reap)
                    proc.start()
                    ranks.procs.append(proc)
            else:
                ranks.procs.append(_FreshRank.start(spec))
    except BaseException:
        ranks.close()
        raise
    return ranks


#: The signals whose handlers raise (the CLI's :class:`~gpudiag.errors.Interrupted`, the
#: deadlines' SIGALRM), held across a fork.
HELD_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGALRM})


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGALRM blocked (``pthread_sigmask``) while active, delivered
    when it ends. Around a fork: a signal arriving just after it would run its handler inside
    Python's at-fork hooks (logging's ``_releaseLock``), where the exception the handler
    raises is printed as "Exception ignored" and lost (measured: 1 Ctrl-C in 10 under
    torchrun). Blocked, it waits in the kernel and is delivered as the mask is restored,
    in the caller's frame. The forked child starts with them blocked too (the mask is
    inherited); :func:`~gpudiag.runtime.rank_side.rank_main` unblocks them once it has set
    its own dispositions. Only the main thread runs signal handlers: elsewhere a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, HELD_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


class UnpicklableJob(InputError):
    """The rank function or its arguments cannot be sent to ranks in fresh interpreters;
    ``reason`` is the pickling error, one line."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


def _write_job(path: Path, fn: RankFn, args: tuple[Any, ...]) -> None:
    """``(fn, args)`` into one file for the ranks to load: ``torch.save`` with cloudpickle,
    so tensors are records of the file (no file descriptor or shared memory each) and
    functions and classes that cannot be imported by name are pickled by value."""
    import cloudpickle
    import torch

    try:
        torch.save((fn, args), path, pickle_module=cloudpickle)
    except Exception as exc:
        path.unlink(missing_ok=True)
        reason = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
        raise UnpicklableJob(
            f"cannot send {getattr(fn, '__name__', 'the rank function')}'s work to ranks started as "
            f"fresh Python processes: {reason}",
            reason,
        ) from exc


class _FreshRank:
    """A rank in a fresh interpreter, with the parts of ``multiprocessing.Process``'s
    interface that :func:`_wait` and :func:`_reap` use."""

    def __init__(self, popen: subprocess.Popen[bytes]):
        self.popen = popen

    @classmethod
    def start(cls, spec: RankSpec) -> _FreshRank:
        env = dict(os.environ)
        # The parent's import path, so a factory named by module resolves in the rank too.
        paths = [os.path.abspath(p or os.curdir) for p in sys.path]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([*paths, *filter(None, [env.get("PYTHONPATH")])]))
        argv = [sys.executable, "-m", "gpudiag.runtime.rank_process", *spec.argv()]
        # A session of its own: a terminal's Ctrl-C goes to the launcher alone, which stops
        # its ranks itself — none prints a traceback from the middle of ``import torch``.
        return cls(subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, start_new_session=True))

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def terminate(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.popen.terminate()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.popen.kill()

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout)


def _wait(procs: list[Any], folder: Path, deadline: float, timeout: float) -> list[Result]:
    done: dict[int, Result] = {}
    while len(done) < len(procs):
        for rank, proc in enumerate(procs):
            if rank in done:
                continue
            error = folder / f"rank{rank}.err"
            if error.exists():
                raise _first_crash(folder, len(procs))
            result = folder / f"rank{rank}.out"
            if result.exists():
                done[rank] = _read(result)
            elif proc.exitcode is not None:
                if error.exists():
                    continue  # written between the two checks; read on the next pass
                raise RankFailure(
                    "rank-crashed",
                    rank,
                    f"rank {rank} exited with code {proc.exitcode} without a result",
                    _exit_reason(proc.exitcode),
                )
        if len(done) < len(procs):
            if time.monotonic() > deadline:
                silent = [r for r in range(len(procs)) if r not in done]
                raise RankFailure(
                    "rank-hung",
                    silent[0],
                    f"rank {', '.join(map(str, silent))} gave no answer within {timeout:g} s",
                    "no result and no error before the deadline; the ranks were killed",
                )
            time.sleep(_POLL_S)
    return [done[r] for r in range(len(procs))]


def _first_crash(folder: Path, world_size: int) -> RankFailure:
    """The rank that failed first: once one rank fails its peers fail too (connection
    closed), so wait a moment for their reports and blame the earliest."""
    time.sleep(_SETTLE_S)
    reports = []
    for rank in range(world_size):
        path = folder / f"rank{rank}.err"
        if path.exists():
            reports.append((path.stat().st_mtime_ns, rank, path.read_text(errors="replace")))
    reports.sort()
    _, rank, text = reports[0]
    summary, _, detail = text.partition("\n")
    others = [r for _, r, _ in reports[1:]]
    message = f"rank {rank} crashed: {summary}"
    if others:
        message += f" (then rank {', '.join(map(str, others))} failed too)"
    return RankFailure("rank-crashed", rank, message, detail)


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _reap(procs: list[Any]) -> None:
    """Terminate every rank still running, then kill what ignores it, and wait for all."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + _GRACE_S
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()


def _read(path: Path) -> Result:
    """A rank's result as a writable buffer, so tensors can be views of it: a private
    mapping of the file (copy-on-write; read as it is used, not copied up front: 0.06 s
    less for resnet18's two gradients), which outlives the file's removal."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return bytearray()  # (an empty file cannot be mapped)
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)


def _join_torchrun(fn: RankFn, backend: str, timeout: float, args: tuple[Any, ...]) -> list[Result]:
    import torch.distributed as dist

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    created = not dist.is_initialized()
    if created:
        dist.init_process_group(backend, init_method="env://", timeout=datetime.timedelta(seconds=timeout))
    try:
        payload = fn(rank, world_size, *args)
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, payload if isinstance(payload, bytes) else b"".join(payload))
        return [bytearray(g) for g in gathered]
    finally:
        if created:
            leave_group(dist)
