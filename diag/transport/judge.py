"""The findings on what a log says beyond which transport each pair took (issue 45):
InfiniBand across hosts without GPUDirect RDMA (``nccl-no-gdrdma``), pairs whose path only
the topology can judge (``nccl-needs-topology``: never an all-clear the log cannot give),
and NCCL's own ``WARN`` lines, the known ones explained (``nccl-shm-failed``, ``nccl-warn``).
"""

from __future__ import annotations

import re
from typing import Any

from gpudiag.findings import Finding
from gpudiag.transport.reader import NcclLog
from gpudiag.transport.report import Pair

__all__ = ["FORCING", "gdr_findings", "needs_topology", "warn_findings"]

#: Families that can use GPUDirect RDMA and print ``/GDRDMA`` when they do.
GDR_FAMILIES = ("NET/IB", "NET/IBext")
_GDR_HCA_OFF = re.compile(r"GPU Direct RDMA Disabled for HCA")
_GDR_DISTANCE = re.compile(
    r"GPU Direct RDMA Disabled for GPU \S{1,40} / HCA \d{1,4} \(distance \d{1,3} [<>]=? \d{1,3}\)"
)


def _names(pairs: list[Pair]) -> str:
    shown = ", ".join(f"{p.from_rank}->{p.to_rank}" for p in pairs[:8])
    return shown + (f" and {len(pairs) - 8} more" if len(pairs) > 8 else "")


def _evidence(pairs: list[Pair]) -> list[dict[str, Any]]:
    keys = ("from_rank", "to_rank", "from_host", "to_host", "transport", "raw", "raw_by_side")
    return [{k: p.to_json()[k] for k in keys} for p in pairs[:16]]


def _env(log: NcclLog, names: tuple[str, ...]) -> list[str]:
    return [f"{name}={'/'.join(log.env[name])}" for name in names if name in log.env]


def _without_gdr(pair: Pair) -> bool:
    """Whether the log shows data of ``pair`` crossing the network without GPUDirect RDMA:
    its receiving end (the NIC writing into GPU memory) printed no ``/GDRDMA``, or, where
    no receiving end was logged, no end did. A sending end alone without it is NCCL's
    default on PCIe GPUs (``NCCL_NET_GDR_READ``): shown, not warned about."""
    receive = pair.sides.get("receive")
    if receive:
        return any("/GDRDMA" not in raw for raw in receive)
    return any("/GDRDMA" not in raw for raws in pair.sides.values() for raw in raws)


def gdr_findings(log: NcclLog, pairs: list[Pair]) -> list[Finding]:
    """``nccl-no-gdrdma`` for InfiniBand pairs between hosts (or hosts the log does not
    tell apart) whose data went through host memory; the causes in the order to check
    them, a cause the log itself shows first (its ``GPU Direct RDMA`` lines)."""
    slow = [p for p in pairs if p.transport in GDR_FAMILIES and p.same_host is not True and _without_gdr(p)]
    if not slow:
        return []
    causes = []
    settings = _env(log, ("NCCL_NET_GDR_LEVEL", "NCCL_IB_GDR_LEVEL", "NCCL_NET_GDR_READ", "NCCL_GDR_DISABLE"))
    if settings:
        causes.append(f"set in the log: {', '.join(settings)}")
    said = [line for line in log.gdr_lines if _GDR_HCA_OFF.search(line) or _GDR_DISTANCE.search(line)]
    if said:
        causes.append(f"NCCL says: {said[0][:200]}")
    causes += [
        "the GPU memory is not registrable by the NIC: the nvidia-peermem module not loaded "
        "(`lsmod | grep peermem`) or DMA-BUF not usable (Linux 5.12+, open kernel driver, recent OFED)",
        "PCIe ACS or the IOMMU redirecting peer traffic between the NIC and the GPU",
        "NCCL_NET_GDR_LEVEL below the NIC–GPU path, set where the log does not show it",
        "the NIC far from the GPU (another PCIe switch or CPU socket: PHB/NODE/SYS in "
        "`nvidia-smi topo -m`'s NIC columns), beyond NCCL's default GDR distance",
    ]
    one_sided = [p for p in slow if any("/GDRDMA" in raw for raws in p.sides.values() for raw in raws)]
    tail = f"; the two ends disagree on {_names(one_sided)}" if one_sided else ""
    return [
        Finding(
            "nccl-no-gdrdma",
            "warning",
            f"{len(slow)} pair(s) over {'/'.join(sorted({p.transport for p in slow}))} between hosts without "
            f"GPUDirect RDMA (no /GDRDMA: data staged through host memory): {_names(slow)}{tail}",
            {"pairs": _evidence(slow), "gdr_lines": said[:4]},
            cause="; ".join(f"{i}. {c}" for i, c in enumerate(causes, 1)),
            fix="rerun with NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET: `GPU Direct RDMA Disabled for HCA` "
            "means no peermem/DMA-BUF (load nvidia-peermem), `… for GPU … (distance N > M)` the NIC–GPU "
            "distance (NCCL_NET_GDR_LEVEL=SYS to try); then `lsmod | grep peermem` and `nvidia-smi topo -m`",
        )
    ]


