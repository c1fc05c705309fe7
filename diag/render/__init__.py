"""Renderers: each takes a result object and a text stream.

``render(kind, result, fmt, stream)`` picks the renderer for a command's result
(``kind``, e.g. ``"topology"``) and an output format: by default the function named after
the kind in the format's module (``text.topology``); :data:`ELSEWHERE` names the
exceptions — a kind with one module for all its formats (``bench.text``), or a format of
a kind kept apart (``text_suite.report``). Rich is imported only by text renderers, and
only when they run.
"""

from __future__ import annotations

import importlib
import os
import re
from typing import Any, TextIO

#: Characters no output shows as they are: C0 controls but tab and newline (ESC starts a
#: terminal's escape sequences: colours, a cleared screen, a title, the clipboard), DEL,
#: C1 controls, Unicode's bidirectional overrides and isolates (text shown reordered), and
#: lone surrogates (a file name's undecodable bytes: no stream can encode them).
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def printable(text: str) -> str:
    """``text`` with every control character (:data:`_CONTROL`) written as its escape
    (``\\x1b``, ``\\u202e``): what a dump, a log or a file name holds reaches a terminal, a
    Markdown file or a pipe as text, never as a command to the terminal."""
    return _CONTROL.sub(_escaped, text) if _CONTROL.search(text) else text


def _escaped(match: re.Match[str]) -> str:
    code = ord(match.group(0))
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


class PrintableStream:
    """A text stream that writes through :func:`printable` (a renderer's output as a whole)."""

    def __init__(self, stream: TextIO):
        self.stream = stream

    def write(self, text: str) -> int:
        return self.stream.write(printable(text))

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return hasattr(self.stream, "isatty") and self.stream.isatty()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


FORMATS: dict[str, tuple[str, ...]] = {
    "topology": ("text", "json", "markdown", "dot"),
    "gradcheck": ("text", "json", "markdown"),
    "nancheck": ("text", "json", "markdown"),
    "peer": ("text", "json", "markdown"),
    "ckpt_inspect": ("text", "json", "markdown"),
    "ckpt_convert": ("text", "json", "markdown"),
    "env": ("text", "json", "markdown"),
    "report": ("text", "json", "markdown"),
    "doctor": ("text", "json", "markdown"),
    "replay": ("text", "json", "markdown"),
    "bench": ("text", "json", "markdown"),
    "transport": ("text", "json", "markdown"),
    "hang": ("text", "json", "markdown"),
}
_MODULES = {"text": "text", "json": "jsonout", "markdown": "markdown", "dot": "dot"}
#: (kind, format) → (module, function) where a renderer is not ``_MODULES[format].kind``.
ELSEWHERE: dict[tuple[str, str], tuple[str, str]] = {
    **{("bench", fmt): ("bench", fmt) for fmt in FORMATS["bench"]},
    **{("transport", fmt): ("transport", fmt) for fmt in FORMATS["transport"]},
    **{("hang", fmt): ("hang", fmt) for fmt in FORMATS["hang"]},
    **{(kind, "text"): ("text_suite", kind) for kind in ("report", "doctor", "replay")},
    **{(kind, "markdown"): ("report_markdown", kind) for kind in ("report", "doctor")},
}


def register_kind(kind: str, formats: tuple[str, ...], module: str | None = None) -> None:
    """Make ``kind`` renderable in ``formats``: by the functions ``text``/``json``/``markdown``
    … of ``gpudiag.render.<module>``, or, with no module, by :mod:`gpudiag.render.generic`
    (any :class:`gpudiag.result.CheckResult`). Called by the checks' registry
    (``gpudiag.checks.registry.register``); a kind renderable already keeps its renderers."""
    if kind in FORMATS:  # gpudiag's own kinds are known here already: they must agree
        if FORMATS[kind] != tuple(formats):
            raise ValueError(f"{kind}: formats {formats} differ from the renderers' {FORMATS[kind]}")
        return
    FORMATS[kind] = tuple(formats)
    for fmt in formats:
        ELSEWHERE[(kind, fmt)] = (module or "generic", fmt)
    _REGISTERED.add(kind)


def unregister_kind(kind: str) -> None:
    """Forget a kind :func:`register_kind` added (a test's throwaway check)."""
    if kind in _REGISTERED:
        _REGISTERED.discard(kind)
        for fmt in FORMATS.pop(kind, ()):
            ELSEWHERE.pop((kind, fmt), None)


_REGISTERED: set[str] = set()


def render(kind: str, result: Any, fmt: str, stream: TextIO) -> None:
    """Write ``result`` of command ``kind`` to ``stream`` in format ``fmt``.

    Under torchrun only rank 0 writes: every rank holds the same gathered result, and
    ``--nproc-per-node 8`` should print one report, not eight."""
    if fmt not in FORMATS.get(kind, ()):
        raise ValueError(f"no {fmt} renderer for {kind}")
    if not first_rank():
        return
    module, function = ELSEWHERE.get((kind, fmt), (_MODULES[fmt], kind))
    if not (fmt == "text" and _colour(stream)):  # (rich's own styles are escape sequences)
        stream = PrintableStream(stream)  # type: ignore[assignment]
    getattr(importlib.import_module(f"gpudiag.render.{module}"), function)(result, stream)


def _colour(stream: TextIO) -> bool:
    """Whether text output to ``stream`` is coloured (:class:`gpudiag.render.text.text_console`):
    then its control characters are escaped by the console itself, piece by piece."""
    tty = hasattr(stream, "isatty") and stream.isatty()
    return not os.environ.get("NO_COLOR") and (tty or bool(os.environ.get("FORCE_COLOR")))


def first_rank() -> bool:
    """False in a process torchrun started as a rank other than 0 (``RANK`` with
    ``WORLD_SIZE`` and ``MASTER_ADDR``, as :func:`gpudiag.runtime.launch.torchrun_env`)."""
    env = os.environ
    return not all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR")) or env["RANK"].strip() == "0"
