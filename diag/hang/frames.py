"""The user's line of a recorded collective or a stack: the innermost frame of the user's own code."""

from __future__ import annotations

import re
from pathlib import Path

from gpudiag.hang.reader import Frame

#: torch's own files, wherever the dump was made (an installed torch, a source checkout).
_TORCH = re.compile(
    r"[/\\](site|dist)-packages[/\\]torch[/\\]|[/\\]torch[/\\](distributed|nn|multiprocessing|_dynamo|utils)[/\\]"
)
_GPUDIAG = re.compile(r"[/\\](site|dist)-packages[/\\]gpudiag[/\\]")
#: Python's standard library (multiprocessing, threading, runpy): never the caller shown.
_STDLIB = re.compile(
    r"[/\\]lib(64)?[/\\]python3\.\d+[/\\](?!site-packages|dist-packages)"
    r"|[/\\]Lib[/\\](?!site-packages)|^<frozen "
)
_PACKAGES = re.compile(r"[/\\](site|dist)-packages[/\\]")
#: This installation's gpudiag folders (diag/, checks/, repro/ in a checkout).
_HERE = Path(__file__).resolve().parents
_OWN = (str(_HERE[1]), str(_HERE[2] / "checks"), str(_HERE[2] / "repro"))


def _ours(file: str) -> bool:
    if _TORCH.search(file) or _GPUDIAG.search(file):
        return True
    return any(file.startswith(root + "/") for root in _OWN)


def _library(file: str) -> bool:
    """The standard library (``subprocess.py``, ``selectors.py``, ``threading.py``), an
    installed package, or no file at all (``<frozen runpy>``, ``<string>``)."""
    return bool(_STDLIB.search(file) or _PACKAGES.search(file) or file.startswith("<"))


def user_frames(frames: tuple[Frame, ...]) -> tuple[Frame | None, Frame | None]:
    """(the innermost frame of the user's own code — not torch, gpudiag, the standard
    library or an installed package —, innermost first; the frame that called it when
    that is user code too: the caller when the collective runs in a helper). Without any
    frame of the user's own, the innermost one of an installed package (a script run
    from one), else None: a standard-library line (``selectors.py:415`` of a rank waiting
    on a subprocess) is never the user's line."""
    for i, frame in enumerate(frames):
        if _ours(frame.file) or _library(frame.file):
            continue
        outer = frames[i + 1] if i + 1 < len(frames) else None
        if outer is None or _ours(outer.file) or _library(outer.file):
            return frame, None  # the script's top level, or called by torch, gpudiag, runpy, click
        return frame, outer
    for frame in frames:
        if not _ours(frame.file) and not _STDLIB.search(frame.file) and not frame.file.startswith("<"):
            return frame, None
    return None, None


def where(frame: Frame | None) -> str | None:
    """``train.py:31``: the file's name and the line (None without a frame)."""
    if frame is None:
        return None
    return f"{Path(frame.file).name}:{frame.line}" if frame.line else frame.file
