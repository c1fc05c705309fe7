"""What NCCL chose for each pair, what the hardware offers, and whether the choice was slow.

:func:`analyze` groups a log's connections (:mod:`.reader`) into directed pairs — one row per
pair and transport family, ``[send]``/``[receive]`` of one connection counted once,
``channels`` the distinct channel ids — and, given a topology (``--machine``), puts the link
each pair has beside it. Findings are raised only where the log (and the topology) show a
slower path than the hardware offers; NCCL's normal choices — SHM on NODE/SYS pairs,
P2P/direct within one process, NET across hosts — stay quiet.

Mapping a pair onto the topology: by bus id when the log prints bus ids and the topology
knows them, else by CUDA device index as ``GPU<n>`` (right when ``CUDA_VISIBLE_DEVICES`` is
unset and devices are in PCI order, as on servers of one GPU model). Only pairs on one host
are mapped: P2P and SHM connections always are; NET ones only when both hosts are known and
equal. A capture describes one machine: a multi-host log is mapped host by host onto it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from gpudiag.errors import EXIT_OK, EXIT_PROBLEM
from gpudiag.findings import Finding, short_repr
from gpudiag.topology.model import Topology, gpu_index, nvlink_count, path_of
from gpudiag.transport.reader import Connection, NcclLog, Unread, busid_from_nccl

SCHEMA = "gpudiag.transport/1"

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


@dataclass
class Pair:
    """One directed pair and the transport family it used."""

    from_rank: int
    to_rank: int
    from_device: int | None
    to_device: int | None
    from_busid: str | None
    to_busid: str | None
    from_host: str | None
    to_host: str | None
    transport: str
    raw: str
    channels: list[int]
    lines: list[int]
    conns: list[int] = field(default_factory=list)
    pids: list[int] = field(
        default_factory=list
    )  # processes that printed its lines  # connection indexes (`Channel NN/MM`'s MM; 0 when not printed)
    offers: str | None = None  # the topology's cell for the pair, e.g. "NV4", "SYS"
    p2p: str | None = None  # the topology's P2P status for the pair, e.g. "OK", "GNS"

    @property
    def same_host(self) -> bool | None:
        """True/False when both hosts are known, else None (NET pairs); P2P/SHM: True."""
        if not self.transport.startswith("NET/"):
            return True
        if self.from_host is None or self.to_host is None:
            return None
        return self.from_host == self.to_host

    def to_json(self) -> dict[str, Any]:
        return {
            "from_rank": self.from_rank,
            "to_rank": self.to_rank,
            "from_device": self.from_device,
            "to_device": self.to_device,
            "from_busid": self.from_busid,
            "to_busid": self.to_busid,
            "from_host": self.from_host,
            "to_host": self.to_host,
            "transport": self.transport,
            "raw": self.raw,
            "channels": list(self.channels),
            "channel_count": len(self.channels),
            "offers": self.offers,
            "p2p": self.p2p,
            "lines": self.lines[:20],
        }


@dataclass
class TransportReport:
    """``gpudiag transport``'s result: the log's facts, pairs, unread lines and findings."""

    log: NcclLog
    pairs: list[Pair]
    findings: list[Finding]
    topology_source: str | None = None
    host_notes: list[str] = field(default_factory=list)

    def __repr__(self) -> str:
        return short_repr(
            self, self.verdict, self.findings, pairs=len(self.pairs), unread=len(self.log.unread)
        )

    @property
    def verdict(self) -> str:
        return "slow-path" if self.exit_code() == EXIT_PROBLEM else ("no-pairs" if not self.pairs else "ok")

    @property
    def simulated(self) -> bool:
        """False: a log is what NCCL did, read, not a simulation."""
        return False

    @property
    def unread(self) -> list[Unread]:
        return self.log.unread

    def exit_code(self) -> int:
        """1 when a pair took a slower path than it should (a warning), else 0."""
        return EXIT_PROBLEM if any(f.severity != "info" for f in self.findings) else EXIT_OK

    def to_json(self) -> dict[str, Any]:
        """The ``gpudiag.transport/1`` document (see ``docs/transport.md``)."""
        log = self.log
        return {
            "schema": SCHEMA,
            "verdict": self.verdict,
            "sources": list(log.sources),
            "nccl_version": log.versions[0] if log.versions else None,
            "nccl_versions": list(log.versions),
            "hosts": list(log.hosts),
            "bracket": log.bracket_kind,
            "env": {name: list(values) for name, values in log.env.items()},
            "ib_devices": list(log.ib_devices),
            "networks": list(log.networks),
            "topology": self.topology_source,
            "lines": log.lines,
            "connection_lines": len(log.connections),
            "pairs": [pair.to_json() for pair in self.pairs],
            "unread": [u.to_json() for u in log.unread],
            "nccl_warnings": list(log.warnings),
            "findings": [f.to_json() for f in self.findings],
        }


def _rank_hosts(log: NcclLog) -> dict[int, str | None]:
    """Each rank's host from the lines its own process printed (None where two hosts
    claim it, as with several communicators numbering ranks anew)."""
    seen: dict[int, set[str]] = {}
    for conn in log.connections:
        if conn.host is not None:
            seen.setdefault(conn.printer_rank, set()).add(conn.host)
    for init in log.inits:
        if init.host is not None:
            seen.setdefault(init.rank, set()).add(init.host)
    return {rank: next(iter(hosts)) if len(hosts) == 1 else None for rank, hosts in seen.items()}


def _shared_names(log: NcclLog, hosts: dict[int, str | None]) -> set[str]:
    """Host names that stand for more than one machine: a name under which two ranks
    use the same device (NCCL refuses two ranks on one GPU), or an anonymised name."""
    devices: dict[str, Counter[str]] = {}
    for conn in log.connections:
        host = hosts.get(conn.printer_rank)
        bracket = conn.to_bracket if conn.side == "receive" else conn.from_bracket
        if host is not None and bracket is not None:
            devices.setdefault(host, Counter())[f"{conn.printer_rank}:{bracket}"] += 1
    shared = set()
    for host, seen in devices.items():
        per_device = Counter(key.split(":", 1)[1] for key in seen)
        if any(n > 1 for n in per_device.values()):
            shared.add(host)
    for host in log.hosts:
        if any(mark in host for mark in "<>*") or host.lower() in ("localhost", "hostname", "host", "xxx"):
            shared.add(host)
    return shared


def _pairs(log: NcclLog) -> tuple[list[Pair], list[str]]:
    hosts = _rank_hosts(log)
    shared = _shared_names(log, hosts)
    trusted = {rank: (host if host not in shared else None) for rank, host in hosts.items()}
    busid = log.bracket_kind == "busid"
    groups: dict[tuple[Any, ...], list[Connection]] = {}
    for conn in log.connections:
        key = (conn.from_rank, conn.to_rank, conn.from_bracket, conn.to_bracket, conn.transport)
        groups.setdefault(key, []).append(conn)
    pairs = []
    for (a, b, abr, bbr, family), conns in groups.items():
        raws = Counter(c.raw for c in conns)
        from_host, to_host = trusted.get(a), trusted.get(b)
        if not family.startswith("NET/"):  # (P2P and SHM join two GPUs of one host)
            from_host = to_host = from_host or to_host
        pairs.append(
            Pair(
                from_rank=a,
                to_rank=b,
                from_device=None if busid or abr is None else int(abr),
                to_device=None if busid or bbr is None else int(bbr),
                from_busid=busid_from_nccl(abr) if busid and abr is not None else None,
                to_busid=busid_from_nccl(bbr) if busid and bbr is not None else None,
                from_host=from_host,
                to_host=to_host,
                transport=family,
                raw=raws.most_common(1)[0][0],
                channels=sorted({c.channel for c in conns}),
                lines=sorted({c.line for c in conns}),
                conns=sorted({c.conn or 0 for c in conns}),
                pids=sorted({c.pid for c in conns if c.pid is not None}),
            )
        )
    pairs.sort(key=lambda p: (p.from_rank, p.to_rank, p.transport))
    notes = [
        f"the host name {name!r} stands for more than one machine (anonymised or shared)"
        for name in sorted(shared)
    ]
    return pairs, notes


def _label(topo: Topology, device: int | None, busid: str | None) -> str | None:
    """The topology's GPU label for a device index or bus id."""
    if busid is not None:
        for label, info in topo.gpus.items():
            if info.pci_bus_id and busid_from_nccl_form(info.pci_bus_id) == busid:
                return label
        return None
    if device is None:
        return None
    label = f"GPU{device}"
    return label if label in topo.gpus and gpu_index(label) == device else None


