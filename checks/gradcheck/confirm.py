"""Two measurements that settle what a comparison with single alone cannot.

- **A float64 yardstick** (:func:`float64_jobs`, :func:`against_float64`): single run in
  float64 on the same batch and seed. float32 single is itself ``e_single`` away from it —
  the spread one correct float32 reduction order has for this model — so a strategy is
  judged against ``max(fixed tolerance, SPREAD × e_single)``, and a strategy at least as
  close to float64 as single is never a difference (RAFT: single 3.6e-5 from float64, DDP
  1.2e-5, the two 3.4e-5 apart — above the fixed 1.3e-5).
- **The per-device batch in the forward** (:func:`batch_size_ratio`): each shard's output
  against the same samples' rows of the whole batch's output. Proportional with a factor
  near W (``out / x.shape[0]``, a mean over the batch dimension) is the model's own
  per-device normalisation, whatever the loss does with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gpudiag.checks.gradcheck.compare import compare, tolerance
from gpudiag.checks.gradcheck.report import Comparison
from gpudiag.checks.gradcheck.schedule import Job, Schedule
from gpudiag.runtime import RunResult
from gpudiag.runtime.batch import call_model, split
from gpudiag.runtime.config import ModelFn

#: The measured tolerance is this many times single's own distance from float64 (two
#: correct float32 orders are at most twice that apart, typically √2).
SPREAD = 3.0
#: Comparisons further from single than this are not rounding, in float32: no float64 run.
NEAR_MISS = 1e-3
#: A shard's output within this (relative) of a constant times the batch's rows is
#: proportional to them.
PROPORTIONAL = 1e-3


@dataclass(frozen=True)
class Float64:
    """``factory``'s model in float64 (parameters, buffers and arithmetic)."""

    factory: ModelFn

    def __call__(self) -> nn.Module:
        return self.factory().double()


def wide(value: Any) -> Any:
    """Floating tensors of a batch (a tensor, tuple or dict) in float64; others as they are."""
    if isinstance(value, torch.Tensor):
        return value.double() if value.is_floating_point() else value
    if isinstance(value, tuple):
        return tuple(wide(v) for v in value)
    if isinstance(value, dict):
        return {k: wide(v) for k, v in value.items()}
    return value


def float64_jobs(name: str, factory: ModelFn, inputs: Any, targets: torch.Tensor) -> list[Job]:
    """The float64 single run of ``factory`` (one job, named ``name``)."""
    return [Job(name, Float64(factory), "single", (("dtype", "fp32"),), wide(inputs), wide(targets))]


def near_misses(comparisons: list[Comparison], dtype: str) -> list[Comparison]:
    """Comparisons outside the fixed tolerance but close enough to be float32 rounding."""
    return [
        c
        for c in comparisons
        if dtype == "fp32" and not c.ok and math.isfinite(c.rel_norm_err) and c.rel_norm_err <= NEAR_MISS
    ]


def _widened(result: RunResult) -> RunResult:
    return RunResult(
        result.strategy, [], {n: g.double() for n, g in result.grads.items()}, {}, {}, result.recorder
    )


def against_float64(
    comparisons: list[Comparison],
    results: dict[str, RunResult],
    ref64: RunResult,
    tol: float,
    order: list[str],
) -> None:
    """Judge ``comparisons`` (of ``results``, whose ``"single"`` is the reference) again
    against the float64 run ``ref64``: each gets ``float64`` (single's and its own distance
    from float64, the measured tolerance) and is ok when within the measured tolerance of
    single or at least as close to float64 as single is (in place)."""
    single = results.get("single")
    if single is None:
        return
    e_single = compare("single", "", 1, _widened(single), ref64, math.inf, order).rel_norm_err
    measured = max(tol, SPREAD * e_single)
    for c in comparisons:
        got = results.get(c.strategy)
        if got is None:
            continue
        e_got = compare(c.strategy, "", 1, _widened(got), ref64, math.inf, order).rel_norm_err
        closer = e_got <= e_single
        c.float64 = {"single": e_single, "strategy": e_got, "tolerance": measured, "closer": closer}
        if c.rel_norm_err <= measured or closer:
            c.ok = c.update_rel_err is None or c.update_rel_err <= measured * 10
            if c.ok:
                c.first_bad_param = None


def batch_size_ratio(model: nn.Module, inputs: Any, world: int, select: Any) -> float | None:
    """The factor k when every shard's output is k times the whole batch's rows for the
    same samples (the forward depends on the batch size it sees), else None. ``model`` is
    run as it is (in controlled form: no draws, BatchNorm on running statistics)."""
    pieces = split(inputs, world)
    if len(pieces) < 2:
        return None
    with torch.no_grad():
        whole = select(call_model(model, inputs)).double()
        parts = [select(call_model(model, piece)).double() for piece in pieces]
    if whole.dim() == 0 or sum(len(p) for p in parts) != len(whole):
        return None
    rows = whole.split([len(p) for p in parts])
    ratios = []
    for part, row in zip(parts, rows, strict=True):
        norm = float(row.norm())
        if norm == 0:
            return None
        k = float(part.norm()) / norm
        if float((part - k * row).norm()) > PROPORTIONAL * float(part.norm()):
            return None
        ratios.append(k)
    if max(ratios) - min(ratios) > PROPORTIONAL * max(ratios) or abs(ratios[0] - 1) <= PROPORTIONAL:
        return None
    return ratios[0]


def rejudge(
    schedule: Schedule,
    factory: ModelFn,
    mode: str,
    results: dict[str, RunResult],
    comparisons: list[Comparison],
) -> None:
    """The near misses of ``comparisons`` judged against a float64 single run of
    ``factory`` (run here; a model that cannot run in float64 leaves them as they are)."""
    near = near_misses(comparisons, schedule.base.dtype)
    if not near:
        return
    name = f"{mode} single float64"
    try:
        ref64 = schedule.runs(float64_jobs(name, factory, schedule.inputs, schedule.targets))[name]
    except Exception:  # (a model that casts to float32 itself, or refuses float64)
        return
    if isinstance(ref64, RunResult):
        order = [n for n in ref64.grads]
        against_float64(near, results, ref64, tolerance(schedule.base.dtype), order)
