"""gradcheck: do single-GPU, DataParallel and DDP compute the same gradients — and if not, why?

Runs the same model, batch and seed under ``single`` (the reference), ``dp`` and ``ddp``
through the runtime, compares gradients (and, with ``steps > 1``, parameter updates), and
explains every difference with a finding (``docs/findings.md``):

- ``batchnorm-per-replica`` / ``dropout-active``: confirmed by a rerun in *controlled* mode
  (BatchNorm on running statistics, dropout off) that agrees;
- ``loss-scale-world-size``: DDP's gradient is W or 1/W times single's with cosine ≈ 1
  (a sum loss under DDP's averaging);
- ``uneven-shards``: the batch does not split evenly; DDP's result equals the average of
  per-shard mean-loss gradients (mean of means), recomputed on one device to confirm;
- ``nonfinite-gradient``, ``ranks-diverged``, ``rank-crashed``, ``rank-hung``,
  ``unused-parameters``, ``mismatch-unexplained``.

Verdict: ``pass`` (all within tolerance), ``explained`` (differences, all attributed),
``fail`` (anything else). Tolerance: the relative norm error of the whole gradient must
not exceed ``torch.testing.assert_close``'s default rtol for the dtype times
:data:`TOLERANCE_HEADROOM`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from gpudiag.findings import Finding
from gpudiag.render.jsonout import number as _number
from gpudiag.runtime import DeviceSet, RankFailure, RunConfig, RunResult, run
from gpudiag.runtime.ddp import forks, start_ddp
from gpudiag.runtime.numerics import Numerics
from gpudiag.runtime.record import Recorder
from gpudiag.runtime.run import DTYPES, ModelFn

SCHEMA = "gpudiag.gradcheck/1"
#: ``torch.testing.assert_close`` default rtol per dtype.
ASSERT_CLOSE_RTOL = {"fp32": 1.3e-6, "bf16": 1.6e-2, "fp16": 1e-3}
#: Headroom over those defaults for a whole-gradient norm: reduction order alone gave up
#: to 4.4e-7 (fp32), 2.5e-3 (bf16) and 3.0e-4 (fp16) relative norm error on the built-in
#: models and resnet18 (see docs/gradcheck.md).
TOLERANCE_HEADROOM = 10.0
#: A norm ratio this close to W or 1/W (relative), with cosine above COSINE_SAME, is
#: a loss-scaling difference.
RATIO_SLACK = 0.02
COSINE_SAME = 0.9999
_UNUSED_ERROR = ("find_unused_parameters", "Expected to have finished reduction")


def tolerance(dtype: str) -> float:
    return ASSERT_CLOSE_RTOL[dtype] * TOLERANCE_HEADROOM


@dataclass
class ParamDiff:
    name: str
    max_abs_err: float
    max_rel_err: float
    rel_norm_err: float


@dataclass
class Comparison:
    """One strategy against ``single``."""

    strategy: str
    world_size: int
    mode: str
    ok: bool
    rel_norm_err: float
    cosine: float
    norm_ratio: float
    max_abs_err: float
    max_rel_err: float
    worst_param: str | None
    first_bad_param: str | None
    params: list[ParamDiff] = field(default_factory=list)
    update_rel_err: float | None = None  # after K > 1 steps: the parameter updates
    options: dict[str, Any] = field(default_factory=dict)  # e.g. a retry's find_unused_parameters

    def to_json(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "world_size": self.world_size,
            "mode": self.mode,
            "ok": self.ok,
            "rel_norm_err": _number(self.rel_norm_err),
            "cosine": _number(self.cosine),
            "norm_ratio": _number(self.norm_ratio),
            "max_abs_err": _number(self.max_abs_err),
            "max_rel_err": _number(self.max_rel_err),
            "worst_param": self.worst_param,
            "first_bad_param": self.first_bad_param,
            "update_rel_err": None if self.update_rel_err is None else _number(self.update_rel_err),
            "options": self.options,
            "params": [
                {
                    "name": p.name,
                    "max_abs_err": _number(p.max_abs_err),
                    "max_rel_err": _number(p.max_rel_err),
                    "rel_norm_err": _number(p.rel_norm_err),
                }
                for p in self.params
            ],
        }


@dataclass
class GradcheckReport:
    verdict: str  # pass | explained | fail
    tolerance: dict[str, Any]
    settings: dict[str, Any]
    comparisons: list[Comparison]
    findings: list[Finding]
    config: dict[str, Any]
    recorders: dict[str, Recorder] = field(default_factory=dict)  # per run, for --trace
    #: the numeric settings each process computed under: "single", "dp", "ddp rank 0", …
    numerics: dict[str, dict[str, Any]] = field(default_factory=dict)

    def summary(self) -> str:
        """One line per comparison and finding, for assertion messages and logs."""
        lines = [f"gradcheck verdict: {self.verdict}"]
        for c in self.comparisons:
            options = "".join(f", {k}={v}" for k, v in c.options.items())
            lines.append(
                f"  {c.strategy} ({c.mode}{options}): "
                f"{'ok' if c.ok else 'DIFFERS'} rel_norm_err={c.rel_norm_err:.3g} cosine={c.cosine:.6f} "
                f"norm_ratio={c.norm_ratio:.4g} first_bad_param={c.first_bad_param}"
            )
        lines += [f"  [{f.severity}] {f.code}: {f.message}" for f in self.findings]
        return "\n".join(lines)

    def exit_code(self, strict: bool = False) -> int:
        if self.verdict == "fail" or (strict and self.verdict == "explained"):
            return 1
        return 0

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "verdict": self.verdict,
            "reference": "single",
            "tolerance": self.tolerance,
            "settings": self.settings,
            "numerics": self.numerics,
            "config": self.config,
            "comparisons": [c.to_json() for c in self.comparisons],
            "findings": [f.to_json() for f in self.findings],
        }


# -- comparing gradients --------------------------------------------------------------------


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
    return RefSide(names, _norms(b_list), torch._foreach_clamp_min(torch._foreach_abs(b_list), 1e-12))


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
    deltas = torch._foreach_sub(a_list, b_list) if names else []
    torch._foreach_abs_(deltas)
    d_norms, b_norms, a_norms = _norms(deltas), side.norms, _norms(a_list)
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
        dot += (
            float(torch.dot(a.flatten(), b.flatten()).double())
            if a.numel() < 2**24
            else float((a.double() * b.double()).sum())
        )
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


def _norms(tensors: list[torch.Tensor]) -> list[float]:
    """The 2-norm of each tensor, in one fused pass, as Python floats. A norm that
    overflows the tensor's dtype (values beyond ~1e19 in fp32) is taken again in float64."""
    if not tensors:
        return []
    norms = torch.stack([n.double() for n in torch._foreach_norm(tensors)]).tolist()
    return [
        float(torch.linalg.vector_norm(t, dtype=torch.float64)) if math.isinf(n) else n
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
    a = torch.cat([(got.params[n] - got.initial_params[n]).double().flatten() for n in names])
    b = torch.cat([(ref.params[n] - ref.initial_params[n]).double().flatten() for n in names])
    norm = float(b.norm())
    return float((a - b).norm()) / norm if norm > 0 else (0.0 if float(a.norm()) == 0 else math.inf)


# -- what the model contains ----------------------------------------------------------------


@dataclass(frozen=True)
class ModelTraits:
    batchnorm: tuple[str, ...]  # BatchNorm modules in train mode
    dropout: tuple[str, ...]  # dropout modules in train mode with p > 0
    order: tuple[str, ...]  # trainable parameter names in module order


def inspect_model(model: nn.Module) -> ModelTraits:
    bn = tuple(
        n for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training
    )
    drop = tuple(
        n
        for n, m in model.named_modules()
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.training and float(getattr(m, "p", 0)) > 0
    )
    order = tuple(n for n, p in model.named_parameters() if p.requires_grad)
    return ModelTraits(bn, drop, order)


class Prebuilt:
    """A factory that builds the model once and then hands out copies.

    ``run`` calls ``torch.manual_seed(seed)`` and then the factory; the first call builds
    the model and records the RNG state it leaves, later calls return a deep copy and
    restore that state — the same weights and the same random stream (dropout masks) as a
    fresh build, at a fraction of the cost for large models."""

    def __init__(self, factory: ModelFn):
        self.factory = factory
        self.template: nn.Module | None = None
        self.rng_after: torch.Tensor | None = None
        self.unwrapped: list[str] = []

    def __call__(self) -> nn.Module:
        import copy

        if self.template is None:
            from gpudiag.models import unwrap

            # The seeds wrap models in nn.DataParallel before training: compare the model
            # itself (each strategy applies its own wrapping).
            self.template, self.unwrapped = unwrap(self.factory())
            self.rng_after = torch.get_rng_state()
            return copy.deepcopy(self.template)
        assert self.rng_after is not None
        torch.set_rng_state(self.rng_after)
        return copy.deepcopy(self.template)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled (for DDP ranks in fresh interpreters) with the parent's template, so the
        rank's copies equal the parent's even for a factory whose own randomness torch's
        seed does not cover, and the rank builds nothing."""
        if self.template is None:
            return (Prebuilt, (self.factory,))
        return (_copied, (self.factory, self.template, self.rng_after, self.unwrapped))


def _copied(factory: ModelFn, template: nn.Module, rng_after: torch.Tensor, unwrapped: list[str]) -> Prebuilt:
    prebuilt = Prebuilt(factory)
    prebuilt.template, prebuilt.rng_after, prebuilt.unwrapped = template, rng_after, unwrapped
    return prebuilt


@dataclass(frozen=True)
class Controlled:
    """A factory that builds the model in controlled mode: BatchNorm modules in eval mode
    (running statistics) and/or dropout off. Picklable when the wrapped factory is."""

    factory: ModelFn
    freeze_batchnorm: bool = True
    disable_dropout: bool = True

    def __call__(self) -> nn.Module:
        model = self.factory()
        for m in model.modules():
            if self.freeze_batchnorm and isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.eval()
            if self.disable_dropout and isinstance(m, nn.modules.dropout._DropoutNd):
                m.eval()
        return model


# -- running --------------------------------------------------------------------------------


def default_devices(world_size: int) -> DeviceSet:
    """CUDA devices 0…W-1 when there are enough, else W CPU virtual devices."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return DeviceSet.cuda(list(range(world_size)))
    return DeviceSet.virtual(world_size)


@dataclass
class _Run:
    results: dict[str, RunResult]
    failures: dict[str, RankFailure]
    options: dict[str, dict[str, Any]] = field(default_factory=dict)  # per strategy: retry options


def _superseded(c: Comparison, comparisons: list[Comparison]) -> bool:
    """A comparison made without an option that a later retry with it answered."""
    return not c.options and any(
        o.strategy == c.strategy and o.mode == c.mode and o.options and o.ok for o in comparisons
    )


def _run_all(
    factories: dict[str, ModelFn],
    inputs: Any,
    targets: torch.Tensor,
    base: RunConfig,
    strategies: list[str],
    before_ddp: Callable[[dict[str, _Run]], object] | None = None,
) -> dict[str, _Run]:
    """Run single and every strategy for each mode's factory (``{"as-is": f}``, or as-is
    and controlled together when auto mode will almost surely need both). DDP runs of
    every mode share one launch.

    Ranks that are forked start at once: they start first, and the in-process strategies
    run meanwhile on one thread, so the ranks keep the other cores. Ranks from a
    forkserver wait until it has finished importing, and CUDA ranks would share the GPUs
    with the in-process runs: those start after. If the launch fails, the first mode's
    DDP run is repeated alone, so the failure is pinned on the right run, and the other
    modes are dropped (run again later if they are needed). ``before_ddp(runs)`` is called
    once the in-process runs are done, before DDP's results are awaited (gradcheck
    compares single with dp there, while this process would otherwise wait)."""
    runs = {mode: _Run({}, {}) for mode in factories}
    local = ["single", *[s for s in strategies if s not in ("single", "ddp")]]
    ddp_config = replace(base, strategy="ddp", track_params=base.steps > 1)
    jobs = [(f, ddp_config) for f in factories.values()] if "ddp" in strategies else []
    failure: RankFailure | None = None
    with contextlib.ExitStack() as stack:
        early = (
            stack.enter_context(start_ddp(jobs, inputs, targets)) if jobs and forks(base.devices) else None
        )
        with _threads(1 if jobs else None):
            for mode, factory in factories.items():
                for strategy in local:
                    runs[mode].results[strategy] = run(
                        factory, inputs, targets, replace(base, strategy=strategy)
                    )
            if before_ddp is not None:
                before_ddp(runs)
        if jobs:
            ddp = early or stack.enter_context(start_ddp(jobs, inputs, targets))
            try:
                for mode, result in zip(factories, ddp.results(), strict=True):
                    runs[mode].results["ddp"] = result
            except RankFailure as exc:
                failure = exc
    if failure is not None:  # (the failed ranks are reaped by now)
        first = next(iter(factories))
        runs = {first: runs[first]}
        if len(factories) > 1:  # which run failed? the first one alone tells
            try:
                runs[first].results["ddp"] = run(factories[first], inputs, targets, ddp_config)
                failure = None
            except RankFailure as again:
                failure = again
        if failure is not None:
            runs[first].failures["ddp"] = failure
    return runs


def _controlled(
    runs: dict[str, _Run],
    outcome: _Run,
    model_factory: ModelFn,
    inputs: Any,
    targets: torch.Tensor,
    base: RunConfig,
    wanted: list[str],
) -> _Run:
    """The controlled-mode runs: those made beside the as-is ones, unless the as-is DDP
    run needed an option (find_unused_parameters) they lacked; then run them again with it."""
    options = outcome.options.get("ddp", {})
    if "controlled" in runs and not options:
        return runs["controlled"]
    again = _run_all(
        {"controlled": Controlled(model_factory)}, inputs, targets, replace(base, **options), wanted
    )
    controlled = again["controlled"]
    if options and "ddp" in controlled.results:
        controlled.options["ddp"] = dict(options)
    return controlled


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


def gradcheck(
    model_factory: ModelFn,
    inputs: Any,
    targets: torch.Tensor,
    *,
    strategies: tuple[str, ...] | list[str] = ("single", "dp", "ddp"),
    world_size: int = 2,
    steps: int = 1,
    lr: float = 0.01,
    optimizer: str = "sgd",
    dtype: str = "fp32",
    loss: str | Callable[[Any, torch.Tensor], torch.Tensor] = "ce",
    mode: str = "auto",
    seed: int = 0,
    inject: tuple[str, ...] | list[str] = (),
    devices: DeviceSet | None = None,
    sync_batchnorm: bool = False,
    timeout: float = 300.0,
    describe: dict[str, Any] | None = None,
) -> GradcheckReport:
    """Compare ``strategies`` against ``single`` for ``model_factory`` on one batch.

    ``inputs`` is a tensor or a tuple of tensors (split along dim 0), ``targets`` a
    tensor; ``loss`` is ``ce``, ``ce-sum``, ``mse``, ``mse-sum`` or ``loss(output, target)``.
    """
    if mode not in ("auto", "as-is", "controlled"):
        raise ValueError(f"mode must be auto, as-is or controlled, not {mode!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}")
    devices = devices or default_devices(world_size)
    world = len(devices)
    tol = tolerance(dtype)
    model_factory = Prebuilt(model_factory)
    numerics = Numerics.comparison()
    base = RunConfig(
        "single",
        devices,
        steps=steps,
        optimizer=optimizer,  # type: ignore[arg-type]
        lr=lr,
        loss=loss,
        dtype=dtype,
        seed=seed,
        faults=tuple(inject),
        sync_batchnorm=sync_batchnorm,
        timeout=timeout,
        keep_state=steps > 1,
        numerics=numerics,
    )
    wanted = [s for s in strategies if s != "single"]
    batch = len(targets)
    findings: list[Finding] = []
    with numerics.applied():  # here (the template is built under them too); every rank sets them itself
        torch.manual_seed(seed)
        traits = inspect_model(model_factory())
        first_mode = "controlled" if mode == "controlled" else "as-is"
        factory = Controlled(model_factory) if first_mode == "controlled" else model_factory
        factories: dict[str, ModelFn] = {first_mode: factory}
        if mode == "auto" and _train_mode_causes(traits) and wanted:
            # BatchNorm in train mode or active dropout: the as-is runs will almost surely
            # differ and need the controlled rerun, so run both modes together.
            factories["controlled"] = Controlled(model_factory)
        comparer = _Comparer(world, tol, traits.order)

        def compare_local(runs: dict[str, _Run]) -> None:
            for name, ran in runs.items():
                comparer.all(ran, name)

        runs = _run_all(factories, inputs, targets, base, wanted, before_ddp=compare_local)
        outcome = runs[first_mode]
        recorders = _recorders(outcome, first_mode)
        findings += _notes(outcome)
        seen = _numerics_seen(outcome)
        findings += _numerics_differ(numerics, seen)
        findings += _failures(outcome, factory, inputs, targets, base, first_mode)
        comparisons = comparer.all(outcome, first_mode)
        findings += _nonfinite(outcome, traits.order)
        unused = _unused_params(outcome, traits.order)
        if unused and not any(f.code == "unused-parameters" for f in findings):
            findings.append(_unused_finding(unused))
            if any(c.strategy == "ddp" and not c.ok for c in comparisons) and not _has_errors(findings):
                # DDP waits for gradients that never come: the bucket holding an unused
                # parameter is not all-reduced in the first step. Compare with the flag on.
                config = replace(
                    base, strategy="ddp", find_unused_parameters=True, track_params=base.steps > 1
                )
                outcome.results["ddp"] = run(factory, inputs, targets, config)
                outcome.options["ddp"] = {"find_unused_parameters": True}
                comparisons += [c for c in comparer.all(outcome, first_mode) if c.strategy == "ddp"]
        findings += _ranks_diverged(outcome)
        unexplained = [
            c
            for c in comparisons
            if not c.ok and math.isfinite(c.rel_norm_err) and not _superseded(c, comparisons)
        ]
        if unexplained and not _has_errors(findings):
            causes = _train_mode_causes(traits) if first_mode == "as-is" else []
            if causes and mode == "auto":
                controlled = _controlled(runs, outcome, model_factory, inputs, targets, base, wanted)
                recorders.update(_recorders(controlled, "controlled"))
                findings += _failures(
                    controlled, Controlled(model_factory), inputs, targets, base, "controlled"
                )
                again = comparer.all(controlled, "controlled")
                comparisons += again
                if all(c.ok for c in again) and not controlled.failures:
                    findings += _train_mode_findings(traits, unexplained, confirmed=True)
                    unexplained = []
                else:
                    outcome, unexplained = controlled, [c for c in again if not c.ok]
            elif causes:
                findings += _train_mode_findings(traits, unexplained, confirmed=False)
                unexplained = []
            rerun_factory = factory if not causes else Controlled(model_factory)
            job = _Job(rerun_factory, inputs, targets, base, world, tol, traits.order)
            explained, unexplained = _scaling_and_shards(unexplained, outcome, job, loss)
            findings += explained
        if unexplained and not _has_errors(findings):
            for c in unexplained:
                findings.append(
                    Finding(
                        "mismatch-unexplained",
                        "error",
                        f"{c.strategy} differs from single by {c.rel_norm_err:.3g} (relative norm error, "
                        f"tolerance {tol:.3g}) and no known cause accounts for it",
                        {
                            "strategy": c.strategy,
                            "mode": c.mode,
                            "rel_norm_err": c.rel_norm_err,
                            "cosine": c.cosine,
                            "norm_ratio": c.norm_ratio,
                            "first_bad_param": c.first_bad_param,
                        },
                        cause="a real fault (a corrupting transfer, a kernel bug) or a model that is not "
                        "deterministic across devices",
                        fix="run `gpudiag nancheck` / `gpudiag peer` on the same GPUs; rerun with "
                        "NCCL_P2P_DISABLE=1 to see whether the difference goes away",
                    )
                )
        if world > batch:
            findings.append(_few_replicas(batch, world))
        if batch % world and not any(f.code == "uneven-shards" for f in findings) and "ddp" in wanted:
            findings.append(_uneven_info(batch, world))
    verdict = _verdict(comparisons, findings)
    return GradcheckReport(
        verdict=verdict,
        tolerance={
            "dtype": dtype,
            "rel_norm_err": tol,
            "basis": f"torch.testing.assert_close rtol "
            f"{ASSERT_CLOSE_RTOL[dtype]:g} x {TOLERANCE_HEADROOM:g}, on the whole gradient",
        },
        settings={"numerics": numerics.summary()},
        numerics={name: n.to_json() for name, n in seen.items()},
        comparisons=comparisons,
        findings=findings,
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
            "mode": mode,
            "seed": seed,
            "inject": list(inject),
            "ddp_shards": "contiguous torch.chunk pieces of the global batch: rank r gets chunk r",
            "unwrapped": model_factory.unwrapped,
        },
        recorders=recorders,
    )


