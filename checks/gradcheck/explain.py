"""gradcheck's findings: what each difference or failure means, and whether a cause fits.

Every function here turns numbers already measured into findings (docs/findings.md);
none runs anything. A cause is named only where it can apply to the configuration and a
confirming measurement brought the difference within tolerance (:func:`confirmed_by`);
otherwise the difference stays ``mismatch-unexplained`` with its numbers, and what could
not be confirmed is named as a *possible* cause.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch

from gpudiag.checks.gradcheck.compare import COSINE_SAME, RATIO_SLACK, first_nonfinite
from gpudiag.checks.gradcheck.report import Comparison
from gpudiag.checks.gradcheck.schedule import Outcome
from gpudiag.checks.gradcheck.trainmode import Site, TrainModeSites
from gpudiag.findings import Finding
from gpudiag.runtime import RankFailure
from gpudiag.runtime.numerics import Numerics

#: Errors of a DDP run that asks for find_unused_parameters.
UNUSED_ERROR = ("find_unused_parameters", "Expected to have finished reduction")
#: A strategy's difference is within the reference's own run-to-run spread when it is at
#: most this many times that spread.
SPREAD_MARGIN = 3.0
#: Sites named in a message (all of them are in the evidence).
SHOWN = 3


def notes(outcome: Outcome) -> list[Finding]:
    seen: dict[tuple[str, str], Finding] = {}
    for result in outcome.results.values():
        for note in result.notes:
            seen.setdefault((note.code, note.message), note)
    return list(seen.values())


def numerics_seen(outcome: Outcome) -> dict[str, Numerics]:
    """The numeric settings each process of ``outcome`` reported, by process name."""
    seen: dict[str, Numerics] = {}
    for strategy, result in outcome.results.items():
        if strategy == "ddp":
            seen.update({f"ddp rank {r}": n for r, n in enumerate(result.numerics)})
        elif result.numerics:
            seen[strategy] = result.numerics[0]
    return seen


def numerics_differ(wanted: Numerics, seen: dict[str, Numerics]) -> list[Finding]:
    """An error for every process that computed under other numeric settings than the
    reference (its gradients would differ for that reason alone); a warning when the
    reference itself ran under other settings than the comparison asked for (something
    in the model changed them: every process alike, so the comparison still holds)."""
    reference = seen.get("single")
    if reference is None:
        return []
    findings = []
    changed = wanted.differences(reference)
    if changed:
        findings.append(
            Finding(
                "numerics-changed",
                "warning",
                "the model changed torch's numeric settings while it was built or run: "
                + _differences_text(changed),
                {"wanted": wanted.to_json(), "seen": reference.to_json()},
                fix="leave TF32, cuDNN and deterministic-algorithm flags alone inside the model",
            )
        )
    for name, got in seen.items():
        differences = reference.differences(got)
        if differences:
            findings.append(
                Finding(
                    "numerics-differ",
                    "error",
                    f"{name} computed under other numeric settings than single: "
                    + _differences_text(differences),
                    {"process": name, "single": reference.to_json(), "seen": got.to_json()},
                    cause="the processes of the comparison did not run the same kernels, so their "
                    "gradients differ for that reason alone",
                    fix="report this as a gpudiag bug, with the output of --format json",
                )
            )
    return findings


def _differences_text(differences: dict[str, tuple[Any, Any]]) -> str:
    return ", ".join(f"{k.replace('_', ' ')} {a} → {b}" for k, (a, b) in differences.items())


def failure_finding(strategy: str, mode: str, failure: RankFailure, simulated: bool = False) -> Finding:
    """``failure`` as a finding of ``strategy`` in ``mode``; on CPU virtual devices
    (``simulated``) a hung rank is never put on a link or NCCL."""
    finding = failure.to_finding(simulated=simulated)
    return replace(
        finding,
        message=f"{strategy} ({mode}): {finding.message}",
        evidence={**finding.evidence, "strategy": strategy, "mode": mode},
    )


def asks_for_unused(failure: RankFailure) -> bool:
    return failure.code == "rank-crashed" and any(s in failure.detail for s in UNUSED_ERROR)


def unused_retry_finding(strategy: str, failure: RankFailure) -> Finding:
    return Finding(
        "unused-parameters",
        "warning",
        "DDP failed because some parameters get no gradient; retried with find_unused_parameters=True",
        {"strategy": strategy, "error": str(failure)},
        cause="parameters that do not contribute to the loss (an unused branch or head)",
        fix="pass find_unused_parameters=True (or static_graph=True) to "
        "DistributedDataParallel, or make every parameter contribute",
    )


def nonfinite(outcome: Outcome, order: tuple[str, ...], virtual: bool = False) -> list[Finding]:
    """A finding per strategy whose gradients or loss hold a NaN or an Inf, with where the
    runtime's record first saw it; on CPU virtual devices (``virtual``) no link is blamed."""
    out = []
    for strategy, result in outcome.results.items():
        bad = first_nonfinite(result.grads, order)
        bad_step = next((i + 1 for i, loss in enumerate(result.losses) if not math.isfinite(loss)), None)
        if bad is None and bad_step is None:
            continue
        evidence: dict[str, Any] = {"strategy": strategy, "param": bad, "step": 1 if bad else bad_step}
        where = ""
        transfer = next((t for t in result.recorder.transfers if t.nonfinite), None)
        bucket = next((b for b in result.recorder.buckets if b.nonfinite_before or b.nonfinite_after), None)
        if transfer is not None:
            evidence.update(
                {
                    "src": transfer.src,
                    "dst": transfer.dst,
                    "link": transfer.link,
                    "phase": transfer.phase,
                    "transfer_step": transfer.step,
                    "tensor": transfer.name,
                }
            )
            where = (
                f"; first seen in the {transfer.phase} transfer {transfer.src}->{transfer.dst} "
                f"over {transfer.link or 'an unknown link'} at step {transfer.step}"
            )
        elif bucket is not None:
            before = bool(bucket.nonfinite_before)
            evidence.update(
                {
                    "rank": bucket.rank,
                    "bucket": bucket.index,
                    "bucket_step": bucket.step,
                    "before_allreduce": before,
                }
            )
            where = (
                f"; rank {bucket.rank} already had it before the all-reduce (bucket {bucket.index})"
                if before
                else f"; finite on every rank before the all-reduce, non-finite on rank {bucket.rank} after "
                f"it (bucket {bucket.index}): the transport"
            )
        what = f"parameter {bad}" if bad else f"the loss at step {bad_step}"
        out.append(
            Finding(
                "nonfinite-gradient",
                "error",
                f"{strategy}: non-finite values in {what}{where}",
                evidence,
                cause="on CPU virtual devices no link exists: a fault planted with --inject, or a model/"
                "learning rate that diverges (then single fails too)"
                if virtual
                else "corrupt data on a link (see the transfer), or a model/learning rate that diverges "
                "(then single fails too)",
                fix="if no fault was injected, lower the learning rate or check the model where it first "
                "went non-finite"
                if virtual
                else "if only parallel strategies fail, run `gpudiag nancheck` and rerun with "
                "NCCL_P2P_DISABLE=1; if single fails too, lower the learning rate or check the model",
            )
        )
    return out


