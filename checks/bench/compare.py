"""``gpudiag bench --compare before.json after.json``: each figure's change, and whether
it exceeds the run-to-run spread (p95 − p50 of the step time) of either run.

A time figure (step time, a phase) changed beyond noise when its change is larger than
the larger of the two runs' spreads; samples/s when the mean step it comes from changed by
more than that (its noise is shown relative to the mean step before). Cases are matched by
strategy, GPUs, dtype and global batch. What makes two runs incomparable — another model,
input, data, device kind, machine or batch convention; one simulated, one not — is listed
first (``differences``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from gpudiag.errors import InputError
from gpudiag.fileio import read_bounded

from .figures import PHASES, Case
from .report import BenchResult

SCHEMA = "gpudiag.bench-compare/1"


@dataclass
class Change:
    figure: str  # step_p50_s, step_p95_s, samples_per_s, phase:<name>
    before: float
    after: float
    noise: float  # the larger spread, in the figure's unit (samples/s: relative)
    beyond_noise: bool

    @property
    def delta(self) -> float:
        return self.after - self.before

    @property
    def relative(self) -> float | None:
        return self.delta / self.before if self.before else None

    def to_json(self) -> dict[str, Any]:
        return {
            "figure": self.figure,
            "before": self.before,
            "after": self.after,
            "delta": self.delta,
            "relative": self.relative,
            "noise": self.noise,
            "beyond_noise": self.beyond_noise,
        }


@dataclass
class CaseChange:
    label: str
    batch: int
    changes: list[Change]


@dataclass
class BenchComparison:
    before: str
    after: str
    cases: list[CaseChange]
    only_before: list[str] = field(default_factory=list)
    only_after: list[str] = field(default_factory=list)
    simulated: bool = False
    #: how the two runs were set up differently (each "what: before → after")
    differences: list[str] = field(default_factory=list)
    #: cases measured before that failed after, and the other way round ("label: error")
    failed: list[str] = field(default_factory=list)

    def __repr__(self) -> str:
        beyond = sum(ch.beyond_noise for c in self.cases for ch in c.changes)
        return f"<BenchComparison cases {len(self.cases)} · beyond noise {beyond}>"

    def exit_code(self) -> int:
        return 0

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "before": self.before,
            "after": self.after,
            "simulated": self.simulated,
            "cases": [
                {"case": c.label, "batch": c.batch, "changes": [ch.to_json() for ch in c.changes]}
                for c in self.cases
            ],
            "only_before": self.only_before,
            "only_after": self.only_after,
            "differences": self.differences,
            "failed": self.failed,
        }


def _key(case: Case) -> tuple[str, int, str, int]:
    return (case.strategy, case.gpus, case.dtype, case.batch)


def compare_cases(a: Case, b: Case) -> list[Change]:
    """The changes from ``a`` (before) to ``b`` (after)."""
    noise = max(a.spread, b.spread)
    changes = [
        Change("step_p50_s", a.p50, b.p50, noise, abs(b.p50 - a.p50) > noise),
        Change("step_p95_s", a.p95, b.p95, noise, abs(b.p95 - a.p95) > noise),
    ]
    rel_noise = noise / a.step_time if a.step_time else 0.0
    changes.append(
        Change(
            "samples_per_s",
            a.samples_per_s,
            b.samples_per_s,
            rel_noise,
            abs(b.step_time - a.step_time) > noise,
        )
    )
    for name in PHASES:
        x, y = a.phases.get(name, 0.0), b.phases.get(name, 0.0)
        if x or y:
            changes.append(Change(f"phase:{name}", x, y, noise, abs(y - x) > noise))
    return changes


def compare(
    before: BenchResult, after: BenchResult, names: tuple[str, str] = ("before", "after")
) -> BenchComparison:
    a = {_key(c): c for c in before.cases if c.error is None and c.steps}
    b = {_key(c): c for c in after.cases if c.error is None and c.steps}
    failed = [
        f"{c.label}, batch {c.batch} {when}: {c.error}"
        for when, result, other in (("before", before, b), ("after", after, a))
        for c in result.cases
        if c.error is not None and _key(c) in other
    ]
    broken = {_key(c) for c in [*before.cases, *after.cases] if c.error is not None}
    common = [k for k in a if k in b]
    return BenchComparison(
        names[0],
        names[1],
        [CaseChange(a[k].label, a[k].batch, compare_cases(a[k], b[k])) for k in common],
        only_before=[f"{a[k].label}, batch {a[k].batch}" for k in a if k not in b and k not in broken],
        only_after=[f"{b[k].label}, batch {b[k].batch}" for k in b if k not in a and k not in broken],
        simulated=before.simulated or after.simulated,
        differences=_differences(before, after),
        failed=failed,
    )


#: Settings that make two runs measure different things.
_SETTINGS = ("model", "input_shape", "data", "devices", "machine", "convention", "steps", "warmup")


def _differences(before: BenchResult, after: BenchResult) -> list[str]:
    out = [
        f"{key}: {before.config.get(key)!r} → {after.config.get(key)!r}"
        for key in _SETTINGS
        if before.config.get(key) != after.config.get(key)
    ]
    if before.simulated != after.simulated:
        state = {True: "simulated (CPU virtual devices)", False: "measured on GPUs"}
        out.append(f"before {state[before.simulated]}, after {state[after.simulated]}")
    return out


#: The most ``read_result`` reads (bytes): a bench result is a few KiB.
MAX_BYTES = 64 * 1024 * 1024


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number a bench result holds")


def read_result(path: str) -> BenchResult:
    """A ``gpudiag bench -o`` file: a regular file (a FIFO or device is refused, never
    waited on), read up to :data:`MAX_BYTES`; JSON without NaN/Infinity, not nested
    beyond the parser's depth; figures that are finite (step times above zero). Bad input
    is :class:`InputError` (exit 2)."""
    raw = read_bounded(path, "bench result", MAX_BYTES)  # (a FIFO refused, never waited on)
    try:
        data = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise InputError(f"{path}: not a bench result (JSON nested too deep)") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: not JSON ({exc})") from None
    return BenchResult.from_json(data, path)


def compare_files(before: str, after: str) -> BenchComparison:
    return compare(read_result(before), read_result(after), (before, after))
