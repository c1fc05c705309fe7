"""One node of a sweep: who this process is (:class:`Identity`), what it was asked
(:class:`SweepOptions`), and the node's own phase (:func:`local_phase`): the suite's
checks through :func:`gpudiag.repro.report.run_report` and the intra-node all-reduce bus
bandwidth, run with torchrun's variables hidden so the checks start local ranks."""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import math
import os
import struct
import sys
import time
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpudiag.errors import GpudiagError
from gpudiag.identity import host_names, hostname
from gpudiag.repro.sweep.budget import MIN_PHASE_S, SKIPPED, Budget, BudgetSpent, hard_stop
from gpudiag.repro.sweep.results import NODE_SCHEMA

LOCAL_CHECKS = ("env", "topology", "peer", "nancheck")
_TORCHRUN_KEYS = ("RANK", "WORLD_SIZE", "MASTER_ADDR")


@dataclass
class SweepOptions:
    """What ``gpudiag sweep`` was asked for. ``timeout``: seconds per phase (the local
    checks, each collective). ``size_mib``: the all-reduce size of the bandwidth tests."""

    output: str = "sweep"
    force: bool = False
    machine: str | None = None
    checks: tuple[str, ...] = LOCAL_CHECKS
    quick: bool = False
    inject: tuple[str, ...] = ()
    delay: float = 0.0  # rehearse a slow node: seconds added before each of its transfers
    stall: str | None = None  # rehearse a hang: this node never enters the named collective
    expect_hosts: str | None = None
    rules: str | None = None
    baseline: str | None = None
    backend: str = "auto"
    timeout: float | None = None
    size_mib: float | None = None
    iters: int | None = None
    anonymize: bool = False
    argv: list[str] = field(default_factory=list)
    #: seconds for the whole node (None: --quick's default, or $GPUDIAG_SWEEP_BUDGET; no
    #: budget without --quick); see :mod:`gpudiag.repro.sweep.budget`
    budget: float | None = None

    @property
    def phase_timeout(self) -> float:
        return self.timeout if self.timeout is not None else (45.0 if self.quick else 300.0)

    @property
    def nbytes(self) -> int:
        mib = self.size_mib if self.size_mib is not None else (1.0 if self.quick else 64.0)
        return max(4, int(mib * (1 << 20)) // 4 * 4)

    @property
    def repeats(self) -> int:
        return self.iters if self.iters is not None else (3 if self.quick else 10)


@dataclass
class Identity:
    """Who this process is in the sweep."""

    rank: int
    world: int
    local_rank: int
    node: int
    host: str
    torchrun: bool

    @classmethod
    def detect(cls, environ: Mapping[str, str] | None = None) -> Identity:
        env = os.environ if environ is None else environ
        from gpudiag.runtime.launch import torchrun_env

        if not torchrun_env(env):
            return cls(0, 1, 0, 0, hostname(), False)
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local_rank = int(env.get("LOCAL_RANK", "0"))
        local_world = max(1, int(env.get("LOCAL_WORLD_SIZE", "1")))
        node = int(env["GROUP_RANK"]) if env.get("GROUP_RANK", "").isdigit() else rank // local_world
        nodes = (
            int(env["GROUP_WORLD_SIZE"])
            if env.get("GROUP_WORLD_SIZE", "").isdigit()
            else -(-world // local_world)
        )
        return cls(rank, world, local_rank, node, hostname(), True, nodes)

    nodes: int = 1  # how many nodes the launcher started (torchrun's GROUP_WORLD_SIZE)

    @property
    def leader(self) -> bool:
        return self.local_rank == 0


@contextlib.contextmanager
def hidden_torchrun() -> Iterator[None]:
    """While active, this process does not look like a torchrun rank, so the runtime's
    :func:`~gpudiag.runtime.launch` starts local ranks for the node's own checks instead
    of joining the cluster's group."""
    saved = {k: os.environ.pop(k) for k in _TORCHRUN_KEYS if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def _digest(topology: Any) -> str | None:
    if topology is None:
        return None
    labels = topology.gpu_labels
    doc = {
        "gpus": [topology.gpus[label].name if label in topology.gpus else None for label in labels],
        "links": [[topology.cell(a, b) for b in labels] for a in labels],
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def _busbw_rank(rank: int, world: int, nbytes: int, iters: int, delay: float, backend: str) -> bytes:
    """One rank of the intra-node bandwidth test: seconds for ``iters`` all-reduces."""
    import torch
    import torch.distributed as dist

    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # (NCCL's barrier uses the current device)
    buf = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dist.all_reduce(buf)  # warm-up: connections, algorithm choice
    dist.barrier()
    best = math.inf
    for _ in range(iters):
        start = time.perf_counter()
        if delay and rank == 0:
            time.sleep(delay)
        dist.all_reduce(buf)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return struct.pack("<d", best)


def intra_busbw(gpus: int, options: SweepOptions, backend: str, timeout: float | None = None) -> float | None:
    """The node's all-reduce bus bandwidth across its ``gpus`` in GB/s (nccl-tests' busbw:
    algbw × 2(n−1)/n; ``all_reduce_perf -b N -e N``) from the fastest of ``iters`` timed
    all-reduces (the slowest rank's), None with fewer than 2. ``timeout``: seconds
    (default: the phase's)."""
    if gpus < 2:
        return None
    from gpudiag.runtime import launch

    results = launch(
        _busbw_rank,
        gpus,
        backend=backend,
        timeout=options.phase_timeout if timeout is None else timeout,
        args=(options.nbytes, options.repeats, options.delay, backend),
    )
    seconds = max(struct.unpack("<d", bytes(r[:8]))[0] for r in results)
    return options.nbytes / seconds * 2 * (gpus - 1) / gpus / 1e9


def _run_checks(here: Any, options: SweepOptions, budget: Budget, alone: bool, notes: list[str]) -> Any:
    """The node's checks as one report (:func:`gpudiag.repro.report.run_report`); under a
    bounded budget one check at a time, each started only with time left and stopped when
    the local share is spent (then it, and every check after it, is ``skipped``)."""
    from gpudiag.checks.suite import CheckRun
    from gpudiag.repro.report import Report, run_report

    inputs = {"input_shape": [3, 8, 8]} if options.quick else None

    def run(names: list[str]) -> Any:
        return run_report(here, names, inject=options.inject, inputs=inputs, argv=list(options.argv))

    if not budget.bounded:
        return run(list(options.checks))
    created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    report = Report([], here, created, list(options.argv) or ["gpudiag", *sys.argv[1:]])
    for name in options.checks:
        left = budget.local_left(alone)
        if left < MIN_PHASE_S:
            notes.append(budget.skip_note(f"check {name}", left))
            report.checks.append(CheckRun(name, "skipped", budget.skip_note("", left).strip(), None))
            continue
        try:
            with hard_stop(left):
                part = run([name])
        except BudgetSpent:
            note = f"check {name} stopped after {left:.1f} s: {SKIPPED}"
            notes.append(note)
            report.checks.append(CheckRun(name, "skipped", note, None))
            continue
        report.checks += part.checks
        report.files.update(part.files)
    return report


@dataclass
class Local:
    """A leader's local phase: its record so far and its report (bundle written later)."""

    record: dict[str, Any]
    report: Any


def local_phase(
    options: SweepOptions,
    ident: Identity,
    backend: str,
    budget: Budget | None = None,
    sweep_set: Collection[str] = (),
) -> Local:
    """The node's own checks and figures, with torchrun's group hidden. Under a
    ``budget`` (``--quick``) each check and the all-reduce start only while the local share
    lasts, and a check still running when it is spent is stopped (skipped, with a note).
    ``sweep_set``: the variables the sweep itself set for its run (``NCCL_ALGO``…), left
    out of the host facts, which are the user's environment."""
    from gpudiag.checks.suite import Here

    budget = budget or Budget(None)
    start = time.perf_counter()
    problems: list[dict[str, Any]] = []
    notes: list[str] = []
    with hidden_torchrun():
        here = Here.detect(options.machine)
        report = _run_checks(here, options, budget, not ident.torchrun, notes)
        gpus = len(here.gpus)
        local_backend = "gloo" if here.machine is not None or backend == "gloo" else "nccl"
        left = budget.local_left(not ident.torchrun)
        intra = None
        if gpus >= 2 and left < MIN_PHASE_S:
            notes.append(budget.skip_note("intra-node all-reduce", left))
        else:
            try:
                intra = intra_busbw(gpus, options, local_backend, min(options.phase_timeout, left))
            except GpudiagError as exc:
                capped = budget.bounded and left < options.phase_timeout
                if capped and getattr(exc, "code", None) == "rank-hung":
                    notes.append(f"intra-node all-reduce stopped: {SKIPPED} ({left:.1f} s were left)")
                else:
                    problems.append(
                        {
                            "code": "node-check-failed",
                            "message": f"intra-node all-reduce: {exc}",
                            "expected": "a figure",
                            "measured": None,
                        }
                    )
    topology = here.machine
    if topology is None and here.nvml is None:
        with contextlib.suppress(GpudiagError):
            from gpudiag.hw.sources import read_topology

            topology = read_topology()
    env = next((c.result for c in report.checks if c.name == "env" and c.result), None) or {}
    sections = env.get("sections", {})
    versions = dict(sections.get("versions", {}))
    iommu = sections.get("iommu") or {}
    host_facts = {  # what differs between nodes of one fleet and matters to collectives
        "iommu": iommu.get("mode"),
        "acs_redirect": bool(iommu.get("acs_redirect")) if "acs_redirect" in iommu else None,
        "nccl_env": {
            k: v
            for k, v in sorted((sections.get("variables") or {}).items())
            if k.startswith("NCCL_") and k not in sweep_set
        },
    }
    names = sorted({str(g.name) for g in topology.gpus.values() if g.name}) if topology is not None else []
    # (a node with no GPU and no machine file measured nothing, simulated or not: the
    # judge names it node-no-gpus)
    virtual = gpus > 0 and (here.machine is not None or local_backend == "gloo")
    kind = names[0] if len(names) == 1 else ("mixed GPUs" if names else "GPU")
    record: dict[str, Any] = {
        "schema": NODE_SCHEMA,
        "host": ident.host,
        # the other names this machine goes by (the kernel's, under GPUDIAG_HOSTNAME): in
        # its host facts they are its own name, not a difference (judge.own_name_out)
        "aliases": [name for name in host_names() if name != ident.host],
        "node": ident.node,
        "rank": ident.rank,
        "simulated": virtual,
        "machine_type": f"{gpus}x {kind}" + (" (virtual)" if here.machine is not None else ""),
        "machine_source": here.machine_source,
        "gpus": gpus,
        "topology_digest": _digest(topology),
        "versions": {
            k: versions.get(k) for k in ("nvidia_driver", "cuda_runtime", "nccl_runtime", "torch", "gpudiag")
        },
        "host_facts": host_facts if env else None,
        "checks": [
            {
                "name": c.name,
                "status": c.status,
                "simulated": c.simulated,
                "codes": sorted({f.code for f in c.findings if f.severity in ("error", "warning")}),
                "headline": c.headline[:300],
            }
            for c in report.checks
        ],
        "figures": {"intra_busbw_gbps": None if intra is None else round(intra, 6), "pair_busbw_gbps": None},
        "allreduce": None,
        "pairs": [],
        "problems": problems,
        "notes": notes,
        # every rehearsed fault of this node, its stall too (--inject-delay: delay_s)
        "injected": [*options.inject, *([f"stall {options.stall}"] if options.stall else [])],
        "delay_s": options.delay or None,
        "seconds": {"local": round(time.perf_counter() - start, 3)},
    }
    return Local(redacted_record(record, options.anonymize), report)


def redacted_record(record: dict[str, Any], anonymize: bool) -> dict[str, Any]:
    """The record as it leaves the node: secrets redacted with this node's
    :class:`~gpudiag.redact.Redactor` (as its bundle is), and with ``anonymize`` its user
    name, host name and addresses masked wherever they appear in values (the paths of
    ``NCCL_DEBUG_FILE``, ``NCCL_TOPO_DUMP_FILE``…) — all but the record's own ``host``,
    which names the node in the verdicts."""
    from gpudiag.redact import Redactor

    clean: dict[str, Any] = Redactor(anonymize=anonymize).data(record)
    clean["host"] = record["host"]
    return clean
