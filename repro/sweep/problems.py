"""The sweep's problem type and the fleet statistics its judges share (pure)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gpudiag.codes import lookup


@dataclass
class Problem:
    """One thing wrong with a node: a stable code, a sentence, expected vs measured."""

    code: str
    message: str
    expected: Any = None
    measured: Any = None

    def __post_init__(self) -> None:
        lookup(self.code)  # a registered finding code (gpudiag.codes), or UnknownCode

    def to_json(self) -> dict[str, Any]:
        return {
            "code": self.code,
            "message": self.message,
            "expected": self.expected,
            "measured": self.measured,
        }


def leave_one_out_medians(values: Sequence[float]) -> list[float | None]:
    """For each position, the median of every *other* value (None when there is no other).

    One sort (n log n), then O(1) per value: removing the element at sorted position k
    shifts the ones above it down by one, so the median of the rest is read off the full
    sorted list at an index that depends only on whether it lies below or above k."""
    n = len(values)
    if n < 2:
        return [None] * n
    order = sorted(range(n), key=values.__getitem__)
    ranked = [values[i] for i in order]
    out: list[float | None] = [None] * n
    rest = n - 1

    def at(j: int, k: int) -> float:  # element j of the sorted list without position k
        return ranked[j] if j < k else ranked[j + 1]

    for k, i in enumerate(order):
        if rest % 2:
            out[i] = at(rest // 2, k)
        else:
            out[i] = (at(rest // 2 - 1, k) + at(rest // 2, k)) / 2
    return out


def median(values: Sequence[float]) -> float | None:
    if not values:
        return None
    s = sorted(values)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
