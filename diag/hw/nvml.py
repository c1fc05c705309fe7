"""Live GPU facts from NVML (the ``pynvml`` module of NVIDIA's ``nvidia-ml-py``).

NVML is initialised lazily, on the first query, never at import. A fatal error (no
library, no driver, driver/library version mismatch) raises :class:`NvmlUnavailable`
(exit 3) with what to do. A per-field error (NotSupported, NoPermission, GpuIsLost…)
makes that field or device N/A (None), adds a note, and everything else still renders.

What is read, with the ``nvidia-smi`` equivalent:

- per GPU: name, PCI bus id, UUID, total memory in MiB (``nvidia-smi -q``), CPU affinity
  and NUMA affinity (``topo -m`` columns ``CPU Affinity``/``NUMA Affinity``), the GPU's own
  NUMA node on Grace systems (``GPU NUMA ID``);
- per pair: the common PCIe ancestor (``nvmlDeviceGetTopologyCommonAncestor``:
  PIX/PXB/PHB/NODE/SYS), the active NVLinks between them (counted by remote PCI bus id;
  on an NVSwitch fabric every pair gets the GPU's fabric link count) — together the
  ``topo -m`` cell — and the P2P status for read, write, nvlink and atomics
  (``topo -p2p r|w|n|a``).

``GPUDIAG_NVML_SCENARIO=file.json`` replaces the library by a scenario-driven fake
(:mod:`gpudiag.hw.fake_nvml`), which is how the tests and demos run this code without GPUs.
"""

from __future__ import annotations

import contextlib
import os
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from gpudiag.errors import CannotRunHere
from gpudiag.findings import Finding
from gpudiag.hw.devices import map_torch_indices, normalize_bus_id
from gpudiag.topology.model import GpuInfo, Matrix, Topology

SCENARIO_ENV = "GPUDIAG_NVML_SCENARIO"

