"""Why a configuration is slower than it should be: findings from measured figures.

Pure: :func:`explain` reads :class:`~checks.bench.figures.Case` figures and the host's
core count, runs nothing, so each finding is tested with figures arranged by hand. Codes
are documented in ``docs/findings.md``.
"""

from __future__ import annotations

from gpudiag.findings import Finding
from gpudiag.topology.analysis import cuda_visible_devices

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
#: The wait for the next batch (``--data loader``) above this share of the step.
INPUT_BOUND_SHARE = 0.10
#: DataParallel's first GPU at this multiple of the others' peak memory, and at least
#: :data:`MEMORY_IMBALANCE_MIN` bytes more.
MEMORY_IMBALANCE_RATIO = 1.25
MEMORY_IMBALANCE_MIN = 256 * 2**20
#: A DDP rank whose own compute per step is this multiple of the other ranks' median.
STRAGGLER_RATIO = 1.25


def _pct(x: float) -> str:
    return f"{100 * x:.0f} %"


def explain(
    cases: list[Case],
    cores: int,
    loader_workers: int | None = None,
    cuda: bool = True,
    floor: tuple[float, float] | None = None,
) -> list[Finding]:
    """Findings for the measured ``cases`` (those without an error) on a host with
    ``cores`` CPU cores; ``loader_workers``: the DataLoader's workers per process
    (``--data loader:N``; None for synthetic data); ``cuda``: measured on CUDA GPUs (else
    CPU virtual devices); ``floor``: (bench's own per-step cost, the step time below which
    figures are not trusted), seconds (``checks.bench.run.step_overhead``)."""
    ok = [c for c in cases if c.error is None and c.steps]
    found: list[Finding] = _below_floor(ok, floor)
    for case in ok:
        found += _input_bound(case, loader_workers, cores) + _dp_overhead(case) + _memory_imbalance(case)
        found += _comm_exposed(case) + _poorly_connected(case) + _stragglers(case)
        found += _small_batch(case) + _oversubscribed(case, cores)
    found += _amp_no_gain(ok, cuda)
    return found


def _below_floor(cases: list[Case], floor: tuple[float, float] | None) -> list[Finding]:
    if floor is None:
        return []
    overhead, trusted = floor
    below = [c for c in cases if c.p50 < trusted]
    if not below or overhead <= 0:
        return []
    shortest = min(below, key=lambda c: c.p50)
    names = ", ".join(f"{c.label} ({1e3 * c.p50:.2f} ms)" for c in below)
    return [
        Finding(
            "below-timing-floor",
            "info",
            f"steps under {1e3 * trusted:.2f} ms are not trusted: bench's own work per step "
            f"({1e3 * overhead:.3f} ms) is more than {_pct(overhead / trusted)} of them "
            f"({_pct(overhead / shortest.p50)} of the shortest) — {names}; "
            "their samples/s understates what a bare training loop gets",
            {
                "step_overhead_s": overhead,
                "trusted_step_floor_s": trusted,
                "cases": [c.label for c in below],
                "step_p50_s": [c.p50 for c in below],
            },
            cause="the runtime's step (phase marks, the loss read back, the batch handling) costs a fixed "
            "time per step, measured with a one-unit model on the same device; on millisecond steps it is "
            "a visible share, so the figures compare the machinery rather than the model",
            fix="raise the batch (--batch-size) or the input size so a step takes longer than the floor, "
            "or time such a small model with your own loop",
        )
    ]


def _evidence(case: Case, **more: object) -> dict[str, object]:
    return {
        "case": case.label,
        "batch": case.batch,
        "per_gpu_batch": case.per_gpu_batch,
        "step_s": round(case.step_time, 6),
        **more,
    }


def _input_bound(case: Case, workers: int | None, cores: int) -> list[Finding]:
    if workers is None:
        return []
    share = case.share("data")
    if share <= INPUT_BOUND_SHARE:
        return []
    processes = case.gpus if case.strategy == "ddp" else 1
    return [
        Finding(
            "input-bound",
            "warning",
            f"{case.label}: {_pct(share)} of each step waits for the next batch from the DataLoader "
            f"({1e3 * case.phases['data']:.2f} ms of {1e3 * case.step_time:.2f} ms; {workers} worker"
            f"{'s' if workers != 1 else ''} per process)",
            _evidence(case, share=round(share, 4), data_s=case.phases["data"], workers=workers, cores=cores),
            cause="the input pipeline (reading, decoding, augmenting, collating on the CPU) produces "
            "batches more slowly than the devices consume them, so the devices idle",
            fix=_input_fix(workers, cores, processes),
        )
    ]


