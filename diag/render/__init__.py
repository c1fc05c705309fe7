"""Renderers: each takes a result object and a text stream.

``render(kind, result, fmt, stream)`` picks the renderer for a command's result
(``kind``, e.g. ``"topology"``) and an output format. Rich is imported only by the text
renderer, and only when it runs.
"""

from __future__ import annotations

import importlib
from typing import Any, TextIO

FORMATS = {
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
}
_MODULES = {"text": "text", "json": "jsonout", "markdown": "markdown", "dot": "dot"}


def render(kind: str, result: Any, fmt: str, stream: TextIO) -> None:
    """Write ``result`` of command ``kind`` to ``stream`` in format ``fmt``."""
    if fmt not in FORMATS.get(kind, ()):
        raise ValueError(f"no {fmt} renderer for {kind}")
    module = importlib.import_module(f"gpudiag.render.{_MODULES[fmt]}")
    getattr(module, kind)(result, stream)
