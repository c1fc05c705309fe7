"""Which parameters each DDP rank's shard leaves without a gradient, found before DDP runs.

A parameter unused on the whole batch is seen in single's gradients; one unused on one
rank's shard alone (an MoE whose image experts get no tokens there, a branch taken by
some samples) is not — yet DDP without ``find_unused_parameters`` waits for its gradient
on that rank and stalls (or fails on the next step, or all-reduces a bucket on some ranks
only). :func:`unused_by_shard` runs the model's forward and the loss on each shard, as
rank r will, and asks autograd which parameters the loss reaches
(``torch.autograd.grad(..., allow_unused=True)``: None for a parameter outside the graph —
what DDP's own ``find_unused_parameters`` finds after each forward). A walk of the graph's
AccumulateGrad nodes, without a backward, found none on torch 2.11."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from gpudiag.checks.gradcheck.explain import sites_text
from gpudiag.checks.gradcheck.trainmode import Site, TrainModeSites
from gpudiag.errors import GpudiagError
from gpudiag.findings import Finding
from gpudiag.runtime.batch import call_model, split
from gpudiag.runtime.stepping import loss_fn


def reached(root: torch.Tensor) -> set[int]:
    """The ids of the leaf tensors (parameters) the autograd graph of ``root`` reaches, by its
    AccumulateGrad nodes' ``variable`` (an empty set where this torch's nodes hold none)."""
    found: set[int] = set()
    seen: set[int] = set()
    todo = [root.grad_fn] if root.grad_fn is not None else []
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)  # AccumulateGrad: the leaf itself
        if isinstance(variable, torch.Tensor):
            found.add(id(variable))
        todo.extend(n for n, _ in getattr(node, "next_functions", ()))
    return found


def unused_by_shard(
    model: nn.Module,
    inputs: Any,
    targets: torch.Tensor,
    world: int,
    loss: Any,
    select: Callable[[Any], Any] | None,
    seed: int = 0,
) -> dict[int, list[str]]:
    """Per rank (of ``world`` contiguous ``torch.chunk`` shards), the trainable parameters
    (module order) that the loss on that rank's shard does not depend on; ranks that use
    every parameter are left out. A shard whose forward or loss raises is left out too
    (the runs report it). ``model`` is run as it is (the caller's copy, in train mode),
    each shard from ``torch.manual_seed(seed)``, as every rank starts: a draw that skips a
    layer (LayerDrop) skips it on every rank alike, as in DDP training seeded per run."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    out: dict[int, list[str]] = {}
    pieces = split(inputs, world)
    with torch.enable_grad():
        for rank, (x, y) in enumerate(zip(pieces, targets.chunk(world), strict=False)):
            torch.manual_seed(seed)
            try:
                output = call_model(model, x)
                value = loss_fn(loss, output if select is None else select(output), y)
            except GpudiagError:  # (the deadline of the block this runs in: not the model's)
                raise
            except Exception:  # the runs name the model's error where it happens
                continue
            if not isinstance(value, torch.Tensor):
                continue
            if not (named and value.requires_grad):
                continue
            # (autograd itself says which parameters the loss reaches: walking grad_fn's
            # AccumulateGrad nodes found none on torch 2.11, where they hold no .variable)
            try:
                grads = torch.autograd.grad(value, [p for _, p in named], allow_unused=True)
            except RuntimeError:  # (reentrant activation checkpointing refuses .grad(): the walk)
                used = reached(value)
                missing = [n for n, p in named if id(p) not in used]
            else:
                missing = [n for (n, _), grad in zip(named, grads, strict=True) if grad is None]
            if missing:
                out[rank] = missing
    return out


def rank_only(by_rank: dict[int, list[str]], world: int) -> dict[int, list[str]]:
    """Of ``by_rank``, the parameters some rank uses and another does not (a parameter
    unused on every shard is an ordinary unused parameter, seen in single's gradients)."""
    everywhere = set.intersection(*(set(v) for v in by_rank.values())) if len(by_rank) == world else set()
    kept = {r: [n for n in names if n not in everywhere] for r, names in by_rank.items()}
    return {r: names for r, names in kept.items() if names}


#: aten ops of dropout of every kind: they zero values, they do not decide which layer runs.
DROPOUT_OPS = frozenset(
    {"bernoulli", "bernoulli_", "native_dropout", "dropout", "feature_dropout", "alpha_dropout"}
)


def structural(sites: tuple[Site, ...]) -> tuple[Site, ...]:
    """Of the random draws, those that can decide which layers run (``rand`` compared with
    a LayerDrop probability, …): every draw but dropout's; all of them if that is all."""
    kept = tuple(s for s in sites if s.what not in DROPOUT_OPS)
    return kept or sites


# -- the findings ---------------------------------------------------------------------------


def unused_finding(unused: list[str], by_draw: Sequence[str] = (), drawn: tuple[Site, ...] = ()) -> Finding:
    """Parameters single's run left without a gradient; ``by_draw``: those of them that
    get one in controlled mode, where ``drawn`` (LayerDrop, stochastic depth) decided it."""
    fixed = [n for n in unused if n not in by_draw]
    parts = []
    if fixed:
        parts.append(f"{len(fixed)} parameter(s) get no gradient ({_names(fixed)})")
    if by_draw:
        parts.append(
            f"{len(by_draw)} {'more ' if fixed else ''}parameter(s) got none in this run because a random "
            f"draw skipped them ({sites_text(drawn)}; with draws at their expected value they get one): a "
            f"draw, not a fixed unused parameter ({_names(by_draw)})"
        )
    causes = []
    if fixed:
        causes.append("parameters that do not contribute to the loss (an unused branch or head)")
    if by_draw:
        causes.append("a random structural draw (LayerDrop, stochastic depth) that skips layers")
    return Finding(
        "unused-parameters",
        "warning",
        "; ".join(parts) + ": DDP without find_unused_parameters=True leaves their bucket un-reduced in the "
        "first step and fails on the next; compared with find_unused_parameters=True",
        {"params": unused, "by_draw": list(by_draw), "drawn": [s.to_json() for s in drawn]},
        cause="; ".join(causes),
        fix="pass find_unused_parameters=True to DistributedDataParallel"
        + (" (static_graph=True cannot follow a draw)" if by_draw else " (or static_graph=True)")
        + ", or make every parameter contribute",
    )


def _names(names: Sequence[str]) -> str:
    return ", ".join(list(names)[:3]) + ("…" if len(names) > 3 else "")


def rank_unused_finding(by_rank: dict[int, list[str]], sites: TrainModeSites) -> Finding:
    """Parameters some DDP rank's shard leaves without a gradient and another uses (found
    by :func:`gpudiag.checks.gradcheck.usage.unused_by_shard` before DDP ran)."""
    names = list(dict.fromkeys(n for names in by_rank.values() for n in names))
    ranks = "; ".join(
        f"rank {r}: " + ", ".join(by_rank[r][:2]) + ("…" if len(by_rank[r]) > 2 else "")
        for r in sorted(by_rank)
    )
    drawn = f" (or a random draw decided it: {sites_text(sites.random)})" if sites.random else ""
    return Finding(
        "unused-parameters",
        "warning",
        f"{len(names)} parameter(s) get a gradient on some DDP ranks' shards and none on others ({ranks}): "
        "DDP without find_unused_parameters=True waits for them on the ranks that use them and stalls; "
        "compared with find_unused_parameters=True",
        {"params": names, "per_rank": {str(r): v for r, v in sorted(by_rank.items())}, "scope": "per rank"},
        cause="parameters used by some samples only (an MoE expert no token of a shard is routed to, a "
        f"branch some inputs take){drawn}",
        fix="pass find_unused_parameters=True to DistributedDataParallel (static_graph=True does not "
        "help: the set changes with the data), or make every expert contribute on every rank (a zero-"
        "weighted term)",
    )
