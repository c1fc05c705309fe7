"""nancheck: find the GPU pair, the link and the step where training breaks.

Trains the same model, data and seed for N steps on each GPU alone and on each selected
pair (``dp`` or ``ddp``), watching every step through the runtime: non-finite loss,
explosion (loss above :data:`EXPLOSION_FACTOR` × its first value), and — from the
runtime's record — the first transfer (``dp``) or all-reduce bucket (``ddp``) that carried
non-finite or corrupted data. Then concludes with one finding:

- ``link-corruption``: only pairs over particular links fail, and their GPUs are healthy
  elsewhere (alone and in other pairs);
- ``device-fault``: every pair containing one GPU fails (or that GPU fails alone);
- ``numeric-divergence``: single-GPU runs diverge too — the model or learning rate;
- ``loss-explosion``: a pair's loss explodes without non-finite values while singles train;
- none: pass.

A pair whose run crashed is evidence of nothing about its link or its GPUs (a crash is
the model, the strategy or gpudiag): it is reported as ``rank-crashed`` and left out of
the findings above. A DDP crash that asks for ``find_unused_parameters`` is retried with
it (``unused-parameters``), so that the pair trains and its link is tested; SyncBatchNorm,
which DDP refuses on CPU virtual devices, cannot run here (exit 3).

On virtual devices (``--machine``) faults come only from ``--inject``; that is how the
detector is tested and demonstrated without GPUs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from gpudiag import defaults as D
from gpudiag.checks.gradcheck.explain import asks_for_unused, unused_retry_finding
from gpudiag.checks.options import NANCHECK, NancheckOptions, specs
from gpudiag.errors import CannotRunHere, GpudiagError, InputError, from_user_code, naming_model
from gpudiag.findings import Finding, short_repr
from gpudiag.hw.cuda import cuda_device_count
from gpudiag.parsers import parse_pairs
from gpudiag.progress import note
from gpudiag.render.jsonout import losses as losses_json
from gpudiag.runtime import DeviceSet, RankFailure, RunConfig, RunResult, run
from gpudiag.runtime.config import ModelFn
from gpudiag.runtime.faults import check_fires, for_devices, parse_fault, rehearsal
from gpudiag.topology.analysis import best_groups, cuda_visible_devices
from gpudiag.topology.model import Topology, path_of

SCHEMA = "gpudiag.nancheck/1"
#: A loss above this multiple of its first value is an explosion.
EXPLOSION_FACTOR = 100.0
#: What torch's DDP raises for SyncBatchNorm on CPU tensors.
SYNCBN_REFUSED = "SyncBatchNorm layers only work with GPU modules"


@dataclass
class Outcome:
    """One training run: a single GPU or a pair."""

    devices: tuple[int, ...]
    status: str  # ok | diverged | exploded | crashed | hung
    first_bad_step: int | None
    losses: list[float]
    first_bad_transfer: dict[str, Any] | None = None
    error: str | None = None
    recorder: Any = None  # the runtime's record of the run (for --trace)
    failure: RankFailure | None = None  # what crashed or hung, with the rank's traceback

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass
class NancheckReport:
    verdict: str  # pass | fail
    strategy: str
    steps: int
    singles: list[Outcome]
    pairs: list[Outcome]
    links: dict[tuple[int, ...], str | None]
    findings: list[Finding]
    topology: Topology | None
    config: dict[str, Any] = field(default_factory=dict)
    machine_source: str | None = None  # the file virtual devices were laid out like, if known

    def __repr__(self) -> str:
        return short_repr(self, self.verdict, self.findings, singles=len(self.singles), pairs=len(self.pairs))

    def exit_code(self) -> int:
        return 0 if self.verdict == "pass" else 1

    @property
    def simulated(self) -> bool:
        """Whether training ran on CPU virtual devices laid out like a machine, not on GPUs."""
        return self.topology is not None or self.config.get("devices") == "virtual"

    @property
    def simulation(self) -> str | None:
        """What was simulated, in one sentence (None on real GPUs)."""
        if not self.simulated:
            return None
        return (
            f"simulated on CPU virtual devices laid out like {self._source}: "
            "training ran on the CPU, not on the machine's GPUs, and only faults given with --inject "
            "can appear, so a pass says nothing about its GPUs or links"
        )

    @property
    def _source(self) -> str:
        return str(self.machine_source or self.config.get("machine") or "a machine file")

    @property
    def recorders(self) -> dict[str, Any]:
        """Each run's record, named ``GPU5`` or ``GPU5+GPU6`` (for ``--trace``)."""
        runs = [*self.singles, *self.pairs]
        return {"+".join(f"GPU{g}" for g in o.devices): o.recorder for o in runs if o.recorder is not None}

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "verdict": self.verdict,
            "simulated": self.simulated,
            "simulation": self.simulation,
            "rehearsal": rehearsal(self.config.get("inject") or []),
            "strategy": self.strategy,
            "steps": self.steps,
            "explosion_factor": EXPLOSION_FACTOR,
            "config": self.config,
            "singles": [
                {
                    "device": o.devices[0],
                    "status": o.status,
                    "first_bad_step": o.first_bad_step,
                    **losses_json(o.losses),
                    "error": o.error,
                }
                for o in self.singles
            ],
            "pairs": [
                {
                    "a": o.devices[0],
                    "b": o.devices[1],
                    "link": self.links.get(o.devices),
                    "status": o.status,
                    "first_bad_step": o.first_bad_step,
                    "first_bad_transfer": o.first_bad_transfer,
                    **losses_json(o.losses),
                    "error": o.error,
                }
                for o in self.pairs
            ],
            "findings": [f.to_json() for f in self.findings],
        }


