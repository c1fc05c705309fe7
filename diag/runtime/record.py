"""What a run recorded: steps, phases, transfers and DDP buckets as events.

Events serialise to JSON Lines (one object per line, ``type`` first) and to the Chrome
trace format (``{"traceEvents": [...]}``, opens in Perfetto / chrome://tracing). Times are
seconds from the start of the run (``time.perf_counter``); the trace uses microseconds.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Transfer:
    """One tensor crossing devices in ``dp``: ``bytes`` moved, a ``checksum`` of what
    arrived (:func:`gpudiag.runtime.stats.checksum`) and ``sent_checksum`` of what was sent,
    ``nonfinite`` (NaN/Inf count of what arrived), ``faults`` injected. ``corrupted``: the
    two checksums differ — a copy is exact, so any difference is data changed on the way."""

    step: int
    phase: str  # scatter | replicate | gather | gather-grad | reduce
    src: int
    dst: int
    link: str | None
    bytes: int
    checksum: float
    nonfinite: int
    start: float
    end: float
    name: str = ""
    faults: list[str] = field(default_factory=list)
    sent_checksum: float | None = None  # the same checksum at the source, before the copy

    @property
    def corrupted(self) -> bool:
        """What arrived differs from what was sent (NaN-aware)."""
        if self.sent_checksum is None:
            return False
        return not (
            self.checksum == self.sent_checksum
            or (self.checksum != self.checksum and self.sent_checksum != self.sent_checksum)
        )


@dataclass
class Bucket:
    """One DDP gradient bucket on one rank: norm and NaN/Inf count before and after the
    all-reduce (after = what this rank received, i.e. the averaged gradient)."""

    step: int
    rank: int
    index: int
    numel: int
    norm_before: float
    nonfinite_before: int
    norm_after: float
    nonfinite_after: int
    faults: list[str] = field(default_factory=list)
    time: float = 0.0  # when the hook ran, seconds from the run's start


@dataclass
class Phase:
    """A timed phase of a step on one device or rank (``device`` None = the whole step)."""

    step: int
    name: str
    start: float
    end: float
    device: int | None = None


@dataclass
class StepRecord:
    """One optimizer step: the loss seen by the reference device or rank 0."""

    step: int
    loss: float
    start: float
    end: float
    rank: int | None = None


@dataclass
class Recorder:
    """Collects events when ``enabled``; a disabled recorder keeps nothing — except the
    phases a bench run times (``RunConfig.time_phases``, :mod:`gpudiag.runtime.timing`),
    which it keeps without the transfers and buckets that watching would cost."""

    enabled: bool = True
    origin: float = field(default_factory=time.perf_counter)
    transfers: list[Transfer] = field(default_factory=list)
    buckets: list[Bucket] = field(default_factory=list)
    phases: list[Phase] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)

    def now(self) -> float:
        return time.perf_counter() - self.origin

    def events(self) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        out += [("step", e) for e in self.steps]
        out += [("phase", e) for e in self.phases]
        out += [("transfer", e) for e in self.transfers]
        out += [("bucket", e) for e in self.buckets]
        return out

    def to_jsonl(self) -> str:
        lines = [json.dumps({"type": kind, **asdict(event)}) for kind, event in self.events()]
        return "\n".join(lines) + ("\n" if lines else "")

    def write(self, path: str, *, force: bool = False) -> None:
        """``--trace FILE`` for one run (see :func:`write_trace`)."""
        write_trace(path, {"run": self}, force=force)

    def to_chrome_trace(self, pid: int = 0) -> dict[str, Any]:
        """Chrome trace events: phases and steps as complete events ("X"), one track per
        device/rank; transfers as complete events on the destination's track; buckets as
        instant events on their rank's track."""
        events: list[dict[str, Any]] = []

        def complete(name: str, cat: str, start: float, end: float, tid: int, args: dict[str, Any]) -> None:
            events.append(
                {
                    "name": name,
                    "cat": cat,
                    "ph": "X",
                    "ts": round(start * 1e6, 3),
                    "dur": round(max(end - start, 0.0) * 1e6, 3),
                    "pid": pid,
                    "tid": tid,
                    "args": args,
                }
            )

        for s in self.steps:
            complete(
                f"step {s.step}", "step", s.start, s.end, -1 if s.rank is None else s.rank, {"loss": s.loss}
            )
        for p in self.phases:
            complete(p.name, "phase", p.start, p.end, -1 if p.device is None else p.device, {"step": p.step})
        for t in self.transfers:
            args = {k: v for k, v in asdict(t).items() if k not in ("start", "end")}
            complete(f"{t.phase} {t.src}->{t.dst}", "transfer", t.start, t.end, t.dst, args)
        for b in self.buckets:
            events.append(
                {
                    "name": f"bucket {b.index}",
                    "cat": "bucket",
                    "ph": "i",
                    "s": "t",
                    "pid": 0,
                    "tid": b.rank,
                    "ts": round(b.time * 1e6, 3),
                    "args": asdict(b),
                }
            )
        return {"traceEvents": events, "displayTimeUnit": "ms"}


def chrome_trace(recorders: dict[str, Recorder]) -> dict[str, Any]:
    """One Chrome trace for several runs: a process per run, named after it."""
    events: list[dict[str, Any]] = []
    for pid, (name, recorder) in enumerate(recorders.items()):
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}})
        events += recorder.to_chrome_trace(pid)["traceEvents"]
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(path: str, recorders: dict[str, Recorder], *, force: bool = False) -> None:
    """``--trace FILE``: JSON Lines when the name ends in ``.jsonl`` (each line names its
    run), else the Chrome trace format (open it in https://ui.perfetto.dev). Atomic."""
    from gpudiag.fileio import atomic_write

    if path.endswith(".jsonl"):
        lines = [
            json.dumps({"run": name, "type": kind, **asdict(event)})
            for name, recorder in recorders.items()
            for kind, event in recorder.events()
        ]
        text = "\n".join(lines) + ("\n" if lines else "")
    else:
        text = json.dumps(chrome_trace(recorders))
    atomic_write(path, text, force=force)
