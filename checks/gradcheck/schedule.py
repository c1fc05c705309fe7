"""Running gradcheck's jobs: the only part of gradcheck that calls the runtime.

A job is one run of one factory under one strategy (:class:`Job`). :meth:`Schedule.runs`
runs a batch of them — those the first comparison needs, or those the explanations ask
for to confirm a cause — with every DDP job of the batch in one launch of ranks, and
returns each job's result or its failure by name.

Ranks that are forked start first, and the in-process jobs run meanwhile on one thread,
so the ranks keep the other cores; ranks from fresh interpreters, or on CUDA (they
would share the GPUs with the in-process runs), start after. If a launch fails, its
first DDP job is repeated alone, so the failure is pinned on the right run, and the
others are reported failed with the same reason.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from gpudiag.errors import from_user_code
from gpudiag.progress import note
from gpudiag.runtime import DeviceSet, RankFailure, RunConfig, RunResult, run
from gpudiag.runtime.config import ModelFn
from gpudiag.runtime.ddp import forks, start_ddp


def default_devices(world_size: int) -> DeviceSet:
    """CUDA devices 0…W-1 when there are enough, else W CPU virtual devices."""
    from gpudiag.hw.cuda import cuda_device_count

    if cuda_device_count() >= world_size:
        return DeviceSet.cuda(list(range(world_size)))
    return DeviceSet.virtual(world_size)


@dataclass(frozen=True)
class Job:
    """One run: ``factory`` under ``strategy`` with ``options`` replacing fields of the
    base :class:`RunConfig`; ``inputs``/``targets`` None: the check's batch."""

    name: str
    factory: ModelFn
    strategy: str
    options: tuple[tuple[str, Any], ...] = ()
    inputs: Any = None
    targets: torch.Tensor | None = None


@dataclass
class Outcome:
    """The runs of one mode by strategy: results, failures, and the options a retry added."""

    results: dict[str, RunResult] = field(default_factory=dict)
    failures: dict[str, RankFailure] = field(default_factory=dict)
    options: dict[str, dict[str, Any]] = field(default_factory=dict)


class Schedule:
    """Runs jobs on one batch under one base configuration."""

    def __init__(self, inputs: Any, targets: torch.Tensor, base: RunConfig):
        self.inputs, self.targets, self.base = inputs, targets, base

    def config(self, job: Job) -> RunConfig:
        config = replace(self.base, strategy=job.strategy, **dict(job.options))
        if job.strategy == "ddp":
            config = replace(config, track_params=self.base.steps > 1)
        return config

    def runs(
        self, jobs: list[Job], between: Callable[[dict[str, RunResult]], object] | None = None
    ) -> dict[str, RunResult | RankFailure]:
        """Every job's result (or failure) by name. ``between(local results)`` is called
        once the in-process jobs are done, before DDP's results are awaited."""
        out: dict[str, RunResult | RankFailure] = {}
        local = [j for j in jobs if j.strategy != "ddp"]
        ddp = [j for j in jobs if j.strategy == "ddp"]
        shared = [j for j in ddp if j.inputs is None]
        for job in ddp:  # DDP jobs on another batch cannot share the launch
            if job.inputs is not None:
                out[job.name] = self._one(job)
        launch = [(j.factory, self.config(j)) for j in shared]
        failure: RankFailure | None = None
        with contextlib.ExitStack() as stack:
            early = (
                stack.enter_context(start_ddp(launch, self.inputs, self.targets))
                if launch and forks(self.base.devices)
                else None
            )
            with _threads(1 if launch else None):
                for job in local:
                    out[job.name] = self._one(job)
                if between is not None:
                    between({n: r for n, r in out.items() if isinstance(r, RunResult)})
            if launch:
                note(f"gradcheck: {', '.join(j.name for j in shared)} ({len(self.base.devices.ids)} ranks)")
                started = early or stack.enter_context(start_ddp(launch, self.inputs, self.targets))
                try:
                    for job, result in zip(shared, started.results(), strict=True):
                        out[job.name] = result
                except RankFailure as exc:
                    failure = exc
        if failure is not None:  # (the failed ranks are reaped by now)
            first = shared[0]
            out[first.name] = self._one(first) if len(shared) > 1 else failure
            for job in shared[1:]:
                out[job.name] = failure if isinstance(out[first.name], RunResult) else out[first.name]
        return out

    def _one(self, job: Job) -> RunResult | RankFailure:
        note(f"gradcheck: {job.name}")
        try:
            return run(
                job.factory,
                self.inputs if job.inputs is None else job.inputs,
                self.targets if job.targets is None else job.targets,
                self.config(job),
            )
        except RankFailure as failure:
            return failure
        except (Exception, SystemExit) as exc:  # the user's model, in this process (single or dp)
            where = f"the model under {job.strategy}"
            if job.strategy == "dp":
                where += " (DataParallel runs it on sub-batches of the batch)"
            raise from_user_code(exc, where) from exc


def outcomes(results: dict[str, RunResult | RankFailure], modes: list[str]) -> dict[str, Outcome]:
    """Jobs named ``"<mode> <strategy>"`` gathered into one :class:`Outcome` per mode."""
    out = {mode: Outcome() for mode in modes}
    for name, result in results.items():
        mode, _, strategy = name.rpartition(" ")
        if mode not in out:
            continue
        if isinstance(result, RankFailure):
            out[mode].failures[strategy] = result
        else:
            out[mode].results[strategy] = result
    return out


def mode_jobs(mode: str, factory: ModelFn, strategies: list[str], **options: Any) -> list[Job]:
    """single and every strategy of ``mode``, named ``"<mode> <strategy>"``."""
    return [
        Job(f"{mode} {s}", factory, s, tuple(options.items()))
        for s in ["single", *[s for s in strategies if s != "single"]]
    ]


@contextlib.contextmanager
def _threads(count: int | None) -> Iterator[None]:
    """torch's intra-op threads set to ``count`` for the block (None: unchanged)."""
    saved = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        if count is not None:
            torch.set_num_threads(saved)
