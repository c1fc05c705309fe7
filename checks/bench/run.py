"""``gpudiag bench``: plan the cases, run each through the runtime with phase timing
(``RunConfig.time_phases``), fold the phases into figures, explain.

Each case is one runtime run of ``warmup + steps`` steps (the warm-up steps' figures are
dropped: the first step builds the optimizer, allocates, autotunes). The model and batch
are the same for every case. ``--data synthetic``: the batch is placed on its device
before the first step (the GPU's ceiling: no data loading); ``--data loader:N``: each
training process reads its share of every batch from a real DataLoader (:mod:`.data`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from gpudiag import defaults as D
from gpudiag.checks.options import BENCH
from gpudiag.errors import InputError, from_user_code, naming_model
from gpudiag.progress import note
from gpudiag.runtime.launch import torchrun_world
from gpudiag.topology.model import Topology

from .data import LoaderData, parse_data
from .explain import explain
from .figures import Case, percentile, rank_figures, step_times
from .nccl import BenchNccl, records
from .report import BenchResult

CONVENTIONS = ("per_gpu", "global")


def _per_gpu(batch: int, gpus: int) -> int:
    """The largest ``torch.chunk`` piece of ``batch`` over ``gpus``."""
    return -(-batch // gpus)


def plan(
    strategies: Sequence[str], gpus: Sequence[int], dtypes: Sequence[str], batch_size: int, convention: str
) -> list[tuple[str, int, str, int]]:
    """The cases, in order: (strategy, GPUs, dtype, global batch); ``single`` runs once per
    dtype on one device, the others once per GPU count. A value named twice counts once."""
    if convention not in CONVENTIONS:
        raise InputError(f"unknown batch convention {convention!r} (expected per_gpu or global)")
    cases = []
    for dtype in dict.fromkeys(dtypes):
        for strategy in dict.fromkeys(strategies):
            for n in [1] if strategy == "single" else dict.fromkeys(gpus):
                batch = batch_size * n if convention == "per_gpu" else batch_size
                if batch < n:
                    raise InputError(f"a global batch of {batch} cannot be split over {n} GPUs")
                cases.append((strategy, n, dtype, batch))
    return cases


def _devices(machine: Topology | None) -> tuple[str, list[int]]:
    """Where to run: ("cuda", ids), ("virtual", the machine's GPU ids), ("virtual", [])
    (any number of virtual devices)."""
    if machine is not None:
        from gpudiag.topology.model import gpu_index

        return "virtual", sorted(i for i in (gpu_index(lbl) for lbl in machine.gpu_labels) if i is not None)
    from gpudiag.hw.cuda import cuda_device_count

    count = cuda_device_count()
    return ("cuda", list(range(count))) if count else ("virtual", [])


def _choose(
    kind: str, available: list[int], n: int, machine: Topology | None, asked: Sequence[int] | None = None
) -> list[int] | None:
    """``n`` devices: the first ``n`` of ``asked`` (``--devices``), else the
    best-connected group of a machine, else the first ``n`` GPUs; None when there are
    not enough."""
    if asked:
        return list(asked[:n]) if n <= len(asked) else None
    if kind == "virtual" and not available:
        return list(range(n))
    if n > len(available):
        return None
    best = _best_group(machine, n)
    return best if best is not None else available[:n]


def _best_group(machine: Topology | None, n: int) -> list[int] | None:
    """The best-connected ``n`` GPUs of ``machine`` (``topology.analysis.best_groups``)."""
    if machine is None or n < 2:
        return None
    from gpudiag.topology.analysis import best_groups

    groups = best_groups(machine, n)
    return list(groups[0]) if groups else None


def _better_connected(devices: Any, ids: list[int], machine: Topology | None) -> tuple[list[int], str] | None:
    """The best group of as many GPUs and its worst link, when its worst link is better
    than the worst link between ``ids`` (both known); else None."""
    from gpudiag.topology.model import link_rank

    best = _best_group(machine, len(ids))
    if best is None or sorted(best) == sorted(ids):
        return None
    worst = min((devices.link(a, b) for a in ids for b in ids if a < b), key=link_rank)
    best_worst = min((devices.link(a, b) for a in best for b in best if a < b), key=link_rank)
    if worst is None or best_worst is None or link_rank(best_worst) <= link_rank(worst):
        return None
    return best, best_worst


def default_gpus(kind: str, available: list[int], asked: Sequence[int] | None = None) -> tuple[int, ...]:
    if asked:
        return (len(asked),)
    if kind == "virtual" and not available:
        return (2,)
    return tuple(n for n in (2, 4, 8) if n <= len(available)) or (1,)


def bench(
    model: str | Callable[[], Any],
    *,
    input_shape: tuple[int, ...] = D.INPUT_SHAPE,
    num_classes: int = D.NUM_CLASSES,
    batch_size: int = BENCH.batch_size,
    convention: str = "per_gpu",
    strategies: Sequence[str] = BENCH.strategies,
    gpus: Sequence[int] | None = None,
    dtypes: Sequence[str] = BENCH.dtypes,
    data: str = "synthetic",
    devices: Sequence[int] | None = None,
    epoch_samples: int = BENCH.epoch_samples,
    steps: int = BENCH.steps,
    warmup: int = BENCH.warmup,
    machine: Topology | str | None = None,
    input_dtype: str = "float",
    input_range: tuple[float, float] | None = None,
    optimizer: str = "sgd",
    lr: float = D.LR,
    seed: int = D.SEED,
    timeout: float = BENCH.timeout,
) -> BenchResult:
    """Measure ``model`` (a ``--model`` spec or a factory) per (strategy, GPU count,
    dtype): samples/s, step time p50/p95, speedup, phases, peak memory. ``convention``:
    ``per_gpu`` (``batch_size`` per GPU) or ``global`` (``batch_size`` in total).
    ``data``: ``synthetic`` or ``loader[:WORKERS]`` (:mod:`.data`). ``devices``: the GPUs
    to use (torch indices; a machine's GPU numbers), first ``n`` for ``n`` GPUs; default
    the best-connected group of a machine, else the first GPUs. ``epoch_samples``: the
    epoch the time per epoch is given for (default CIFAR-10's 50,000).
    On CPU virtual devices (no GPU, or ``machine`` given) the result is ``simulated``."""
    from gpudiag.hw.sources import read_machine_or_capture
    from gpudiag.models import random_batch, resolve_model
    from gpudiag.runtime import DeviceSet, RankFailure, RunConfig, run

    data_kind, workers = parse_data(data)
    if steps < 2 or warmup < 1:
        raise InputError("bench needs at least 2 timed steps and 1 warm-up step")
    if epoch_samples < 1:
        raise InputError("--epoch-samples must be at least 1")
    source = machine if isinstance(machine, str) else None
    topo = read_machine_or_capture(machine) if isinstance(machine, str) else machine
    kind, available = _devices(topo)
    if devices is not None:
        _check_devices(kind, available, devices)
    counts = tuple(gpus) if gpus else default_gpus(kind, available, devices)
    world = torchrun_world()
    skipped: list[dict[str, Any]] = []
    if world is not None:  # every process of the job runs this; the ranks' figures are gathered
        skipped = [
            {
                "case": s,
                "reason": "under torchrun only ddp is measured (one process per GPU); run bench "
                "without torchrun for single and dp",
            }
            for s in strategies
            if s != "ddp"
        ]
        strategies, counts = [s for s in strategies if s == "ddp"], (world,)
        if not strategies:
            raise InputError("under torchrun bench measures ddp: add ddp to --strategies")
    spec = model if isinstance(model, str) else getattr(model, "__name__", "model")
    factory = resolve_model(model, input_shape, num_classes) if isinstance(model, str) else model
    planned = plan(strategies, counts, dtypes, batch_size, convention)
    batches: dict[int, Any] = {}
    cases: list[Case] = []
    nccl = BenchNccl(records(kind) and "ddp" in strategies, torchrun=world is not None)
    with naming_model(spec), nccl:
        for strategy, n, dtype, batch in planned:
            label = f"{strategy} ×{n} {dtype}"
            ids = (
                _choose(kind, available, n, topo, devices)
                if world is None
                else _local_ids(kind, available, n)
            )
            if ids is None:
                have = f"--devices names {len(devices)}" if devices else f"{len(available)} here"
                skipped.append({"case": label, "reason": f"{n} devices asked for, {have}"})
                continue
            if batch not in batches:
                batches[batch] = random_batch(
                    factory, batch, input_shape, num_classes, "ce", seed, None, input_dtype, input_range
                )
            inputs, targets = batches[batch]
            device_set = DeviceSet.virtual(ids, topo) if kind == "virtual" else DeviceSet.cuda(ids)
            loader = (
                LoaderData(
                    workers,
                    batch,
                    warmup + steps,
                    input_shape,
                    num_classes,
                    input_dtype,
                    input_range,
                    seed,
                    pin_memory=kind == "cuda",
                )
                if data_kind == "loader"
                else None
            )
            config = RunConfig(
                strategy,  # type: ignore[arg-type, unused-ignore]
                device_set,
                steps=warmup + steps,
                optimizer=optimizer,  # type: ignore[arg-type, unused-ignore]
                lr=lr,
                dtype=dtype,
                seed=seed,
                watch=False,
                keep_state=True,  # every timed step applies its update
                timeout=timeout,
                time_phases=True,
                loader=loader,
            )
            case = Case(strategy, n, dtype, batch, _per_gpu(batch, n), devices=ids)
            case.links = sorted(
                {link for a in ids for b in ids if a < b for link in [device_set.link(a, b)] if link}
            )
            better = _better_connected(device_set, ids, topo) if strategy != "single" else None
            if better is not None:
                case.better_devices, case.better_link = better
            note(f"bench: {label}, batch {batch}")
            try:
                with _one_thread(kind == "virtual" and strategy != "ddp"), nccl.case(case):
                    result = run(factory, inputs, targets, config)
            except RankFailure as exc:
                case.error = str(exc)
                cases.append(case)
                continue
            except (Exception, SystemExit) as exc:  # the user's model, in this process (single or dp)
                raise from_user_code(exc, f"the model under {strategy}") from exc
            timed = step_times(strategy, result.recorder.phases, warmup)
            case.steps, case.phases, case.allreduce_hidden = timed.steps, timed.phases, timed.allreduce_hidden
            case.peak_memory = result.timing.get("peak_memory") if kind == "cuda" else None
            case.threads = list(result.timing.get("threads", []))
            if strategy == "ddp":
                case.ranks = rank_figures(result.recorder.phases, warmup, result.timing.get("hosts", []))
            cases.append(case)
        transport = nccl.result(topo)
    if not cases:
        reasons = "; ".join(f"{s['case']}: {s['reason']}" for s in skipped)
        raise InputError(f"nothing to measure: {reasons}")
    _speedups(cases)
    first = cases[0].devices or [0]
    overhead = step_overhead(
        DeviceSet.virtual(first[:1], topo) if kind == "virtual" else DeviceSet.cuda(first[:1]), warmup
    )
    config_out = {
        "model": spec,
        "input_shape": list(input_shape),
        "batch_size": batch_size,
        "convention": convention,
        "strategies": list(strategies),
        "gpus": list(counts),
        "dtypes": list(dtypes),
        "data": data_kind if data_kind == "synthetic" else f"loader:{workers}",
        "loader_workers": workers if data_kind == "loader" else None,
        "devices_asked": list(devices) if devices is not None else None,
        "epoch_samples": epoch_samples,
        "steps": steps,
        "warmup": warmup,
        "devices": kind,
        "machine": source,
        "timing": "CUDA events, one synchronisation per step"
        if kind == "cuda"
        else "perf_counter on the CPU",
        "cores": os.cpu_count() or 1,
        "step_overhead_s": overhead,
        "trusted_step_floor_s": overhead / FLOOR_SHARE,
    }
    return BenchResult(
        cases,
        explain(
            cases,
            os.cpu_count() or 1,
            workers if data_kind == "loader" else None,
            cuda=kind == "cuda",
            floor=(overhead, overhead / FLOOR_SHARE),
        )
        + transport.findings,
        config_out,
        simulated=kind == "virtual",
        skipped=skipped,
        transport=transport.report,
        transport_case=transport.case,
        transport_note=transport.note,
    )


#: A step is trusted when bench's own per-step cost is at most this share of it.
FLOOR_SHARE = 0.05
#: Timed steps of the overhead measurement (:func:`step_overhead`).
OVERHEAD_STEPS = 50


def _one_unit() -> Any:
    import torch

    return torch.nn.Linear(1, 1)


def step_overhead(devices: Any, warmup: int = 3) -> float:
    """Seconds per step that bench's own machinery takes (the runtime's step, its phase
    marks, the loss read back) around a model: the median timed step of ``single`` with
    a one-unit linear model on a batch of one, on the first device of the run — an upper
    bound (the model's own few kernels are in it). A case whose median step is below
    ``overhead / FLOOR_SHARE`` carries more than :data:`FLOOR_SHARE` of it: its samples/s
    is under-reported against a bare training loop (issue 36: 0.75–0.83× on ``cnn``'s
    ~3 ms steps), which the ``below-timing-floor`` finding says."""
    import torch

    from gpudiag.runtime import RunConfig, run

    config = RunConfig(
        "single",
        devices,
        steps=warmup + OVERHEAD_STEPS,
        watch=False,
        keep_state=True,
        time_phases=True,
        loss="mse",
    )
    with _one_thread(devices.kind == "virtual"):
        result = run(_one_unit, torch.zeros(1, 1), torch.zeros(1, 1), config)
    timed = step_times("single", result.recorder.phases, warmup)
    return percentile(timed.steps, 50) if timed.steps else 0.0


def _local_ids(kind: str, available: list[int], world: int) -> list[int]:
    """Under torchrun: this machine's devices, one per local process (``LOCAL_WORLD_SIZE``
    CUDA GPUs; virtual devices: one per rank of the job)."""
    if kind == "virtual":
        return list(range(world))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", len(available)))
    if local > len(available):
        raise InputError(f"torchrun starts {local} processes on this node, {len(available)} CUDA GPUs here")
    return available[:local]


def _check_devices(kind: str, available: list[int], asked: Sequence[int]) -> None:
    """``--devices`` must name distinct GPUs that exist: CUDA GPUs, or a machine's."""
    if not asked or len(set(asked)) != len(asked):
        raise InputError(f"--devices must name distinct devices, got {list(asked)}")
    if kind == "virtual" and not available:
        raise InputError(
            "--devices names GPUs, and there is none here: run on a GPU machine, or play a machine's "
            "GPUs on virtual devices with --machine FILE"
        )
    missing = [d for d in asked if d not in available]
    if missing:
        where = "CUDA GPUs" if kind == "cuda" else "GPUs of the machine"
        raise InputError(
            f"--devices {','.join(map(str, asked))}: no {' '.join(map(str, missing))} among the {where} "
            f"({', '.join(map(str, available))})"
        )


@contextlib.contextmanager
def _one_thread(on: bool) -> Iterator[None]:
    """On virtual devices, single and dp compute on one intra-op thread, as every forked
    DDP rank does (``gpudiag.runtime.launch``): each virtual device is one core, so the
    strategies are compared on equal terms (with torch's default threads a loaded 2-core
    machine ran single 20× slower per sample than two one-thread DDP ranks)."""
    if not on:
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _speedups(cases: list[Case]) -> None:
    """Each case's samples/s against ``single`` at the same dtype (None without one)."""
    single = {c.dtype: c for c in cases if c.strategy == "single" and c.error is None and c.steps}
    for case in cases:
        ref = single.get(case.dtype)
        if ref is not None and case.error is None and case.steps:
            case.speedup = case.samples_per_s / ref.samples_per_s