def ranks_diverged(outcome: Outcome) -> list[Finding]:
    ddp = outcome.results.get("ddp")
    if ddp is None or len(ddp.rank_digests) < 2 or not ddp.rank_digests[0]:
        return []
    for step, digests in enumerate(zip(*ddp.rank_digests, strict=True), start=1):
        if len(set(digests)) > 1:
            odd = [r for r, d in enumerate(digests) if d != digests[0]]
            return [
                Finding(
                    "ranks-diverged",
                    "error",
                    f"after step {step} DDP rank(s) {', '.join(map(str, odd))} hold different parameters "
                    "than rank 0",
                    {"step": step, "ranks": odd},
                    cause="gradients computed outside DDP's all-reduce (torch.autograd.grad), rank-dependent "
                    "code, or corrupted collectives",
                    fix="keep every gradient inside loss.backward() under DDP; check collectives with "
                    "`gpudiag peer`",
                )
            ]
    return []


def few_replicas(batch: int, world: int) -> Finding:
    used = len(torch.empty(batch).chunk(world))
    return Finding(
        "uneven-shards",
        "info",
        f"batch {batch} is smaller than the {world} devices: DataParallel runs {used} replica(s), DDP cannot "
        "give every rank data",
        {"batch_size": batch, "world_size": world, "dp_replicas": used},
        fix="use a batch of at least the device count",
    )


