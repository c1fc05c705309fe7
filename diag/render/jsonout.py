"""JSON output: every result's ``to_json()`` document, indented, one trailing newline,
written in one piece (a string that cannot be encoded — a lone surrogate from a file
name — is escaped, never the cause of half a document); and :func:`dumps_bounded`, JSON of
any tree a reader produced, its size checked as it is made."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
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
    """``document`` as indented JSON and a newline, in one write: non-ASCII as it is where
    the stream can encode it, escaped (``\\udc80``, still JSON) where it cannot."""
    text = json.dumps(document, indent=2, ensure_ascii=False)
    try:
        text.encode(getattr(stream, "encoding", None) or "utf-8")
    except (UnicodeEncodeError, LookupError):
        text = json.dumps(document, indent=2, ensure_ascii=True)
    stream.write(text + "\n")


def document(result: Any, stream: TextIO) -> None:
    """Most kinds: the result's own ``to_json()``."""
    write(result.to_json(), stream)


topology = gradcheck = nancheck = ckpt_inspect = ckpt_convert = peer = env = replay = document


def report(report: Any, stream: TextIO) -> None:
    write({**report.to_json(), "bundle": report.bundle_path}, stream)


def doctor(report: Any, stream: TextIO) -> None:
    write(report.doctor_json(), stream)


class TooLarge(ValueError):
    """:func:`dumps_bounded`'s document grew past its limit (``limit`` bytes)."""

    def __init__(self, limit: int):
        super().__init__(f"more than {limit} bytes as JSON")
        self.limit = limit


#: Integers of more digits than this are written as a string (``"<int of 5000 digits>"``):
#: Python refuses to print one of more than 4300 digits, and no figure needs so many.
MAX_INT_DIGITS = 1000


def dumps_bounded(tree: Any, limit: int, *, indent: int | None = None) -> bytes:
    """``tree`` as JSON (UTF-8, ASCII-escaped, a trailing newline), refused with
    :class:`TooLarge` as soon as it passes ``limit`` bytes: the size is counted as the text
    is made, so a small tree whose one large string is referenced a thousand times (a
    pickle's memo) is refused after ``limit`` bytes, not after gigabytes. Any value a reader
    can produce is written: keys that are not strings (a tuple, bytes, a frozenset) as a
    short text of them, sets as lists, bytes as their ``repr`` (at most 4 KiB), integers of
    more than :data:`MAX_INT_DIGITS` digits as a note of their size; lone surrogates
    escaped. A tree that holds itself is a ``ValueError``."""
    encoder = json.JSONEncoder(ensure_ascii=True, indent=indent, check_circular=True)
    parts: list[str] = []
    size = 0
    try:
        for part in encoder.iterencode(_plain(tree), _one_shot=False):
            size += len(part)
            if size > limit:
                raise TooLarge(limit)
            parts.append(part)
    except RecursionError:
        raise ValueError("nested too deep to write as JSON") from None
    return ("".join(parts) + "\n").encode("ascii")


def _plain(tree: Any) -> Any:
    """``tree`` with what ``json`` cannot write replaced (see :func:`dumps_bounded`); shared
    subtrees stay shared (the size is bounded as the text is made, not here)."""
    done: dict[int, Any] = {}
    stack: list[tuple[Any, Any]] = []

    def convert(value: Any) -> Any:
        if isinstance(value, bool) or value is None or isinstance(value, (str, float)):
            return value
        if isinstance(value, int):
            return value if _digits(value) <= MAX_INT_DIGITS else f"<int of {_digits(value)} digits>"
        if isinstance(value, (Mapping, list, tuple, set, frozenset)):
            if id(value) not in done:
                done[id(value)] = {} if isinstance(value, Mapping) else []
                stack.append((value, done[id(value)]))
            return done[id(value)]
        return _text(value, _KEY_CHARS)

    root = convert(tree)
    while stack:
        source, target = stack.pop()
        if isinstance(target, dict):
            for key, value in source.items():
                target[key if isinstance(key, str) else _key(key)] = convert(value)
        else:
            target.extend(convert(value) for value in source)
    return root


#: The most characters a key that is not a string (or a value JSON has no form for) becomes.
_KEY_CHARS = 4096


def _key(key: Any) -> str:
    """A key ``json`` cannot write as it is, as text: a number or constant as ``json``
    writes it, anything else (a tuple, bytes, a frozenset) as a short ``repr``-like text."""
    if isinstance(key, bool) or key is None or isinstance(key, float):
        return json.dumps(key)
    return _text(key, _KEY_CHARS)


def _text(value: Any, budget: int) -> str:
    """``value`` as at most about ``budget`` characters, built piece by piece (a tuple
    holding one long string a thousand times is not written out a thousand times first)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value) if _digits(value) <= MAX_INT_DIGITS else f"<int of {_digits(value)} digits>"
    if isinstance(value, (str, bytes, bytearray)):
        return repr(value[:budget]) + ("…" if len(value) > budget else "")
    if isinstance(value, (tuple, list, set, frozenset)):
        opening, closing = ("(", ")") if isinstance(value, tuple) else ("[", "]")
        pieces: list[str] = []
        left = budget
        for item in value:
            if left <= 0:
                pieces.append("…")
                break
            piece = _text(item, left)
            pieces.append(piece)
            left -= len(piece) + 2
        return opening + ", ".join(pieces) + closing
    if isinstance(value, (bool, float)) or value is None:
        return repr(value)
    return f"<{type(value).__name__}>"


def _digits(value: int) -> int:
    """About how many decimal digits ``value`` has (from its bits: no conversion)."""
    return max(1, int(abs(value).bit_length() * 0.30103) + 1)
