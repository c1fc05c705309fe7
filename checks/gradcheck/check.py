"""``gradcheck()``: the order of things, from the model to the verdict.

1. Build the model once (:class:`Prebuilt`) and probe what train mode switches on in
   it (:func:`trainmode.probe`: batch statistics, random draws, by module).
2. Run single, dp and ddp (as-is; in auto mode also controlled, when the probe found
   something to control) — one :meth:`Schedule.runs` batch, one DDP launch.
3. Compare every strategy with single; failed runs, non-finite gradients, unused
   parameters, diverged ranks and numeric settings become findings.
4. Explain what differs, each cause only where it can apply and once a measurement
   confirms it: controlled mode (train-mode behaviour), the world-size loss scale, uneven
   shards (mean of per-shard gradients), the reference's own spread (the same seed again:
   non-deterministic kernels; another RNG state: random draws controlled mode cannot
   take away). The confirming runs are asked for in batches and run by the schedule.
5. What is left is ``mismatch-unexplained``, with its numbers and possible causes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from gpudiag.checks.gradcheck import causes, confirm, explain, usage
from gpudiag.checks.gradcheck.compare import TOLERANCE_BASIS, Comparer, tolerance
from gpudiag.checks.gradcheck.factories import Controlled, Prebuilt
from gpudiag.checks.gradcheck.report import Comparison, GradcheckReport, has_errors, verdict
from gpudiag.checks.gradcheck.schedule import (
    Job,
    Outcome,
    Schedule,
    default_devices,
    mode_jobs,
    outcomes,
)
from gpudiag.checks.gradcheck.trainmode import TrainModeSites, probe
from gpudiag.checks.options import GRADCHECK, GradcheckOptions, specs
from gpudiag.errors import InputError, from_user_code
from gpudiag.findings import Finding
from gpudiag.runtime import DeviceSet, RankFailure, RunConfig, RunResult
from gpudiag.runtime.batch import OutputKey, batch_size, split
from gpudiag.runtime.config import ModelFn
from gpudiag.runtime.deadline import contained
from gpudiag.runtime.faults import check_fires
from gpudiag.runtime.numerics import Numerics
from gpudiag.runtime.record import Recorder
from gpudiag.runtime.stepping import output_selector


@dataclass
class _Check:
    """One gradcheck's fixed parts and what it has found so far."""

    schedule: Schedule
    comparer: Comparer
    wanted: list[str]
    world: int
    tol: float
    mode: str
    seed: int
    loss: Any
    sites: TrainModeSites
    factories: dict[str, ModelFn]
    replicas: dict[str, int]
    findings: list[Finding] = field(default_factory=list)
    comparisons: list[Comparison] = field(default_factory=list)
    recorders: dict[str, Recorder] = field(default_factory=dict)
    runs: dict[str, Outcome] = field(default_factory=dict)
    #: options every DDP run takes from the start (find_unused_parameters, from the probe)
    ddp_options: dict[str, Any] = field(default_factory=dict)
    #: CPU virtual devices: no link, no NCCL (a hung rank is never put on them)
    virtual: bool = False

    def mode_runs(self, mode: str, **options: Any) -> Outcome:
        """Every strategy of ``mode`` (run now unless already run with these options)."""
        kept = self.runs.get(mode)
        if kept is not None and not kept.failures and kept.options.get("ddp", {}) == options:
            return kept
        results = self.schedule.runs(mode_jobs(mode, self.factories[mode], self.wanted, **options))
        outcome = outcomes(results, [mode])[mode]
        if options and "ddp" in outcome.results:
            outcome.options["ddp"] = dict(options)
        self.runs[mode] = outcome
        return outcome


