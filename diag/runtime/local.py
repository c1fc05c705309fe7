"""``single`` and ``dp`` runs, in this process: the model built on the first device,
DataParallel's scatter/replicate/apply/gather over the watched transport for ``dp``,
:class:`~gpudiag.runtime.stepping.Stepper` for each step."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from gpudiag.findings import Finding
from gpudiag.runtime.batch import call_model, micro_batches, to_device
from gpudiag.runtime.config import ModelFn, RunConfig, RunResult, sync_batchnorm_note
from gpudiag.runtime.dp import dp_forward
from gpudiag.runtime.faults import FaultPlan
from gpudiag.runtime.feed import Feed
from gpudiag.runtime.numerics import Numerics, nondeterministic_alerts
from gpudiag.runtime.record import Recorder, StepRecord
from gpudiag.runtime.stepping import Stepper, _cpu, build_model, output_selector
from gpudiag.runtime.timing import NO_TIMER, PhaseTimer, Timer, peak_memory, reset_peak_memory
from gpudiag.runtime.transport import Transport


def run_local(model_fn: ModelFn, inputs: Any, targets: torch.Tensor, config: RunConfig) -> RunResult:
    devices = config.devices
    recorder = Recorder(enabled=config.watch)
    transport = Transport(devices, recorder, FaultPlan.parse(config.faults))
    model = build_model(model_fn, config.seed).to(devices.torch_device(devices.ids[0]))
    notes: list[Finding] = []
    if config.sync_batchnorm and config.strategy == "dp":
        notes.append(sync_batchnorm_note(config.strategy))

    select = output_selector(config)

    def forward(x: Any) -> Any:
        if config.strategy == "single":
            return call_model(model, x)
        args, kwargs = ((), x) if isinstance(x, dict) else (x if isinstance(x, tuple) else (x,), {})
        # DataParallel picks each replica's loss tensor before gathering (only it travels).
        return dp_forward(model, args, kwargs, transport, select)

    stepper = Stepper(model, config, forward, selects=config.strategy == "dp")
    initial = _cpu(dict(model.named_parameters())) if config.steps > 1 else {}
    losses = []
    first = devices.torch_device(devices.ids[0])
    used = devices.ids[:1] if config.strategy == "single" else devices.ids
    timer: Timer = NO_TIMER
    if config.time_phases:  # bench: the batch on its device once (synthetic data)
        timer = transport.timer = stepper.timer = PhaseTimer(recorder, first)
        if config.loader is None:
            inputs, targets = to_device(inputs, first), targets.to(first)
        reset_peak_memory(devices, used)
    feed = Feed(config.loader) if config.loader is not None else None
    with nondeterministic_alerts() as alerts, feed or contextlib.nullcontext():
        for step in range(1, config.steps + 1):
            transport.step = step
            start = recorder.now()
            timer.begin(step)
            if feed is not None:
                with timer.phase("data"):
                    inputs, targets = feed.next()
            with timer.phase("copy"):
                micro = micro_batches(inputs, targets, config.accumulate, first)
            loss = stepper.step(step, micro)
            timer.end()
            losses.append(loss)
            if recorder.enabled:
                recorder.steps.append(StepRecord(step, loss, start, recorder.now()))
    timing = (
        {"peak_memory": peak_memory(devices, used), "threads": [torch.get_num_threads()]}
        if config.time_phases
        else {}
    )
    return RunResult(
        strategy=config.strategy,
        losses=losses,
        grads=stepper.first_grads,
        params=_cpu(dict(model.named_parameters())) if config.keep_state else {},
        buffers=_cpu(dict(model.named_buffers())) if config.keep_state else {},
        recorder=recorder,
        notes=notes,
        initial_params=initial,
        numerics=[Numerics.observe()],
        nondeterministic=alerts,
        timing=timing,
    )
