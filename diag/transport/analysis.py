"""What NCCL chose for each pair, what the hardware offers, and whether the choice was slow.

:func:`analyze` groups a log's connections (:mod:`.reader`) into directed pairs — one row per
pair and transport family, ``[send]``/``[receive]`` of one connection counted once,
``channels`` the distinct channel ids — and, given a topology (``--machine``), puts the link
each pair has beside it. Findings are raised only where the log (and the topology) show a
slower path than the hardware offers; NCCL's normal choices — SHM on NODE/SYS pairs,
P2P/direct within one process, NET across hosts — stay quiet.

Mapping a pair onto the topology: by bus id when the log prints bus ids and the topology
knows them; else by the NVML index the rank's ``Init`` line gives for its CUDA device
(``cudaDev 0 nvmlDev 4``: NCCL 2.16 and later), as ``GPU<nvml>`` — nvidia-smi's numbering,
right under any ``CUDA_VISIBLE_DEVICES``; else by CUDA device index as ``GPU<n>`` (right
when ``CUDA_VISIBLE_DEVICES`` is unset and devices are in PCI order, as on servers of one
GPU model). Only pairs on one host
are mapped: P2P and SHM connections always are; NET ones only when both hosts are known and
equal. A capture describes one machine: a multi-host log is mapped host by host onto it.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from gpudiag.topology.model import Topology, gpu_index
from gpudiag.transport.reader import Connection, NcclLog, busid_from_nccl
from gpudiag.transport.report import Pair, TransportReport
from gpudiag.transport.rules import SUBSYS_HINT as SUBSYS_HINT
from gpudiag.transport.rules import transport_findings


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
    shared.update(host for host in log.hosts if placeholder(host))
    return shared


def placeholder(host: str) -> bool:
    """Whether a host name is a stand-in rather than a machine's name (anonymised by its
    author, ``<cluster_name>``, ``node*``, or generic: ``localhost``, ``hostname``)."""
    return any(mark in host for mark in "<>*") or host.lower() in ("localhost", "hostname", "host", "xxx")


def _pairs(log: NcclLog) -> tuple[list[Pair], list[str]]:
    hosts = _rank_hosts(log)
    shared = _shared_names(log, hosts)
    trusted = {rank: (host if host not in shared else None) for rank, host in hosts.items()}
    groups: dict[tuple[Any, ...], list[Connection]] = {}
    for conn in log.connections:
        kind = log.kind_of(conn)
        key = (conn.from_rank, conn.to_rank, conn.from_bracket, conn.to_bracket, conn.transport, kind)
        groups.setdefault(key, []).append(conn)
    pairs = []
    for (a, b, abr, bbr, family, kind), conns in groups.items():
        busid = kind == "busid"
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
                sides=_sides(conns),
                origins=sorted({(c.source, c.host) for c in conns}, key=str),
            )
        )
    pairs.sort(key=lambda p: (p.from_rank, p.to_rank, p.transport))
    notes = [
        f"the host name {name!r} stands for more than one machine (anonymised or shared)"
        for name in sorted(shared)
    ]
    return pairs, notes + _runs_notes(log)


def _runs_notes(log: NcclLog) -> list[str]:
    """Notes when the input holds more than one NCCL run: several NCCL versions, or one
    connection line printed by two processes (two jobs, or communicators numbering their
    ranks anew): its pairs are then those of all of them, each line read as its process
    printed it."""
    notes = []
    if len(log.versions) > 1:
        notes.append(f"the input holds more than one NCCL run (versions {', '.join(log.versions[:4])})")
    printers: dict[tuple[Any, ...], set[tuple[Any, ...]]] = {}
    for c in log.connections:
        key = (c.printer_rank, c.from_rank, c.to_rank, c.channel, c.conn, c.side)
        printers.setdefault(key, set()).add((c.source, c.host, c.pid))
    twice = sorted({key[0] for key, seen in printers.items() if len(seen) > 1})
    if twice:
        shown = ", ".join(str(r) for r in twice[:8]) + (" …" if len(twice) > 8 else "")
        notes.append(
            f"rank(s) {shown} printed the same connection from two processes: the input holds more "
            "than one job (or communicators numbering their ranks anew); the pairs are all of theirs"
        )
    return notes


def _sides(conns: list[Connection]) -> dict[str, list[str]]:
    """Each end's distinct transport texts (``""`` for lines that name no side)."""
    out: dict[str, list[str]] = {}
    for conn in conns:
        raws = out.setdefault(conn.side or "", [])
        if conn.raw not in raws and len(raws) < 8:
            raws.append(conn.raw)
    return out


def _nvml_indexes(log: NcclLog) -> dict[tuple[int, int], int | None]:
    """(rank, CUDA device) → NVML index, from the ranks' ``Init`` lines; None for a rank
    whose lines disagree (several communicators numbering their ranks anew): its GPU is
    not known — nor is it its CUDA device number, which those lines say it is not."""
    seen: dict[tuple[int, int], set[int]] = {}
    for init in log.inits:
        if init.nvml is not None:
            seen.setdefault((init.rank, init.device), set()).add(init.nvml)
    return {key: next(iter(found)) if len(found) == 1 else None for key, found in seen.items()}


def _smi_index(nvml: dict[tuple[int, int], int | None], rank: int, device: int | None) -> int | None:
    """nvidia-smi's number of ``rank``'s CUDA ``device``: its NVML index where the log gave
    it, None where its ``Init`` lines disagree (unknown: the pair is not placed, unless a bus
    id places it), else the CUDA index itself."""
    return None if device is None else nvml.get((rank, device), device)


def _label(topo: Topology, device: int | None, busid: str | None) -> str | None:
    """The topology's GPU label for a device index (nvidia-smi's) or bus id."""
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


def _place(pairs: list[Pair], topo: Topology, log: NcclLog) -> None:
    nvml = _nvml_indexes(log)
    for pair in pairs:
        if pair.same_host is not True:
            continue
        a = _label(topo, _smi_index(nvml, pair.from_rank, pair.from_device), pair.from_busid)
        b = _label(topo, _smi_index(nvml, pair.to_rank, pair.to_device), pair.to_busid)
        if a is None or b is None or a == b:
            continue
        pair.offers = topo.cell(a, b)
        caps = topo.p2p_status(a, b)
        pair.p2p = caps.get("reported") or next((v for v in caps.values() if v is not None), None)


def analyze(log: NcclLog, topology: Topology | None = None) -> TransportReport:
    """Pairs and findings from a read log, with the topology beside them when given."""
    pairs, notes = _pairs(log)
    if topology is not None:
        _place(pairs, topology, log)
    findings = transport_findings(log, pairs, topology is not None)
    return TransportReport(
        log=log,
        pairs=pairs,
        findings=findings,
        topology_source=topology.source if topology is not None else None,
        host_notes=notes,
        topology=topology,
    )