def gradcheck(
    model_factory: ModelFn,
    inputs: Any,
    targets: torch.Tensor,
    *,
    strategies: tuple[str, ...] | list[str] = GRADCHECK.strategies,
    world_size: int = GRADCHECK.world_size,
    steps: int = GRADCHECK.steps,
    lr: float = GRADCHECK.lr,
    optimizer: str = GRADCHECK.optimizer,
    dtype: str = GRADCHECK.dtype,
    loss: Any = GRADCHECK.loss,
    output: OutputKey = None,
    mode: str = GRADCHECK.mode,
    seed: int = GRADCHECK.seed,
    inject: tuple[str, ...] | list[str] = (),
    devices: DeviceSet | None = None,
    sync_batchnorm: bool = False,
    timeout: float = GRADCHECK.timeout,
    describe: dict[str, Any] | None = None,
) -> GradcheckReport:
    """Compare ``strategies`` against ``single`` for ``model_factory`` on one batch.

    ``inputs``: a tensor, a tuple of tensors (positional arguments) or a dict of tensors
    (keyword arguments), split along dim 0; ``targets``: a tensor. ``loss``: ``ce``,
    ``ce-sum``, ``mse``, ``mse-sum`` or ``loss(output, target)``. ``output``: the part of
    the model's output the loss takes (an index, a key or attribute; None: automatic,
    see :func:`gpudiag.runtime.batch.select_output`)."""
    for name, value in (("mode", mode), ("dtype", dtype), ("optimizer", optimizer)):
        choices = specs(GradcheckOptions)[name][1].choices or ()
        if value not in choices:
            raise ValueError(f"{name} must be one of {', '.join(choices)}, not {value!r}")
    if devices is None and world_size < 1:
        raise InputError(f"world_size must be at least 1, not {world_size}")
    devices = devices or default_devices(world_size)
    world, tol, batch = len(devices), tolerance(dtype), batch_size(inputs)
    if not isinstance(targets, torch.Tensor) or targets.dim() == 0 or len(targets) != batch:
        raise InputError(f"targets must be a tensor of {batch} rows, one per sample of the inputs")
    moving = [r for s, r in (("dp", devices.ids), ("ddp", tuple(range(world)))) if s in strategies]
    check_fires(inject, moving, steps)
    prebuilt = Prebuilt(model_factory)
    numerics = Numerics.comparison()
    base = RunConfig(
        "single",
        devices,
        steps=steps,
        optimizer=optimizer,
        lr=lr,
        loss=loss,
        dtype=dtype,
        seed=seed,
        faults=tuple(inject),
        sync_batchnorm=sync_batchnorm,
        timeout=timeout,
        keep_state=steps > 1,
        numerics=numerics,
        output=output,
    )
    wanted = [s for s in strategies if s != "single"]
    with numerics.applied():  # here (the template is built under them too); every rank sets them itself
        torch.manual_seed(seed)
        try:
            with contained(timeout, "building the model"):
                template = prebuilt()
        except (Exception, SystemExit) as exc:  # the user's factory failed
            raise from_user_code(exc, "the model factory") from exc
        order = tuple(n for n, p in template.named_parameters() if p.requires_grad)
        with contained(timeout, "the train-mode probe (one forward of the model)"):
            sites = _probe(template, inputs, seed)  # (a copy of its own: probed as it is)
            rank_unused = (
                usage.rank_only(
                    usage.unused_by_shard(
                        template, inputs, targets, world, loss, output_selector(base), seed
                    ),
                    world,
                )
                if "ddp" in wanted and world > 1
                else {}
            )
        del template
        check = _Check(
            Schedule(inputs, targets, base),
            Comparer(world, tol, order),
            wanted,
            world,
            tol,
            mode,
            seed,
            loss,
            sites,
            {"as-is": prebuilt, "controlled": Controlled(prebuilt, seed)},
            {"dp": len(split(inputs, world)), "ddp": world},
        )
        check.virtual = devices.kind == "virtual"
        if rank_unused:  # DDP without the flag would stall on the ranks that use them
            check.ddp_options = {"find_unused_parameters": True}
            check.findings.append(usage.rank_unused_finding(rank_unused, sites))
        first = "controlled" if mode == "controlled" else "as-is"
        outcome = _first_runs(check, first)
        _explain(check, first, outcome, devices.kind == "virtual")
        if world > batch:
            check.findings.append(explain.few_replicas(batch, world))
        if batch % world and "ddp" in wanted and not any(f.code == "uneven-shards" for f in check.findings):
            check.findings.append(explain.uneven_info(batch, world))
    seen = explain.numerics_seen(outcome)
    return GradcheckReport(
        verdict=verdict(check.comparisons, check.findings),
        tolerance={"dtype": dtype, "rel_norm_err": tol, "basis": TOLERANCE_BASIS},
        settings={"numerics": numerics.summary()},
        numerics={name: n.to_json() for name, n in seen.items()},
        train_mode={
            "batch_statistics": [s.to_json() for s in sites.batch_statistics],
            "random": [s.to_json() for s in sites.random],
        },
        comparisons=check.comparisons,
        findings=check.findings,
        config={
            **(describe or {}),
            "strategies": ["single", *wanted],
            "world_size": world,
            "devices": {"kind": devices.kind, "ids": list(devices.ids)},
            "batch_size": batch,
            "steps": steps,
            "optimizer": optimizer,
            "lr": lr,
            "dtype": dtype,
            "loss": loss if isinstance(loss, str) else getattr(loss, "__name__", "custom"),
            "output": output,
            "mode": mode,
            "seed": seed,
            "inject": list(inject),
            "ddp_shards": "contiguous torch.chunk pieces of the global batch: rank r gets chunk r",
            "unwrapped": prebuilt.unwrapped,
        },
        recorders=check.recorders,
    )


