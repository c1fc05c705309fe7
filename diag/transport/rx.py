"""The NCCL log reader's regular expressions, compiled so that they run in linear time.

Every pattern on a pasted log uses possessive quantifiers (``*+``, ``++``, ``?+``,
``{m,n}+``: Python 3.11's ``re``), which never give back what they matched: a hostile line
cannot make one backtrack (issue 44: one 51-byte ``Ring`` line took 148 s). Python 3.10,
which gpudiag still supports, has no possessive quantifiers; there :func:`compile` takes
the markers out (:func:`without_possessive`). The patterns match the same text either way
on every real log in the tests (tests/core/transport/test_transport_rx.py); on 3.10 only
the time bound is lost.
"""

from __future__ import annotations

import re
import sys
from typing import AnyStr

#: Whether this Python's ``re`` has possessive quantifiers (3.11 and newer).
POSSESSIVE = sys.version_info >= (3, 11)


def without_possessive(pattern: AnyStr) -> AnyStr:
    """``pattern`` with every possessive marker (the ``+`` after a quantifier) taken out;
    escapes and character classes kept as they are."""
    text = pattern.decode("latin-1") if isinstance(pattern, bytes) else pattern
    out: list[str] = []
    i, in_class, after_quantifier = 0, False, False
    while i < len(text):
        char = text[i]
        if char == "\\":
            out.append(text[i : i + 2])
            i, after_quantifier = i + 2, False
            continue
        if in_class:
            in_class = char != "]" or out[-1] in ("[", "[^")
            out.append(char)
            i += 1
            continue
        if char == "+" and after_quantifier:  # (possessive: dropped)
            i, after_quantifier = i + 1, False
            continue
        if char == "[":
            in_class = True
            start = "[^" if text.startswith("[^", i) else "["
            out.append(start)
            i += len(start)
            after_quantifier = False
            continue
        lazy = char == "?" and after_quantifier
        group = char == "?" and bool(out) and out[-1] == "("
        after_quantifier = char in "*+?}" and not lazy and not group
        out.append(char)
        i += 1
    result = "".join(out)
    return result.encode("latin-1") if isinstance(pattern, bytes) else result


def compile(pattern: AnyStr, flags: int = 0) -> re.Pattern[AnyStr]:
    """``re.compile(pattern, flags)``, possessive where this Python has it."""
    return re.compile(pattern if POSSESSIVE else without_possessive(pattern), flags)
