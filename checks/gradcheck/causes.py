"""The causes gradcheck confirms after train mode, each by a measurement: the world-size
loss scale (DDP's gradient rescaled agrees), uneven shards (the mean of per-shard
gradients), the per-device batch in the forward (each shard's output a constant times the
batch's rows), and the reference's own spread (single again from the same RNG state:
non-deterministic kernels or an unseeded draw; from another: draws controlled mode cannot
take away). Each returns the comparisons it could not explain."""

from __future__ import annotations

import math
from typing import Any

from gpudiag.checks.gradcheck import bugs, explain
from gpudiag.checks.gradcheck.compare import compare, mean_of, scaled
from gpudiag.checks.gradcheck.confirm import batch_size_ratio
from gpudiag.checks.gradcheck.factories import OTHER_RNG_OFFSET, Controlled, OtherRng
from gpudiag.checks.gradcheck.report import Comparison
from gpudiag.checks.gradcheck.schedule import Job, Outcome
from gpudiag.checks.gradcheck.trainmode import TrainModeSites, probe
from gpudiag.runtime import DeviceSet, RankFailure, RunResult
from gpudiag.runtime.batch import split
from gpudiag.runtime.stepping import output_selector

#: The check in progress (``check._Check``: not imported, which would close a circle).
Check = Any


def scale_and_shards(check: Check, outcome: Outcome, mode: str, left: list[Comparison]) -> list[Comparison]:
    """The world-size loss scale (DDP's gradient rescaled agrees) and uneven shards (DDP
    agrees with the mean of per-shard gradients, computed on one device)."""
    ref, ddp = outcome.results.get("single"), outcome.results.get("ddp")
    targets, world = check.schedule.targets, check.world
    remaining = []
    shard_results: dict[str, RunResult | RankFailure] | None = None
    for c in left:
        factor = explain.loss_scale_applies(c, world)
        if factor and ref is not None and ddp is not None:
            value = 1 / world if factor == "1/W" else world
            rescaled = scaled(ddp, 1 / value)
            err = compare("ddp", mode, world, rescaled, ref, check.tol, check.comparer.order).rel_norm_err
            if err <= check.tol:
                check.findings.append(explain.loss_scale_finding(c, world, factor, err, check.loss))
                continue
        if c.strategy == "ddp" and len(targets) % world and ref is not None and ddp is not None:
            if shard_results is None:
                shard_results = check.schedule.runs(_shard_jobs(check, mode))
            shards = [r for r in shard_results.values() if isinstance(r, RunResult)]
            err = (
                compare(
                    "ddp", mode, world, ddp, mean_of(shards), check.tol, check.comparer.order
                ).rel_norm_err
                if len(shards) == world
                else math.inf
            )
            if err <= check.tol:
                check.findings.append(explain.uneven_shards_finding(c, targets, world, err))
                continue
        remaining.append(c)
    return remaining


def _shard_jobs(check: Check, mode: str) -> list[Job]:
    devices = check.schedule.base.devices
    one = DeviceSet.virtual(1) if devices.kind == "virtual" else devices
    xs, ys = split(check.schedule.inputs, check.world), check.schedule.targets.chunk(check.world)
    return [
        Job(f"shard {i}", check.factories[mode], "single", (("steps", 1), ("devices", one)), x, y)
        for i, (x, y) in enumerate(zip(xs, ys, strict=True))
    ]


