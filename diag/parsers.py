"""Parsers of option values several commands share (``--pairs``, ``--sizes``): plain
text in, plain values out or an :class:`~gpudiag.errors.InputError` (exit 2) naming the
option; no torch, so the CLI checks them while it parses."""

from __future__ import annotations

import itertools

from gpudiag.errors import InputError

#: ``--sizes`` suffixes (binary: 4K is 4096 bytes, as nccl-tests reads them).
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_pairs(text: str, gpus: list[int]) -> list[tuple[int, int]]:
    """``all`` or ``0-1,5-6`` → sorted pairs of known GPUs."""
    if text.strip() == "all":
        return list(itertools.combinations(sorted(gpus), 2))
    pairs = []
    for part in text.split(","):
        a, sep, b = part.strip().partition("-")
        if not sep or not (a + b).isascii() or not a.isdigit() or not b.isdigit() or a == b:
            raise InputError(f"bad --pairs {text!r}: expected all or A-B,C-D (e.g. 0-1,5-6)")
        pair = tuple(sorted((int(a), int(b))))
        unknown = [g for g in pair if g not in gpus]
        if unknown:
            raise InputError(f"--pairs {text!r}: no GPU {', '.join(map(str, unknown))} here (GPUs: {gpus})")
        pairs.append(pair)
    return list(dict.fromkeys(pairs))  # type: ignore[arg-type]


def parse_sizes(text: str) -> tuple[int, ...]:
    """``4K,1M,256M`` → bytes."""
    sizes = []
    for part in text.split(","):
        part = part.strip().upper().removesuffix("B").removesuffix("I")
        unit = _UNITS.get(part[-1:], 1)
        number = part[:-1] if part[-1:] in _UNITS else part
        if not number.isascii() or not number.isdigit() or int(number) * unit < 8:
            raise InputError(f"bad --sizes {text!r}: expected sizes like 4K,1M,256M")
        sizes.append(int(number) * unit)
    return tuple(sizes)
