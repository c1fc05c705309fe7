"""nancheck's conclusion: one finding from the pattern of failures across the singles
and pairs (:func:`conclude`; the rules are listed in :mod:`gpudiag.checks.nancheck`'s
docstring), and ``rank-crashed`` for the pairs that crashed.
"""

from __future__ import annotations

from typing import Any

from gpudiag.checks.nancheck_report import EXPLOSION_FACTOR, Outcome
from gpudiag.findings import Finding
from gpudiag.topology.analysis import best_groups, cuda_visible_devices
from gpudiag.topology.model import Topology, path_of

__all__ = ["conclude"]


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