#: ``NVML_TOPOLOGY_*`` levels → the ``nvidia-smi topo -m`` code (INTERNAL = same board).
LEVEL_CODES = {0: "PIX", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
#: ``NVML_P2P_STATUS_*`` → the ``nvidia-smi topo -p2p`` code.
P2P_CODES = {0: "OK", 1: "CNS", 2: "GNS", 3: "TNS", 4: "DR", 5: "NS", 6: "U"}
#: ``NVML_P2P_CAPS_INDEX_*`` as plain ints: in nvidia-ml-py 13.615 the READ constant is the
#: tuple ``(0,)``, which ctypes cannot pass.
P2P_CAP_INDEX = {"read": 0, "write": 1, "nvlink": 2, "atomics": 3}
NVLINK_REMOTE_SWITCH = 2
MAX_NVLINKS = 36  # NVML_NVLINK_MAX_LINKS in nvidia-ml-py 13.x
AFFINITY_SCOPE_NODE = 0  # NVML_AFFINITY_SCOPE_NODE
CPU_MASK_WORDS = 16  # room for 1024 CPUs

#: Errors after which nothing can be read; everything else is per field.
_FATAL = {
    "LibraryNotFound": "the NVIDIA driver library (libnvidia-ml.so) is not installed",
    "DriverNotLoaded": "the NVIDIA kernel driver is not loaded",
    "LibRmVersionMismatch": "the NVML library and the kernel driver versions differ "
    "(reboot after a driver update)",
    "NoPermission": "no permission to talk to the NVIDIA driver",
    "Uninitialized": "NVML could not be initialised",
}
#: Fields that are normally absent, so their absence is not worth a note: the GPU's own
#: NUMA node exists only where GPU memory is a NUMA node (Grace).
_EXPECTED_GAPS = {("gpu_numa_id", "NotSupported")}
_HINT = (
    "to analyse a capture instead: `nvidia-smi topo -m > topo.txt` on the GPU machine, "
    "then `gpudiag topology --from-file topo.txt`"
)


class NvmlUnavailable(CannotRunHere):
    """NVML cannot be used on this machine (exit 3)."""


def error_name(exc: BaseException) -> str:
    """``NVMLError_NotSupported`` → ``NotSupported`` (real and fake pynvml alike)."""
    return type(exc).__name__.removeprefix("NVMLError_")


def load_pynvml() -> Any:
    """The ``pynvml`` module, or the scenario fake when ``GPUDIAG_NVML_SCENARIO`` is set."""
    scenario = os.environ.get(SCENARIO_ENV)
    if scenario:
        from gpudiag.hw.fake_nvml import FakeNvml

        return FakeNvml.from_file(scenario)
    try:
        import pynvml
    except ImportError as exc:
        raise NvmlUnavailable("the nvidia-ml-py package is missing: pip install nvidia-ml-py") from exc
    return pynvml


def cpu_list(masks: Any) -> str | None:
    """64-bit masks (element 0 = CPUs 0-63) → ``0-47,96-143``; None when empty."""
    ids = [word * 64 + bit for word, mask in enumerate(masks) for bit in range(64) if int(mask) >> bit & 1]
    if not ids:
        return None
    ranges = []
    start = prev = ids[0]
    for cpu in [*ids[1:], None]:
        if cpu is not None and cpu == prev + 1:
            prev = cpu
            continue
        ranges.append(str(start) if start == prev else f"{start}-{prev}")
        if cpu is not None:
            start = prev = cpu
    return ",".join(ranges)


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


class NvmlBackend:
    """GPU facts from NVML. ``nvml`` injects a pynvml-compatible module (tests)."""

    source = "nvml"

    def __init__(self, nvml: Any = None, env: dict[str, str] | None = None):
        self._nvml = nvml
        self._env = dict(os.environ) if env is None else env
        self._ready = False
        self._handles: list[Any] = []
        self._failures: dict[tuple[str, str], list[int]] = defaultdict(list)
        self._lost: set[int] = set()

    # -- life cycle ----------------------------------------------------------------------
    def _lib(self) -> Any:
        if not self._ready:
            nvml = self._nvml if self._nvml is not None else load_pynvml()
            try:
                nvml.nvmlInit()
            except Exception as exc:
                raise self._fatal(exc) from exc
            self._nvml = nvml
            self._ready = True
            try:
                count = int(nvml.nvmlDeviceGetCount())
            except Exception as exc:
                raise self._fatal(exc) from exc
            self._handles = [self._handle(i) for i in range(count)]
        return self._nvml

    def _fatal(self, exc: Exception) -> NvmlUnavailable:
        name = error_name(exc)
        what = _FATAL.get(name, f"NVML failed ({name}: {exc})")
        return NvmlUnavailable(f"cannot read GPUs through NVML: {what}; {_HINT}")

    def close(self) -> None:
        if self._ready:
            with contextlib.suppress(Exception):  # shutting down a broken NVML is best effort
                self._nvml.nvmlShutdown()
            self._ready = False

    def __enter__(self) -> NvmlBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- per-field reads -----------------------------------------------------------------
    def _handle(self, index: int) -> Any:
        try:
            return self._nvml.nvmlDeviceGetHandleByIndex(index)
        except Exception as exc:
            self._failed("device", exc, index)
            self._lost.add(index)
            return None

    def _failed(self, field: str, exc: Exception, index: int) -> None:
        name = error_name(exc)
        if name == "GpuIsLost":
            self._lost.add(index)
        if (field, name) not in _EXPECTED_GAPS:
            self._failures[(field, name)].append(index)

    def _read(self, field: str, index: int, call: Callable[..., Any], *args: Any) -> Any:
        """``call(*args)``, or None (and a note) when NVML cannot give this field."""
        if index in self._lost:
            return None
        try:
            return call(*args)
        except Exception as exc:
            if not hasattr(exc, "value") and not type(exc).__name__.startswith("NVMLError"):
                raise
            self._failed(field, exc, index)
            return None

    # -- the Backend interface -----------------------------------------------------------
    def driver_version(self) -> str | None:
        nvml = self._lib()
        try:
            return _text(nvml.nvmlSystemGetDriverVersion())
        except Exception:
            return None

    def gpus(self) -> list[GpuInfo]:
        nvml = self._lib()
        # CPU mask words of 64 CPUs; generous, since a container may see fewer CPUs than NVML.
        words = max(CPU_MASK_WORDS, -(-(os.cpu_count() or 1) // 64))
        out = []
        for i, h in enumerate(self._handles):
            info = GpuInfo(label=f"GPU{i}", index=i)
            if h is not None:
                name = self._read("name", i, nvml.nvmlDeviceGetName, h)
                info.name = None if name is None else _text(name)
                pci = self._read("pci_bus_id", i, nvml.nvmlDeviceGetPciInfo, h)
                info.pci_bus_id = None if pci is None else normalize_bus_id(pci.busId)
                uuid = self._read("uuid", i, nvml.nvmlDeviceGetUUID, h)
                info.uuid = None if uuid is None else _text(uuid)
                memory = self._read("memory", i, nvml.nvmlDeviceGetMemoryInfo, h)
                info.memory_total_mib = None if memory is None else int(memory.total) // 2**20
                cpus = self._read("cpu_affinity", i, nvml.nvmlDeviceGetCpuAffinity, h, words)
                info.cpu_affinity = None if cpus is None else cpu_list(cpus)
                nodes = self._read(
                    "numa_affinity", i, nvml.nvmlDeviceGetMemoryAffinity, h, 4, AFFINITY_SCOPE_NODE
                )
                info.numa_affinity = None if nodes is None else cpu_list(nodes)
                node = self._read("gpu_numa_id", i, nvml.nvmlDeviceGetNumaNodeId, h)
                info.gpu_numa_id = None if node is None or int(node) < 0 else str(node)
            out.append(info)
        mapping = map_torch_indices(out, self._env)
        for info in out:
            info.torch_index = mapping.torch_of.get(info.index)
        return out

    def _nvlinks(self, gpus: list[GpuInfo]) -> tuple[dict[tuple[int, int], int], dict[int, int]]:
        """Active NVLinks per (gpu, peer) by remote bus id, and links into an NVSwitch."""
        nvml = self._nvml
        by_bus = {g.pci_bus_id: g.index for g in gpus if g.pci_bus_id}
        direct: dict[tuple[int, int], int] = defaultdict(int)
        fabric: dict[int, int] = defaultdict(int)
        for i, h in enumerate(self._handles):
            if h is None or i in self._lost:
                continue
            for link in range(MAX_NVLINKS):
                try:
                    active = nvml.nvmlDeviceGetNvLinkState(h, link)
                except Exception as exc:
                    # No such link (InvalidArgument) or no NVLink there (NotSupported): the
                    # numbering of links can have gaps, so keep looking at the others.
                    if error_name(exc) not in ("InvalidArgument", "NotSupported"):
                        self._failed("nvlink", exc, i)
                    continue
                if not active:
                    continue
                kind = self._read("nvlink_remote", i, nvml.nvmlDeviceGetNvLinkRemoteDeviceType, h, link)
                if kind == NVLINK_REMOTE_SWITCH:
                    fabric[i] += 1
                    continue
                remote = self._read("nvlink_remote", i, nvml.nvmlDeviceGetNvLinkRemotePciInfo, h, link)
                peer = None if remote is None else by_bus.get(normalize_bus_id(remote.busId))
                if peer is not None:
                    direct[(i, peer)] += 1
        return direct, fabric

    def topology(self) -> Topology:
        gpus = self.gpus()
        nvml = self._nvml
        direct, fabric = self._nvlinks(gpus)
        labels = [g.label for g in gpus]
        matrix: Matrix = {label: {} for label in labels}
        p2p: dict[str, Matrix] = {cap: {label: {} for label in labels} for cap in P2P_CAP_INDEX}
        for i, hi in enumerate(self._handles):
            for j, hj in enumerate(self._handles):
                row, col = labels[i], labels[j]
                if i == j:
                    matrix[row][col] = "X"
                    for cap in P2P_CAP_INDEX:
                        p2p[cap][row][col] = "X"
                    continue
                usable = hi is not None and hj is not None and j not in self._lost
                if not usable:
                    matrix[row][col] = None
                    for cap in P2P_CAP_INDEX:
                        p2p[cap][row][col] = None
                    continue
                links = direct.get((i, j), 0) or min(fabric.get(i, 0), fabric.get(j, 0))
                if links:
                    matrix[row][col] = f"NV{links}"
                else:
                    level = self._read("topology", i, nvml.nvmlDeviceGetTopologyCommonAncestor, hi, hj)
                    matrix[row][col] = None if level is None else LEVEL_CODES.get(int(level))
                for cap, index in P2P_CAP_INDEX.items():
                    status = self._read(f"p2p_{cap}", i, nvml.nvmlDeviceGetP2PStatus, hi, hj, index)
                    p2p[cap][row][col] = None if status is None else P2P_CODES.get(int(status), "U")
        return Topology(
            source="nvml",
            labels=labels,
            matrix=matrix,
            gpus={g.label: g for g in gpus},
            p2p=p2p,
            notes=self.notes(),
        )

    def notes(self) -> list[Finding]:
        """What could not be read: one note per field and error, naming the GPUs."""
        out = []
        if self._lost:
            lost = sorted(self._lost)
            out.append(
                Finding(
                    "gpu-lost",
                    "error",
                    f"GPU {', '.join(map(str, lost))} cannot be reached (fell off the bus or "
                    "failed); its fields and links are N/A",
                    {"gpus": lost},
                    cause="a GPU that NVML reports lost has usually hit an Xid error",
                    fix="check `dmesg | grep -i xid` and `nvidia-smi -q -i <index>`; a reset "
                    "or reboot is usually needed",
                )
            )
        for (field, error), gpus in sorted(self._failures.items()):
            if error == "GpuIsLost" or field == "device":
                continue
            unique = sorted(set(gpus))
            out.append(
                Finding(
                    "nvml-field-unavailable",
                    "warning",
                    f"NVML could not read {field} for GPU {', '.join(map(str, unique))} "
                    f"({error}); shown as N/A",
                    {"field": field, "error": error, "gpus": unique},
                )
            )
        return out