def _outcome(devices: tuple[int, ...], result: RunResult, strategy: str) -> Outcome:
    losses = result.losses
    first = losses[0] if losses else math.nan
    bad_step = next((i + 1 for i, x in enumerate(losses) if not math.isfinite(x)), None)
    exploded = next(
        (
            i + 1
            for i, x in enumerate(losses)
            if math.isfinite(x)
            and math.isfinite(first)
            and abs(first) > 0
            and x > EXPLOSION_FACTOR * abs(first)
        ),
        None,
    )
    transfer = _first_bad_transfer(result, devices, strategy)
    candidates = [s for s in (bad_step, transfer["step"] if transfer else None) if s is not None]
    if candidates:
        return Outcome(devices, "diverged", min(candidates), losses, transfer, recorder=result.recorder)
    if exploded is not None:
        return Outcome(devices, "exploded", exploded, losses, None, recorder=result.recorder)
    return Outcome(devices, "ok", None, losses, recorder=result.recorder)


def _first_bad_transfer(result: RunResult, devices: tuple[int, ...], strategy: str) -> dict[str, Any] | None:
    rec = result.recorder
    if strategy == "dp":
        bad = next((t for t in rec.transfers if t.nonfinite or t.corrupted), None)
        if bad is None:
            return None
        return {
            "src": bad.src,
            "dst": bad.dst,
            "phase": bad.phase,
            "step": bad.step,
            "link": bad.link,
            "tensor": bad.name,
            "nonfinite": bad.nonfinite,
            "corrupted": bad.corrupted,
        }
    buckets = sorted(rec.buckets, key=lambda b: (b.step, b.index, b.rank))
    bad_b = next((b for b in buckets if b.nonfinite_before or b.nonfinite_after), None)
    if bad_b is None:
        return None
    # One all-reduce spreads a rank's non-finite gradient to every rank: blame the rank
    # where it was non-finite before the all-reduce, if there is one, not where it arrived.
    origin = [b for b in buckets if (b.step, b.index) == (bad_b.step, bad_b.index) and b.nonfinite_before]
    bad_b = origin[0] if origin else bad_b
    dst = devices[bad_b.rank]
    src = devices[1 - bad_b.rank] if len(devices) == 2 else None
    return {
        "src": src,
        "dst": dst,
        "phase": "allreduce",
        "step": bad_b.step,
        "bucket": bad_b.index,
        "before_allreduce": bool(bad_b.nonfinite_before),
    }