def reference_spread(
    check: Check,
    outcome: Outcome,
    mode: str,
    left: list[Comparison],
    possible: dict[str, list[str]],
    virtual: bool,
) -> list[Comparison]:
    """Is the reference reproducible? single again from the same RNG state (a difference:
    non-deterministic kernels) and, where the forward still draws random numbers, from
    another (a difference: those draws). A strategy within that spread is explained."""
    ref = outcome.results.get("single")
    if ref is None:
        return left
    factory = check.factories[mode]
    left_in_controlled = _probe_controlled(check) if mode == "controlled" and check.sites else None
    remaining_sites = (
        check.sites.random if mode == "as-is" else left_in_controlled.random if left_in_controlled else ()
    )
    if left_in_controlled is not None and left_in_controlled.batch_statistics:
        # BatchNorm without running statistics: controlled mode cannot replace its batch
        # statistics, so it stays a possible cause.
        for c in left:
            if explain.batchnorm_applies(left_in_controlled, check.replicas.get(c.strategy, 1)):
                possible.setdefault(c.strategy, []).append(
                    "BatchNorm without running statistics, so batch statistics even in controlled mode "
                    f"({explain.sites_text(left_in_controlled.batch_statistics)})"
                )
    jobs = [Job("single again", factory, "single")]
    if remaining_sites and mode != "as-is":
        other = (
            Controlled(check.factories["as-is"], check.seed + OTHER_RNG_OFFSET)
            if mode == "controlled"
            else OtherRng(factory, check.seed)
        )
        jobs.append(Job("single other rng", other, "single"))
    results = check.schedule.runs(jobs)
    spreads: dict[str, float] = {}
    for name, key in (("single again", "same seed"), ("single other rng", "another RNG state")):
        result = results.get(name)
        if isinstance(result, RunResult):
            spreads[key] = compare(
                "single", mode, check.world, result, ref, check.tol, check.comparer.order
            ).rel_norm_err
    ops = list(
        dict.fromkeys(
            op
            for r in [*outcome.results.values(), *results.values()]
            if isinstance(r, RunResult)
            for op in r.nondeterministic
        )
    )
    remaining: list[Comparison] = []
    unseeded: list[Comparison] = []
    stateful: list[Comparison] = []
    for c in left:
        if explain.within_spread(c, spreads.get("same seed", 0.0)):
            if remaining_sites and not ops:  # draws the seed does not reach
                unseeded.append(c)
            else:
                check.findings.append(explain.nondeterministic_finding(ops, c, spreads["same seed"]))
        elif (
            mode != "as-is"
            and remaining_sites
            and explain.within_spread(c, spreads.get("another RNG state", 0.0))
        ):
            check.findings.append(
                explain.random_in_forward_finding(remaining_sites, c, spreads["another RNG state"])
            )
        elif check.sites.state_writes:
            stateful.append(c)
            remaining.append(c)
        else:
            check.findings.append(
                explain.mismatch_finding(
                    c, check.tol, virtual, possible.get(c.strategy, []), spreads, check.mode
                )
            )
            remaining.append(c)
    if unseeded:
        check.findings.append(bugs.unseeded_finding(tuple(remaining_sites), unseeded, spreads["same seed"]))
    if stateful:
        check.findings.append(bugs.state_finding(check.sites.state_writes, stateful))
    return remaining


def _probe_controlled(check: Check) -> TrainModeSites:
    """What train mode still does in controlled form (random draws without an expected
    value, BatchNorm without running statistics)."""
    model = check.factories["as-is"]()
    return probe(model, check.schedule.inputs, controlled=True, seed=check.seed, given=True)


def batch_size_in_forward(check: Check, mode: str, left: list[Comparison]) -> list[Comparison]:
    """A difference whose norm ratio is near W or 1/W with cosine near 1, confirmed when
    every shard's output is a constant (near W or 1/W) times the whole batch's rows."""
    world, remaining, found = check.world, [], []
    ratio: float | None = None
    measured = False
    for c in left:
        near = any(abs(c.norm_ratio / k - 1) <= BATCH_RATIO_SLACK for k in (world, 1 / world))
        if world > 1 and near and c.cosine >= BATCH_COSINE:
            if not measured:
                measured = True
                model = check.factories[mode]()
                select = output_selector(check.schedule.base) or (lambda out: out)
                try:
                    ratio = batch_size_ratio(model, check.schedule.inputs, world, select)
                except Exception:  # (an output the selector cannot take: not this cause)
                    ratio = None
            if ratio is not None and any(abs(ratio / k - 1) <= BATCH_RATIO_SLACK for k in (world, 1 / world)):
                found.append(c)
                continue
        remaining.append(c)
    if found and ratio is not None:
        check.findings.append(bugs.batch_size_finding(found, world, ratio))
    return remaining


#: How near W or 1/W a norm ratio (and the output ratio) must be, and how near 1 the
#: cosine, for the per-device batch in the forward to be measured.
BATCH_RATIO_SLACK = 0.1
BATCH_COSINE = 0.99