def _input_fix(workers: int, cores: int, processes: int) -> str:
    """More DataLoader workers when the cores allow them (at most the cores per training
    process, counting the process itself), else the CPU is the limit: say so, never advise
    more workers than there are cores."""
    per_process = max(1, cores // processes)
    rest = (
        "pin_memory=True and persistent_workers=True, lighter or GPU-side augmentation, a faster "
        "storage format; --data synthetic shows the devices' ceiling"
    )
    if workers + 1 < per_process:
        more = min(2 * max(workers, 1), per_process - 1)
        return (
            f"give the DataLoader more workers (num_workers={more}, here --data loader:{more}: this host has "
            f"{cores} cores for {processes} training process{'es' if processes != 1 else ''}, "
            f"{per_process} each with the process itself), {rest}"
        )
    return (
        f"more workers would not help here: {processes} training process{'es' if processes != 1 else ''} "
        f"and {workers} worker{'s' if workers != 1 else ''} per process already take this host's {cores} "
        f"core{'s' if cores != 1 else ''}; a host with more cores per GPU, {rest}"
    )


def _memory_imbalance(case: Case) -> list[Finding]:
    memory = case.peak_memory or {}
    if case.strategy != "dp" or len(memory) < 2 or not case.devices:
        return []
    first = memory.get(case.devices[0])
    others = [b for d, b in memory.items() if d != case.devices[0]]
    if first is None or not others:
        return []
    most = max(others)
    if first < MEMORY_IMBALANCE_RATIO * most or first - most < MEMORY_IMBALANCE_MIN:
        return []
    return [
        Finding(
            "dp-memory-imbalance",
            "warning",
            f"{case.label}: the first GPU (cuda:{case.devices[0]}) peaks at {first / 2**20:.0f} MiB, "
            f"{first / most:.2f}× the others' {most / 2**20:.0f} MiB",
            _evidence(case, first_device=case.devices[0], first_bytes=first, others_max_bytes=most),
            cause="DataParallel keeps the model, the optimizer state, the gathered outputs and the loss "
            "on its first GPU and scatters from there, so that GPU fills first and caps the batch for all",
            fix="use DistributedDataParallel (every GPU holds the same); or leave headroom on the first "
            "GPU (a smaller batch, or compute the loss inside the module so only the loss is gathered)",
        )
    ]


def _poorly_connected(case: Case) -> list[Finding]:
    if not case.better_devices or case.better_link is None:
        return []
    chosen = ",".join(map(str, case.devices))
    better = ",".join(map(str, case.better_devices))
    return [
        Finding(
            "gpus-poorly-connected",
            "warning",
            f"{case.label}: the chosen GPUs ({chosen}) talk over {'/'.join(case.links) or 'unknown links'}, "
            f"while GPUs {better} are joined by {case.better_link} or better",
            _evidence(case, devices=case.devices, links=case.links, better=case.better_devices),
            cause="the GPUs were picked by number, not by how they are connected: gradients and "
            "DataParallel's copies cross a slower PCIe path (or the CPU interconnect)",
            fix=f"run on GPUs {better} ({cuda_visible_devices(case.better_devices)}; gpudiag topology lists "
            "the best-connected groups)",
        )
    ]


def _stragglers(case: Case) -> list[Finding]:
    from statistics import median

    ranks = [r for r in case.ranks if r.get("compute_s") is not None]
    if len(ranks) < 2:
        return []
    found = []
    for r in ranks:
        others = median(o["compute_s"] for o in ranks if o is not r)
        waits = median(o.get("allreduce_s", 0.0) for o in ranks if o is not r)
        if others <= 0 or r["compute_s"] < STRAGGLER_RATIO * others:
            continue
        if waits - r.get("allreduce_s", 0.0) < 0.5 * (r["compute_s"] - others):
            continue  # the others do not wait for it (about its extra time): noise, not a straggler
        where = f" on {r['host']}" if r.get("host") else ""
        found.append(
            Finding(
                "rank-straggler",
                "warning",
                f"{case.label}: rank {r['rank']}{where} computes a step in {1e3 * r['compute_s']:.2f} ms, "
                f"{r['compute_s'] / others:.2f}× the other ranks' {1e3 * others:.2f} ms; they wait for it "
                "in every all-reduce",
                _evidence(
                    case, rank=r["rank"], host=r.get("host"), compute_s=r["compute_s"], others_s=others
                ),
                cause="one process is slower than its peers: a throttled or shared GPU, a busier CPU or "
                "input pipeline on its node, a different GPU model — DDP runs at the slowest rank's pace",
                fix=f"look at rank {r['rank']}'s node (nvidia-smi -q -d PERFORMANCE,CLOCK for throttling, "
                "other processes on its GPU, its CPU load); gpudiag sweep compares nodes",
            )
        )
    return found


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
            cause=_comm_cause(links),
            fix="raise the per-GPU batch (more compute to hide it), use better-connected GPUs "
            "(gpudiag topology), or try gradient compression hooks (bf16_compress_hook)",
        )
    ]