def nancheck(
    model_factory: ModelFn,
    inputs: Any,
    targets: torch.Tensor,
    *,
    machine: Topology | None = None,
    pairs: str = "all",
    strategy: str = NANCHECK.strategy,
    steps: int = NANCHECK.steps,
    lr: float = NANCHECK.lr,
    loss: str = NANCHECK.loss,
    seed: int = NANCHECK.seed,
    inject: tuple[str, ...] | list[str] = (),
    timeout: float = NANCHECK.timeout,
    watch: bool = True,
) -> NancheckReport:
    """Train on every GPU alone and on every selected pair; locate where it breaks."""
    strategies = specs(NancheckOptions)["strategy"][1].choices or ()
    if strategy not in strategies:
        raise InputError(f"--strategy must be one of {', '.join(strategies)}, not {strategy!r}")
    for spec in inject:
        parse_fault(spec)  # bad specs fail before anything runs
    if machine is not None:
        gpus = sorted(info.index for info in machine.gpus.values())
        make = lambda ids: DeviceSet.virtual(list(ids), machine)  # noqa: E731
    else:
        count = cuda_device_count()
        if count == 0:
            raise CannotRunHere(
                "no CUDA GPU here; simulate a machine with --machine FILE (make one from a capture: "
                "gpudiag topology --from-file topo.txt --save-machine machine.json)"
            )
        gpus = list(range(count))
        make = lambda ids: DeviceSet.cuda(list(ids))  # noqa: E731
    chosen = parse_pairs(pairs, gpus)
    check_fires(inject, chosen, steps)
    singles_wanted = sorted({g for pair in chosen for g in pair}) if pairs.strip() != "all" else gpus
    base = RunConfig(
        "single",
        make([gpus[0]]),
        steps=steps,
        lr=lr,
        loss=loss,
        seed=seed,
        timeout=timeout,
        keep_state=False,
        watch=watch,
    )
    singles = [
        _outcome((g,), _run(model_factory, inputs, targets, replace(base, devices=make([g]))), "single")
        for g in singles_wanted
    ]
    outcomes = []
    unused: RankFailure | None = None
    notes: dict[str, Finding] = {}  # what the runtime said of a run (syncbn-skipped), once each
    for pair in chosen:
        config = replace(
            base, strategy=strategy, devices=make(pair), faults=for_devices(inject, pair, strategy == "ddp")
        )
        got = _attempt(model_factory, inputs, targets, config)
        if isinstance(got, RankFailure) and unused is None and asks_for_unused(got):
            # DDP asks for find_unused_parameters: give it (to this pair and the rest)
            unused, base = got, replace(base, find_unused_parameters=True)
            got = _attempt(model_factory, inputs, targets, replace(config, find_unused_parameters=True))
        if isinstance(got, RankFailure):
            status = "hung" if got.code == "rank-hung" else "crashed"
            outcomes.append(Outcome(pair, status, None, [], None, str(got), failure=got))
        else:
            notes.update((f.code, f) for f in got.notes if f.code not in notes)
            outcomes.append(_outcome(pair, got, strategy))
    links = {pair: (machine.cell(f"GPU{pair[0]}", f"GPU{pair[1]}") if machine else None) for pair in chosen}
    findings = conclude(singles, outcomes, links, machine, strategy)
    if unused is not None:
        findings.insert(0, unused_retry_finding(strategy, unused))
    findings[:0] = notes.values()
    verdict = "fail" if any(f.severity == "error" for f in findings) else "pass"
    return NancheckReport(
        verdict,
        strategy,
        steps,
        singles,
        outcomes,
        links,
        findings,
        machine,
        config={
            "pairs": pairs,
            "inject": list(inject),
            "lr": lr,
            "loss": loss,
            "seed": seed,
            "devices": "virtual" if machine is not None else "cuda",
        },
    )