def _probe(template: torch.nn.Module, inputs: Any, seed: int) -> TrainModeSites:
    """The probe of ``template``, a copy :class:`Prebuilt` handed out for it alone."""
    try:
        return probe(template, inputs, seed=seed, given=True)
    except (Exception, SystemExit) as exc:  # the user's model failed on the user's batch
        raise from_user_code(exc, "the model's forward on the batch") from exc


def _first_runs(check: _Check, first: str) -> Outcome:
    """Step 2 and 3: the first runs, their failures and the plain findings."""
    modes = [first]
    if check.mode == "auto" and check.sites and check.wanted:
        # Train-mode behaviour: the as-is runs will almost surely differ and need the
        # controlled ones, so they run together (one DDP launch).
        modes.append("controlled")
    jobs = [job for m in modes for job in mode_jobs(m, check.factories[m], check.wanted, **check.ddp_options)]

    def compare_local(local: dict[str, RunResult]) -> None:  # while the DDP ranks work
        for name, ran in outcomes(dict(local), modes).items():
            check.comparer.all(ran, name)

    check.runs = outcomes(check.schedule.runs(jobs, between=compare_local), modes)
    for ran in check.runs.values():
        if check.ddp_options and "ddp" in ran.results:
            ran.options["ddp"] = dict(check.ddp_options)
    if "controlled" in check.runs and first != "controlled" and check.runs[first].failures:
        del check.runs["controlled"]  # its DDP run shared the failed launch: run again if needed
    outcome = check.runs[first]
    findings = check.findings
    findings += explain.notes(outcome)
    findings += explain.numerics_differ(Numerics.comparison(), explain.numerics_seen(outcome))
    findings += _failures(check, outcome, first)
    check.recorders.update(_recorders(outcome, first))
    check.comparisons += check.comparer.all(outcome, first)
    confirm.rejudge(check.schedule, check.factories[first], first, outcome.results, check.comparisons)
    order = tuple(check.comparer.order)
    findings += explain.nonfinite(outcome, order, check.virtual)
    ref = outcome.results.get("single")
    unused = [n for n in order if n not in ref.grads] if ref is not None else []
    if unused and not any(f.code == "unused-parameters" for f in findings):
        steady = _steady_grads(check) if check.sites.random else {}
        by_draw = [n for n in unused if n in steady]
        findings.append(
            usage.unused_finding(unused, by_draw, usage.structural(check.sites.random) if by_draw else ())
        )
        retry = not check.ddp_options.get("find_unused_parameters")
        if (
            retry
            and any(c.strategy == "ddp" and not c.ok for c in check.comparisons)
            and not has_errors(findings)
        ):
            # DDP waits for gradients that never come: the bucket holding an unused
            # parameter is not all-reduced in the first step. Compare with the flag on.
            failure = _retry_unused(check, outcome, first)
            if failure is not None:  # DDP could not find the unused parameters either
                outcome.failures.pop("ddp", None)
                findings.append(
                    explain.failure_finding("ddp", f"{first}, find_unused_parameters", failure, check.virtual)
                )
            else:
                check.comparisons += [c for c in check.comparer.all(outcome, first) if c.strategy == "ddp"]
    findings += explain.ranks_diverged(outcome)
    return outcome


def _steady_grads(check: _Check) -> dict[str, Any]:
    """single's gradients in controlled mode (draws at their expected value): from the
    controlled runs when they ran, else one single run now."""
    kept = check.runs.get("controlled")
    if kept is not None and "single" in kept.results:
        return kept.results["single"].grads
    job = Job("controlled single", check.factories["controlled"], "single")
    result = check.schedule.runs([job])[job.name]
    return result.grads if isinstance(result, RunResult) else {}


def _failures(check: _Check, outcome: Outcome, mode: str) -> list[Finding]:
    """A finding per failed run; a DDP failure that asks for find_unused_parameters is
    retried with it (and becomes a warning if that works)."""
    out = []
    for strategy, failure in list(outcome.failures.items()):
        if strategy == "ddp" and explain.asks_for_unused(failure):
            out.append(explain.unused_retry_finding(strategy, failure))
            again = _retry_unused(check, outcome, mode)
            if again is None:
                continue
            failure = again
        out.append(explain.failure_finding(strategy, mode, failure, check.virtual))
    return out


