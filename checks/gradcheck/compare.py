"""Comparing gradients: one run against the reference, per parameter and as a whole.

The tolerance is on the relative norm error of the whole gradient,
``‖g − g_single‖ / ‖g_single‖``, per dtype (:data:`TOLERANCES`): several times the largest
spread measured between two correct computations of the same gradient (another
reduction order: DataParallel or DDP against single) over the model zoo, and below 1 %
in every dtype so that a 10 % gradient error always fails (``bench/tolerance_spread.py``,
docs/gradcheck.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from gpudiag.checks.gradcheck.report import Comparison, ParamDiff
from gpudiag.runtime import RunResult

if TYPE_CHECKING:
    from gpudiag.checks.gradcheck.schedule import Outcome

#: Relative norm error allowed per dtype (see the module docstring for where they come from).
TOLERANCES = {"fp32": 1.3e-5, "bf16": 0.03, "fp16": 0.005}
TOLERANCE_BASIS = "measured spread between correct reduction orders x headroom (docs/gradcheck.md)"
#: A norm ratio this close to W or 1/W (relative), with cosine above COSINE_SAME, is
#: a loss-scaling difference.
RATIO_SLACK = 0.02
COSINE_SAME = 0.9999


def tolerance(dtype: str) -> float:
    return TOLERANCES[dtype]


@dataclass
class RefSide:
    """What comparing with a reference needs of the reference alone, for the parameters
    ``names``: their gradients' norms and the denominators of relative errors (``|b|``,
    at least 1e-12). Comparisons against the same single run can share it."""

    names: list[str]
    norms: list[float]
    scale: list[torch.Tensor]


def ref_side(ref: RunResult, names: list[str]) -> RefSide:
    b_list = [ref.grads[n] for n in names]
    return RefSide(names, norms(b_list), list(torch._foreach_clamp_min(torch._foreach_abs(b_list), 1e-12)))


def compare(
    strategy: str,
    mode: str,
    world: int,
    got: RunResult,
    ref: RunResult,
    tol: float,
    order: list[str],
    side: RefSide | None = None,
) -> Comparison:
    """Per-parameter and whole-gradient differences of ``got`` against ``ref`` (``side``:
    the reference's own part, if already computed for these parameters).

    Differences are taken in the gradients' dtype (exact for nearby values); the
    per-parameter norms are fused ``torch._foreach_norm`` passes (as ``clip_grad_norm_``
    computes them) and summed in float64; the dot product for the cosine is a BLAS dot."""
    names = [n for n in order if n in ref.grads and n in got.grads]
    if side is None or side.names != names:
        side = ref_side(ref, names)
    a_list, b_list = [got.grads[n] for n in names], [ref.grads[n] for n in names]
    deltas = list(torch._foreach_sub(a_list, b_list)) if names else []
    if any(d.is_complex() for d in deltas):  # |a - b| of complex values is real: not in place
        deltas = list(torch._foreach_abs(deltas))
    else:
        torch._foreach_abs_(deltas)
    d_norms, b_norms, a_norms = norms(deltas), side.norms, norms(a_list)
    p_abs = _maxes(deltas)
    torch._foreach_div_(deltas, side.scale)
    p_rel = _maxes(deltas)
    diffs = []
    sq_delta = sq_ref = sq_got = dot = 0.0
    max_abs = max_rel = 0.0
    for name, a, b, d_norm, b_norm, a_norm, abs_err, rel_err in zip(
        names, a_list, b_list, d_norms, b_norms, a_norms, p_abs, p_rel, strict=True
    ):
        sq_delta, sq_ref, sq_got = sq_delta + d_norm**2, sq_ref + b_norm**2, sq_got + a_norm**2
        dot += _dot(a, b)
        max_abs, max_rel = _nan_max(max_abs, abs_err), _nan_max(max_rel, rel_err)
        rel_norm = d_norm / b_norm if b_norm > 0 else (0.0 if d_norm == 0 else math.inf)
        diffs.append(ParamDiff(name, abs_err, rel_err, rel_norm))
    if not diffs:
        return Comparison(strategy, world, mode, True, 0.0, 1.0, 1.0, 0.0, 0.0, None, None)
    ref_norm, got_norm = math.sqrt(sq_ref), math.sqrt(sq_got)
    rel = math.sqrt(sq_delta) / ref_norm if ref_norm > 0 else math.inf
    cosine = dot / (ref_norm * got_norm) if ref_norm > 0 and got_norm > 0 else math.nan
    ratio = got_norm / ref_norm if ref_norm > 0 else math.nan
    finite = [d for d in diffs if math.isfinite(d.rel_norm_err)]
    worst = max(finite, key=lambda d: d.rel_norm_err, default=None)
    first_bad = next((d.name for d in diffs if not d.rel_norm_err <= tol), None)
    comparison = Comparison(
        strategy,
        world,
        mode,
        math.isfinite(rel) and rel <= tol,
        rel,
        cosine,
        ratio,
        max_abs,
        max_rel,
        worst.name if worst and worst.rel_norm_err > 0 else None,
        first_bad,
        diffs,
    )
    if got.params and ref.params and _moved(ref):
        comparison.update_rel_err = _update_error(got, ref, order)
        comparison.ok = comparison.ok and comparison.update_rel_err <= tol * 10
    return comparison


def _dot(a: torch.Tensor, b: torch.Tensor) -> float:
    """The real inner product ``Re <a, b>`` (for real tensors the dot product), as the
    cosine between two gradients needs it: a BLAS dot, or in float64 for a large tensor;
    complex values as complex (``vdot`` conjugates ``a``), never their real part alone."""
    if a.is_complex():
        if a.numel() < 2**24:
            return float(torch.vdot(a.flatten(), b.flatten()).real)
        return float((a.conj().to(torch.complex128) * b.to(torch.complex128)).real.sum())
    if a.numel() < 2**24:
        return float(torch.dot(a.flatten(), b.flatten()).double())
    return float((a.double() * b.double()).sum())


def _wide(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in float64, or complex128 if it is complex (never its real part alone)."""
    return tensor.to(torch.complex128) if tensor.is_complex() else tensor.double()


def norms(tensors: list[torch.Tensor]) -> list[float]:
    """The 2-norm of each tensor, in one fused pass, as Python floats. A norm that
    overflows the tensor's dtype (values beyond ~1e19 in fp32) is taken again in float64."""
    if not tensors:
        return []
    norms = torch.stack([n.double() for n in torch._foreach_norm(tensors)]).tolist()
    return [
        float(torch.linalg.vector_norm(_wide(t))) if math.isinf(n) else n
        for t, n in zip(tensors, norms, strict=True)
    ]


def _maxes(tensors: list[torch.Tensor]) -> list[float]:
    """The largest element of each tensor (NaN if it holds one; 0 for an empty one), in
    one fused pass."""
    full = [t for t in tensors if t.numel()]
    found = iter(torch.stack(torch._foreach_max(full)).tolist() if full else [])
    return [next(found) if t.numel() else 0.0 for t in tensors]


def _nan_max(a: float, b: float) -> float:
    """max that keeps NaN (Python's max drops it depending on the order)."""
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def _moved(result: RunResult) -> bool:
    return bool(result.initial_params)


def _update_error(got: RunResult, ref: RunResult, order: list[str]) -> float:
    """Relative norm error of the parameter updates (after K steps minus before)."""
    names = [n for n in order if n in ref.params and n in ref.initial_params]
    a = torch.cat([_wide(got.params[n] - got.initial_params[n]).flatten() for n in names])
    b = torch.cat([_wide(ref.params[n] - ref.initial_params[n]).flatten() for n in names])
    norm = float(b.norm())
    return float((a - b).norm()) / norm if norm > 0 else (0.0 if float(a.norm()) == 0 else math.inf)


def first_nonfinite(grads: dict[str, torch.Tensor], order: tuple[str, ...]) -> str | None:
    """The first parameter (in module order) whose gradient holds a NaN or an Inf: a norm
    is finite exactly when every value is (``_norms`` retakes in float64 any that only
    overflowed), so one fused pass tells."""
    names = [n for n in order if n in grads]
    found = norms([grads[n] for n in names])
    return next((n for n, norm in zip(names, found, strict=True) if not math.isfinite(norm)), None)


class Comparer:
    """The comparisons of one gradcheck: each made once, by result (the results are kept,
    so their ids stay theirs), and each single run's reference side computed once."""

    def __init__(self, world: int, tol: float, order: tuple[str, ...]):
        self.world, self.tol, self.order = world, tol, list(order)
        self._done: dict[tuple[int, int, str], tuple[RunResult, RunResult, Comparison]] = {}
        self._sides: dict[int, tuple[RunResult, RefSide]] = {}

    def all(self, outcome: Outcome, mode: str) -> list[Comparison]:
        """Every strategy of ``outcome`` against its single run."""
        ref = outcome.results.get("single")
        if ref is None:
            return []
        out = []
        for strategy, result in outcome.results.items():
            if strategy == "single":
                continue
            key = (id(result), id(ref), mode)
            if key not in self._done:
                names = [n for n in self.order if n in ref.grads and n in result.grads]
                kept = self._sides.get(id(ref))
                side = kept[1] if kept is not None and kept[1].names == names else ref_side(ref, names)
                self._sides[id(ref)] = (ref, side)
                made = compare(strategy, mode, self.world, result, ref, self.tol, self.order, side)
                self._done[key] = (result, ref, made)
            comparison = self._done[key][2]
            comparison.options = dict(outcome.options.get(strategy, {}))
            out.append(comparison)
        return out


def scaled(result: RunResult, factor: float) -> RunResult:
    """``result``'s gradients times ``factor`` (undoing a loss scale)."""
    grads = {n: g * factor for n, g in result.grads.items()}
    return RunResult(result.strategy, [], grads, {}, {}, result.recorder)


def mean_of(results: list[RunResult]) -> RunResult:
    """The average of the runs' gradients: DDP's semantics (the mean of per-shard
    gradients), recomputed from one run per shard."""
    grads: dict[str, torch.Tensor] = {}
    for result in results:
        for n, g in result.grads.items():
            grads[n] = grads.get(n, torch.zeros_like(g)) + g / len(results)
    return RunResult("mean-of-means", [], grads, {}, {}, results[0].recorder)
