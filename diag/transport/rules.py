"""The ``nccl-*`` findings on a log's pairs: raised only where the log (and the topology)
show a slower path than the hardware offers (SHM or the network where P2P was open, the
network on one host, sockets beside InfiniBand, settings that forbid a path, one link with
mixed transports), and ``nccl-no-transport-lines`` when the log shows no pair.
"""

from __future__ import annotations

from typing import Any

from gpudiag.findings import Finding
from gpudiag.topology.model import nvlink_count, path_of
from gpudiag.transport.judge import gdr_findings, needs_topology, warn_findings
from gpudiag.transport.reader import NcclLog
from gpudiag.transport.report import Pair

__all__ = ["FAST_PATHS", "SUBSYS_HINT", "TRANSPORT_SETTINGS", "transport_findings"]

#: Settings that change which transport NCCL may pick.
TRANSPORT_SETTINGS = (
    "NCCL_P2P_DISABLE",
    "NCCL_P2P_LEVEL",
    "NCCL_SHM_DISABLE",
    "NCCL_IB_DISABLE",
    "NCCL_IBEXT_DISABLE",
    "NCCL_NET",
    "NCCL_NET_GDR_LEVEL",
    "NCCL_P2P_USE_CUDA_MEMCPY",
    "NCCL_CUMEM_ENABLE",
)
#: Paths on which NCCL uses P2P by default (its P2P level is PXB: NVLink, PIX, PXB).
FAST_PATHS = ("NVLINK", "PIX", "PXB")
SUBSYS_HINT = "NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,P2P,NET,GRAPH"


def _fast(pair: Pair) -> bool:
    return pair.offers is not None and (nvlink_count(pair.offers) > 0 or path_of(pair.offers) in FAST_PATHS)


def _env_line(log: NcclLog, names: tuple[str, ...]) -> str | None:
    seen = [f"{name}={'/'.join(log.env[name])}" for name in names if name in log.env]
    return ", ".join(seen) if seen else None


def _evidence(pairs: list[Pair]) -> list[dict[str, Any]]:
    return [
        {
            k: p.to_json()[k]
            for k in (
                "from_rank",
                "to_rank",
                "from_device",
                "to_device",
                "from_busid",
                "to_busid",
                "transport",
                "raw",
                "offers",
                "p2p",
            )
        }
        for p in pairs[:16]
    ]


def _names(pairs: list[Pair]) -> str:
    shown = ", ".join(f"{p.from_rank}->{p.to_rank}" for p in pairs[:8])
    return shown + (f" and {len(pairs) - 8} more" if len(pairs) > 8 else "")


def _isolated(log: NcclLog, slow: list[Pair]) -> str | None:
    """The log's own evidence that each process sees other GPUs: two ranks of the slow
    pairs on one host and one CUDA device number that their ``Init`` lines put on two GPUs
    (``cudaDev 0 nvmlDev 4`` and ``cudaDev 0 nvmlDev 5``: ``CUDA_VISIBLE_DEVICES`` set per
    process). Ranks on two hosts prove nothing (each host numbers its own GPUs), nor does
    an ``Init`` line without its host."""
    seen: dict[int, set[tuple[str, int, int]]] = {}
    for init in log.inits:
        if init.nvml is not None and init.host:
            seen.setdefault(init.rank, set()).add((init.host, init.device, init.nvml))
    ranks = sorted({r for p in slow for r in (p.from_rank, p.to_rank)})
    known = {r: next(iter(seen[r])) for r in ranks if len(seen.get(r, ())) == 1}
    by_device: dict[tuple[str, int], list[int]] = {}
    for rank, (host, device, _) in known.items():
        by_device.setdefault((host, device), []).append(rank)
    for (_, device), together in sorted(by_device.items()):
        gpus = {known[r][2] for r in together}
        if len(gpus) > 1:
            shown = ", ".join(f"rank {r} GPU {known[r][2]}" for r in together[:4])
            return (
                f"the log shows each process seeing its own GPU: cudaDev {device} is {shown} "
                "(CUDA_VISIBLE_DEVICES set per process), which keeps NCCL from opening the peer "
                "(CUDA IPC needs both GPUs visible: set CUDA_VISIBLE_DEVICES alike for all ranks of a "
                "host and pick the device by local rank)"
            )
    return None


