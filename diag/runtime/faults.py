"""Fault injection: one grammar for every command that runs the runtime.

``--inject SRC->DST:KIND[@STEP][xCOUNT]`` (repeatable; ``SRC-DST:…`` is the same spec and
survives an unquoted shell, which reads ``>`` as a redirection):

- ``SRC``, ``DST``: device (``dp``) or rank (``ddp``) numbers, or ``*`` for any;
- ``KIND``: ``nan`` / ``inf`` (the first element becomes NaN / +inf), ``zero`` (all zeros),
  ``bitflip`` (flips the top exponent bit of the first element) or ``scale=F`` (all × F);
- ``@STEP``: the first step it applies to (1-based; default 1);
- ``xCOUNT``: how many transfers it hits (default: every one from STEP on).

In ``dp`` a fault corrupts what arrives at DST over a transfer from SRC (any phase). In
``ddp`` it corrupts what rank DST receives from the all-reduce, attributed to link SRC→DST.
Examples: ``5->6:nan@3`` (or ``5-6:nan@3``), ``*->1:bitflip x2``, ``0->1:scale=1e4@2x1``.
Wherever gpudiag prints a spec it quotes it for the shell (:func:`quoted`).
"""

from __future__ import annotations

import math
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gpudiag.errors import InputError

GRAMMAR = (
    "SRC->DST:KIND[@STEP][xCOUNT] (or SRC-DST:…) with KIND one of nan, inf, zero, bitflip, scale=F; "
    "SRC/DST a number or *"
)
#: What a refused spec adds: an unquoted ``5->6:nan@3`` reaches gpudiag as ``5-`` (the shell
#: sends the output to a file named ``6:nan@3``).
QUOTE_HINT = "quote the spec (--inject '5->6:nan@3') or write it without '>' (--inject 5-6:nan@3)"
KINDS = ("nan", "inf", "zero", "bitflip", "scale")

_SPEC = re.compile(
    r"^\s*(?P<src>\*|[0-9]+)\s*->?\s*(?P<dst>\*|[0-9]+)\s*:\s*(?P<kind>nan|inf|zero|bitflip|scale=(?P<factor>[^@x\s]+))"
    r"\s*(?:@\s*(?P<step>[0-9]+))?\s*(?:x\s*(?P<count>[0-9]+))?\s*$"
)
#: The top exponent bit per element size in bytes: flipping it turns 1.0 into inf/huge.
_EXPONENT_BIT = {2: 14, 4: 30, 8: 62}


class InjectSpecError(InputError):
    """A malformed ``--inject`` value (exit 2); the message shows the grammar."""


@dataclass(frozen=True)
class Fault:
    """One parsed ``--inject`` spec. ``src``/``dst`` None means any."""

    src: int | None
    dst: int | None
    kind: str
    step: int = 1
    count: int | None = None
    factor: float = 1.0

    @property
    def text(self) -> str:
        src = "*" if self.src is None else str(self.src)
        dst = "*" if self.dst is None else str(self.dst)
        kind = f"scale={self.factor:g}" if self.kind == "scale" else self.kind
        tail = f"@{self.step}" + (f"x{self.count}" if self.count is not None else "")
        return f"{src}->{dst}:{kind}{tail}"

    def matches(self, src: int, dst: int, step: int) -> bool:
        return (
            (self.src is None or self.src == src)
            and (self.dst is None or self.dst == dst)
            and step >= self.step
        )


#: What an unquoted ``SRC->DST…`` leaves after the shell took ``>`` as a redirection.
_CUT_BY_SHELL = re.compile(r"^\s*(\*|[0-9]+)\s*-\s*$")


def quoted(spec: str) -> str:
    """``spec`` as the shell must be given it: ``'5->6:nan@3'`` (``5-6:nan@3`` needs no quotes)."""
    return shlex.quote(spec)


def _bad(spec: str, why: str = "") -> InjectSpecError:
    if not why and _CUT_BY_SHELL.match(spec):
        why = (
            "the shell took '>' for a redirection and passed only this (it may have created a file "
            "named after the rest of the spec)"
        )
    return InjectSpecError(
        f"bad --inject {quoted(spec)}: {why + '; ' if why else ''}expected {GRAMMAR}; {QUOTE_HINT}"
    )


def parse_fault(spec: str) -> Fault:
    """Parse one spec; :class:`InjectSpecError` shows the grammar on failure."""
    match = _SPEC.match(spec)
    if match is None:
        raise _bad(spec)
    factor = 1.0
    kind = match.group("kind")
    if kind.startswith("scale="):
        try:
            factor = float(match.group("factor"))
        except ValueError:
            raise _bad(spec, "scale=F needs a number, e.g. scale=1e4") from None
        kind = "scale"
    step = int(match.group("step") or 1)
    if step < 1:
        raise _bad(spec, "STEP counts from 1")
    count = None if match.group("count") is None else int(match.group("count"))
    if count == 0:
        raise _bad(spec, "xCOUNT must be at least 1")
    src = None if match.group("src") == "*" else int(match.group("src"))
    dst = None if match.group("dst") == "*" else int(match.group("dst"))
    return Fault(src, dst, kind, step, count, factor)


