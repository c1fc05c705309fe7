"""The user's line of a recorded collective: the first frame outside torch and gpudiag."""

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
_STDLIB = re.compile(r"[/\\]lib[/\\]python3\.\d+[/\\](?!site-packages|dist-packages)|^<frozen ")
_PACKAGES = re.compile(r"[/\\](site|dist)-packages[/\\]")
#: This installation's gpudiag folders (diag/, checks/, repro/ in a checkout).
_HERE = Path(__file__).resolve().parents
_OWN = (str(_HERE[1]), str(_HERE[2] / "checks"), str(_HERE[2] / "repro"))


def _ours(file: str) -> bool:
    if _TORCH.search(file) or _GPUDIAG.search(file):
        return True
    return any(file.startswith(root + "/") for root in _OWN)


def user_frames(frames: tuple[Frame, ...]) -> tuple[Frame | None, Frame | None]:
    """(the first frame outside torch and gpudiag, innermost first; the frame that called
    it when that is user code too — not torch, gpudiag, the standard library or another
    installed package: the caller when the collective runs in a helper)."""
    for i, frame in enumerate(frames):
        if _ours(frame.file):
            continue
        outer = frames[i + 1] if i + 1 < len(frames) else None
        if outer is None or _ours(outer.file) or _STDLIB.search(outer.file) or _PACKAGES.search(outer.file):
            return frame, None  # the script's top level, or called by torch, gpudiag, runpy, click
        return frame, outer
    return None, None


def where(frame: Frame | None) -> str | None:
    """``train.py:31``: the file's name and the line (None without a frame)."""
    if frame is None:
        return None
    return f"{Path(frame.file).name}:{frame.line}" if frame.line else frame.file
