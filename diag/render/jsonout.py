"""JSON output: every result's ``to_json()`` document, indented, one trailing newline."""

from __future__ import annotations

import json
import math
from typing import Any, TextIO


def number(x: float) -> float | str:
    """JSON has no NaN/Infinity: non-finite numbers are written as "nan", "inf", "-inf"."""
    return x if math.isfinite(x) else str(x)


def write(document: dict[str, Any], stream: TextIO) -> None:
    json.dump(document, stream, indent=2, ensure_ascii=False)
    stream.write("\n")


def topology(report: Any, stream: TextIO) -> None:
    write(report.to_json(), stream)


def gradcheck(report: Any, stream: TextIO) -> None:
    write(report.to_json(), stream)


def nancheck(report: Any, stream: TextIO) -> None:
    write(report.to_json(), stream)


def ckpt_inspect(result: Any, stream: TextIO) -> None:
    write(result.to_json(), stream)


def ckpt_convert(result: Any, stream: TextIO) -> None:
    write(result.to_json(), stream)


def peer(report: Any, stream: TextIO) -> None:
    write(report.to_json(), stream)


def env(report: Any, stream: TextIO) -> None:
    write(report.to_json(), stream)


def report(report: Any, stream: TextIO) -> None:
    write({**report.to_json(), "bundle": report.bundle_path}, stream)


def doctor(report: Any, stream: TextIO) -> None:
    write(report.doctor_json(), stream)


def replay(report: Any, stream: TextIO) -> None:
    write(report.to_json(), stream)
