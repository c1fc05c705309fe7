"""The hardware layer: the only code that talks to NVML, CUDA or host files.

Two backends share one interface (:class:`Backend`): live NVML (:mod:`gpudiag.hw.nvml`)
and machine files (:mod:`gpudiag.hw.machine`), JSON descriptions of a machine that
tests, demos and the runtime's CPU virtual devices use in place of real GPUs.
Nothing here touches hardware at import time.
"""

from __future__ import annotations

from typing import Protocol

from gpudiag.topology.model import GpuInfo, Topology


class Backend(Protocol):
    """A source of GPU facts: NVML or a machine file."""

    source: str

    def gpus(self) -> list[GpuInfo]:
        """Every GPU, in nvidia-smi order (PCI bus order)."""
        ...

    def topology(self) -> Topology:
        """GPUs, links between every pair, P2P status and affinities."""
        ...
