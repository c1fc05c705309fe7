"""JSON output: every result's ``to_json()`` document, indented, one trailing newline."""

from __future__ import annotations

import json
import math
from typing import Any, TextIO


def number(x: float) -> float | str:
    """JSON has no NaN/Infinity: non-finite numbers are written as "nan", "inf", "-inf"."""
    return x if math.isfinite(x) else str(x)


def losses(values: list[float]) -> dict[str, Any]:
    """A per-step list of losses for JSON: numbers, ``null`` where the loss was not finite
    (so every element of ``losses`` is a number or null), and those steps apart with
    what they held: ``{"losses": [0.7, null], "nonfinite": [{"step": 2, "value": "nan"}]}``."""
    return {
        "losses": [x if math.isfinite(x) else None for x in values],
        "nonfinite": [{"step": i, "value": str(x)} for i, x in enumerate(values, 1) if not math.isfinite(x)],
    }


def write(document: dict[str, Any], stream: TextIO) -> None:
    json.dump(document, stream, indent=2, ensure_ascii=False)
    stream.write("\n")


def document(result: Any, stream: TextIO) -> None:
    """Most kinds: the result's own ``to_json()``."""
    write(result.to_json(), stream)


topology = gradcheck = nancheck = ckpt_inspect = ckpt_convert = peer = env = replay = document


def report(report: Any, stream: TextIO) -> None:
    write({**report.to_json(), "bundle": report.bundle_path}, stream)


def doctor(report: Any, stream: TextIO) -> None:
    write(report.doctor_json(), stream)
