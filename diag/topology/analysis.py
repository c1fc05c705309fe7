"""What a topology means for training: ranked GPU pairs, warnings and advice.

Each conclusion is a :class:`~gpudiag.findings.Finding` with a stable code documented
in ``docs/findings.md``:

- warnings: ``asymmetric-cell``, ``mixed-links``, ``sys-ambiguous``,
  ``nvswitch-without-nvlink``, ``p2p-not-supported`` (plus the reading notes a source
  attached, e.g. ``truncated-capture``, ``nvml-field-unavailable``);
- advice: ``best-gpu-groups`` (groups of 2 and 4 and the ``CUDA_VISIBLE_DEVICES`` to use)
  and ``numa-affinity`` (where to pin data-loader threads).

GPU numbers are nvidia-smi's (PCI bus order), so every ``CUDA_VISIBLE_DEVICES`` given is
paired with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, which makes CUDA count the same way.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Any

from gpudiag.findings import Finding, short_repr
from gpudiag.topology.model import (
    P2P_STATUS,
    GpuPair,
    Topology,
    gpu_index,
    link_rank,
)

SCHEMA = "gpudiag.topology/1"

#: GPU models that sit on an NVSwitch fabric when installed as SXM/HGX boards.
NVSWITCH_CLASS = re.compile(r"A100-SXM|A800-SXM|H100 80GB HBM3|H100-SXM|H800|H200(?! NVL)|B200|B300")

#: Groups larger than this many GPUs are not searched exhaustively for size 4.
_MAX_GPUS_FOR_GROUP_SEARCH = 32

_P2P_CAUSE = {
    "GNS": "this GPU model does not offer peer-to-peer (GeForce and some workstation SKUs)",
    "CNS": "the chipset or the virtual machine does not allow peer-to-peer",
    "TNS": "the PCIe topology between the GPUs does not allow peer-to-peer",
    "NS": "peer-to-peer is not supported between these GPUs",
    "DR": "peer-to-peer is disabled by a driver registry key",
    "U": "the driver does not know whether peer-to-peer works",
}


@dataclass
class TopologyReport:
    """A topology with its GPU pairs ranked best to worst and its findings."""

    topology: Topology
    pairs: list[GpuPair]
    findings: list[Finding]

    def __repr__(self) -> str:
        return short_repr(self, self.topology.source, self.findings, gpus=len(self.topology.gpus))

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity != "info"]

    @property
    def advice(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "info"]

    @property
    def verdict(self) -> str:
        """``warning`` when a finding is more than advice, else ``pass``."""
        return "warning" if self.warnings else "pass"

    @property
    def simulated(self) -> bool:
        """False: a capture or machine file is read, not simulated."""
        return False

    def exit_code(self) -> int:
        """0: the topology is a fact to look at, not a failure (``gpudiag topology`` exits 0)."""
        return 0

    def to_json(self) -> dict[str, Any]:
        """The ``gpudiag.topology/1`` document (see ``docs/topology.md``)."""
        topo = self.topology
        return {
            "schema": SCHEMA,
            "source": topo.source,
            "numbering": topo.numbering,
            "labels": list(topo.labels),
            "gpus": {
                label: {
                    "index": info.index,
                    "name": info.name,
                    "pci_bus_id": info.pci_bus_id,
                    "uuid": info.uuid,
                    "memory_total_mib": info.memory_total_mib,
                    "cpu_affinity": info.cpu_affinity,
                    "numa_affinity": info.numa_affinity,
                    "gpu_numa_id": info.gpu_numa_id,
                    "torch_index": info.torch_index,
                }
                for label, info in topo.gpus.items()
            },
            "nic_legend": dict(topo.nic_legend),
            "matrix": {row: dict(cells) for row, cells in topo.matrix.items()},
            "p2p_matrix": {cap: {r: dict(c) for r, c in m.items()} for cap, m in topo.p2p.items()},
            "legend": topo.legend,
            "pairs": [
                {
                    "a": p.a,
                    "b": p.b,
                    "link": p.link,
                    "kind": p.kind,
                    "nvlinks": p.nvlinks,
                    "path": p.path,
                    "p2p": p.p2p,
                    "p2p_caps": p.p2p_caps,
                }
                for p in self.pairs
            ],
            "warnings": [f.to_json() for f in self.warnings],
            "advice": [f.to_json() for f in self.advice],
        }


def analyze(topology: Topology) -> TopologyReport:
    """Rank the GPU pairs and derive every warning and piece of advice."""
    pairs = sorted(topology.pairs(), key=lambda p: (-p.rank, p.a, p.b))
    findings = list(topology.notes)
    findings += _asymmetric_cells(topology)
    findings += _mixed_links(pairs)
    findings += _sys_ambiguous(topology, pairs)
    findings += _nvswitch_without_nvlink(topology, pairs)
    findings += _p2p_not_supported(pairs)
    for size in (2, 4):
        findings += _best_groups(topology, size)
    findings += _numa_affinity(topology)
    return TopologyReport(topology, pairs, findings)


def cuda_visible_devices(group: tuple[int, ...] | list[int]) -> str:
    """The environment that makes CUDA (and torch) see exactly these nvidia-smi GPUs."""
    return "CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=" + ",".join(map(str, group))


def _fmt_pairs(pairs: list[tuple[int, int]]) -> str:
    return " ".join(f"({a},{b})" for a, b in pairs)


def _asymmetric_cells(topo: Topology) -> list[Finding]:
    out = []
    for i, a in enumerate(topo.labels):
        for b in topo.labels[i + 1 :]:
            ab, ba = topo.cell(a, b), topo.cell(b, a)
            if ab is not None and ba is not None and ab != ba:
                out.append(
                    Finding(
                        "asymmetric-cell",
                        "warning",
                        f"{a}→{b} reads {ab} but {b}→{a} reads {ba}; gpudiag uses {ab}",
                        {"row": a, "column": b, "value": ab, "transposed": ba},
                        cause="a damaged paste or a driver reporting different paths",
                        fix="check the capture against a fresh `nvidia-smi topo -m`",
                    )
                )
    return out


def _mixed_links(pairs: list[GpuPair]) -> list[Finding]:
    nvlink = sorted((p.a, p.b) for p in pairs if p.kind == "nvlink")
    pcie = [p for p in pairs if p.kind == "pcie"]
    if not nvlink or not pcie:
        return []
    paths = sorted({p.path for p in pcie if p.path}, key=lambda x: -link_rank(x))
    return [
        Finding(
            "mixed-links",
            "warning",
            f"NVLink joins {_fmt_pairs(nvlink)}; the other {len(pcie)} GPU pairs go over "
            f"PCIe ({', '.join(paths)})",
            {
                "nvlink_pairs": [list(p) for p in nvlink],
                "pcie_pairs": len(pcie),
                "pcie_paths": paths,
            },
            cause="NVLink bridges or links join only some GPUs",
            fix="run each job on GPUs of one NVLink group (see best-gpu-groups); a job that "
            "spans a PCIe pair depends on PCIe peer-to-peer: test it with `gpudiag peer`",
        )
    ]


def _locality(topo: Topology, label: str) -> str | None:
    info = topo.gpus.get(label)
    if info is None:
        return None
    return info.numa_affinity or info.cpu_affinity


def _sys_ambiguous(topo: Topology, pairs: list[GpuPair]) -> list[Finding]:
    same = []
    for p in pairs:
        if p.path != "SYS":
            continue
        here, there = _locality(topo, f"GPU{p.a}"), _locality(topo, f"GPU{p.b}")
        if here is not None and here == there:
            same.append((p.a, p.b))
    if not same:
        return []
    return [
        Finding(
            "sys-ambiguous",
            "warning",
            f"SYS joins GPUs with the same NUMA/CPU affinity: {_fmt_pairs(same)}; here SYS "
            "most likely means 'path unknown', not a link between sockets",
            {"pairs": [list(p) for p in same]},
            cause="consumer boards, some BIOSes and virtual machines report SYS when the "
            "driver cannot resolve the PCIe path",
            fix="measure instead of trusting the label: `gpudiag peer`, or "
            "p2pBandwidthLatencyTest with P2P enabled and disabled",
        )
    ]


def _nvswitch_without_nvlink(topo: Topology, pairs: list[GpuPair]) -> list[Finding]:
    fabric = {i.index for i in topo.gpus.values() if i.name and NVSWITCH_CLASS.search(i.name)}
    if len(fabric) < 2:
        return []
    between = [p for p in pairs if p.a in fabric and p.b in fabric and p.link is not None]
    if not between or any(p.kind == "nvlink" for p in between):
        return []
    names = sorted({topo.gpus[f"GPU{i}"].name or "" for i in fabric})
    return [
        Finding(
            "nvswitch-without-nvlink",
            "warning",
            f"{', '.join(names)} GPUs normally talk over NVSwitch, but no GPU pair shows NVLink",
            {"gpus": sorted(fabric), "links": sorted({p.link for p in between if p.link})},
            cause="the NVSwitch fabric is not up (Fabric Manager stopped or failed), or the NVLinks are down",
            fix="check `systemctl status nvidia-fabricmanager` and `nvidia-smi nvlink --status`",
        )
    ]


def _p2p_not_supported(pairs: list[GpuPair]) -> list[Finding]:
    bad = [p for p in pairs if p.p2p not in (None, "OK")]
    if not bad:
        return []
    statuses = sorted({p.p2p for p in bad if p.p2p})
    causes = "; ".join(f"{s} = {P2P_STATUS.get(s, s)}: {_P2P_CAUSE.get(s, '')}" for s in statuses)
    return [
        Finding(
            "p2p-not-supported",
            "warning",
            f"peer-to-peer is not available for {_fmt_pairs([(p.a, p.b) for p in bad])} "
            f"({', '.join(statuses)})",
            {"pairs": [{"a": p.a, "b": p.b, "p2p": p.p2p, "caps": p.p2p_caps} for p in bad]},
            cause=causes,
            fix="expected on such GPUs: NCCL falls back to shared memory (slower, correct); "
            "if the status is unexpected, check IOMMU/ACS (`iommu=pt`, `pci=noacs`)",
        )
    ]


def _group_key(topo: Topology, group: tuple[int, ...]) -> tuple[int, int, int]:
    """Sort key (higher is better): the worst link, the sum of links, one NUMA node."""
    ranks = [link_rank(topo.cell(f"GPU{a}", f"GPU{b}")) for a, b in itertools.combinations(group, 2)]
    places = {_locality(topo, f"GPU{i}") for i in group}
    return (min(ranks), sum(ranks), int(len(places) == 1 and None not in places))


def best_groups(topo: Topology, size: int) -> list[tuple[int, ...]]:
    """Disjoint groups of ``size`` GPUs, best first: each pick maximises its worst link,
    then the sum of its links, then prefers GPUs on one NUMA node."""
    left = sorted(i for i in (gpu_index(lbl) for lbl in topo.gpu_labels) if i is not None)
    if len(left) > _MAX_GPUS_FOR_GROUP_SEARCH:
        return []
    groups = []
    while len(left) >= size:
        candidates = itertools.combinations(left, size)
        best = max(candidates, key=lambda g: (_group_key(topo, g), [-i for i in g]))
        groups.append(best)
        left = [i for i in left if i not in best]
    return groups


def _worst_link(topo: Topology, group: tuple[int, ...]) -> str | None:
    cells = [topo.cell(f"GPU{a}", f"GPU{b}") for a, b in itertools.combinations(group, 2)]
    return min(cells, key=link_rank)


def _best_groups(topo: Topology, size: int) -> list[Finding]:
    if len(topo.gpu_labels) <= size:
        return []
    groups = [g for g in best_groups(topo, size) if _worst_link(topo, g) is not None]
    if not groups:
        return []
    worst = [_worst_link(topo, g) for g in groups]
    by_link: dict[str | None, list[str]] = {}
    for group, link in zip(groups, worst, strict=True):
        by_link.setdefault(link, []).append("(" + ",".join(map(str, group)) + ")")
    shown = "; ".join(f"{' '.join(gs)} over {link or 'unknown links'}" for link, gs in by_link.items())
    name = "pairs" if size == 2 else f"groups of {size}"
    others = " / ".join(",".join(map(str, g)) for g in groups[1:])
    return [
        Finding(
            "best-gpu-groups",
            "info",
            f"best {name}: {shown}",
            {
                "size": size,
                "groups": [list(g) for g in groups],
                "worst_links": worst,
                "env": [cuda_visible_devices(g) for g in groups],
            },
            fix=f"`{cuda_visible_devices(groups[0])}`" + (f" (or {others})" if others else ""),
        )
    ]


def _numa_affinity(topo: Topology) -> list[Finding]:
    places: dict[tuple[str | None, str | None], list[int]] = {}
    for info in topo.gpus.values():
        if info.numa_affinity is None and info.cpu_affinity is None:
            continue
        places.setdefault((info.numa_affinity, info.cpu_affinity), []).append(info.index)
    if not places:
        return []
    parts = []
    evidence = []
    for (numa, cpus), gpus in places.items():
        where = f"NUMA node {numa}" if numa is not None else "no NUMA node reported"
        parts.append(f"GPU {','.join(map(str, gpus))}: {where}, CPUs {cpus or 'unknown'}")
        evidence.append({"gpus": gpus, "numa_affinity": numa, "cpu_affinity": cpus})
    numa_nodes = [str(numa) for numa, _ in places if numa is not None]
    example = (
        f"`numactl --cpunodebind={numa_nodes[0]} --membind={numa_nodes[0]} …`"
        if numa_nodes and re.fullmatch(r"[0-9]+", numa_nodes[0])
        else "`taskset -c <CPUs> …`"
    )
    return [
        Finding(
            "numa-affinity",
            "info",
            "pin each rank's data-loader threads near its GPU — " + "; ".join(parts),
            {"places": evidence},
            fix=f"start each rank on its GPU's CPUs, e.g. {example}",
        )
    ]