def uneven_info(batch: int, world: int) -> Finding:
    return Finding(
        "uneven-shards",
        "info",
        f"batch {batch} does not split evenly over {world} ranks "
        f"({'/'.join(str(len(t)) for t in torch.empty(batch).chunk(world))}); DataParallel still matches "
        "single (it computes the loss on the gathered output)",
        {"batch_size": batch, "world_size": world},
    )


# -- causes of a difference ------------------------------------------------------------------


def sites_text(sites: tuple[Site, ...] | list[Site]) -> str:
    shown = "; ".join(s.describe() for s in sites[:SHOWN])
    return shown + (f" and {len(sites) - SHOWN} more" if len(sites) > SHOWN else "")


def batchnorm_applies(sites: TrainModeSites, replicas: int) -> bool:
    """Per-replica batch statistics can only make a difference where a replica normalises
    a sub-batch that is not the whole batch (more than one replica)."""
    return bool(sites.batch_statistics) and replicas > 1


def train_mode_findings(
    sites: TrainModeSites, before: list[Comparison], after: list[Comparison], replicas: dict[str, int]
) -> list[Finding]:
    """The causes controlled mode confirmed: it took every difference in ``before`` (the
    as-is comparisons) within tolerance (``after``)."""
    worst_before = max(before, key=lambda c: c.rel_norm_err)
    worst_after = max(after, key=lambda c: c.rel_norm_err, default=None)
    share = share_removed(worst_before, worst_after) if worst_after is not None else 1.0
    rest = (
        f"; it removes {share:.0%} of the difference, the rest has another cause (below)"
        if worst_after is not None and not worst_after.ok
        else ""
    )
    numbers = (
        f"relative norm error {worst_before.rel_norm_err:.3g} as-is, "
        f"{worst_after.rel_norm_err if worst_after else 0.0:.3g} in controlled mode"
    )
    evidence = {
        "share": share,
        "strategies": [c.strategy for c in before],
        "rel_norm_err": worst_before.rel_norm_err,
        "rel_norm_err_controlled": worst_after.rel_norm_err if worst_after else 0.0,
        "confirmed_by_controlled_rerun": True,
    }
    out = []
    if any(batchnorm_applies(sites, replicas.get(c.strategy, 1)) for c in before):
        out.append(
            Finding(
                "batchnorm-per-replica",
                "warning",
                f"BatchNorm normalises each replica's sub-batch with its own statistics "
                f"({sites_text(sites.batch_statistics)}): {numbers} (BatchNorm on running statistics){rest}",
                {**evidence, "modules": [s.to_json() for s in sites.batch_statistics]},
                cause="per-device batch statistics (expected with DP and with DDP without SyncBatchNorm)",
                fix="for agreement, use SyncBatchNorm under DDP (torch.nn.SyncBatchNorm."
                "convert_sync_batchnorm) or larger per-device batches; for tests, BatchNorm in eval mode",
            )
        )
    if sites.random:
        out.append(
            Finding(
                "dropout-active",
                "warning",
                f"random draws of train mode ({sites_text(sites.random)}) differ under each strategy: "
                f"{numbers} (random draws at their expected value, the RNG re-seeded at every forward){rest}",
                {**evidence, "modules": [s.to_json() for s in sites.random]},
                cause="dropout masks, dropped paths and noise depend on how the batch is split and on "
                "which RNG each device draws from",
                fix="compare with dropout/drop path off (model.eval() for those modules); in training "
                "this is expected",
            )
        )
    return out