def _comm_cause(links: list[str]) -> str:
    """Why an all-reduce shows, by the links between the GPUs used."""
    slow = [link for link in links if not link.startswith("NV")]
    if slow:
        return (
            f"the gradients' all-reduce is slower than the backward it could overlap with: the GPUs talk "
            f"over {'/'.join(slow)} (PCIe, or across CPU sockets for NODE/SYS) rather than NVLink"
        )
    if links:
        return (
            "the gradients' all-reduce is slower than the backward it could overlap with, although the GPUs "
            f"share {'/'.join(links)}: too little compute per step to hide it, or many small buckets"
        )
    return (
        "the gradients' all-reduce is slower than the backward it could overlap with: a slow link (PCIe or "
        "across CPU sockets rather than NVLink), or too little compute per step"
    )


def _small_batch(case: Case) -> list[Finding]:
    if case.gpus < 2 or case.efficiency is None:
        return []
    if case.per_gpu_batch >= SMALL_BATCH or case.efficiency >= SMALL_BATCH_EFFICIENCY:
        return []
    if case.share("data") > INPUT_BOUND_SHARE:
        return []  # the input pipeline holds it back (input-bound says so), not the batch
    return [
        Finding(
            "per-gpu-batch-small",
            "warning",
            f"{case.label}: a per-GPU batch of {case.per_gpu_batch} scales at {_pct(case.efficiency)} "
            f"efficiency (speedup {case.speedup:.2f} on {case.gpus} GPUs)",
            _evidence(case, efficiency=round(case.efficiency, 4), speedup=case.speedup),
            cause="each device gets too little work per step to hide the fixed costs of a step "
            "(kernel launches, synchronisation, communication)",
            fix=f"raise the per-GPU batch to {SMALL_BATCH} or more (e.g. --per-gpu --batch-size "
            f"{2 * SMALL_BATCH}), or use "
            "fewer GPUs; with a fixed global batch (--global) the per-GPU batch shrinks as GPUs are added",
        )
    ]


def _oversubscribed(case: Case, cores: int) -> list[Finding]:
    processes, threads = len(case.threads), max(case.threads, default=0)
    if processes < 2 or sum(case.threads) <= cores:
        return []
    if threads == 1:  # one thread each already: more processes than cores
        message = (
            f"{processes} processes of one compute thread each on {cores} CPU core{'s' if cores != 1 else ''}"
        )
        cause = (
            "there are more training processes than cores, so they take turns on the CPU "
            "(on CPU virtual devices every rank is such a process)"
        )
        fix = "run fewer processes per machine than it has cores, or measure on GPUs"
    else:
        message = (
            f"{processes} processes × {threads} threads each = {sum(case.threads)} compute threads "
            f"on {cores} CPU cores"
        )
        cause = (
            "every rank's torch uses as many intra-op threads as the machine has cores, so the ranks' "
            "threads fight for the same cores"
        )
        fix = (
            f"set OMP_NUM_THREADS={max(1, cores // processes)} (cores ÷ ranks; torchrun sets 1) "
            "or torch.set_num_threads in each rank"
        )
    evidence = _evidence(case, processes=processes, threads=case.threads, cores=cores)
    return [
        Finding("cpu-oversubscribed", "warning", f"{case.label}: {message}", evidence, cause=cause, fix=fix)
    ]


def _amp_no_gain(cases: list[Case], cuda: bool) -> list[Finding]:
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
                "multiples of 8; look at the phase breakdown for where the step goes"
                if cuda
                else "measured on CPU virtual devices, which have no tensor cores: this says nothing about "
                "mixed precision on a GPU; measure it there",
            )
        )
    return found
