"""The errors gpudiag raises on purpose, each tied to its exit code.

Exit codes (``../shared/DESIGN.md``): 0 nothing wrong, 1 a check found a problem,
2 bad usage or bad input, 3 cannot run here. The CLI turns a :class:`GpudiagError`
into one line on stderr and its ``exit_code``; anything else is a bug and shows a
traceback only with ``--debug``.
"""

from __future__ import annotations

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