def gradcheck_spec(
    model: str,
    *,
    input_shape: tuple[int, ...] = (3, 32, 32),
    num_classes: int = 10,
    batch_size: int = 8,
    loss: str = "ce",
    **options: Any,
) -> GradcheckReport:
    """``gpudiag gradcheck``: resolve ``--model``, make the seeded batch, compare."""
    from gpudiag.models import random_batch, resolve_model

    factory = resolve_model(model, input_shape, num_classes)
    options["inject"] = tuple(options.get("inject", ()))
    options["strategies"] = tuple(options.get("strategies", ("single", "dp", "ddp")))
    seed = options.get("seed", 0)
    inputs, targets = random_batch(factory, batch_size, input_shape, num_classes, loss, seed)
    describe = {"model": model, "input_shape": list(input_shape), "num_classes": num_classes}
    return gradcheck(factory, inputs, targets, loss=loss, describe=describe, **options)


def _recorders(outcome: _Run, mode: str) -> dict[str, Recorder]:
    return {f"{name} ({mode})": r.recorder for name, r in outcome.results.items() if r.recorder.events()}


def _has_errors(findings: list[Finding]) -> bool:
    return any(f.severity == "error" for f in findings)


#: Codes that account for a difference (their presence makes the verdict "explained").
EXPLAINS = (
    "batchnorm-per-replica",
    "dropout-active",
    "loss-scale-world-size",
    "uneven-shards",
    "unused-parameters",
)


