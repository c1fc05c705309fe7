"""From recorded phases to figures: step times, percentiles, samples/s and the phase
breakdown of one measured case. Pure functions over :class:`Phase` events (no runs).

Per step, the phases the runtime times (``gpudiag.runtime.timing``) are folded into:

- ``data`` (``--data loader``): the wait for the next batch from the DataLoader;
- ``copy``: the batch to the device (synthetic data sits there already: ~0);
- ``scatter``, ``replicate``, ``gather`` (``dp``): DataParallel's own work;
- ``forward``: the model's forward and the loss (for ``dp`` without scatter, replicate
  and gather, which happen inside DataParallel's forward);
- ``backward``: autograd's backward (for ``ddp`` without the exposed all-reduce;
  for ``dp`` it includes the replicas' gradients travelling back to the first device);
- ``allreduce`` (``ddp``): the exposed part of the gradient all-reduce — from the last
  bucket becoming ready (gradient computation over) to the last all-reduce finishing;
  the part hidden under backward is reported apart (``allreduce_hidden``: the overlap of
  the buckets' all-reduce intervals with backward, so never more than backward), not in
  the step;
- ``optimizer``: the optimizer step (and GradScaler update);
- ``other``: the rest of the step (zeroing gradients, fp16's unscale and overflow check,
  the loss read back).

A ``ddp`` case's step is, step by step, the slowest rank's — its time and its phases,
so the phases add up to the step; each rank's own figures are :func:`rank_figures`.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

#: The phases of a step in the order shown; their means add up to the mean step time.
PHASES = (
    "data",
    "copy",
    "scatter",
    "replicate",
    "forward",
    "gather",
    "backward",
    "allreduce",
    "optimizer",
    "other",
)
DP_PHASES = ("scatter", "replicate", "gather")


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0–100) by linear interpolation (numpy's default)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


@dataclass
class StepTimes:
    """What the timed steps of one case took: ``steps`` (seconds each), ``phases`` (mean
    seconds per step, :data:`PHASES`), ``allreduce_hidden`` (mean seconds per step of
    all-reduce overlapped with backward; ddp)."""

    steps: list[float]
    phases: dict[str, float]
    allreduce_hidden: float | None = None


def union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The disjoint, sorted intervals covering ``intervals`` (seconds; empty ones dropped)."""
    out: list[tuple[float, float]] = []
    for start, end in sorted((s, e) for s, e in intervals if e > s):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def overlap(a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]]) -> float:
    """Seconds covered by both ``a`` and ``b`` (each a list of intervals)."""
    ua, ub = union(a), union(b)
    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in ua for s2, e2 in ub)


def split_allreduce(
    comm: Sequence[tuple[float, float]], backward: Sequence[tuple[float, float]]
) -> tuple[float, float]:
    """One DDP step's all-reduce, in seconds: (exposed, hidden). ``comm``: each bucket's
    (ready, done); ``backward``: the backward phase's interval(s). Buckets run
    concurrently, so their time is that of the union of their intervals, never their sum.
    Exposed: the union's part after the last bucket became ready (the gradients are
    computed, the step waits); hidden: its part inside backward before that — the overlap of
    intervals, so it cannot exceed the backward it hides under."""
    last_ready = max(s for s, _ in comm)
    covered = union(comm)
    exposed = overlap(covered, [(last_ready, math.inf)])
    hidden = overlap(covered, [(s, min(e, last_ready)) for s, e in backward])
    return exposed, hidden


def _fold(strategy: str, events: Iterable[Any]) -> tuple[list[float], list[dict[str, float]], list[float]]:
    """One process's timed events → per step: its time, its phases, hidden all-reduce."""
    per_step: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    spans: dict[int, list[tuple[float, float]]] = defaultdict(list)
    backward: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for p in events:
        if strategy == "dp" and p.device is not None:
            continue  # a replica's own forward: inside the step-level forward
        if p.name == "allreduce":
            spans[p.step].append((p.start, p.end))
        else:
            per_step[p.step][p.name] += p.end - p.start
            if p.name == "backward":
                backward[p.step].append((p.start, p.end))
    times, phases, hidden = [], [], []
    for step in sorted(per_step):
        got = per_step[step]
        if "step" not in got:
            continue
        total = got.pop("step")
        row = {name: got.get(name, 0.0) for name in PHASES if name not in ("allreduce", "other")}
        if strategy == "dp":
            row["forward"] = max(0.0, row["forward"] - sum(row[n] for n in DP_PHASES))
        comm = spans.get(step, [])
        exposed = 0.0
        if comm:
            exposed, under = split_allreduce(comm, backward.get(step, []))
            exposed = min(exposed, row["backward"])
            row["backward"] -= exposed
            hidden.append(under)
        row["allreduce"] = exposed
        row["other"] = max(0.0, total - sum(row.values()))
        times.append(total)
        phases.append(row)
    return times, phases, hidden