def check_fires(specs: Sequence[str], runs: Sequence[Sequence[int]], steps: int | None) -> None:
    """Refuse, before anything runs, a spec that cannot fire (see :func:`why_it_cannot_fire`).
    A rehearsal that injects nothing must not pass as one that found nothing."""
    for spec in specs:
        why = why_it_cannot_fire(spec, runs, steps)
        if why is not None:
            raise InjectSpecError(f"--inject {quoted(spec)} can never fire: {why}; nothing was run")


def can_fire(spec: str, runs: Sequence[Sequence[int]], steps: int | None) -> bool:
    """Whether some run of ``runs`` has the spec's SRC and DST and reaches its STEP."""
    return why_it_cannot_fire(spec, runs, steps) is None


def why_it_cannot_fire(spec: str, runs: Sequence[Sequence[int]], steps: int | None) -> str | None:
    """Why ``spec`` cannot fire, or None: a STEP after the last of ``steps`` (None: no
    steps, e.g. peer copies), or a SRC or DST that no run in ``runs`` (the device or rank
    numbers of each run that moves tensors) has together with the other."""
    fault = parse_fault(spec)
    if steps is not None and fault.step > steps:
        return f"step {fault.step} comes after the run's last step ({steps})"
    named = [d for d in (fault.src, fault.dst) if d is not None]
    if not any(all(d in run for d in named) for run in runs):
        where = ", ".join("-".join(map(str, r)) for r in runs) if runs else "no run moves tensors"
        return f"no run here has {' and '.join(map(str, named))} (runs: {where})"
    return None


def rehearsal(specs: Sequence[str]) -> str | None:
    """One sentence saying faults were injected on purpose, and which (None: none were)."""
    if not specs:
        return None
    flags = " ".join(f"--inject {quoted(s)}" for s in specs)
    return (
        f"rehearsal with injected faults ({flags}): failures they cause were planted by gpudiag "
        "to test its detectors, not found on the machine"
    )


@dataclass
class FaultPlan:
    """The faults of a run and how many transfers each has hit so far."""

    faults: list[Fault] = field(default_factory=list)
    hits: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.hits = [0] * len(self.faults)

    @classmethod
    def parse(cls, specs: list[str] | tuple[str, ...]) -> FaultPlan:
        return cls([parse_fault(s) for s in specs])

    def __bool__(self) -> bool:
        return bool(self.faults)

    def due(self, src: int, dst: int, step: int) -> list[Fault]:
        """The faults that hit this transfer, counted as used."""
        out = []
        for i, fault in enumerate(self.faults):
            if fault.matches(src, dst, step) and (fault.count is None or self.hits[i] < fault.count):
                self.hits[i] += 1
                out.append(fault)
        return out

    def due_on_rank(self, rank: int, step: int) -> list[Fault]:
        """DDP: the faults that hit what ``rank`` receives from one all-reduce (the SRC of a
        fault only names the link it is attributed to)."""
        out = []
        for i, fault in enumerate(self.faults):
            hit = (fault.dst is None or fault.dst == rank) and step >= fault.step
            if hit and (fault.count is None or self.hits[i] < fault.count):
                self.hits[i] += 1
                out.append(fault)
        return out


def corrupt(tensor: Any, fault: Fault) -> Any:
    """Return a corrupted copy of ``tensor`` (floating point or complex, dense or sparse —
    a sparse one's stored values, a complex one's real and imaginary parts as floats;
    others are left as they are)."""
    import torch

    if not (tensor.is_floating_point() or tensor.is_complex()) or tensor.numel() == 0:
        return tensor
    out = tensor.detach().coalesce().clone() if tensor.is_sparse else tensor.detach().clone()
    values = out.values() if out.is_sparse else out  # a sparse tensor's values: a view
    flat = (torch.view_as_real(values) if values.is_complex() else values).view(-1)
    if flat.numel() == 0:
        return out
    if fault.kind == "nan":
        flat[0] = math.nan
    elif fault.kind == "inf":
        flat[0] = math.inf
    elif fault.kind == "zero":
        flat.zero_()
    elif fault.kind == "scale":
        flat.mul_(fault.factor)
    elif fault.kind == "bitflip":
        size = flat.element_size()
        ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
        bits = flat[:1].view(ints)
        bits ^= 1 << _EXPONENT_BIT[size]
    return out


def for_devices(
    specs: list[str] | tuple[str, ...], devices: tuple[int, ...], to_ranks: bool
) -> tuple[str, ...]:
    """The --inject specs that concern a run on ``devices`` (numbered as the machine). For
    rank-based runs (ddp, collectives) device numbers become ranks: rank i = devices[i]."""
    out = []
    for fault in (parse_fault(s) for s in specs):
        if (fault.dst is not None and fault.dst not in devices) or (
            fault.src is not None and fault.src not in devices
        ):
            continue
        if to_ranks:
            fault = Fault(
                None if fault.src is None else devices.index(fault.src),
                None if fault.dst is None else devices.index(fault.dst),
                fault.kind,
                fault.step,
                fault.count,
                fault.factor,
            )
        out.append(fault.text)
    return tuple(out)
