"""How many CUDA devices torch sees here (the one place gpudiag asks), and the link between two.

``torch.cuda.device_count()`` when ``torch.cuda.is_available()``, else 0 — the count
after ``CUDA_VISIBLE_DEVICES`` (``nvidia-smi -L`` lists them all). Importing this module
does not import torch; calling it does.
"""

from __future__ import annotations

from typing import Any


def cuda_device_count() -> int:
    """CUDA devices torch can use here (0 without CUDA, a driver or a GPU)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def cuda_link(a: int, b: int) -> str | None:
    """The topology's link code (``NV2``, ``PIX``…) between torch devices ``cuda:a`` and
    ``cuda:b`` (NVML, with torch's numbering mapped to nvidia-smi's), or None when it cannot
    be read."""
    try:
        import os

        import torch

        from gpudiag.hw.devices import bus_id_from_torch, map_torch_indices
        from gpudiag.hw.sources import read_topology

        topology = read_topology()
        props: list[Any] = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
        buses = [bus_id_from_torch(p.pci_domain_id, p.pci_bus_id, p.pci_device_id) for p in props]
        mapping = map_torch_indices(list(topology.gpus.values()), os.environ, buses)
        smi = {t: s for s, t in mapping.torch_of.items() if t is not None}
        return topology.cell(f"GPU{smi[a]}", f"GPU{smi[b]}")
    except Exception:  # the topology is a nicety to the caller: never fail a report for it
        return None