def step_times(strategy: str, events: Iterable[Any], warmup: int) -> StepTimes:
    """Fold the ``Phase`` events of a run (every rank's for ddp) into :class:`StepTimes`,
    dropping the first ``warmup`` steps."""
    timed = [p for p in events if p.step > warmup]
    groups: dict[Any, list[Any]] = defaultdict(list)
    for p in timed:
        groups[p.device if strategy == "ddp" else None].append(p)
    folded = [_fold(strategy, groups[key]) for key in sorted(groups, key=lambda k: -1 if k is None else k)]
    folded = [f for f in folded if f[0]]
    if not folded:
        return StepTimes([], {})
    count = min(len(f[0]) for f in folded)
    # Each step is its slowest process's (DDP: the rank the others waited for), phases included,
    # so the phases add up to the step.
    slowest = [max(folded, key=lambda f: f[0][i]) for i in range(count)]
    steps = [f[0][i] for i, f in enumerate(slowest)]
    rows = [f[1][i] for i, f in enumerate(slowest)]
    phases = {name: sum(r[name] for r in rows) / len(rows) for name in PHASES}
    hidden = [f[2][i] for i, f in enumerate(slowest) if i < len(f[2])]
    return StepTimes(steps, phases, sum(hidden) / len(hidden) if hidden else None)


def rank_figures(events: Iterable[Any], warmup: int, hosts: Sequence[str] = ()) -> list[dict[str, Any]]:
    """DDP: each rank's own figures over the timed steps — ``rank``, ``host`` (where it
    ran, when known), ``step_p50_s``, ``compute_s`` (mean data + copy + forward + backward +
    optimizer: the rank's own work) and ``allreduce_s`` (mean exposed all-reduce: mostly
    waiting for the slowest rank). Every rank's step ends with the same all-reduce, so the
    step times agree and a slow rank (or node, under torchrun) shows in its compute."""
    by_rank: dict[int, list[Any]] = defaultdict(list)
    for p in events:
        if p.step > warmup and p.device is not None:
            by_rank[p.device].append(p)
    out = []
    own = ("data", "copy", "forward", "backward", "optimizer")
    for rank in sorted(by_rank):
        times, rows, _ = _fold("ddp", by_rank[rank])
        if not times:
            continue
        out.append(
            {
                "rank": rank,
                "host": hosts[rank] if rank < len(hosts) else None,
                "step_p50_s": percentile(times, 50),
                "compute_s": sum(r[n] for r in rows for n in own) / len(rows),
                "allreduce_s": sum(r["allreduce"] for r in rows) / len(rows),
            }
        )
    return out