def busid_from_nccl_form(pci: str) -> str | None:
    """A topology's bus id (``0000:3b:00.0`` in any case and width) in nvidia-smi's form."""
    from gpudiag.hw.devices import normalize_bus_id

    return normalize_bus_id(pci)


def _place(pairs: list[Pair], topo: Topology) -> None:
    for pair in pairs:
        if pair.same_host is not True:
            continue
        a = _label(topo, pair.from_device, pair.from_busid)
        b = _label(topo, pair.to_device, pair.to_busid)
        if a is None or b is None or a == b:
            continue
        pair.offers = topo.cell(a, b)
        caps = topo.p2p_status(a, b)
        pair.p2p = caps.get("reported") or next((v for v in caps.values() if v is not None), None)


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


def _slow_intra(log: NcclLog, pairs: list[Pair]) -> list[Finding]:
    slow = [p for p in pairs if _fast(p) and (p.transport == "SHM" or p.transport.startswith("NET/"))]
    if not slow:
        return []
    env = _env_line(log, ("NCCL_P2P_DISABLE", "NCCL_P2P_LEVEL", "NCCL_SHM_DISABLE"))
    causes = [f"set in the log: {env}"] if env else []
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
        causes += [
            "the ranks run in separate containers or pods without a shared IPC namespace "
            "(no CUDA IPC between them)",
            "each process sees only its own GPU (CUDA_VISIBLE_DEVICES set per process), "
            "so NCCL cannot open the peer",
        ]
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


def _socket_with_ib(log: NcclLog, pairs: list[Pair]) -> list[Finding]:
    sockets = [p for p in pairs if p.transport == "NET/Socket"]
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


def analyze(log: NcclLog, topology: Topology | None = None) -> TransportReport:
    """Pairs and findings from a read log, with the topology beside them when given."""
    pairs, notes = _pairs(log)
    if topology is not None:
        _place(pairs, topology)
    findings = [
        *_slow_intra(log, pairs),
        *_same_host_net(log, pairs),
        *_socket_with_ib(log, pairs),
        *_mixed(pairs),
        *_settings(log, pairs),
        *_no_pairs(log),
    ]
    return TransportReport(
        log=log,
        pairs=pairs,
        findings=findings,
        topology_source=topology.source if topology is not None else None,
        host_notes=notes,
    )
