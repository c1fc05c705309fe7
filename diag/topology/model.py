"""The topology model: which devices a machine has and how each pair is connected.

One :class:`Topology` is what every source produces — live NVML (``hw/nvml.py``), an
``nvidia-smi topo -m`` capture (``topology/capture.py``) or a machine file
(``hw/machine.py``) — and what every renderer and check reads.

The matrix keeps link codes exactly as ``nvidia-smi topo -m`` prints them (``NV4``,
``PIX``, ``PXB``, ``PHB``, ``NODE``, ``SYS``, legacy ``SOC``, DCGM's ``PSB``); only the
self marker is normalised to ``X``. ``None`` means the value is not known (N/A).
GPU numbering is nvidia-smi's (= NVML's, PCI bus order), never torch's ``cuda:N``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from gpudiag.findings import Finding

#: PCIe path classes from best to worst, as ``nvidia-smi topo -m`` names them.
PCIE_PATHS = ("PIX", "PXB", "PHB", "NODE", "SYS")

#: Older or tool-specific names for the same path classes.
PATH_ALIASES = {"SOC": "SYS", "PSB": "PIX", "CPU": "NODE"}

#: ``nvidia-smi topo -p2p`` status codes and their legend text (= ``NVML_P2P_STATUS_*``).
P2P_STATUS = {
    "OK": "Status Ok",
    "CNS": "Chipset not supported",
    "GNS": "GPU not supported",
    "TNS": "Topology not supported",
    "NS": "Not supported",
    "DR": "Disabled by regkey",
    "U": "Unknown",
}

#: P2P capabilities as NVML names them (``NVML_P2P_CAPS_INDEX_*``); ``reported`` is a
#: status read from a ``topo -p2p`` capture whose capability letters are not known.
P2P_CAPS = ("read", "write", "nvlink", "atomics", "reported")

#: GpuInfo fields shown as ``nvidia-smi topo -m`` affinity columns, with their headings.
AFFINITY_COLUMNS = (
    ("cpu_affinity", "CPU Affinity"),
    ("numa_affinity", "NUMA Affinity"),
    ("gpu_numa_id", "GPU NUMA ID"),
)

_NVLINK = re.compile(r"NV(\d+)", re.ASCII)
_GPU_LABEL = re.compile(r"GPU(\d+)", re.ASCII)

LinkKind = Literal["nvlink", "pcie"]


def nvlink_count(code: str | None) -> int:
    """Number of bonded NVLinks a cell like ``NV12`` names; 0 for a PCIe code or None."""
    match = _NVLINK.fullmatch(code or "")
    return int(match.group(1)) if match else 0


def path_of(code: str | None) -> str | None:
    """The path class of a cell: ``NVLINK`` or one of :data:`PCIE_PATHS`; None if unknown."""
    if code is None:
        return None
    if nvlink_count(code):
        return "NVLINK"
    code = PATH_ALIASES.get(code, code)
    return code if code in PCIE_PATHS else None


def link_rank(code: str | None) -> int:
    """Higher is better: NVLink by link count above every PCIe path, PIX > … > SYS > unknown."""
    links = nvlink_count(code)
    if links:
        return 100 + links
    path = path_of(code)
    if path is None:
        return 0
    return 10 * (len(PCIE_PATHS) - PCIE_PATHS.index(path))


def gpu_index(label: str) -> int | None:
    """``GPU3`` -> 3; None for a NIC label."""
    match = _GPU_LABEL.fullmatch(label)
    return int(match.group(1)) if match else None


@dataclass
class GpuInfo:
    """What is known of one GPU. Fields a source cannot read are None.

    ``index`` is the nvidia-smi/NVML index (PCI bus order). ``cpu_affinity`` and
    ``numa_affinity`` are kept as nvidia-smi prints them (``0-47,96-143``, ``0,3-9``);
    ``gpu_numa_id`` is the GPU memory's own NUMA node (Grace systems only).
    ``torch_index`` is the ``cuda:N`` this GPU gets in torch under the current
    ``CUDA_VISIBLE_DEVICES``/``CUDA_DEVICE_ORDER`` (live NVML only; None if hidden).
    """

    label: str
    index: int
    name: str | None = None
    pci_bus_id: str | None = None
    uuid: str | None = None
    memory_total_mib: int | None = None
    cpu_affinity: str | None = None
    numa_affinity: str | None = None
    gpu_numa_id: str | None = None
    torch_index: int | None = None


@dataclass(frozen=True)
class GpuPair:
    """How GPUs ``a`` < ``b`` (nvidia-smi numbering) are joined."""

    a: int
    b: int
    link: str | None  # the cell as printed, e.g. "NV4", "SYS"
    p2p: str | None  # summary P2P status (read and write), e.g. "OK", "GNS"
    p2p_caps: dict[str, str | None] = field(default_factory=dict)

    @property
    def kind(self) -> LinkKind | None:
        if self.link is None:
            return None
        return "nvlink" if nvlink_count(self.link) else "pcie"

    @property
    def nvlinks(self) -> int | None:
        return None if self.link is None else nvlink_count(self.link)

    @property
    def path(self) -> str | None:
        return path_of(self.link)

    @property
    def rank(self) -> int:
        return link_rank(self.link)


Matrix = dict[str, dict[str, str | None]]


@dataclass
class Topology:
    """A machine's devices and links.

    ``labels`` are the device names in printed order (``GPU0``…, then NICs as the
    capture names them: ``NIC0`` or ``mlx5_0``). ``matrix[row][col]`` is the link code.
    ``p2p[cap][row][col]`` is a P2P status code per capability (see :data:`P2P_CAPS`).
    ``notes`` are problems met while reading (repaired cells, N/A fields, a truncated
    capture); analysis findings are derived on demand by ``topology.advice``.
    """

    source: str  # "nvml" | "nvidia-smi" | "machine-file"
    labels: list[str]
    matrix: Matrix
    gpus: dict[str, GpuInfo]
    nic_legend: dict[str, str] = field(default_factory=dict)
    p2p: dict[str, Matrix] = field(default_factory=dict)
    notes: list[Finding] = field(default_factory=list)
    legend: str | None = None  # legend generation of a capture: modern | soc | oldest
    numbering: str = "nvidia-smi"

    @property
    def gpu_labels(self) -> list[str]:
        return [label for label in self.labels if gpu_index(label) is not None]

    @property
    def nic_labels(self) -> list[str]:
        return [label for label in self.labels if gpu_index(label) is None]

    def cell(self, a: str, b: str) -> str | None:
        return self.matrix.get(a, {}).get(b)

    def p2p_status(self, a: str, b: str) -> dict[str, str | None]:
        """P2P status per capability for the pair; the worse of the two directions."""
        caps: dict[str, str | None] = {}
        for cap, matrix in self.p2p.items():
            there = matrix.get(a, {}).get(b)
            back = matrix.get(b, {}).get(a)
            caps[cap] = there if there not in (None, "OK") else (back or there)
        return caps

    def pairs(self) -> list[GpuPair]:
        """Every GPU pair a < b, in index order."""
        out = []
        labels = self.gpu_labels
        for i, la in enumerate(labels):
            for lb in labels[i + 1 :]:
                caps = self.p2p_status(la, lb)
                a, b = gpu_index(la), gpu_index(lb)
                assert a is not None and b is not None
                out.append(GpuPair(a, b, self.cell(la, lb), summarize_p2p(caps), caps))
        return out

    def affinity_columns(self) -> list[tuple[str, str]]:
        """(GpuInfo field, ``topo -m`` heading) of the affinity columns any GPU has."""
        gpus = self.gpus.values()
        return [(f, h) for f, h in AFFINITY_COLUMNS if any(getattr(g, f) is not None for g in gpus)]


def summarize_p2p(caps: dict[str, str | None]) -> str | None:
    """One status for a pair: the first non-OK of read and write (or of what is known)."""
    wanted = [caps[c] for c in ("read", "write") if c in caps] or list(caps.values())
    known = [s for s in wanted if s is not None]
    if not known:
        return None
    bad = [s for s in known if s != "OK"]
    return bad[0] if bad else "OK"