def _verdict(comparisons: list[Comparison], findings: list[Finding]) -> str:
    if _has_errors(findings):
        return "fail"
    explained = any(f.code in EXPLAINS and f.severity == "warning" for f in findings)
    if all(c.ok for c in comparisons) and not explained:
        return "pass"
    return "explained"


class _Comparer:
    """The comparisons of one gradcheck: each made once, by result (the results are kept,
    so their ids stay theirs), and each single run's reference side computed once."""

    def __init__(self, world: int, tol: float, order: tuple[str, ...]):
        self.world, self.tol, self.order = world, tol, list(order)
        self._done: dict[tuple[int, int, str], tuple[RunResult, RunResult, Comparison]] = {}
        self._sides: dict[int, tuple[RunResult, RefSide]] = {}

    def all(self, outcome: _Run, mode: str) -> list[Comparison]:
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


def _notes(outcome: _Run) -> list[Finding]:
    seen: dict[tuple[str, str], Finding] = {}
    for result in outcome.results.values():
        for note in result.notes:
            seen.setdefault((note.code, note.message), note)
    return list(seen.values())


def _numerics_seen(outcome: _Run) -> dict[str, Numerics]:
    """The numeric settings each process of ``outcome`` reported, by process name."""
    seen: dict[str, Numerics] = {}
    for strategy, result in outcome.results.items():
        if strategy == "ddp":
            seen.update({f"ddp rank {r}": n for r, n in enumerate(result.numerics)})
        elif result.numerics:
            seen[strategy] = result.numerics[0]
    return seen


