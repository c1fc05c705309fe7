"""Phase times of each step, for ``gpudiag bench`` (``RunConfig.time_phases``).

A :class:`PhaseTimer` marks the start and end of each phase of a step — ``copy`` (the
batch to the device), ``forward``, ``backward``, ``optimizer``; for ``dp`` also
``scatter``, ``replicate``, ``gather`` and each replica's ``forward``; for ``ddp`` each
bucket's ``allreduce`` — and at the end of the step turns them into
:class:`~gpudiag.runtime.record.Phase` events, with a ``step`` phase around them all.

Device time: on CUDA a mark is a ``torch.cuda.Event(enable_timing=True)`` recorded on
the current stream of the timer's device, and the end of the step is the one
synchronisation (``Event.synchronize``) after which every phase's time is read with
``elapsed_time`` (what ``torch.cuda.Event`` timing loops do); on the CPU a mark is
``time.perf_counter()``. Times are seconds from the recorder's origin.

Without ``time_phases`` the runtime's steps hold :data:`NO_TIMER`, whose marks are
``None`` and whose phases record nothing: the same code path, a few no-op calls per step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from gpudiag.runtime.record import Phase, Recorder


class PhaseTimer:
    """Marks phases of one step on ``device`` (a torch device); ``rank`` (DDP) is the
    ``device`` field of the step-level phases it records (None in-process)."""

    def __init__(self, recorder: Recorder, device: Any, rank: int | None = None):
        self.recorder = recorder
        self.rank = rank
        self.cuda = getattr(device, "type", "cpu") == "cuda"
        self.device = device
        self.stream = torch.cuda.current_stream(device) if self.cuda else None
        self.step = 0
        self._marks: list[tuple[str, int | None, Any, Any]] = []
        self._host_start = 0.0
        self._start: Any = None

    def mark(self, current: bool = False) -> Any:
        """Now: a CUDA event recorded on the timer's stream — with ``current``, on the stream
        current in this thread (a DDP comm hook's ``then`` callback runs on one that waits
        for NCCL's work) — or ``perf_counter()`` on the CPU."""
        if self.stream is not None:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device) if current else self.stream)
            return event
        return time.perf_counter()

    def add(self, name: str, start: Any, device: int | None = None, stop: Any = None) -> None:
        """A phase from ``start`` (a :meth:`mark`) until ``stop`` (a mark; now if None)."""
        stop = self.mark() if stop is None else stop
        self._marks.append((name, self.rank if device is None else device, start, stop))

    @contextmanager
    def phase(self, name: str, device: int | None = None) -> Iterator[None]:
        start = self.mark()
        try:
            yield
        finally:
            self.add(name, start, device)

    def begin(self, step: int) -> None:
        self.step = step
        self._marks = []
        self._host_start = time.perf_counter()
        self._start = self.mark()

    def end(self, spans: list[tuple[str, float, float]] | None = None) -> None:
        """Close the step: one synchronisation on CUDA, then every mark becomes a
        :class:`Phase`. ``spans``: host-clock ``(name, start, end)`` phases (perf_counter
        seconds) measured elsewhere, e.g. DDP's all-reduce per bucket."""
        end = self.mark()
        origin = self.recorder.origin
        if self.stream is not None:
            end.synchronize()  # the step's one synchronisation
            for _, _, _, stop in self._marks:  # (marks on other streams: done by now, as a rule)
                stop.synchronize()
            base = self._host_start - origin
            first = self._start

            def at(mark: Any) -> float:
                return base + first.elapsed_time(mark) / 1e3
        else:

            def at(mark: Any) -> float:
                return float(mark) - origin

        phases = self.recorder.phases
        phases.append(Phase(self.step, "step", at(self._start), at(end), self.rank))
        for name, device, start, stop in self._marks:
            phases.append(Phase(self.step, name, at(start), at(stop), device))
        for name, start, stop in spans or ():
            phases.append(Phase(self.step, name, start - origin, stop - origin, self.rank))
        self._marks = []


class NullTimer:
    """A :class:`PhaseTimer` that times nothing (``time_phases`` off)."""

    def mark(self) -> None:
        return None

    def add(self, name: str, start: Any, device: int | None = None) -> None:
        pass

    @contextmanager
    def phase(self, name: str, device: int | None = None) -> Iterator[None]:
        yield

    def begin(self, step: int) -> None:
        pass

    def end(self, spans: list[tuple[str, float, float]] | None = None) -> None:
        pass


#: The timer of a run that is not timed.
NO_TIMER = NullTimer()
Timer = PhaseTimer | NullTimer


@dataclass
class CommTimes:
    """State of :func:`gpudiag.runtime.ddp.timed_hook`: when each bucket's all-reduce was
    started (the bucket was ready) and finished, host clock (``perf_counter``) on gloo.
    With ``timer`` (CUDA) the two are CUDA events in the timer's phases instead: the host
    learns of an NCCL all-reduce when it is queued, not when it is done (``fut.done()``
    only means enqueued for GPU work; torch's ``Work.get_future`` documentation)."""

    world_size: int
    spans: list[list[float]] = field(default_factory=list)
    timer: PhaseTimer | None = None

    def take(self) -> list[tuple[str, float, float]]:
        spans, self.spans = self.spans, []
        return [("allreduce", s, e) for s, e in spans if not math.isnan(e)]


def peak_memory(devices: Any, ids: tuple[int, ...]) -> dict[int, int]:
    """Peak bytes allocated by torch on each CUDA device of ``ids`` since the last reset
    (``torch.cuda.max_memory_allocated``; ``nvidia-smi`` shows more: the caching
    allocator's reserve and the context). Empty on virtual devices."""
    if devices.kind != "cuda":
        return {}
    return {i: int(torch.cuda.max_memory_allocated(devices.torch_device(i))) for i in ids}


def reset_peak_memory(devices: Any, ids: tuple[int, ...]) -> None:
    if devices.kind == "cuda":
        for i in ids:
            torch.cuda.reset_peak_memory_stats(devices.torch_device(i))