def _retry_unused(check: _Check, outcome: Outcome, mode: str) -> RankFailure | None:
    """DDP of ``mode`` again with find_unused_parameters; its failure, if it fails."""
    job = Job(f"{mode} ddp", check.factories[mode], "ddp", (("find_unused_parameters", True),))
    result = check.schedule.runs([job])[job.name]
    if isinstance(result, RankFailure):
        outcome.failures["ddp"] = result
        return result
    outcome.results["ddp"] = result
    outcome.options["ddp"] = {"find_unused_parameters": True}
    outcome.failures.pop("ddp", None)
    return None


def _strategies_in_error(findings: list[Finding]) -> tuple[set[str], bool]:
    """The strategies an error belongs to (a crashed or hung run, non-finite gradients,
    diverged DDP ranks), whose differences are not explained — the other strategies' still
    are; and whether an error belongs to no one strategy (then nothing is explained)."""
    failed: set[str] = set()
    stop = False
    for f in findings:
        if f.severity != "error":
            continue
        if f.code == "ranks-diverged":
            failed.add("ddp")
        elif isinstance(f.evidence.get("strategy"), str):
            failed.add(f.evidence["strategy"])
        elif isinstance(f.evidence.get("strategies"), list):
            failed.update(f.evidence["strategies"])
        else:
            stop = True
    return failed, stop


def _differing(comparisons: list[Comparison]) -> list[Comparison]:
    """Comparisons outside tolerance (finite), less those a later retry with an option
    (find_unused_parameters) answered."""
    return [
        c
        for c in comparisons
        if not c.ok
        and math.isfinite(c.rel_norm_err)
        and not (
            not c.options
            and any(o.strategy == c.strategy and o.mode == c.mode and o.options and o.ok for o in comparisons)
        )
    ]


def _explain(check: _Check, first: str, outcome: Outcome, virtual: bool) -> None:
    """Step 4 and 5: attribute every difference, or leave it unexplained."""
    failed, stop = _strategies_in_error(check.findings)
    left = [c for c in _differing(check.comparisons) if c.strategy not in failed]
    if not left or stop:
        return
    possible: dict[str, list[str]] = {}
    mode_now = first
    if first == "as-is":
        applicable = [
            c
            for c in left
            if check.sites.random or explain.batchnorm_applies(check.sites, check.replicas.get(c.strategy, 1))
        ]
        if applicable and check.mode == "as-is":
            for c in applicable:
                possible[c.strategy] = explain.possible_causes(
                    check.sites, c, check.replicas.get(c.strategy, 1)
                )
        elif applicable:
            controlled = check.mode_runs("controlled", **outcome.options.get("ddp", {}))
            check.recorders.update(_recorders(controlled, "controlled"))
            check.findings += [
                explain.failure_finding(s, "controlled", f, check.virtual)
                for s, f in controlled.failures.items()
            ]
            again = check.comparer.all(controlled, "controlled")
            confirm.rejudge(
                check.schedule, check.factories["controlled"], "controlled", controlled.results, again
            )
            check.comparisons += again
            if controlled.failures:  # the strategies that ran are still explained
                applicable = [c for c in applicable if c.strategy not in controlled.failures]
                if not applicable:
                    return
            by_strategy = {c.strategy: c for c in again}
            confirmed = [c for c in applicable if by_strategy.get(c.strategy) and by_strategy[c.strategy].ok]
            # A cause that removes most of a difference is named too, with its share; what
            # it leaves is judged below on the controlled runs (Faster R-CNN: BatchNorm
            # 0.80 → 0.041, the samplers' randperm the rest).
            partial = [
                c
                for c in applicable
                if c not in confirmed
                and by_strategy.get(c.strategy)
                and explain.share_removed(c, by_strategy[c.strategy]) >= explain.SHARE_NAMED
            ]
            if confirmed or partial:
                after = [by_strategy[c.strategy] for c in [*confirmed, *partial]]
                check.findings += explain.train_mode_findings(
                    check.sites, [*confirmed, *partial], after, check.replicas
                )
            # What controlled mode did not take away is judged on its own runs.
            left = [by_strategy[c.strategy] for c in left if c not in confirmed and c.strategy in by_strategy]
            left += [c for c in again if not c.ok and c not in left and math.isfinite(c.rel_norm_err)]
            outcome, mode_now = controlled, "controlled"
    left = causes.scale_and_shards(check, outcome, mode_now, left)
    if left:
        left = causes.batch_size_in_forward(check, mode_now, left)
    if left:
        left = causes.reference_spread(check, outcome, mode_now, left, possible, virtual)


def _recorders(outcome: Outcome, mode: str) -> dict[str, Recorder]:
    return {f"{name} ({mode})": r.recorder for name, r in outcome.results.items() if r.recorder.events()}