def _numerics_differ(wanted: Numerics, seen: dict[str, Numerics]) -> list[Finding]:
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


def _failures(
    outcome: _Run, factory: ModelFn, inputs: Any, targets: torch.Tensor, base: RunConfig, mode: str
) -> list[Finding]:
    """A finding per failed run of ``mode``; a DDP failure that asks for
    find_unused_parameters is retried with it (and becomes a warning if that works)."""
    out = []
    for strategy, failure in list(outcome.failures.items()):
        if failure.code == "rank-crashed" and any(s in failure.detail for s in _UNUSED_ERROR):
            out.append(
                Finding(
                    "unused-parameters",
                    "warning",
                    "DDP failed because some parameters get no gradient; retried with "
                    "find_unused_parameters=True",
                    {"strategy": strategy, "error": str(failure)},
                    cause="parameters that do not contribute to the loss (an unused branch or head)",
                    fix="pass find_unused_parameters=True (or static_graph=True) to "
                    "DistributedDataParallel, or make every parameter contribute",
                )
            )
            try:
                config = replace(base, strategy=strategy, find_unused_parameters=True)
                outcome.results[strategy] = run(factory, inputs, targets, config)
                outcome.options[strategy] = {"find_unused_parameters": True}
                del outcome.failures[strategy]
                continue
            except RankFailure as again:
                failure = again
                outcome.failures[strategy] = again
        finding = failure.to_finding()
        out.append(
            replace(
                finding,
                message=f"{strategy} ({mode}): {finding.message}",
                evidence={**finding.evidence, "strategy": strategy, "mode": mode},
            )
        )
    return out


