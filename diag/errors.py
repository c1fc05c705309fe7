"""The errors gpudiag raises on purpose, each tied to its exit code.

Exit codes (``../shared/DESIGN.md``): 0 nothing wrong, 1 a check found a problem,
2 bad usage or bad input, 3 cannot run here. The CLI turns a :class:`GpudiagError`
into one line on stderr and its ``exit_code``; anything else is a bug and shows a
traceback only with ``--debug``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

EXIT_OK = 0
EXIT_PROBLEM = 1
EXIT_BAD_INPUT = 2
EXIT_CANNOT_RUN = 3


class GpudiagError(Exception):
    """Base class: ``str(error)`` is the one-line message shown to the user."""

    exit_code = EXIT_BAD_INPUT


class InputError(GpudiagError):
    """The user's input (a file, a capture, an option value) cannot be used."""

    exit_code = EXIT_BAD_INPUT


class CannotRunHere(GpudiagError):
    """This machine lacks what the command needs (driver, GPU, optional dependency)."""

    exit_code = EXIT_CANNOT_RUN


class UserCodeError(InputError):
    """The user's own code — a model's forward, its factory, the file that defines it —
    raised or exited (exit 2: the user's to fix, not a gpudiag bug)."""


@contextlib.contextmanager
def naming_model(spec: str) -> Iterator[None]:
    """A :class:`UserCodeError` raised in the block names ``--model SPEC`` first."""
    try:
        yield
    except UserCodeError as exc:
        if str(exc).startswith("--model "):
            raise
        raise UserCodeError(f"--model {spec!r}: {exc}") from exc


class ResourceError(CannotRunHere):
    """The machine ran out of something the run needs: memory (host or GPU) or disk
    space. Exit 3, like anything else that cannot run here."""


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived: raised in the main thread by the CLI's signal handler,
    so every ``finally`` (rank reaping, temporary files) runs before gpudiag exits with
    ``128 + signal``. A BaseException, like KeyboardInterrupt: no ``except Exception``
    swallows it."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum
        self.exit_code = 128 + signum


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0]


def is_out_of_memory(exc: BaseException) -> bool:
    """Host ``MemoryError``, ``torch.OutOfMemoryError`` (CUDA), or the ``RuntimeError``
    older torch raises for it ("CUDA out of memory", "DefaultCPUAllocator: can't
    allocate memory") — told apart without importing torch."""
    if isinstance(exc, MemoryError) or any(t.__name__ == "OutOfMemoryError" for t in type(exc).__mro__):
        return True
    text = _first_line(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


def is_out_of_space(exc: BaseException) -> bool:
    """``OSError`` ENOSPC (no space left on device) or EDQUOT (disk quota exceeded)."""
    import errno

    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def from_user_code(exc: BaseException, where: str) -> GpudiagError:
    """The error to show for ``exc``, raised by the user's code in ``where`` (e.g. "the
    model's forward under dp"): exit 3 for memory and disk space, exit 2 for anything
    else the code did — an exception or a ``sys.exit``. The message names where and what."""
    if isinstance(exc, GpudiagError):
        return exc
    if isinstance(exc, SystemExit):
        how = getattr(exc, "via", "sys.exit")
        return UserCodeError(f"{where} called {how}({exc.code!r}) — gpudiag stopped instead of exiting")
    if is_out_of_memory(exc):
        return ResourceError(f"{where} ran out of memory ({type(exc).__name__}: {_first_line(exc)})")
    if is_out_of_space(exc):
        assert isinstance(exc, OSError)
        on = f" writing {exc.filename}" if exc.filename else ""
        return ResourceError(f"{where}: no space left on device{on} ({exc.strerror})")
    return UserCodeError(f"{where} raised {type(exc).__name__}: {_first_line(exc)}{_hint(exc)}")


def _hint(exc: BaseException) -> str:
    """What to do about a common mistake in the inputs gpudiag generated for the model: float
    inputs fed to an Embedding (torch: "Expected tensor for argument #1 'indices' to have one
    of the following scalar types: Long, Int; but got torch.FloatTensor")."""
    text = str(exc)
    if "'indices'" in text and "Long" in text and "Float" in text:
        return (
            " — the model takes integer ids (an Embedding): generate them with "
            "--input-dtype long --input-range 0,VOCAB (VOCAB: its num_embeddings)"
        )
    return ""