#: A train-mode cause that removes at least this share of a difference is named, with
#: its share, even when something else is left.
SHARE_NAMED = 0.5


def share_removed(before: Comparison, after: Comparison) -> float:
    """The share of ``before``'s difference that ``after`` (the same strategy, with a
    cause taken away) no longer has: 1 - after/before, at least 0."""
    if not before.rel_norm_err > 0 or not math.isfinite(after.rel_norm_err):
        return 0.0
    return max(0.0, 1.0 - after.rel_norm_err / before.rel_norm_err)


def possible_causes(sites: TrainModeSites, c: Comparison, replicas: int) -> list[str]:
    """Train-mode causes that can apply to ``c`` but were not confirmed (as-is mode)."""
    out = []
    if batchnorm_applies(sites, replicas):
        out.append(f"BatchNorm batch statistics per replica ({sites_text(sites.batch_statistics)})")
    if sites.random:
        out.append(f"random draws in train mode ({sites_text(sites.random)})")
    return out


def loss_scale_applies(c: Comparison, world: int) -> str | None:
    """ "W" or "1/W" when DDP's gradient looks like single's scaled by the world size
    (which needs a world size above 1), else None."""
    if c.strategy != "ddp" or world < 2 or not c.cosine >= COSINE_SAME:
        return None
    for factor, value in (("1/W", 1 / world), ("W", world)):
        if abs(c.norm_ratio / value - 1) <= RATIO_SLACK:
            return factor
    return None


def loss_scale_finding(c: Comparison, world: int, factor: str, rescaled_err: float, loss: Any) -> Finding:
    return Finding(
        "loss-scale-world-size",
        "error",  # the training code's loss is normalised per device: a bug, the run fails
        f"DDP's gradient is {c.norm_ratio:.4g}x single's ({factor}, W={world}) with cosine {c.cosine:.6f}: "
        f"the loss scale depends on the world size (multiplied by {'W' if factor == '1/W' else '1/W'} it "
        f"differs from single by {rescaled_err:.3g})",
        {
            "strategy": c.strategy,
            "norm_ratio": c.norm_ratio,
            "cosine": c.cosine,
            "world_size": world,
            "rel_norm_err_rescaled": rescaled_err,
            "loss": loss if isinstance(loss, str) else "custom",
        },
        cause="DDP averages gradients over ranks: a sum-reduced loss gives 1/W of the single-GPU "
        "gradient; a mean loss multiplied by W (compensation applied twice) gives W",
        fix="use a mean-reduced loss, or multiply a summed local loss by W",
    )


def uneven_shards_finding(
    c: Comparison, targets: torch.Tensor, world: int, mean_of_means_err: float
) -> Finding:
    batch = len(targets)
    shards = [len(t) for t in targets.chunk(world)]
    return Finding(
        "uneven-shards",
        "warning",
        f"batch {batch} does not split evenly over {world} DDP ranks ({'/'.join(map(str, shards))}): DDP "
        f"averages per-rank means, which weights samples unequally (relative norm error "
        f"{c.rel_norm_err:.3g}; {mean_of_means_err:.3g} against the mean of per-shard gradients)",
        {"batch_size": batch, "world_size": world, "shards": shards, "rel_norm_err": c.rel_norm_err},
        cause="(x1/n1 + x2/n2)/2 differs from (x1+x2)/(n1+n2) when n1 != n2",
        fix="use a global batch divisible by the world size (drop_last=True), or normalise by the "
        "global sample count",
    )


def within_spread(c: Comparison, spread: float) -> bool:
    return spread > 0 and c.rel_norm_err <= SPREAD_MARGIN * spread


