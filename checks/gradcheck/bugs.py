"""Findings that are bugs in the user's code, not properties of a strategy: they fail the
run (severity error), name where the probe saw them and say what to change — never
"report it to gpudiag". Each is made only once a measurement confirmed it (see
:mod:`gpudiag.checks.gradcheck.causes`)."""

from __future__ import annotations

from gpudiag.checks.gradcheck.report import Comparison
from gpudiag.checks.gradcheck.trainmode import Site
from gpudiag.findings import Finding


def _sites(sites: tuple[Site, ...] | list[Site]) -> str:
    shown = "; ".join(s.describe() for s in sites[:3])
    return shown + (f" and {len(sites) - 3} more" if len(sites) > 3 else "")


def batch_size_finding(cs: list[Comparison], world: int, ratio: float) -> Finding:
    """The forward's output on a shard is ``ratio`` (≈ W) times the same samples' output
    in the whole batch: it divides by (or multiplies with) the batch it sees. One finding
    for every strategy it explains (``cs``)."""
    c = cs[0]
    names = ", ".join(x.strategy for x in cs)
    return Finding(
        "batch-size-in-forward",
        "error",
        f"{names}: norm ratio {c.norm_ratio:.4g} ≈ W={world}, cosine {c.cosine:.6f}: the model's forward "
        f"depends on the per-device batch (each shard's output is {ratio:.4g}x the same samples' output "
        "in the whole batch)",
        {
            "strategies": [x.strategy for x in cs],
            "output_ratio": ratio,
            "world_size": world,
            "norm_ratio": c.norm_ratio,
            "cosine": c.cosine,
            "rel_norm_err": c.rel_norm_err,
        },
        cause="a per-device normalisation in the model: code that divides by x.shape[0] (or takes a "
        "mean or sum over the batch dimension) in forward sees 1/W of the batch on each device",
        fix="normalise in the loss with a mean over the global batch, or divide by the global batch "
        "size (x.shape[0] * world size) instead of x.shape[0]",
    )


def unseeded_finding(sites: tuple[Site, ...], cs: list[Comparison], spread: float) -> Finding:
    """single twice from the same seed differs, no kernel is non-deterministic, and the
    probe recorded random draws: they come from a generator the seed does not reach."""
    return Finding(
        "unseeded-random",
        "error",
        f"two single runs with the same seed differ by {spread:.3g}: the forward draws random numbers the "
        f"seed does not reach ({_sites(sites)}); "
        + ", ".join(f"{c.strategy} differs by {c.rel_norm_err:.3g}" for c in cs),
        {
            "strategies": [c.strategy for c in cs],
            "rel_norm_err": max(c.rel_norm_err for c in cs),
            "reference_spread_same_rng": spread,
            "modules": [s.to_json() for s in sites],
        },
        cause="a draw from a generator seeded outside torch.manual_seed (torch.Generator().seed(), the "
        "clock, Python's random, NumPy): no run of the model can be reproduced, on one device or many",
        fix="draw from torch's default generator, or from a torch.Generator seeded from the run's seed",
    )


def state_finding(sites: tuple[Site, ...], cs: list[Comparison]) -> Finding:
    """The forward writes parameters (a data-dependent init, an update in forward): every
    replica writes its own from its sub-batch."""
    return Finding(
        "state-in-forward",
        "error",
        ", ".join(f"{c.strategy} ({c.mode})" for c in cs)
        + f" differ from single by up to {max(c.rel_norm_err for c in cs):.3g}: the forward writes "
        f"parameters "
        f"({_sites(sites)}), so each replica sets them from its own sub-batch",
        {
            "strategies": [c.strategy for c in cs],
            "mode": cs[0].mode,
            "rel_norm_err": max(c.rel_norm_err for c in cs),
            "modules": [s.to_json() for s in sites],
        },
        cause="per-replica state: a data-dependent initialisation in forward (ActNorm) or a parameter "
        "updated in forward; under DataParallel the replicas' writes are lost, under DDP each rank "
        "keeps its own until the next broadcast",
        fix="initialise from data once, before wrapping the model (on the global batch, then broadcast), "
        "and update parameters only in the optimizer step",
    )
