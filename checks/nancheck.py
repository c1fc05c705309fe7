"""nancheck: find the GPU pair, the link and the step where training breaks.

Trains the same model, data and seed for N steps on each GPU alone and on each selected
pair (``dp`` or ``ddp``), watching every step through the runtime: non-finite loss,
explosion (loss above :data:`~gpudiag.checks.nancheck_report.EXPLOSION_FACTOR` × its first
value), and — from the runtime's record — the first transfer (``dp``) or all-reduce bucket
(``ddp``) that carried non-finite or corrupted data. Then concludes with one finding:

- ``link-corruption``: only pairs over particular links fail, and their GPUs are healthy
  elsewhere (alone and in other pairs);
- ``device-fault``: every pair containing one GPU fails (or that GPU fails alone);
- ``numeric-divergence``: single-GPU runs diverge too — the model or learning rate;
- ``loss-explosion``: a pair's loss explodes without non-finite values while singles train;
- none: pass.

A pair whose run crashed is evidence of nothing about its link or its GPUs (a crash is
the model, the strategy or gpudiag): it is reported as ``rank-crashed`` and left out of
the findings above. A DDP crash that asks for ``find_unused_parameters`` is retried with
it (``unused-parameters``), so that the pair trains and its link is tested; SyncBatchNorm,
which DDP refuses on CPU virtual devices, cannot run here (exit 3).

On virtual devices (``--machine``) faults come only from ``--inject``; that is how the
detector is tested and demonstrated without GPUs.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch

from gpudiag import defaults as D
from gpudiag.checks.gradcheck.explain import asks_for_unused, unused_retry_finding
from gpudiag.checks.nancheck_report import EXPLOSION_FACTOR, NancheckReport, Outcome
from gpudiag.checks.nancheck_rules import conclude
from gpudiag.checks.options import NANCHECK, NancheckOptions, specs
from gpudiag.errors import CannotRunHere, GpudiagError, InputError, from_user_code, naming_model
from gpudiag.findings import Finding
from gpudiag.hw.cuda import cuda_device_count
from gpudiag.parsers import parse_pairs
from gpudiag.progress import note
from gpudiag.runtime import DeviceSet, RankFailure, RunConfig, RunResult, run
from gpudiag.runtime.config import ModelFn
from gpudiag.runtime.faults import check_fires, for_devices, parse_fault
from gpudiag.topology.model import Topology

#: What torch's DDP raises for SyncBatchNorm on CPU tensors.
SYNCBN_REFUSED = "SyncBatchNorm layers only work with GPU modules"


def _outcome(devices: tuple[int, ...], result: RunResult, strategy: str) -> Outcome:
    losses = result.losses
    first = losses[0] if losses else math.nan
    bad_step = next((i + 1 for i, x in enumerate(losses) if not math.isfinite(x)), None)
    exploded = next(
        (
            i + 1
            for i, x in enumerate(losses)
            if math.isfinite(x)
            and math.isfinite(first)
            and abs(first) > 0
            and x > EXPLOSION_FACTOR * abs(first)
        ),
        None,
    )
    transfer = _first_bad_transfer(result, devices, strategy)
    candidates = [s for s in (bad_step, transfer["step"] if transfer else None) if s is not None]
    if candidates:
        return Outcome(devices, "diverged", min(candidates), losses, transfer, recorder=result.recorder)
    if exploded is not None:
        return Outcome(devices, "exploded", exploded, losses, None, recorder=result.recorder)
    return Outcome(devices, "ok", None, losses, recorder=result.recorder)


def _first_bad_transfer(result: RunResult, devices: tuple[int, ...], strategy: str) -> dict[str, Any] | None:
    rec = result.recorder
    if strategy == "dp":
        bad = next((t for t in rec.transfers if t.nonfinite or t.corrupted), None)
        if bad is None:
            return None
        return {
            "src": bad.src,
            "dst": bad.dst,
            "phase": bad.phase,
            "step": bad.step,
            "link": bad.link,
            "tensor": bad.name,
            "nonfinite": bad.nonfinite,
            "corrupted": bad.corrupted,
        }
    buckets = sorted(rec.buckets, key=lambda b: (b.step, b.index, b.rank))
    bad_b = next((b for b in buckets if b.nonfinite_before or b.nonfinite_after), None)
    if bad_b is None:
        return None
    # One all-reduce spreads a rank's non-finite gradient to every rank: blame the rank
    # where it was non-finite before the all-reduce, if there is one, not where it arrived.
    origin = [b for b in buckets if (b.step, b.index) == (bad_b.step, bad_b.index) and b.nonfinite_before]
    bad_b = origin[0] if origin else bad_b
    dst = devices[bad_b.rank]
    src = devices[1 - bad_b.rank] if len(devices) == 2 else None
    return {
        "src": src,
        "dst": dst,
        "phase": "allreduce",
        "step": bad_b.step,
        "bucket": bad_b.index,
        "before_allreduce": bool(bad_b.nonfinite_before),
    }


def nancheck(
    model_factory: ModelFn,
    inputs: Any,
    targets: torch.Tensor,
    *,
    machine: Topology | None = None,
    pairs: str = "all",
    strategy: str = NANCHECK.strategy,
    steps: int = NANCHECK.steps,
    lr: float = NANCHECK.lr,
    loss: str = NANCHECK.loss,
    seed: int = NANCHECK.seed,
    inject: tuple[str, ...] | list[str] = (),
    timeout: float = NANCHECK.timeout,
    watch: bool = True,
) -> NancheckReport:
    """Train on every GPU alone and on every selected pair; locate where it breaks."""
    strategies = specs(NancheckOptions)["strategy"][1].choices or ()
    if strategy not in strategies:
        raise InputError(f"--strategy must be one of {', '.join(strategies)}, not {strategy!r}")
    for spec in inject:
        parse_fault(spec)  # bad specs fail before anything runs
    if machine is not None:
        gpus = sorted(info.index for info in machine.gpus.values())
        make = lambda ids: DeviceSet.virtual(list(ids), machine)  # noqa: E731
    else:
        count = cuda_device_count()
        if count == 0:
            raise CannotRunHere(
                "no CUDA GPU here; simulate a machine with --machine FILE (make one from a capture: "
                "gpudiag topology --from-file topo.txt --save-machine machine.json)"
            )
        gpus = list(range(count))
        make = lambda ids: DeviceSet.cuda(list(ids))  # noqa: E731
    chosen = parse_pairs(pairs, gpus)
    check_fires(inject, chosen, steps)
    singles_wanted = sorted({g for pair in chosen for g in pair}) if pairs.strip() != "all" else gpus
    base = RunConfig(
        "single",
        make([gpus[0]]),
        steps=steps,
        lr=lr,
        loss=loss,
        seed=seed,
        timeout=timeout,
        keep_state=False,
        watch=watch,
    )
    singles = [
        _outcome((g,), _run(model_factory, inputs, targets, replace(base, devices=make([g]))), "single")
        for g in singles_wanted
    ]
    outcomes = []
    unused: RankFailure | None = None
    notes: dict[str, Finding] = {}  # what the runtime said of a run (syncbn-skipped), once each
    for pair in chosen:
        config = replace(
            base, strategy=strategy, devices=make(pair), faults=for_devices(inject, pair, strategy == "ddp")
        )
        got = _attempt(model_factory, inputs, targets, config)
        if isinstance(got, RankFailure) and unused is None and asks_for_unused(got):
            # DDP asks for find_unused_parameters: give it (to this pair and the rest)
            unused, base = got, replace(base, find_unused_parameters=True)
            got = _attempt(model_factory, inputs, targets, replace(config, find_unused_parameters=True))
        if isinstance(got, RankFailure):
            status = "hung" if got.code == "rank-hung" else "crashed"
            outcomes.append(Outcome(pair, status, None, [], None, str(got), failure=got))
        else:
            notes.update((f.code, f) for f in got.notes if f.code not in notes)
            outcomes.append(_outcome(pair, got, strategy))
    links = {pair: (machine.cell(f"GPU{pair[0]}", f"GPU{pair[1]}") if machine else None) for pair in chosen}
    findings = conclude(singles, outcomes, links, machine, strategy)
    if unused is not None:
        findings.insert(0, unused_retry_finding(strategy, unused))
    findings[:0] = notes.values()
    verdict = "fail" if any(f.severity == "error" for f in findings) else "pass"
    return NancheckReport(
        verdict,
        strategy,
        steps,
        singles,
        outcomes,
        links,
        findings,
        machine,
        config={
            "pairs": pairs,
            "inject": list(inject),
            "lr": lr,
            "loss": loss,
            "seed": seed,
            "devices": "virtual" if machine is not None else "cuda",
        },
    )


def _attempt(model_factory: Any, inputs: Any, targets: Any, config: RunConfig) -> RunResult | RankFailure:
    """:func:`_run`, a failing rank returned rather than raised. DDP refusing SyncBatchNorm
    on CPU virtual devices is not a failure of the pair: it cannot run here (exit 3)."""
    try:
        return _run(model_factory, inputs, targets, config)
    except RankFailure as failure:
        if config.devices.kind == "virtual" and SYNCBN_REFUSED in failure.detail:
            raise CannotRunHere(
                "the model has SyncBatchNorm, which torch's DDP refuses on CPU virtual devices "
                f"({SYNCBN_REFUSED}): nancheck --strategy ddp needs GPUs for it (--strategy dp runs here)"
            ) from failure
        return failure


def _run(model_factory: Any, inputs: Any, targets: Any, config: RunConfig) -> RunResult:
    """One training run; the user's model failing in this process is an error naming the
    run (exit 2; 3 for memory or disk space), a failing rank a :class:`RankFailure`."""
    devices = config.devices.ids[:1] if config.strategy == "single" else config.devices.ids
    note(f"nancheck: {config.strategy} on {'+'.join(f'GPU{d}' for d in devices)}")
    try:
        return run(model_factory, inputs, targets, config)
    except (RankFailure, GpudiagError):
        raise
    except (Exception, SystemExit) as exc:
        where = f"the model under {config.strategy} on device {','.join(map(str, devices))}"
        raise from_user_code(exc, where) from exc


def nancheck_spec(
    model: str = "mlp",
    *,
    input_shape: tuple[int, ...] = D.INPUT_SHAPE,
    num_classes: int = D.NUM_CLASSES,
    batch_size: int = D.BATCH_SIZE,
    machine_file: str | None = None,
    machine: Topology | None = None,
    input_dtype: str = "float",
    input_range: tuple[float, float] | None = None,
    inputs_file: str | None = None,
    **options: Any,
) -> NancheckReport:
    """``gpudiag nancheck``: resolve the model and machine (a machine file or capture, or
    an already loaded ``machine``), make the batch (see :func:`gpudiag.models.random_inputs`)
    or read it from ``inputs_file`` (targets generated, as gradcheck does), sweep."""
    from gpudiag.hw.sources import read_machine_or_capture
    from gpudiag.models import load_inputs, random_batch, random_targets, resolve_model

    if machine_file:
        machine = read_machine_or_capture(machine_file)
    with naming_model(model):
        factory = resolve_model(model, input_shape, num_classes)
        seed = options.get("seed", 0)
        loss = options.get("loss", NANCHECK.loss)
        if inputs_file is None:
            inputs, targets = random_batch(
                factory, batch_size, input_shape, num_classes, loss, seed, None, input_dtype, input_range
            )
        else:
            inputs = load_inputs(inputs_file)
            generator = torch.Generator().manual_seed(seed)
            targets = random_targets(factory, inputs, num_classes, loss, generator, seed, None)
        report = nancheck(factory, inputs, targets, machine=machine, **options)
    report.config.update(
        {"model": model, "input_shape": list(input_shape), "batch_size": batch_size, "machine": machine_file}
    )
    if input_dtype != "float" or input_range is not None:
        report.config.update(input_dtype=input_dtype, input_range=input_range and list(input_range))
    if inputs_file is not None:
        report.config.update(inputs_file=inputs_file, batch_size=len(targets))
    return report