def random_in_forward_finding(left: tuple[Site, ...], c: Comparison, spread: float) -> Finding:
    """Draws controlled mode could not take away; the difference is within what another
    RNG state does to the reference itself."""
    return Finding(
        "random-in-forward",
        "warning",
        f"the reference is not reproducible: with the RNG in another state single's gradient moves by "
        f"{spread:.3g}, because the forward draws random numbers gradcheck cannot make identical across "
        f"replicas ({sites_text(left)}); {c.strategy} differs by {c.rel_norm_err:.3g}, within that",
        {
            "strategy": c.strategy,
            "rel_norm_err": c.rel_norm_err,
            "reference_spread_other_rng": spread,
            "modules": [s.to_json() for s in left],
        },
        cause="random numbers drawn in forward whose values have no expected value to replace them "
        "(randint, randperm, multinomial, …) or whose shape depends on each replica's sub-batch",
        fix="draw from a torch.Generator seeded per sample, or turn the randomness off for the comparison",
    )


def nondeterministic_finding(ops: list[str], c: Comparison, spread: float) -> Finding:
    named = ", ".join(ops) if ops else "none reported by torch"
    return Finding(
        "nondeterministic-op",
        "warning",
        f"the reference is not reproducible: two single runs with the same seed differ by {spread:.3g} "
        f"(ops without a deterministic implementation: {named}); {c.strategy} differs by "
        f"{c.rel_norm_err:.3g}, within that",
        {
            "strategy": c.strategy,
            "rel_norm_err": c.rel_norm_err,
            "reference_spread_same_rng": spread,
            "ops": ops,
        },
        cause="kernels whose result depends on the order of atomic additions (some backward kernels "
        "on CUDA: adaptive pooling, interpolation, reflection padding; histc, bincount with weights)"
        + ("" if ops else ", or randomness outside torch (Python's random, NumPy)"),
        fix="torch.use_deterministic_algorithms(True) makes torch raise at such ops; "
        "replace them or accept the spread",
    )


def mismatch_finding(
    c: Comparison,
    tol: float,
    virtual: bool,
    possible: list[str],
    spreads: dict[str, float],
    mode: str = "auto",
) -> Finding:
    """A difference nothing confirmed. On CPU virtual devices there is no link to blame."""
    maybe = f"; possible cause (not confirmed): {'; '.join(possible)}" if possible else ""
    measured = "".join(f"; single against itself ({k}): {v:.3g}" for k, v in spreads.items())
    if virtual:
        cause = (
            "not a link or transfer fault: these are CPU virtual devices (simulated), where no link exists; "
            "something in the model or the comparison that gradcheck does not know"
        )
        fix = (
            "rerun with --mode auto (the default) to test the possible causes"
            if mode == "as-is" and possible
            else "take the possible causes out of the model to see whether the difference goes away"
            if possible
            else "report the model (--format json) with the gpudiag version"
        )
    else:
        cause = (
            "a real fault (a corrupting transfer, a kernel bug) or a model that is not deterministic "
            "across devices"
        )
        fix = (
            "run `gpudiag nancheck` / `gpudiag peer` on the same GPUs; rerun with NCCL_P2P_DISABLE=1 to "
            "see whether the difference goes away"
        )
    update_failed = c.update_rel_err is not None and c.rel_norm_err <= tol
    figure = (
        f"{c.strategy} ({c.mode}): the parameter update after the last step differs from single's by "
        f"{c.update_rel_err:.3g} (relative norm error, allowed {10 * tol:.3g}; the first step's gradient "
        f"agrees to {c.rel_norm_err:.3g})"
        if update_failed
        else f"{c.strategy} ({c.mode}) differs from single by {c.rel_norm_err:.3g} (relative norm error, "
        f"tolerance {tol:.3g}; cosine {c.cosine:.6f}, norm ratio {c.norm_ratio:.4g})"
    )
    return Finding(
        "mismatch-unexplained",
        "error",
        f"{figure}{measured} and no known cause accounts for it{maybe}",
        {
            "strategy": c.strategy,
            "mode": c.mode,
            "rel_norm_err": c.rel_norm_err,
            "update_rel_err": c.update_rel_err,
            "cosine": c.cosine,
            "norm_ratio": c.norm_ratio,
            "first_bad_param": c.first_bad_param,
            "possible_causes": possible,
            "reference_spread": spreads,
            "devices": "virtual" if virtual else "cuda",
        },
        cause=cause,
        fix=fix,
    )
