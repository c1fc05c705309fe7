"""Why a configuration is slower than it should be: findings from measured figures.

Pure: :func:`explain` reads :class:`~checks.bench.figures.Case` figures and the host's
core count, runs nothing, so each finding is tested with figures arranged by hand. Codes
are documented in ``docs/findings.md``.
"""

from __future__ import annotations

from gpudiag.findings import Finding

from .figures import DP_PHASES, Case

#: DataParallel's scatter + replicate + gather above this share of the step.
DP_OVERHEAD_SHARE = 0.15
#: Exposed all-reduce above this share of the step.
COMM_EXPOSED_SHARE = 0.20
#: A per-GPU batch below this, with scaling efficiency below :data:`SMALL_BATCH_EFFICIENCY`.
SMALL_BATCH = 32
SMALL_BATCH_EFFICIENCY = 0.75
#: Mixed precision must beat fp32's samples/s by at least this factor to count as a gain.
AMP_MIN_GAIN = 1.05


def _pct(x: float) -> str:
    return f"{100 * x:.0f} %"


def explain(cases: list[Case], cores: int) -> list[Finding]:
    """Findings for the measured ``cases`` (those without an error) on a host with
    ``cores`` CPU cores."""
    ok = [c for c in cases if c.error is None and c.steps]
    found: list[Finding] = []
    for case in ok:
        found += _dp_overhead(case) + _comm_exposed(case) + _small_batch(case) + _oversubscribed(case, cores)
    found += _amp_no_gain(ok)
    return found


def _evidence(case: Case, **more: object) -> dict[str, object]:
    return {
        "case": case.label,
        "batch": case.batch,
        "per_gpu_batch": case.per_gpu_batch,
        "step_s": round(case.step_time, 6),
        **more,
    }


def _dp_overhead(case: Case) -> list[Finding]:
    if case.strategy != "dp" or case.gpus < 2:
        return []
    share = case.share(*DP_PHASES)
    if share <= DP_OVERHEAD_SHARE:
        return []
    parts = ", ".join(f"{n} {1e3 * case.phases.get(n, 0.0):.2f} ms" for n in DP_PHASES)
    return [
        Finding(
            "dp-overhead",
            "warning",
            f"{case.label}: DataParallel's scatter, replicate and gather take {_pct(share)} of each "
            f"step ({parts})",
            _evidence(case, share=round(share, 4), **{f"{n}_s": case.phases.get(n, 0.0) for n in DP_PHASES}),
            cause="DataParallel copies the weights to every GPU and splits and gathers the batch on "
            "the first GPU in every step, from one Python process (one thread per GPU under the GIL)",
            fix="use DistributedDataParallel (one process per GPU: torchrun --nproc-per-node N); "
            "compare with --strategies dp,ddp",
        )
    ]


def _comm_exposed(case: Case) -> list[Finding]:
    if case.strategy != "ddp" or case.gpus < 2:
        return []
    share = case.share("allreduce")
    if share <= COMM_EXPOSED_SHARE:
        return []
    links = sorted(set(case.links))
    over = f" over {'/'.join(links)}" if links else ""
    return [
        Finding(
            "comm-exposed",
            "warning",
            f"{case.label}: {_pct(share)} of each step waits for the gradient all-reduce{over} "
            f"after backward ({1e3 * case.phases['allreduce']:.2f} ms exposed, "
            f"{1e3 * (case.allreduce_hidden or 0.0):.2f} ms hidden under backward)",
            _evidence(
                case,
                share=round(share, 4),
                exposed_s=case.phases["allreduce"],
                hidden_s=case.allreduce_hidden,
                links=links,
            ),
            cause="the gradients' all-reduce is slower than the backward it could overlap with: "
            "a slow link (PCIe or across CPU sockets rather than NVLink), or too little compute per step",
            fix="raise the per-GPU batch (more compute to hide it), use better-connected GPUs "
            "(gpudiag topology), or try gradient compression hooks (bf16_compress_hook)",
        )
    ]


def _small_batch(case: Case) -> list[Finding]:
    if case.gpus < 2 or case.efficiency is None:
        return []
    if case.per_gpu_batch >= SMALL_BATCH or case.efficiency >= SMALL_BATCH_EFFICIENCY:
        return []
    return [
        Finding(
            "per-gpu-batch-small",
            "warning",
            f"{case.label}: a per-GPU batch of {case.per_gpu_batch} scales at {_pct(case.efficiency)} "
            f"efficiency (speedup {case.speedup:.2f} on {case.gpus} GPUs)",
            _evidence(case, efficiency=round(case.efficiency, 4), speedup=case.speedup),
            cause="each device gets too little work per step to hide the fixed costs of a step "
            "(kernel launches, synchronisation, communication)",
            fix=f"raise the per-GPU batch (at least {SMALL_BATCH}: --per-gpu --batch-size 64), or use "
            "fewer GPUs; with a fixed global batch (--global) the per-GPU batch shrinks as GPUs are added",
        )
    ]


def _oversubscribed(case: Case, cores: int) -> list[Finding]:
    if len(case.threads) < 2 or sum(case.threads) <= cores:
        return []
    return [
        Finding(
            "cpu-oversubscribed",
            "warning",
            f"{case.label}: {len(case.threads)} processes × {max(case.threads)} threads = "
            f"{sum(case.threads)} compute threads on {cores} CPU cores",
            _evidence(case, processes=len(case.threads), threads=case.threads, cores=cores),
            cause="every rank's torch uses as many intra-op threads as the machine has cores, so the "
            "ranks' threads fight for the same cores",
            fix=f"set OMP_NUM_THREADS={max(1, cores // len(case.threads))} (cores ÷ ranks; torchrun sets 1) "
            "or torch.set_num_threads in each rank",
        )
    ]


def _amp_no_gain(cases: list[Case]) -> list[Finding]:
    fp32 = {(c.strategy, c.gpus, c.batch): c for c in cases if c.dtype == "fp32"}
    found = []
    for case in cases:
        base = fp32.get((case.strategy, case.gpus, case.batch))
        if case.dtype == "fp32" or base is None:
            continue
        gain = case.samples_per_s / base.samples_per_s
        if gain >= AMP_MIN_GAIN:
            continue
        found.append(
            Finding(
                "amp-no-gain",
                "warning",
                f"{case.label}: {gain:.2f}× the samples/s of fp32 ({case.samples_per_s:.1f} against "
                f"{base.samples_per_s:.1f}): mixed precision gains nothing here",
                _evidence(case, gain=round(gain, 4), fp32_samples_per_s=base.samples_per_s),
                cause="the step is not bound by matrix arithmetic that lower precision speeds up: "
                "small layers, a CPU, a GPU without tensor cores for the dtype, or time spent elsewhere "
                "(data, communication, DataParallel's copies); fp16 also pays its loss scaling",
                fix="keep fp32, or give the tensor cores work: larger batches and layer widths that are "
                "multiples of 8; look at the phase breakdown for where the step goes",
            )
        )
    return found