def _attempt(model_factory: Any, inputs: Any, targets: Any, config: RunConfig) -> RunResult | RankFailure:
    """:func:`_run`, a failing rank returned rather than raised. DDP refusing SyncBatchNorm
    on CPU virtual devices is not a failure of the pair: it cannot run here (exit 3)."""
    try:
        return _run(model_factory, inputs, targets, config)
    except RankFailure as failure:
        if config.devices.kind == "virtual" and SYNCBN_REFUSED in failure.detail:
            raise CannotRunHere(
                "the model has SyncBatchNorm, which torch's DDP refuses on CPU virtual devices "
                f"({SYNCBN_REFUSED}): nancheck --strategy ddp needs GPUs for it (--strategy dp runs here)"
            ) from failure
        return failure


def _run(model_factory: Any, inputs: Any, targets: Any, config: RunConfig) -> RunResult:
    """One training run; the user's model failing in this process is an error naming the
    run (exit 2; 3 for memory or disk space), a failing rank a :class:`RankFailure`."""
    devices = config.devices.ids[:1] if config.strategy == "single" else config.devices.ids
    note(f"nancheck: {config.strategy} on {'+'.join(f'GPU{d}' for d in devices)}")
    try:
        return run(model_factory, inputs, targets, config)
    except (RankFailure, GpudiagError):
        raise
    except (Exception, SystemExit) as exc:
        where = f"the model under {config.strategy} on device {','.join(map(str, devices))}"
        raise from_user_code(exc, where) from exc


def _confirm_and_fix(machine: Topology | None) -> tuple[str, str]:
    confirm = (
        "rerun the failing pair with NCCL_P2P_DISABLE=1 (and for DataParallel, stage copies through the host)"
    )
    fix = "check IOMMU/ACS on the host (kernel parameter iommu=pt, or pci=noacs / ACS off in the BIOS)"
    if machine is not None:
        groups = [
            g
            for g in best_groups(machine, 2)
            if path_of(machine.cell(f"GPU{g[0]}", f"GPU{g[1]}")) == "NVLINK"
        ]
        if groups:
            fix += f"; meanwhile train on NVLink pairs, e.g. `{cuda_visible_devices(groups[0])}`"
    return confirm, fix


def conclude(
    singles: list[Outcome],
    pairs: list[Outcome],
    links: dict[tuple[int, ...], str | None],
    machine: Topology | None,
    strategy: str,
) -> list[Finding]:
    """One finding from the pattern of failures (see the module docstring), made from the
    runs that trained; and a ``rank-crashed`` finding for the pairs that crashed, which
    say nothing about their links or GPUs."""
    crashed = [o for o in pairs if o.status == "crashed"]
    trained = [o for o in pairs if o.status != "crashed"]
    return _from_training(singles, trained, links, machine, strategy) + _crashes(crashed, strategy)


def _crashes(crashed: list[Outcome], strategy: str) -> list[Finding]:
    """One ``rank-crashed`` finding for the pairs whose runs crashed (the first one's
    error and traceback; each pair's error in ``errors``), or none."""
    if not crashed:
        return []
    first = crashed[0]
    names = " ".join(f"({o.devices[0]},{o.devices[1]})" for o in crashed)
    return [
        Finding(
            "rank-crashed",
            "error",
            f"{strategy} crashed on pair(s) {names}: {first.error}; a crash is no evidence about a link "
            "or a GPU, so nothing is concluded from these pairs",
            {
                "pairs": [list(o.devices) for o in crashed],
                "strategy": strategy,
                "rank": first.failure.rank if first.failure is not None else None,
                "detail": first.failure.detail if first.failure is not None else "",
                "errors": [o.error for o in crashed],
            },
            cause="the model, its setup under this strategy, or gpudiag: the run raised before it could "
            "say anything about the pair's link",
            fix="read the rank's traceback (evidence.detail, or --format json); rerun with the same seed "
            "to reproduce; gpudiag gradcheck with --strategies single," + strategy + " shows it too",
        )
    ]