def _slow_intra(log: NcclLog, pairs: list[Pair]) -> list[Finding]:
    slow = [p for p in pairs if _fast(p) and (p.transport == "SHM" or p.transport.startswith("NET/"))]
    if not slow:
        return []
    env = _env_line(log, ("NCCL_P2P_DISABLE", "NCCL_P2P_LEVEL", "NCCL_SHM_DISABLE"))
    causes = [f"set in the log: {env}"] if env else []
    isolated = _isolated(log, slow)
    if isolated:
        causes.append(isolated)
    p2p_refused = [p for p in slow if p.p2p not in (None, "OK")]
    if p2p_refused:
        causes.append(
            f"the driver refuses P2P on these pairs (topology P2P status {p2p_refused[0].p2p}): "
            "ACS or the IOMMU"
        )
    causes += [
        "peer access blocked by PCIe ACS or the IOMMU (P2P fails although the link exists)",
        "NCCL_P2P_DISABLE=1 or an NCCL_P2P_LEVEL below the pair's path, set where the log does not show it "
        "(the environment, /etc/nccl.conf, ~/.nccl.conf)",
    ]
    one_process = len({pid for p in slow for pid in p.pids}) == 1
    if not one_process:  # (one process drives all these GPUs: no container or visibility between them)
        causes.append(
            "the ranks run in separate containers or pods without a shared IPC namespace "
            "(no CUDA IPC between them)"
        )
        if not isolated:
            causes.append(
                "each process sees only its own GPU (CUDA_VISIBLE_DEVICES set per process), "
                "so NCCL cannot open the peer"
            )
    kinds = sorted({p.transport for p in slow})
    return [
        Finding(
            "nccl-slow-path",
            "warning",
            f"{len(slow)} pair(s) joined by {'/'.join(sorted({p.offers or '?' for p in slow}))} went over "
            f"{' and '.join(kinds)} instead of P2P: {_names(slow)}",
            {"pairs": _evidence(slow)},
            cause="; ".join(f"{i}. {c}" for i, c in enumerate(causes, 1)),
            fix="`nvidia-smi topo -p2p r` (OK on the pair: P2P is allowed, look at settings and containers; "
            "CNS/GNS/TNS: the platform refuses it) and `gpudiag peer` (does a copy over the pair work)",
        )
    ]