#: Settings that force a slower path, and the path they force.
FORCING = {
    "NCCL_P2P_DISABLE": "forbids P2P",
    "NCCL_P2P_LEVEL": "limits P2P to paths up to that level (LOC: none)",
    "NCCL_SHM_DISABLE": "forbids SHM",
    "NCCL_IB_DISABLE": "forbids InfiniBand",
}


def _forcing(log: NcclLog) -> list[str]:
    out = []
    for name, what in FORCING.items():
        values = [v for v in log.env.get(name, []) if v not in ("0", "")]
        if values and (name == "NCCL_P2P_LEVEL" or any(v != "0" for v in values)):
            out.append(f"{name}={'/'.join(values)} ({what})")
    return out


def needs_topology(log: NcclLog, pairs: list[Pair], has_topology: bool) -> list[Finding]:
    """``nccl-needs-topology`` for the SHM pairs the topology gave no link for (none given,
    or their GPUs not found in it): whether P2P was open to them is the topology's call, so
    the log alone gives no all-clear. A setting in the log that forces the slower path is
    named as their cause. (Network pairs on one host are ``nccl-same-host-net`` already;
    between hosts the network is the only path.)"""
    shm = [p for p in pairs if p.transport == "SHM" and p.offers is None]
    if not shm:
        return []
    how = (
        "the topology given has no link for them (their GPUs were not found in it)"
        if has_topology
        else "no topology was given (--machine), and P2P or SHM is the topology's call"
    )
    forcing = _forcing(log)
    cause = how + (
        f"; the log sets {', '.join(forcing)}, which is why these pairs took SHM" if forcing else ""
    )
    return [
        Finding(
            "nccl-needs-topology",
            "info",
            f"not judged: {len(shm)} SHM pair(s) ({_names(shm)}) may have had P2P; "
            "only the topology of their host can tell",
            {"pairs": _evidence(shm), "forcing_settings": forcing},
            cause=cause,
            fix="give the topology of the host the log came from: `nvidia-smi topo -m > topo.txt` there, "
            "then `gpudiag transport --from-log LOG --machine topo.txt` "
            "(or run `gpudiag transport` on that host)",
        )
    ]


#: NCCL WARN texts about its shared memory segment (a full or missing /dev/shm).
_SHM_FAILED = re.compile(
    r"shared memory|/dev/shm|shm_open|No space left on device|Bus error"
    r"|Call to (?:open|ftruncate|mmap|posix_fallocate|unlink) failed",
    re.IGNORECASE,
)
#: Other known WARN texts: (pattern, what it means, what to do).
_KNOWN = (
    (
        re.compile(r"peer access is not supported|P2P is not supported|peer mapping resources exhausted"),
        "CUDA refused peer access between two GPUs (no P2P on this platform, ACS or the IOMMU)",
        "`nvidia-smi topo -p2p r` and `gpudiag peer`; NCCL_P2P_DISABLE=1 to run without P2P",
    ),
    (
        re.compile(r"Duplicate GPU detected"),
        "two ranks were given the same GPU",
        "pick each rank's device by its local rank (torch.cuda.set_device(LOCAL_RANK))",
    ),
    (
        re.compile(r"NET/IB\w* ?: ?No device found|No IB device|ibv_\w+ failed|NET/IB.*(?:failed|error)"),
        "the InfiniBand devices could not be used (none found in the container, port down, or a verbs error)",
        "`ibv_devinfo` (PORT_ACTIVE?) and `ls /dev/infiniband` inside the container",
    ),
)


def warn_findings(log: NcclLog) -> list[Finding]:
    """NCCL's WARN lines as findings: ``nccl-shm-failed`` for its shared memory segment
    (a container's small /dev/shm), ``nccl-warn`` for the others, explained when known."""
    if not log.warnings:
        return []
    shm = [w for w in log.warnings if _SHM_FAILED.search(w)]
    other = [w for w in log.warnings if w not in shm]
    out = []
    if shm:
        out.append(
            Finding(
                "nccl-shm-failed",
                "warning",
                f"NCCL could not use its shared memory segment: {shm[0][:200]}",
                {"warnings": shm[:8]},
                cause="/dev/shm too small or not shared between the ranks: a container's default 64 MB "
                "(docker without --ipc=host or --shm-size; a Kubernetes pod without a memory-backed "
                "/dev/shm volume)",
                fix="`docker run --ipc=host …` or `--shm-size=16g` (Kubernetes: an emptyDir with "
                "medium: Memory mounted at /dev/shm); check with `df -h /dev/shm` in the container",
            )
        )
    if other:
        explained = []
        for text in other:
            for pattern, meaning, fix in _KNOWN:
                if pattern.search(text):
                    explained.append((text, meaning, fix))
                    break
        first = explained[0] if explained else None
        out.append(
            Finding(
                "nccl-warn",
                "warning",
                f"NCCL logged {len(other)} distinct WARN line(s): {other[0][:200]}",
                {"warnings": other[:8], "warn_lines": log.warn_lines},
                cause=first[1]
                if first
                else "NCCL's WARN level is its error level: the run failed or degraded",
                fix=first[2] if first else "read the WARN lines in order: the first one is usually the cause",
            )
        )
    return out