def _nonfinite(outcome: _Run, order: tuple[str, ...]) -> list[Finding]:
    out = []
    for strategy, result in outcome.results.items():
        bad = _first_nonfinite(result.grads, order)
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
                cause="corrupt data on a link (see the transfer), or a model/learning rate that diverges "
                "(then single fails too)",
                fix="if only parallel strategies fail, run `gpudiag nancheck` and rerun with "
                "NCCL_P2P_DISABLE=1; if single fails too, lower the learning rate or check the model",
            )
        )
    return out


def _first_nonfinite(grads: dict[str, torch.Tensor], order: tuple[str, ...]) -> str | None:
    """The first parameter (in module order) whose gradient holds a NaN or an Inf: a norm
    is finite exactly when every value is (``_norms`` retakes in float64 any that only
    overflowed), so one fused pass tells."""
    names = [n for n in order if n in grads]
    norms = _norms([grads[n] for n in names])
    return next((n for n, norm in zip(names, norms, strict=True) if not math.isfinite(norm)), None)


def _unused_params(outcome: _Run, order: tuple[str, ...]) -> list[str]:
    """Trainable parameters that got no gradient in the reference run."""
    ref = outcome.results.get("single")
    return [] if ref is None else [n for n in order if n not in ref.grads]


def _unused_finding(unused: list[str]) -> Finding:
    shown = ", ".join(unused[:3]) + ("…" if len(unused) > 3 else "")
    return Finding(
        "unused-parameters",
        "warning",
        f"{len(unused)} parameter(s) get no gradient ({shown}): DDP without find_unused_parameters=True "
        "leaves their bucket un-reduced in the first step and fails on the next; compared with "
        "find_unused_parameters=True",
        {"params": unused},
        cause="parameters that do not contribute to the loss (an unused branch or head)",
        fix="pass find_unused_parameters=True (or static_graph=True) to DistributedDataParallel, "
        "or remove the unused parameters",
    )


