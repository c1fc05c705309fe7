"""The NCCL log reader's patterns are possessive (linear on hostile lines, Python 3.11's
``re``); on Python 3.10, which has none, they are compiled without the markers
(:func:`gpudiag.transport.rx.without_possessive`). Every such pattern, compiled both ways,
finds the same matches on every line of every real log in ``tests/data/nccl``."""

from __future__ import annotations

import re

import pytest

from gpudiag.transport import bundled, reader, records, run, rx
from tests.helpers import NCCL

LOGS = {p.name: p.read_bytes() for p in sorted(NCCL.glob("*.log"))}
POSSESSIVE = re.compile(r"(?<!\\)(?:[*+?}])\+")


def possessive_patterns() -> list[tuple[str, re.Pattern[str] | re.Pattern[bytes]]]:
    found = []
    for module in (reader, records, bundled, run):
        for name, value in vars(module).items():
            if isinstance(value, re.Pattern):
                text = value.pattern.decode("latin-1") if isinstance(value.pattern, bytes) else value.pattern
                if POSSESSIVE.search(text):
                    found.append((f"{module.__name__}.{name}", value))
    return found


def test_the_reader_has_possessive_patterns_to_check() -> None:
    assert len(possessive_patterns()) >= 10


@pytest.mark.parametrize(
    ("name", "pattern"), possessive_patterns(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_a_pattern_without_its_possessive_markers_matches_the_same_on_real_logs(
    name: str, pattern: re.Pattern[str] | re.Pattern[bytes]
) -> None:
    plain = re.compile(rx.without_possessive(pattern.pattern), pattern.flags)
    assert not POSSESSIVE.search(
        plain.pattern.decode("latin-1") if isinstance(plain.pattern, bytes) else plain.pattern
    )
    compared = 0
    for log in LOGS.values():
        text: str | bytes = log if isinstance(pattern.pattern, bytes) else log.decode("utf-8", "replace")
        for line in text.splitlines():  # type: ignore[union-attr]
            ours = [(m.span(), m.groups()) for m in pattern.finditer(line)]  # type: ignore[arg-type]
            theirs = [(m.span(), m.groups()) for m in plain.finditer(line)]  # type: ignore[arg-type]
            assert ours == theirs, (name, line)
            compared += 1
    assert compared > 1000


@pytest.mark.parametrize(
    ("pattern", "plain"),
    [
        (r"\s++(?P<n>\d++)(?:/(\d++))?\s*+:", r"\s+(?P<n>\d+)(?:/(\d+))?\s*:"),
        (r"[ \t]{1,16}+([^\s:]{0,255}+)", r"[ \t]{1,16}([^\s:]{0,255})"),
        (rb"\x00++", rb"\x00+"),
        (r"a+?b\++[]+]++\(?x", r"a+?b\++[]+]+\(?x"),  # (lazy, an escaped +, a class holding +)
    ],
)
def test_only_the_possessive_markers_are_taken_out(pattern: str, plain: str) -> None:
    assert rx.without_possessive(pattern) == plain
    re.compile(plain)
