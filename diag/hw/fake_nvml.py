"""A pynvml stand-in driven by a scenario file, for tests and demos without GPUs.

It implements the handful of NVML calls :mod:`gpudiag.hw.nvml` makes, with the same
signatures, return shapes (ctypes-like masks, ``busId`` bytes) and error classes
(``NVMLError_NotSupported``…, matched by name like the real ones). A scenario is JSON::

    {"schema": "gpudiag.nvml-scenario/1",
     "description": "2x RTX 5090 on PCIe, P2P not supported",
     "init_error": null,                       # e.g. "LibraryNotFound" → no driver
     "driver_version": "575.57.08",
     "gpus": [{"name": "NVIDIA GeForce RTX 5090", "pci_bus_id": "00000000:01:00.0",
               "uuid": "GPU-…", "memory_total_mib": 32607,
               "cpus": "0-63", "numa_nodes": "0", "numa_node_id": null,
               "nvlinks": [{"remote": "00000000:02:00.0", "links": 4}],  # or "switch",
                                                         # "down", "unsupported"
               "lost": false,
               "errors": {"nvmlDeviceGetUUID": "NoPermission"}}],
     "paths": [["X", "PHB"], ["PHB", "X"]],    # common ancestor as nvidia-smi codes
     "p2p": {"read": [["X", "GNS"], ["GNS", "X"]], "write": …},   # absent caps: all OK
     "errors": {"nvmlDeviceGetP2PStatus": "NotSupported"}}        # for every device

Set ``GPUDIAG_NVML_SCENARIO=path/to/scenario.json`` to run any command against one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpudiag.errors import InputError

_ERROR_VALUES = {
    "Uninitialized": 1,
    "InvalidArgument": 2,
    "NotSupported": 3,
    "NoPermission": 4,
    "NotFound": 6,
    "DriverNotLoaded": 9,
    "LibraryNotFound": 12,
    "FunctionNotFound": 13,
    "GpuIsLost": 15,
    "LibRmVersionMismatch": 18,
    "Unknown": 999,
}
_LEVELS = {"PIX": 10, "PXB": 20, "PHB": 30, "NODE": 40, "SYS": 50, "SOC": 50}
_P2P = {"OK": 0, "CNS": 1, "GNS": 2, "TNS": 3, "DR": 4, "NS": 5, "U": 6}
_CAPS = {0: "read", 1: "write", 2: "nvlink", 3: "atomics"}


class NVMLError(Exception):
    """Base of the fake errors; ``value`` is the NVML return code."""

    value = 999


def _error_class(name: str) -> type[NVMLError]:
    return type(f"NVMLError_{name}", (NVMLError,), {"value": _ERROR_VALUES.get(name, 999)})


_ERRORS = {name: _error_class(name) for name in _ERROR_VALUES}


def _raise(name: str) -> None:
    raise _ERRORS.get(name, _error_class(name))(f"fake NVML error: {name}")


def _ranges(text: str | None) -> list[int]:
    ids: list[int] = []
    for part in (text or "").split(","):
        if part:
            lo, _, hi = part.partition("-")
            ids.extend(range(int(lo), int(hi or lo) + 1))
    return ids


class _Obj:
    def __init__(self, **fields: Any):
        self.__dict__.update(fields)


class FakeNvml:
    """A pynvml-compatible object over one scenario."""

    NVML_NVLINK_MAX_LINKS = 36

    def __init__(self, scenario: dict[str, Any]):
        self.scenario = scenario
        self.gpus: list[dict[str, Any]] = list(scenario.get("gpus", []))
        self.initialised = False
        self.calls: list[str] = []
        for name, cls in _ERRORS.items():
            setattr(self, f"NVMLError_{name}", cls)
        self.NVMLError = NVMLError

    @classmethod
    def from_file(cls, path: str | Path) -> FakeNvml:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise InputError(f"NVML scenario {path}: {exc}") from exc
        return cls(data)

    # -- helpers ------------------------------------------------------------------------
    def _call(self, fn: str, handle: int | None = None) -> dict[str, Any] | None:
        self.calls.append(fn)
        if not self.initialised:
            _raise("Uninitialized")
        if fn in self.scenario.get("errors", {}):
            _raise(self.scenario["errors"][fn])
        if handle is None:
            return None
        gpu = self.gpus[handle]
        if gpu.get("lost"):
            _raise("GpuIsLost")
        if fn in gpu.get("errors", {}):
            _raise(gpu["errors"][fn])
        return gpu

    def _links(self, gpu: dict[str, Any]) -> list[str]:
        links: list[str] = []
        for entry in gpu.get("nvlinks", []):
            links += [entry["remote"]] * int(entry.get("links", 1))
        return links

    @staticmethod
    def _masks(ids: list[int], words: int) -> list[int]:
        masks = [0] * words
        for i in ids:
            if i // 64 < words:
                masks[i // 64] |= 1 << (i % 64)
        return masks

    # -- the NVML calls gpudiag makes ---------------------------------------------------
    def nvmlInit(self) -> None:
        self.calls.append("nvmlInit")
        if self.scenario.get("init_error"):
            _raise(self.scenario["init_error"])
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self.initialised = False

    def nvmlSystemGetDriverVersion(self) -> str:
        self._call("nvmlSystemGetDriverVersion")
        return str(self.scenario.get("driver_version", "unknown"))

    def nvmlDeviceGetCount(self) -> int:
        self._call("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        self._call("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            _raise("InvalidArgument")
        if self.gpus[index].get("lost"):
            _raise("GpuIsLost")
        return index

    def nvmlDeviceGetName(self, h: int) -> bytes:
        return str(self._call("nvmlDeviceGetName", h)["name"]).encode()  # type: ignore[index]

    def nvmlDeviceGetPciInfo(self, h: int) -> _Obj:
        gpu = self._call("nvmlDeviceGetPciInfo", h)
        return _Obj(busId=str(gpu["pci_bus_id"]).encode())  # type: ignore[index]

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return str(self._call("nvmlDeviceGetUUID", h)["uuid"])  # type: ignore[index]

    def nvmlDeviceGetMemoryInfo(self, h: int) -> _Obj:
        gpu = self._call("nvmlDeviceGetMemoryInfo", h)
        return _Obj(total=int(gpu["memory_total_mib"]) * 2**20)  # type: ignore[index]

    def nvmlDeviceGetCpuAffinity(self, h: int, size: int) -> list[int]:
        gpu = self._call("nvmlDeviceGetCpuAffinity", h)
        return self._masks(_ranges(gpu.get("cpus")), size)  # type: ignore[union-attr]

    def nvmlDeviceGetMemoryAffinity(self, h: int, size: int, scope: int) -> list[int]:
        gpu = self._call("nvmlDeviceGetMemoryAffinity", h)
        return self._masks(_ranges(gpu.get("numa_nodes")), size)  # type: ignore[union-attr]

    def nvmlDeviceGetNumaNodeId(self, h: int) -> int:
        gpu = self._call("nvmlDeviceGetNumaNodeId", h)
        node = gpu.get("numa_node_id")  # type: ignore[union-attr]
        if node is None:
            _raise("NotSupported")
        return int(node)  # type: ignore[arg-type]

    def nvmlDeviceGetTopologyCommonAncestor(self, a: int, b: int) -> int:
        self._call("nvmlDeviceGetTopologyCommonAncestor", a)
        self._call("nvmlDeviceGetTopologyCommonAncestor", b)
        return _LEVELS[self.scenario["paths"][a][b]]

    def nvmlDeviceGetNvLinkState(self, h: int, link: int) -> int:
        gpu = self._call("nvmlDeviceGetNvLinkState", h)
        links = self._links(gpu)  # type: ignore[arg-type]
        if not links:
            _raise("NotSupported")
        if link >= len(links):
            _raise("InvalidArgument")
        if links[link] == "unsupported":  # a gap in the link numbering
            _raise("NotSupported")
        return 0 if links[link] == "down" else 1

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, h: int, link: int) -> int:
        gpu = self._call("nvmlDeviceGetNvLinkRemoteDeviceType", h)
        return 2 if self._links(gpu)[link] == "switch" else 0  # type: ignore[arg-type]

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h: int, link: int) -> _Obj:
        gpu = self._call("nvmlDeviceGetNvLinkRemotePciInfo", h)
        return _Obj(busId=self._links(gpu)[link].encode())  # type: ignore[arg-type]

    def nvmlDeviceGetP2PStatus(self, a: int, b: int, index: int) -> int:
        if not isinstance(index, int):  # the real binding fails the same way on (0,)
            raise TypeError("Don't know how to convert parameter 3")
        self._call("nvmlDeviceGetP2PStatus", a)
        self._call("nvmlDeviceGetP2PStatus", b)
        table = self.scenario.get("p2p", {}).get(_CAPS[index])
        return _P2P[table[a][b]] if table else 0