def _ranks_diverged(outcome: _Run) -> list[Finding]:
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


def _train_mode_causes(traits: ModelTraits) -> list[str]:
    return (["batchnorm"] if traits.batchnorm else []) + (["dropout"] if traits.dropout else [])


def _train_mode_findings(traits: ModelTraits, diffs: list[Comparison], confirmed: bool) -> list[Finding]:
    worst = max(diffs, key=lambda c: c.rel_norm_err)
    evidence = {
        "strategies": [c.strategy for c in diffs],
        "rel_norm_err": worst.rel_norm_err,
        "confirmed_by_controlled_rerun": confirmed,
    }
    how = (
        "a rerun with BatchNorm on running statistics and dropout off agrees"
        if confirmed
        else "not confirmed (--mode as-is); --mode auto reruns in controlled mode to confirm"
    )
    out = []
    if traits.batchnorm:
        out.append(
            Finding(
                "batchnorm-per-replica",
                "warning",
                f"BatchNorm in train mode ({len(traits.batchnorm)} layer(s), "
                f"e.g. module {traits.batchnorm[0]!r}) normalises each replica's sub-batch with its own "
                f"statistics: relative norm error {worst.rel_norm_err:.3g}; {how}",
                {**evidence, "modules": list(traits.batchnorm)},
                cause="per-device batch statistics (expected with DP and with DDP without SyncBatchNorm)",
                fix="for agreement, use SyncBatchNorm under DDP (torch.nn.SyncBatchNorm."
                "convert_sync_batchnorm) or larger per-device batches; for tests, BatchNorm in eval mode",
            )
        )
    if traits.dropout:
        out.append(
            Finding(
                "dropout-active",
                "warning",
                f"dropout in train mode ({len(traits.dropout)} layer(s), e.g. module {traits.dropout[0]!r}) "
                f"draws different masks under each strategy: relative norm error "
                f"{worst.rel_norm_err:.3g}; {how}",
                {**evidence, "modules": list(traits.dropout)},
                cause="random masks depend on how the batch is split and which RNG each device uses",
                fix="compare with dropout off (model.eval() for those layers); in training this is expected",
            )
        )
    return out


