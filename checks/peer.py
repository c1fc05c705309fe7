"""peer: the peer-to-peer path that corrupts data — proven, not taken from a capability bit.

For each ordered GPU pair (src → dst):

- the grant: peer access as torch (``can_device_access_peer``) and NVML report it — a grant,
  not proof;
- one-way copies verified at the destination: a known pattern (``arange mod 251``) of each
  size and dtype is copied src → dst and compared there with the pattern computed on dst
  (a round trip, as simpleP2P does, cannot see a write that lands in the wrong place). The
  first copies over each direction in this process — each size and dtype once, before any
  other — are ``cold`` (lazily enabled peer access, first-copy bugs), the repeat ``warm``.
  Each such round is a *step* of ``--inject``'s ``@STEP``: round 1 the cold copies, round 2
  the warm ones, and a fault from a later step adds warm rounds up to it (at most
  :data:`MAX_ROUNDS`); the all-reduce below runs once, or once per step up to the last
  ``@STEP``;
- bandwidth (CUDA only): the direct copy against one staged through host memory — direct
  slower than staged is the signature of an ACS/IOMMU redirect;
- a two-rank all-reduce with exact expected values (sums of small integers, exact in fp32)
  as configured, and again with ``NCCL_P2P_DISABLE=1`` as the control, each with a timeout.

Plus host facts that explain failures (:mod:`gpudiag.hw.host`). On virtual devices
(``--machine``) copies and collectives run on the CPU and ``--inject`` breaks them; the
bandwidth test is skipped (meaningless on a CPU) and the report is ``simulated``: it shows
the checks work, not that the machine's peer-to-peer paths do. Without two GPUs and without
``--machine`` only the host probes run and the verdict is ``skipped`` (exit 3) with the reason.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from gpudiag.findings import Finding, short_repr
from gpudiag.hw.cuda import cuda_device_count
from gpudiag.hw.host import HostFacts, Runner, collect
from gpudiag.parsers import parse_pairs
from gpudiag.runtime import DeviceSet, RankFailure
from gpudiag.runtime.faults import FaultPlan, check_fires, corrupt, for_devices, rehearsal
from gpudiag.runtime.launch import launch
from gpudiag.runtime.transport import Transport
from gpudiag.topology.model import Topology

SCHEMA = "gpudiag.peer/1"
GPU_SIZES = (4 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20)
VIRTUAL_SIZES = (4 << 10, 64 << 10, 1 << 20)
DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
ALLREDUCE_ELEMENTS = 1 << 16
#: The most rounds (``--inject`` steps) of copies and all-reduces a run makes: a spec from a
#: later step is refused before anything runs.
MAX_ROUNDS = 10


@dataclass
class PairResult:
    src: int
    dst: int
    link: str | None
    grant: dict[str, Any]
    copies: list[dict[str, Any]] = field(default_factory=list)
    bandwidth: dict[str, Any] | None = None
    allreduce: dict[str, Any] | None = None


@dataclass
class PeerReport:
    verdict: str  # pass | fail | skipped (no pair to test here: host probes only)
    devices: str  # cuda | virtual | none
    pairs: list[PairResult]
    host: HostFacts
    skipped: list[str]
    findings: list[Finding]
    machine_source: str | None = None  # the file virtual devices were laid out like
    reason: str | None = None  # why no pair was tested (verdict ``skipped``)
    inject: list[str] = field(default_factory=list)  # faults injected on purpose (--inject)
    unfired: list[str] = field(default_factory=list)  # of those, the ones that hit nothing

    def __repr__(self) -> str:
        return short_repr(self, self.verdict, self.findings, directions=len(self.pairs))

    @property
    def simulated(self) -> bool:
        """Whether copies and collectives ran on CPU virtual devices, not on GPUs."""
        return self.devices == "virtual"

    @property
    def simulation(self) -> str | None:
        """What was simulated, in one sentence (None on real GPUs)."""
        if not self.simulated:
            return None
        return (
            f"simulated on CPU virtual devices laid out like {self.machine_source or 'a machine file'}: "
            "copies and all-reduces went through CPU memory, not over the machine's GPU links, "
            "so a pass shows the checks work, not that its peer-to-peer paths do"
        )

    def exit_code(self) -> int:
        """1 when a copy or collective is wrong, 3 when no pair could be tested here."""
        return {"fail": 1, "skipped": 3}.get(self.verdict, 0)

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "verdict": self.verdict,
            "simulated": self.simulated,
            "simulation": self.simulation,
            "rehearsal": rehearsal(self.inject),
            "unfired": self.unfired,
            "reason": self.reason,
            "devices": self.devices,
            "pairs": [p.__dict__ for p in self.pairs],
            "host": self.host.__dict__,
            "skipped": self.skipped,
            "findings": [f.to_json() for f in self.findings],
        }


def _pattern(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return (torch.arange(n, device=device) % 251).to(dtype)


def copy_check(
    transport: Transport, src: int, dst: int, nbytes: int, dtype_name: str, phase: str
) -> dict[str, Any]:
    """Copy a pattern src → dst once; count wrong elements at the destination."""
    dtype = DTYPES[dtype_name]
    n = max(1, nbytes // torch.empty((), dtype=dtype).element_size())
    devices = transport.devices
    data = _pattern(n, dtype, devices.torch_device(src))
    if data.is_cuda:  # the pattern written before the clock starts
        torch.cuda.synchronize(data.device)
    start = time.perf_counter()
    arrived = transport.move(data, src, dst, "peer-copy")
    if arrived.is_cuda:
        torch.cuda.synchronize(arrived.device)
        torch.cuda.synchronize(data.device)
    elapsed = time.perf_counter() - start
    expected = _pattern(n, dtype, devices.torch_device(dst))
    wrong = int((arrived != expected).sum())
    return {
        "bytes": n * data.element_size(),
        "dtype": dtype_name,
        "phase": phase,
        "wrong": wrong,
        "seconds": round(elapsed, 6),
    }


def bandwidth(devices: DeviceSet, src: int, dst: int, nbytes: int) -> dict[str, Any]:
    """GB/s of a direct copy against one staged through pinned host memory (CUDA). A copy
    between GPUs runs on the source's stream: both GPUs are synchronised (a bare
    ``torch.cuda.synchronize()`` waits for the current device alone)."""
    data = torch.empty(nbytes // 4, dtype=torch.float32, device=devices.torch_device(src))
    staging = torch.empty_like(data, device="cpu").pin_memory()
    target = torch.empty_like(data, device=devices.torch_device(dst))

    def settle() -> None:
        for index in (src, dst):
            torch.cuda.synchronize(devices.torch_device(index))

    def timed(fn: Any) -> float:
        fn()
        settle()
        start = time.perf_counter()
        for _ in range(5):
            fn()
        settle()
        return 5 * nbytes / (time.perf_counter() - start) / 1e9

    direct = timed(lambda: target.copy_(data))
    staged = timed(lambda: (staging.copy_(data), target.copy_(staging)))
    return {"bytes": nbytes, "direct_gbs": round(direct, 2), "staged_gbs": round(staged, 2)}


def _allreduce_rank(
    rank: int, world: int, n: int, faults: tuple[str, ...], gpus: tuple[int, ...], rounds: int = 1
) -> bytes:
    """``rounds`` all-reduces (steps 1…rounds for ``faults``): the wrong values summed over
    them, the first step with any, and how many times each fault hit."""
    import json

    import torch.distributed as dist

    device = "cpu"
    if dist.get_backend() == "nccl":
        torch.cuda.set_device(gpus[rank])
        device = f"cuda:{gpus[rank]}"
    plan = FaultPlan.parse(faults)
    expected = (world * (world + 1) // 2) * _pattern(n, torch.float32, torch.device(device))
    wrong, first = 0, None
    for step in range(1, rounds + 1):
        values = (rank + 1) * _pattern(n, torch.float32, torch.device(device))
        dist.all_reduce(values)
        for fault in plan.due_on_rank(rank, step):
            values = corrupt(values, fault)
        bad = int((values != expected).sum())
        wrong += bad
        first = step if bad and first is None else first
    return json.dumps({"rank": rank, "wrong": wrong, "first_step": first, "hits": plan.hits}).encode()


def allreduce_check(
    pair: tuple[int, int], devices: DeviceSet, faults: tuple[str, ...], timeout: float, rounds: int = 1
) -> dict[str, Any]:
    """All-reduce on the pair as configured and with NCCL_P2P_DISABLE=1 (the control),
    ``rounds`` times each (``faults`` count them as steps). ``hits``: per fault, the
    corrupted results it caused on the configured run."""
    import json

    backend = "gloo" if devices.kind == "virtual" else "nccl"
    out: dict[str, Any] = {}
    for label, disable in (("configured", None), ("p2p_disabled", "1")):
        saved = os.environ.get("NCCL_P2P_DISABLE")
        if disable is not None:
            os.environ["NCCL_P2P_DISABLE"] = disable
        try:
            results = [
                json.loads(r[:])
                for r in launch(
                    _allreduce_rank,
                    2,
                    backend=backend,
                    timeout=timeout,
                    args=(ALLREDUCE_ELEMENTS, faults if disable is None else (), pair, rounds),
                )
            ]
            firsts = [r["first_step"] for r in results if r.get("first_step") is not None]
            out[label] = {
                "wrong": sum(r["wrong"] for r in results),
                "hung": False,
                "wrong_by_rank": {pair[r["rank"]]: r["wrong"] for r in results},
                "first_wrong_step": min(firsts) if firsts else None,
            }
            if disable is None:
                out[label]["hits"] = [sum(r["hits"][i] for r in results) for i in range(len(faults))]
        except RankFailure as failure:
            out[label] = {"wrong": None, "hung": failure.code == "rank-hung", "error": str(failure)}
        finally:
            if disable is not None:
                if saved is None:
                    os.environ.pop("NCCL_P2P_DISABLE", None)
                else:
                    os.environ["NCCL_P2P_DISABLE"] = saved
    return out


def peer(
    *,
    machine: Topology | None = None,
    pairs: str = "all",
    sizes: tuple[int, ...] | None = None,
    inject: tuple[str, ...] | list[str] = (),
    runner: Runner | None = None,
    timeout: float = 60.0,
    machine_source: str | None = None,
) -> PeerReport:
    """Probe the host, then every ordered pair of GPUs (or virtual devices laid out like
    ``machine``, read from ``machine_source``). With no pair to test the verdict is
    ``skipped`` and the report still carries the host probes."""

    for spec in inject:
        FaultPlan.parse([spec])
    skipped: list[str] = []
    reason: str | None = None
    results: list[PairResult] = []
    if machine is not None:
        gpus = sorted(info.index for info in machine.gpus.values())
        devices = DeviceSet.virtual(gpus, machine)
        skipped.append("bandwidth: virtual devices copy in CPU memory; direct vs staged is meaningless there")
    elif cuda_device_count() >= 2:
        gpus = list(range(cuda_device_count()))
        devices = DeviceSet.cuda(gpus)
    else:
        gpus, devices = [], None
        reason = (
            f"GPU tests: not enough GPUs (fewer than 2 CUDA GPUs here: {cuda_device_count()}); "
            "host probes only (simulate a machine with --machine FILE)"
        )
    chosen = parse_pairs(pairs, gpus) if devices is not None else []
    if devices is not None and not chosen:
        reason = f"GPU tests: not enough GPUs ({len(gpus)} {devices.kind} device(s)); host probes only"
    if reason is not None:
        skipped.append(reason)
    check_fires(inject, chosen, MAX_ROUNDS)
    last = max([1] + [FaultPlan.parse([spec]).faults[0].step for spec in inject])  # (the last @STEP)
    rounds = max(2, last)
    fired = [0] * len(inject)
    host = collect(runner)
    if devices is not None:
        sizes = sizes or (VIRTUAL_SIZES if devices.kind == "virtual" else GPU_SIZES)
        plan = FaultPlan.parse(list(inject))
        transport = Transport(devices, faults=plan)
        grants = {(p.a, p.b): p.p2p for p in machine.pairs()} if machine is not None else {}
        for a, b in chosen:
            first_direction = len(results)
            for src, dst in ((a, b), (b, a)):
                grant = {"nvml": grants.get((a, b))}
                if devices.kind == "cuda":
                    grant["torch"] = bool(torch.cuda.can_device_access_peer(src, dst))
                link = devices.link(src, dst)
                result = PairResult(src, dst, link, grant)
                for step in range(1, rounds + 1):  # cold: the first copies over src → dst here
                    transport.step = step
                    phase = "cold" if step == 1 else "warm"
                    for dtype in DTYPES:
                        for size in sizes:
                            copy = copy_check(transport, src, dst, size, dtype, phase)
                            result.copies.append({**copy, "step": step})
                if devices.kind == "cuda":
                    result.bandwidth = bandwidth(devices, src, dst, max(sizes))
                results.append(result)
            pair_devices = (a, b)
            # (each spec that concerns the pair, in rank numbers, and which of inject it is)
            mine = [(i, for_devices((spec,), pair_devices, to_ranks=True)) for i, spec in enumerate(inject)]
            mine = [(i, specs) for i, specs in mine if specs]
            report = allreduce_check(
                pair_devices,
                DeviceSet.virtual(list(pair_devices), machine)
                if devices.kind == "virtual"
                else DeviceSet.cuda(list(pair_devices)),
                tuple(specs[0] for _, specs in mine),
                timeout,
                last,
            )
            for (i, _), hits in zip(mine, report.get("configured", {}).pop("hits", []), strict=False):
                fired[i] += hits
            results[first_direction].allreduce = report
        fired = [n + hits for n, hits in zip(fired, plan.hits, strict=True)]
    findings = conclude(results, host)
    verdict = "fail" if any(f.severity == "error" for f in findings) else ("pass" if results else "skipped")
    kind = devices.kind if devices else "none"
    source = machine_source if machine is not None else None
    unfired = [spec for spec, n in zip(inject, fired, strict=True) if not n] if results else []
    return PeerReport(verdict, kind, results, host, skipped, findings, source, reason, list(inject), unfired)


_CONFIRM = "rerun with NCCL_P2P_DISABLE=1 (and compare p2pBandwidthLatencyTest with P2P on and off)"
_FIX = "boot with iommu=pt (or disable VT-d/AMD-Vi), disable ACS on the PCIe switches (pci=noacs or setpci)"


def conclude(results: list[PairResult], host: HostFacts) -> list[Finding]:
    out: list[Finding] = []
    denied = [
        (r.src, r.dst, r.grant)
        for r in results
        if r.grant.get("torch") is False or r.grant.get("nvml") not in (None, "OK")
    ]
    if denied:
        out.append(
            Finding(
                "p2p-not-supported",
                "warning",
                f"peer access is not granted for {len(denied)} direction(s), "
                f"e.g. {denied[0][0]}->{denied[0][1]}",
                {"directions": [[s, d, g] for s, d, g in denied]},
                fix="expected on GeForce and in many VMs: NCCL uses shared memory instead",
            )
        )
    bad = [(r, c) for r in results for c in r.copies if c["wrong"]]
    if bad:
        r, c = bad[0]
        out.append(
            Finding(
                "p2p-copy-mismatch",
                "error",
                f"copies {r.src}->{r.dst} over {r.link or 'an unknown link'} arrive wrong: "
                f"{c['wrong']} wrong element(s) in {c['bytes']} bytes of {c['dtype']} "
                f"({c['phase']}, step {c.get('step', 1)}); "
                f"{len(bad)} bad copies in all",
                {
                    "directions": sorted({(x.src, x.dst) for x, _ in bad}),
                    "first": {"src": r.src, "dst": r.dst, **c},
                },
                cause="the peer-to-peer path delivers wrong data (IOMMU translating peer DMA, ACS "
                "redirect, a GPU/driver that grants P2P it cannot do)",
                fix=f"confirm: {_CONFIRM}; fix: {_FIX}",
            )
        )
    inverted = [r for r in results if r.bandwidth and r.bandwidth["direct_gbs"] < r.bandwidth["staged_gbs"]]
    if inverted:
        r = inverted[0]
        speeds = r.bandwidth or {}
        out.append(
            Finding(
                "p2p-bandwidth-inverted",
                "warning",
                f"direct copies {r.src}->{r.dst} ({speeds['direct_gbs']} GB/s) are slower than copies "
                f"staged through the host ({speeds['staged_gbs']} GB/s)",
                {"directions": [[x.src, x.dst, x.bandwidth] for x in inverted]},
                cause="peer traffic redirected through the root complex (ACS) or translated by an IOMMU",
                fix=_FIX,
            )
        )
    for r in results:
        report = r.allreduce or {}
        configured, control = report.get("configured"), report.get("p2p_disabled")
        if not configured:
            continue
        if configured.get("hung"):
            out.append(
                Finding(
                    "collective-hang",
                    "error",
                    f"the all-reduce on GPUs {r.src},{r.dst} did not finish"
                    + ("; with NCCL_P2P_DISABLE=1 it did" if control and control.get("wrong") == 0 else ""),
                    {"pair": [r.src, r.dst], "control_ok": bool(control and control.get("wrong") == 0)},
                    cause="peer-to-peer traffic that stalls (ACS/IOMMU), see failure-modes 1.2",
                    fix=f"confirm: {_CONFIRM}; fix: {_FIX}",
                )
            )
        elif configured.get("wrong"):
            control_ok = bool(control and control.get("wrong") == 0)
            out.append(
                Finding(
                    "allreduce-wrong-values",
                    "error",
                    f"the all-reduce on GPUs {r.src},{r.dst} returned {configured['wrong']} wrong value(s)"
                    + ("; with NCCL_P2P_DISABLE=1 it was exact" if control_ok else ""),
                    {
                        "pair": [r.src, r.dst],
                        "wrong_by_gpu": configured.get("wrong_by_rank"),
                        "control_ok": control_ok,
                    },
                    cause="collectives corrupted on the peer-to-peer path while copies may pass",
                    fix=f"confirm: {_CONFIRM}; fix: {_FIX}",
                )
            )
    if host.iommu_mode == "translated":
        out.append(
            Finding(
                "iommu-enabled",
                "warning",
                "an IOMMU translates device DMA "
                f"({', '.join(host.iommu_units) or 'enabled on the kernel command line'}); on bare metal "
                "NVIDIA does not support peer-to-peer through it",
                {"units": host.iommu_units, "cmdline": host.cmdline, "kernel_log": host.kernel_lines},
                fix="add iommu=pt to the kernel command line (or disable VT-d/AMD-Vi in the BIOS)",
            )
        )
    if host.acs_redirect:
        out.append(
            Finding(
                "acs-redirect",
                "warning",
                f"{len(host.acs_redirect)} PCIe device(s) redirect peer requests "
                "(ACSCtl ReqRedir+/CmpltRedir+)",
                {"devices": host.acs_redirect},
                fix="disable ACS in the BIOS, boot with pci=noacs, or clear it with setpci "
                "(ECAP_ACS+6.w=0000) on those bridges",
            )
        )
    overrides = {
        k: v
        for k, v in host.nccl.items()
        if k
        in (
            "NCCL_P2P_DISABLE",
            "NCCL_P2P_LEVEL",
            "NCCL_SHM_DISABLE",
            "NCCL_IB_DISABLE",
            "NCCL_ALGO",
            "NCCL_PROTO",
            "NCCL_NET",
        )
    }
    if overrides:
        out.append(
            Finding(
                "nccl-env-override",
                "info",
                "NCCL settings change how GPUs talk: " + ", ".join(f"{k}={v}" for k, v in overrides.items()),
                {"settings": overrides},
                fix="remember them when comparing results; unset to test the default path",
            )
        )
    return out
