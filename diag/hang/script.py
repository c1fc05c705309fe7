"""Running the user's script as ``python SCRIPT ARGS`` runs it (``gpudiag run``, docs/hang.md).

:func:`load` makes the script's ``__main__`` module as the interpreter does for a file
(``__file__`` absolute, ``__loader__`` a ``SourceFileLoader``, no ``__spec__``) and
compiles its code; :func:`execute` runs that code in it. What the script leaves
unhandled is handed back to the interpreter unchanged by :func:`hand_back`: the exception
propagates to the top, where Python calls ``sys.excepthook`` (the user's, or torch's
``[rankN]:`` one), ends its non-daemon threads, runs ``atexit`` and finalises (open files
flushed), then exits with 1 — or, for an unhandled ``KeyboardInterrupt``, by SIGINT, as
``python SCRIPT`` does. The traceback the hook receives starts at the script's own
``<module>`` frame: gpudiag's frames and runpy's never show.
"""

from __future__ import annotations

import sys
import types
from importlib.machinery import SourceFileLoader
from pathlib import Path
from typing import Any, NoReturn


def load(script: Path) -> tuple[types.ModuleType, types.CodeType]:
    """The script's fresh ``__main__`` module (installed in ``sys.modules``, as Python's
    own is, so pickling a class defined in the script and spawned workers find it) and its
    code; a ``SyntaxError`` propagates (:func:`hand_back` shows it as Python does)."""
    path = str(script.resolve())
    module = types.ModuleType("__main__")
    module.__dict__.update(
        __file__=path,
        __cached__=None,
        __loader__=SourceFileLoader("__main__", path),
        __spec__=None,
        __package__=None,
        __builtins__=__builtins__,
    )
    source = script.read_bytes()
    code = compile(source, path, "exec", dont_inherit=True)
    sys.modules["__main__"] = module
    return module, code


def execute(module: types.ModuleType, code: types.CodeType) -> None:
    """Run the script's code in its ``__main__`` module."""
    exec(code, module.__dict__)


def hand_back(exc: BaseException, filename: str) -> NoReturn:
    """Raise ``exc`` on to the interpreter's top level, where Python handles it as it
    handles a script's (module docstring). The ``sys.excepthook`` in place when it gets
    there — the script may set one until its last line — receives the traceback from the
    script's top-level frame on; the hook is wrapped once, for this exception only."""
    if isinstance(exc, SyntaxError):
        exc.__traceback__ = None  # (Python shows a script's syntax error with no frame)
    previous = sys.excepthook

    def from_the_script(kind: type[BaseException], value: BaseException, tb: Any) -> Any:
        sys.excepthook = previous
        if value is exc:
            tb = None if isinstance(exc, SyntaxError) else _tail(tb, filename)
            value.__traceback__ = tb
        return previous(kind, value, tb)

    sys.excepthook = from_the_script
    raise exc


def _tail(tb: types.TracebackType | None, filename: str) -> types.TracebackType | None:
    """``tb`` from the script's top-level frame on (gpudiag's and runpy's entries dropped);
    ``tb`` itself when none is the script's."""
    first = tb
    while first is not None:
        code = first.tb_frame.f_code
        if code.co_filename == filename and code.co_name == "<module>":
            return first
        first = first.tb_next
    return tb