@dataclass(frozen=True)
class _Job:
    """What a rerun needs: the factory and batch, the run settings, how to compare."""

    factory: ModelFn
    inputs: Any
    targets: torch.Tensor
    base: RunConfig
    world: int
    tol: float
    order: tuple[str, ...]


def _scaling_and_shards(
    diffs: list[Comparison], outcome: _Run, job: _Job, loss: Any
) -> tuple[list[Finding], list[Comparison]]:
    findings, left = [], []
    world, targets = job.world, job.targets
    batch = len(targets)
    for c in diffs:
        near = lambda x, y: abs(x / y - 1) <= RATIO_SLACK  # noqa: E731
        if (
            c.strategy == "ddp"
            and c.cosine >= COSINE_SAME
            and (near(c.norm_ratio, 1 / world) or near(c.norm_ratio, world))
        ):
            factor = "1/W" if near(c.norm_ratio, 1 / world) else "W"
            findings.append(
                Finding(
                    "loss-scale-world-size",
                    "warning",
                    f"DDP's gradient is {c.norm_ratio:.4g}x single's ({factor}, W={world}) with cosine "
                    f"{c.cosine:.6f}: the loss scale depends on the world size",
                    {
                        "strategy": c.strategy,
                        "norm_ratio": c.norm_ratio,
                        "cosine": c.cosine,
                        "world_size": world,
                        "loss": loss if isinstance(loss, str) else "custom",
                    },
                    cause="DDP averages gradients over ranks: a sum-reduced loss gives 1/W of the single-GPU "
                    "gradient; a mean loss multiplied by W (compensation applied twice) gives W",
                    fix="use a mean-reduced loss, or multiply a summed local loss by W",
                )
            )
            continue
        if c.strategy == "ddp" and batch % world and _mean_of_means_matches(c, outcome, job):
            findings.append(
                Finding(
                    "uneven-shards",
                    "warning",
                    f"batch {batch} does not split evenly over {world} DDP ranks "
                    f"({'/'.join(str(len(t)) for t in targets.chunk(world))}): DDP averages per-rank "
                    f"means, which weights samples unequally (relative norm error {c.rel_norm_err:.3g})",
                    {
                        "batch_size": batch,
                        "world_size": world,
                        "shards": [len(t) for t in targets.chunk(world)],
                        "rel_norm_err": c.rel_norm_err,
                    },
                    cause="(x1/n1 + x2/n2)/2 differs from (x1+x2)/(n1+n2) when n1 != n2",
                    fix="use a global batch divisible by the world size (drop_last=True), or normalise "
                    "by the global sample count",
                )
            )
            continue
        left.append(c)
    return findings, left