@dataclass
class Case:
    """One measured configuration: ``strategy`` on ``gpus`` devices at ``dtype``, with
    the global ``batch`` (each device's share: ``per_gpu_batch``, the largest
    ``torch.chunk`` piece). Times in seconds; ``samples_per_s`` over the timed steps."""

    strategy: str
    gpus: int
    dtype: str
    batch: int
    per_gpu_batch: int
    devices: list[int] = field(default_factory=list)
    steps: list[float] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)
    allreduce_hidden: float | None = None
    peak_memory: dict[int, int] | None = None  # bytes per CUDA device; None on virtual devices
    threads: list[int] = field(default_factory=list)  # torch threads of each computing process
    links: list[str] = field(default_factory=list)  # link classes between the devices used
    speedup: float | None = None  # samples/s against single at the same dtype
    #: ``--devices`` chose GPUs worse connected than others: the best group and its worst link
    better_devices: list[int] | None = None
    better_link: str | None = None
    #: ddp: each rank's figures (:func:`rank_figures`)
    ranks: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None

    @property
    def label(self) -> str:
        return f"{self.strategy} ×{self.gpus} {self.dtype}"

    @property
    def p50(self) -> float:
        return percentile(self.steps, 50)

    @property
    def p95(self) -> float:
        return percentile(self.steps, 95)

    @property
    def spread(self) -> float:
        """Run-to-run spread of the step time: p95 − p50 (seconds)."""
        return self.p95 - self.p50

    @property
    def samples_per_s(self) -> float:
        total = sum(self.steps)
        return self.batch * len(self.steps) / total if total > 0 else math.nan

    @property
    def samples_per_s_per_gpu(self) -> float:
        return self.samples_per_s / self.gpus

    @property
    def efficiency(self) -> float | None:
        """Scaling efficiency: speedup / GPUs (1.0 = linear)."""
        return None if self.speedup is None else self.speedup / self.gpus

    @property
    def step_time(self) -> float:
        """Mean step time (what the phases add up to)."""
        return sum(self.steps) / len(self.steps) if self.steps else math.nan

    def epoch_time(self, samples: int) -> float:
        """Seconds for an epoch of ``samples`` samples at this case's samples/s (the seeds'
        "time per epoch"; CIFAR-10's training set is 50,000 samples)."""
        rate = self.samples_per_s
        return samples / rate if rate > 0 else math.nan

    def share(self, *names: str) -> float:
        """The phases' share of the mean step time (0–1)."""
        total = self.step_time
        return sum(self.phases.get(n, 0.0) for n in names) / total if total > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        ok = self.error is None and bool(self.steps)
        return {
            "strategy": self.strategy,
            "gpus": self.gpus,
            "dtype": self.dtype,
            "batch": self.batch,
            "per_gpu_batch": self.per_gpu_batch,
            "devices": self.devices,
            "timed_steps": len(self.steps),
            "step_s": {"p50": self.p50, "p95": self.p95, "mean": self.step_time} if ok else None,
            "samples_per_s": self.samples_per_s if ok else None,
            "samples_per_s_per_gpu": self.samples_per_s_per_gpu if ok else None,
            "speedup": self.speedup,
            "efficiency": self.efficiency,
            "phases_s": self.phases,
            "allreduce_hidden_s": self.allreduce_hidden,
            "peak_memory_bytes": None
            if self.peak_memory is None
            else {str(k): v for k, v in self.peak_memory.items()},
            "threads": self.threads,
            "links": self.links,
            "better_devices": self.better_devices,
            "better_link": self.better_link,
            "ranks": self.ranks,
            "steps_s": self.steps,
            "error": self.error,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Case:
        """A case as :meth:`to_json` wrote it; ``ValueError`` for figures no measurement
        gives (a step time that is not a positive finite number, a phase, hidden all-reduce
        or speedup that is negative or not finite), so a damaged file is never compared."""
        case = cls._from_json(data)
        bad = [s for s in case.steps if not (math.isfinite(s) and s > 0)]
        if bad:
            raise ValueError(f"{case.label}: a step time of {bad[0]!r} s (each must be above zero)")
        if case.gpus < 1 or case.batch < 1:
            raise ValueError(f"{case.label}: {case.gpus} GPUs, batch {case.batch}")
        figures: dict[str, Any] = {f"phase {k}": v for k, v in case.phases.items()}
        figures["allreduce_hidden_s"] = case.allreduce_hidden
        figures["speedup"] = case.speedup
        for name, value in figures.items():
            number = isinstance(value, (int, float)) and math.isfinite(value)
            if value is not None and not (number and value >= 0):
                raise ValueError(f"{case.label}: {name} is {value!r}")
        return case

    @classmethod
    def _from_json(cls, data: dict[str, Any]) -> Case:
        memory = data.get("peak_memory_bytes")
        return cls(
            strategy=str(data["strategy"]),
            gpus=int(data["gpus"]),
            dtype=str(data["dtype"]),
            batch=int(data["batch"]),
            per_gpu_batch=int(data["per_gpu_batch"]),
            devices=[int(d) for d in data.get("devices", [])],
            steps=[float(s) for s in data.get("steps_s", [])],
            phases={str(k): float(v) for k, v in (data.get("phases_s") or {}).items()},
            allreduce_hidden=data.get("allreduce_hidden_s"),
            peak_memory=None if memory is None else {int(k): int(v) for k, v in memory.items()},
            threads=[int(t) for t in data.get("threads", [])],
            links=[str(link) for link in data.get("links", [])],
            better_devices=None
            if data.get("better_devices") is None
            else [int(d) for d in data["better_devices"]],
            better_link=data.get("better_link"),
            ranks=[dict(r) for r in data.get("ranks") or []],
            speedup=data.get("speedup"),
            error=data.get("error"),
        )
