"""Which torch ``cuda:N`` is which physical GPU.

NVML and ``nvidia-smi`` number GPUs in PCI bus order and ignore ``CUDA_VISIBLE_DEVICES``.
CUDA (and so torch) first orders the GPUs by ``CUDA_DEVICE_ORDER`` — ``FASTEST_FIRST``
by default, ``PCI_BUS_ID`` on request — and then keeps and reorders them by
``CUDA_VISIBLE_DEVICES`` (indices into that order, or ``GPU-`` UUID prefixes; parsing stops
at the first invalid entry). The only reliable join is the PCI bus id.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from gpudiag.topology.model import GpuInfo

_BUS_ID = re.compile(
    r"(?:(?P<domain>[0-9a-fA-F]{1,8}):)?(?P<bus>[0-9a-fA-F]{1,2}):(?P<device>[0-9a-fA-F]{1,2})"
    r"\.(?P<function>[0-7])"
)


def normalize_bus_id(text: str | bytes | None) -> str | None:
    """``0000:07:00.0``, ``b'00000000:07:00.0'`` → ``00000000:07:00.0`` (nvidia-smi's form)."""
    if text is None:
        return None
    if isinstance(text, bytes):
        text = text.decode("ascii", "replace")
    match = _BUS_ID.search(text.strip())
    if match is None:
        return None
    domain = int(match.group("domain") or "0", 16)
    return (
        f"{domain:08X}:{int(match.group('bus'), 16):02X}:"
        f"{int(match.group('device'), 16):02X}.{match.group('function')}"
    )


def bus_id_from_torch(domain: int, bus: int, device: int) -> str:
    """The bus id of ``torch.cuda.get_device_properties(i)`` (``pci_domain_id``, …)."""
    return f"{domain:08X}:{bus:02X}:{device:02X}.0"


@dataclass(frozen=True)
class DeviceMapping:
    """torch's numbering of the GPUs against nvidia-smi's.

    ``torch_of[nvml_index]`` is the ``cuda:N`` index, or None when the GPU is hidden.
    ``certain`` is False when CUDA's FASTEST_FIRST order cannot be predicted (GPUs of
    different models); ``notes`` says why and what to set.
    """

    torch_of: dict[int, int | None]
    certain: bool
    notes: tuple[str, ...] = ()


def cuda_order(gpus: list[GpuInfo], device_order: str | None) -> tuple[list[GpuInfo], bool]:
    """The GPUs in CUDA's enumeration order and whether that order is certain.

    GPUs whose bus id NVML could not read (lost GPUs) are left out: CUDA does not
    enumerate a GPU that has fallen off the bus, and nothing else can place them.
    """
    known = [g for g in gpus if g.pci_bus_id]
    by_bus = sorted(known, key=lambda g: g.pci_bus_id or "")
    certain = len(known) == len(gpus)
    if (device_order or "FASTEST_FIRST").upper() == "PCI_BUS_ID":
        return by_bus, certain
    # FASTEST_FIRST puts the fastest GPU first; among identical GPUs CUDA keeps PCI order.
    return by_bus, certain and len({g.name for g in known}) <= 1


def map_torch_indices(
    gpus: list[GpuInfo],
    env: Mapping[str, str],
    torch_bus_ids: Iterable[str] | None = None,
) -> DeviceMapping:
    """Map nvidia-smi indices to torch indices.

    With ``torch_bus_ids`` (the bus ids torch reports for ``cuda:0…``) the join is exact.
    Otherwise the mapping is predicted from ``CUDA_DEVICE_ORDER`` and
    ``CUDA_VISIBLE_DEVICES`` in ``env``.
    """
    if torch_bus_ids is not None:
        position = {normalize_bus_id(b): i for i, b in enumerate(torch_bus_ids)}
        return DeviceMapping({g.index: position.get(g.pci_bus_id) for g in gpus}, True)
    order, certain = cuda_order(gpus, env.get("CUDA_DEVICE_ORDER"))
    notes = []
    unknown = [g.index for g in gpus if not g.pci_bus_id]
    if unknown:
        notes.append(f"the PCI bus id of GPU {', '.join(map(str, unknown))} is unknown: not mapped")
    elif not certain:
        notes.append(
            "GPUs of different models under CUDA_DEVICE_ORDER=FASTEST_FIRST: torch's order "
            "is CUDA's guess; set CUDA_DEVICE_ORDER=PCI_BUS_ID to make it match nvidia-smi"
        )
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        chosen = order
    else:
        chosen, why = _parse_visible(visible, order)
        if why:
            notes.append(why)
    torch_of: dict[int, int | None] = {g.index: None for g in gpus}
    for torch_index, gpu in enumerate(chosen):
        torch_of[gpu.index] = torch_index
    return DeviceMapping(torch_of, certain, tuple(notes))


def _parse_visible(value: str, order: list[GpuInfo]) -> tuple[list[GpuInfo], str | None]:
    """CUDA's reading of ``CUDA_VISIBLE_DEVICES``: stops at the first invalid entry."""
    chosen: list[GpuInfo] = []
    for raw in value.split(","):
        entry = raw.strip()
        gpu = None
        if re.fullmatch(r"[0-9]+", entry):
            if int(entry) < len(order):
                gpu = order[int(entry)]
        elif entry.upper().startswith("GPU-"):
            matches = [g for g in order if g.uuid and g.uuid.lower().startswith(entry.lower())]
            gpu = matches[0] if len(matches) == 1 else None
        if gpu is None or gpu in chosen:
            why = f"CUDA_VISIBLE_DEVICES entry {entry!r} is not a GPU here"
            if entry.upper().startswith("MIG-"):
                why = f"CUDA_VISIBLE_DEVICES entry {entry!r} is a MIG instance"
            if gpu is not None:
                why = f"CUDA_VISIBLE_DEVICES names {entry!r} twice"
            return chosen, why + "; CUDA ignores it and every entry after it"
        chosen.append(gpu)
    return chosen, None