def _from_training(
    singles: list[Outcome],
    pairs: list[Outcome],
    links: dict[tuple[int, ...], str | None],
    machine: Topology | None,
    strategy: str,
) -> list[Finding]:
    """:func:`conclude` over the runs that trained (every single, the pairs that did not crash)."""
    bad_singles = [o for o in singles if not o.ok]
    bad_pairs = [o for o in pairs if o.status in ("diverged", "hung")]
    exploded = [o for o in pairs if o.status == "exploded"]
    confirm, fix = _confirm_and_fix(machine)
    if singles and len(bad_singles) == len(singles):
        return [
            Finding(
                "numeric-divergence",
                "error",
                f"training diverges on every GPU alone too (first at step "
                f"{min(o.first_bad_step or 0 for o in bad_singles)}): the model or the learning rate, "
                "not the hardware",
                {
                    "singles": [o.devices[0] for o in bad_singles],
                    "first_bad_step": min(o.first_bad_step or 0 for o in bad_singles),
                },
                cause="a learning rate too high for the model, or an unstable model/loss",
                fix="lower the learning rate, add warm-up or gradient clipping, check the loss for log(0)",
            )
        ]
    gpus = sorted({g for o in singles for g in o.devices} | {g for o in pairs for g in o.devices})
    for g in gpus:
        with_g = [o for o in pairs if g in o.devices]
        alone_bad = any(o.devices == (g,) for o in bad_singles)
        others_ok = all(o.ok or g in o.devices for o in pairs)
        if (alone_bad or (with_g and all(o in bad_pairs for o in with_g) and len(with_g) > 1)) and others_ok:
            return [
                Finding(
                    "device-fault",
                    "error",
                    f"GPU {g} fails {'alone and ' if alone_bad else ''}in every pair it is in "
                    f"({len(with_g)} pair(s)); pairs without it train",
                    {
                        "device": g,
                        "pairs": [list(o.devices) for o in with_g if o in bad_pairs],
                        "first_bad_step": min((o.first_bad_step or 0) for o in with_g if o in bad_pairs)
                        if any(o in bad_pairs for o in with_g)
                        else None,
                    },
                    cause="one GPU (its memory, its PCIe link or its driver state) corrupts what it "
                    "receives or computes",
                    fix=f"take GPU {g} out of service (CUDA_VISIBLE_DEVICES without it) and check "
                    f"`nvidia-smi -q -i {g}` for ECC/Xid errors; {confirm}",
                )
            ]
    if bad_pairs and all(_arose_in_compute(o.first_bad_transfer) for o in bad_pairs):
        first = min(bad_pairs, key=lambda o: o.first_bad_step or 10**9)
        names = " ".join(f"({o.devices[0]},{o.devices[1]})" for o in bad_pairs)
        return [
            Finding(
                "pair-numeric-divergence",
                "warning",
                f"training diverges on pair(s) {names} while each GPU trains alone, but the first "
                "non-finite values arose in the "
                f"{'ranks' if strategy == 'ddp' else 'replicas'}' own computation (step "
                f"{first.first_bad_step}), before any transfer: the split batch, not the link",
                {
                    "pairs": [list(o.devices) for o in bad_pairs],
                    "first_bad_step": first.first_bad_step,
                    "first_bad_transfer": first.first_bad_transfer,
                    "strategy": strategy,
                },
                cause="each device trains on a part of the batch: BatchNorm statistics of a few samples, "
                "or a model and learning rate that are unstable at that per-device batch",
                fix="use a larger per-device batch (--batch-size), SyncBatchNorm under DDP, or a lower "
                "learning rate; to test the links themselves, nancheck a model that is stable on small "
                "batches (the default mlp)",
            )
        ]
    if bad_pairs:
        failing = [list(o.devices) for o in bad_pairs]
        kinds = sorted({links.get(o.devices) or "unknown" for o in bad_pairs})
        first = min(bad_pairs, key=lambda o: o.first_bad_step or 10**9)
        where = first.first_bad_transfer
        place = (
            f"; first bad data at step {where['step']} in the {where['phase']} {where['src']}->{where['dst']}"
            if where
            else ""
        )
        healthy = sorted({g for o in bad_pairs for g in o.devices})
        return [
            Finding(
                "link-corruption",
                "error",
                f"training breaks only on pair(s) {' '.join(f'({a},{b})' for a, b in failing)} over "
                f"{', '.join(kinds)}{place}; the same GPUs train fine alone and in other pairs",
                {
                    "pairs": failing,
                    "links": kinds,
                    "first_bad_step": first.first_bad_step,
                    "first_bad_transfer": where,
                    "healthy_gpus": healthy,
                    "strategy": strategy,
                },
                cause="the peer-to-peer path between these GPUs corrupts or drops data (IOMMU/ACS redirect, "
                "a GPU that advertises P2P it cannot do) — not the model",
                fix=f"confirm: {confirm}; fix: {fix}",
            )
        ]
    if exploded:
        return [
            Finding(
                "loss-explosion",
                "warning",
                f"the loss grew past {EXPLOSION_FACTOR:g}x its first value on pair(s) "
                f"{' '.join(f'({o.devices[0]},{o.devices[1]})' for o in exploded)} while single GPUs train",
                {
                    "pairs": [list(o.devices) for o in exploded],
                    "first_bad_step": min(o.first_bad_step or 0 for o in exploded),
                },
                cause="scaled or slightly corrupted data on a link, or a parallel setup that changes the "
                "effective learning rate",
                fix=f"check the link: {confirm}; compare gradients with `gpudiag gradcheck`",
            )
        ]
    return []