def _mean_of_means_matches(c: Comparison, outcome: _Run, job: _Job) -> bool:
    """Recompute DDP's semantics on one device — the average of each shard's gradient — and
    check that DDP matches it."""
    ddp = outcome.results.get("ddp")
    if ddp is None:
        return False
    inputs, targets, base, world = job.inputs, job.targets, job.base, job.world
    shards_x = (
        inputs.chunk(world)
        if not isinstance(inputs, tuple)
        else list(zip(*(x.chunk(world) for x in inputs), strict=True))
    )
    shards_y = targets.chunk(world)
    single = replace(
        base,
        strategy="single",
        steps=1,
        devices=DeviceSet.virtual(1) if base.devices.kind == "virtual" else base.devices,
    )
    grads: dict[str, torch.Tensor] = {}
    for x, y in zip(shards_x, shards_y, strict=True):
        result = run(job.factory, x, y, single)
        for n, g in result.grads.items():
            grads[n] = grads.get(n, torch.zeros_like(g)) + g / world
    expected = RunResult("mean-of-means", [], grads, {}, {}, ddp.recorder)
    return compare("ddp", c.mode, world, ddp, expected, job.tol, list(job.order)).rel_norm_err <= job.tol


def _few_replicas(batch: int, world: int) -> Finding:
    used = len(torch.empty(batch).chunk(world))
    return Finding(
        "uneven-shards",
        "info",
        f"batch {batch} is smaller than the {world} devices: DataParallel runs {used} replica(s), DDP cannot "
        "give every rank data",
        {"batch_size": batch, "world_size": world, "dp_replicas": used},
        fix="use a batch of at least the device count",
    )


def _uneven_info(batch: int, world: int) -> Finding:
    return Finding(
        "uneven-shards",
        "info",
        f"batch {batch} does not split evenly over {world} ranks "
        f"({'/'.join(str(len(t)) for t in torch.empty(batch).chunk(world))}); DataParallel still matches "
        "single (it computes the loss on the gathered output)",
        {"batch_size": batch, "world_size": world},
    )