def _same_host_net(log: NcclLog, pairs: list[Pair]) -> list[Finding]:
    single_node = bool(log.nnodes) and max(log.nnodes) == 1
    net = [p for p in pairs if p.transport.startswith("NET/")]
    same = [
        p
        for p in net
        if (p.same_host is True and (p.from_device, p.from_busid) != (p.to_device, p.to_busid)) or single_node
    ]
    if not same:
        return []
    env = _env_line(log, ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_P2P_LEVEL"))
    causes = [f"set in the log: {env}"] if env else []
    if len({pid for p in same for pid in p.pids}) == 1:  # (one process: no container between the GPUs)
        causes.append(
            "NCCL_P2P_DISABLE=1 (or NCCL_P2P_LEVEL=LOC) together with NCCL_SHM_DISABLE=1, set where the "
            "log does not show them: one process drives these GPUs, so nothing else keeps P2P from them"
        )
    else:
        causes += [
            "the ranks run in separate containers or pods that each see one GPU "
            "(k8s device plugin, docker --gpus device=N)",
            "P2P and SHM both unusable between the processes "
            "(no shared /dev/shm or IPC namespace: docker --ipc=host missing)",
            "NCCL_P2P_DISABLE=1 together with NCCL_SHM_DISABLE=1 set outside the log",
        ]
    kinds = "/".join(sorted({p.transport for p in same}))
    return [
        Finding(
            "nccl-same-host-net",
            "warning",
            f"{len(same)} pair(s) of GPUs on one host talk over the network ({kinds}): {_names(same)}",
            {"pairs": _evidence(same), "nnodes": list(log.nnodes)},
            cause="; ".join(f"{i}. {c}" for i, c in enumerate(causes, 1)),
            fix="in each rank's container run `nvidia-smi -L` (one GPU each: separate containers) and "
            "`ls -la /dev/shm; ipcs -m` (empty or tiny: no shared memory), and print `env | grep NCCL_`",
        )
    ]


def _listed_ib(log: NcclLog, pair: Pair) -> bool:
    """Whether a process that listed InfiniBand devices printed ``pair``'s lines, or one of
    its log and host (another job's IB devices say nothing of this pair)."""
    for source, host in pair.origins:
        if (source, host) in log.ib_where or (host is None and any(s == source for s, _ in log.ib_where)):
            return True
    return False


def _socket_with_ib(log: NcclLog, pairs: list[Pair]) -> list[Finding]:
    sockets = [p for p in pairs if p.transport == "NET/Socket" and _listed_ib(log, p)]
    if not sockets or not log.ib_devices:
        return []
    disabled = [v for v in log.env.get("NCCL_IB_DISABLE", []) if v not in ("0", "")]
    causes = [f"NCCL_IB_DISABLE={disabled[0]} in the log"] if disabled else []
    if "NCCL_NET" in log.env:
        causes.append(f"NCCL_NET={'/'.join(log.env['NCCL_NET'])} in the log")
    causes += [
        "the ranks that used sockets did not find the IB devices "
        "(a container without /dev/infiniband, or a node without them)",
        "the IB ports are down or have no link layer NCCL can use",
        "NCCL_NET=Socket or NCCL_IB_HCA excluding the devices, set outside the log",
    ]
    return [
        Finding(
            "nccl-socket-with-ib",
            "warning",
            f"{len(sockets)} pair(s) went over NET/Socket although the log lists InfiniBand devices "
            f"({', '.join(log.ib_devices[:4])}): {_names(sockets)}",
            {"pairs": _evidence(sockets), "ib_devices": list(log.ib_devices)},
            cause="; ".join(f"{i}. {c}" for i, c in enumerate(causes, 1)),
            fix="`ibv_devinfo` on each node (PORT_ACTIVE?) and `ls /dev/infiniband` inside the container",
        )
    ]


def _settings(log: NcclLog, pairs: list[Pair]) -> list[Finding]:
    """A note naming the transport settings the log shows, and the pairs that took the
    path such a setting leaves (SHM or NET on one host with P2P off or limited, sockets
    with IB off); a warning only comes from the topology (``nccl-slow-path``)."""
    seen = {name: log.env[name] for name in TRANSPORT_SETTINGS if name in log.env}
    if not seen:
        return []
    shown = ", ".join(f"{name}={'/'.join(values)}" for name, values in seen.items())
    p2p_off = any(v not in ("0", "") for v in seen.get("NCCL_P2P_DISABLE", [])) or "NCCL_P2P_LEVEL" in seen
    ib_off = any(v not in ("0", "") for v in seen.get("NCCL_IB_DISABLE", []))
    fallback = [
        p
        for p in pairs
        if (p2p_off and (p.transport == "SHM" or (p.transport.startswith("NET/") and p.same_host is True)))
        or (ib_off and p.transport == "NET/Socket")
    ]
    tail = f"; pairs on the path it leaves: {_names(fallback)}" if fallback else ""
    return [
        Finding(
            "nccl-transport-setting",
            "info",
            f"the log shows settings that choose NCCL's transports: {shown}{tail}",
            {"settings": {k: list(v) for k, v in seen.items()}, "pairs": _evidence(fallback)},
            cause="set in the environment of the run (or in /etc/nccl.conf, ~/.nccl.conf)",
            fix="check whether they are still needed: unset them and compare `gpudiag transport` "
            "and the speed",
        )
    ]


def _mixed(pairs: list[Pair]) -> list[Finding]:
    """Pairs the topology calls equal (same cell) that went over different classes of
    transport, among the ring/tree connections (index 0): send/receive operations
    (``Channel NN/1``) may take another transport by NCCL's own rules."""
    by_link: dict[str, dict[str, list[Pair]]] = {}
    for p in pairs:
        if p.offers is None or 0 not in p.conns:
            continue
        family = (
            "P2P"
            if p.transport.startswith("P2P/")
            else ("NET" if p.transport.startswith("NET/") else p.transport)
        )
        by_link.setdefault(p.offers, {}).setdefault(family, []).append(p)
    out = []
    for link, families in sorted(by_link.items()):
        if len(families) < 2:
            continue
        counts = ", ".join(f"{fam} on {len(ps)}" for fam, ps in sorted(families.items()))
        out.append(
            Finding(
                "nccl-mixed-transports",
                "warning",
                f"pairs joined by {link} did not all take one path: {counts}",
                {"link": link, "pairs": _evidence([p for ps in families.values() for p in ps])},
                cause="1. P2P refused on some of these pairs only (ACS on one PCIe switch, a GPU in another "
                "container); 2. the ranks of some pairs share one process (P2P/direct) and others do not",
                fix="`nvidia-smi topo -p2p r` for the pairs that differ, then `gpudiag peer`",
            )
        )
    return out


def _no_pairs(log: NcclLog) -> list[Finding]:
    if log.connections:
        return []
    single = bool(log.nranks) and max(log.nranks) == 1
    why = (
        f"every communicator in it has one rank, so NCCL connected no pair (a run of 2 or more "
        f"ranks with {SUBSYS_HINT} logs them)"
        if single
        else f"NCCL logs them at INFO level under INIT/P2P/NET: rerun with {SUBSYS_HINT} "
        "and a world of 2 or more ranks"
    )
    return [
        Finding(
            "nccl-no-transport-lines",
            "info",
            f"the log has no transport line (`Channel NN : a -> b via …`): {why}",
            {"nranks": log.nranks, "nccl_lines": log.nccl_lines, "warnings": list(log.warnings[:5])},
        )
    ]


def transport_findings(log: NcclLog, pairs: list[Pair], has_topology: bool = False) -> list[Finding]:
    """Every rule's findings on ``pairs`` (placed on the topology when one was given), in
    the order the report lists them."""
    return [
        *warn_findings(log),
        *_slow_intra(log, pairs),
        *_same_host_net(log, pairs),
        *_socket_with_ib(log, pairs),
        *gdr_findings(log, pairs),
        *_mixed(pairs),
        *needs_topology(log, pairs, has_topology),
        *_settings(log, pairs),
        *_no_pairs(log),
    ]