def _arose_in_compute(where: dict[str, Any] | None) -> bool:
    """Whether the first bad data was already non-finite where it was made: before DDP's
    all-reduce on its rank, or sent non-finite (and received as sent) over a DataParallel
    transfer. A link that corrupts shows finite data sent and bad data received."""
    if where is None:
        return False
    if where.get("phase") == "allreduce":
        return bool(where.get("before_allreduce"))
    return bool(where.get("nonfinite")) and not where.get("corrupted")


def nancheck_spec(
    model: str = "mlp",
    *,
    input_shape: tuple[int, ...] = D.INPUT_SHAPE,
    num_classes: int = D.NUM_CLASSES,
    batch_size: int = D.BATCH_SIZE,
    machine_file: str | None = None,
    machine: Topology | None = None,
    input_dtype: str = "float",
    input_range: tuple[float, float] | None = None,
    **options: Any,
) -> NancheckReport:
    """``gpudiag nancheck``: resolve the model and machine (a machine file or capture, or
    an already loaded ``machine``), make the batch (see :func:`gpudiag.models.random_inputs`),
    sweep."""
    from gpudiag.hw.sources import read_machine_or_capture
    from gpudiag.models import random_batch, resolve_model

    if machine_file:
        machine = read_machine_or_capture(machine_file)
    with naming_model(model):
        factory = resolve_model(model, input_shape, num_classes)
        seed = options.get("seed", 0)
        loss = options.get("loss", NANCHECK.loss)
        inputs, targets = random_batch(
            factory, batch_size, input_shape, num_classes, loss, seed, None, input_dtype, input_range
        )
        report = nancheck(factory, inputs, targets, machine=machine, **options)
    report.config.update(
        {"model": model, "input_shape": list(input_shape), "batch_size": batch_size, "machine": machine_file}
    )
    if input_dtype != "float" or input_range is not None:
        report.config.update(input_dtype=input_dtype, input_range=input_range and list(input_range))
    return report
