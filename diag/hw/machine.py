"""Machine files: a JSON description of a machine's GPUs, links and P2P status.

A machine file is what ``gpudiag topology --save-machine`` writes (from NVML or from a
capture) and what ``--machine FILE`` reads back, giving the same result. Tests, demos
and the runtime's CPU virtual devices use machine files in place of real GPUs. Format
(``schema: gpudiag.machine/1``)::

    {"schema": "gpudiag.machine/1",
     "description": "8 GPUs, NVLink pairs (0,1) (2,3) (4,5) (6,7)",
     "labels": ["GPU0", "GPU1", "NIC0"],
     "gpus": [{"label": "GPU0", "index": 0, "name": "NVIDIA A100-SXM4-80GB",
               "pci_bus_id": "00000000:07:00.0", "uuid": null, "memory_total_mib": 81920,
               "cpu_affinity": "0-31", "numa_affinity": "0", "gpu_numa_id": null}, …],
     "nic_legend": {"NIC0": "mlx5_0"},
     "matrix": [["X", "NV4", "PIX"], ["NV4", "X", "PIX"], ["PIX", "PIX", "X"]],
     "p2p": {"read": [["X", "OK", null], …]},          # optional; per capability
     "legend": "modern", "notes": [...]}

Rows of ``matrix`` and of each ``p2p`` table follow ``labels``; ``null`` is unknown.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from gpudiag.errors import InputError
from gpudiag.fileio import atomic_write
from gpudiag.findings import Finding
from gpudiag.topology.model import P2P_CAPS, P2P_STATUS, GpuInfo, Matrix, Topology, gpu_index

SCHEMA = "gpudiag.machine/1"
_LINK = re.compile(r"NV[1-9][0-9]?|SYS|SOC|NODE|PHB|PXB|PIX|PSB|CPU")
_GPU_FIELDS = (
    "name",
    "pci_bus_id",
    "uuid",
    "memory_total_mib",
    "cpu_affinity",
    "numa_affinity",
    "gpu_numa_id",
)


class MachineFileError(InputError):
    """A machine file that cannot be used; the message names the file and the problem."""


def to_json(topology: Topology, description: str | None = None) -> dict[str, Any]:
    """The machine-file document for a topology."""
    labels = topology.labels
    return {
        "schema": SCHEMA,
        "description": description,
        "labels": list(labels),
        "gpus": [
            {"label": info.label, "index": info.index, **{f: getattr(info, f) for f in _GPU_FIELDS}}
            for info in topology.gpus.values()
        ],
        "nic_legend": dict(topology.nic_legend),
        "matrix": [[topology.matrix[r].get(c) for c in labels] for r in labels],
        "p2p": {
            cap: [[table.get(r, {}).get(c) for c in labels] for r in labels]
            for cap, table in topology.p2p.items()
        },
        "legend": topology.legend,
        "notes": [note.to_json() for note in topology.notes],
    }


def save_machine(topology: Topology, path: str | Path, *, force: bool = False) -> Path:
    """Write ``topology`` as a machine file (atomically; an existing file needs ``force``)."""
    text = json.dumps(to_json(topology), indent=1) + "\n"
    return atomic_write(path, text, force=force)


def from_json(data: Any, name: str = "machine file") -> Topology:
    """Validate a machine-file document and build its :class:`Topology`."""

    def fail(message: str) -> MachineFileError:
        return MachineFileError(f"{name}: {message}")

    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise fail(f'not a machine file (expected "schema": "{SCHEMA}")')
    labels = data.get("labels")
    if (
        not isinstance(labels, list)
        or not labels
        or not all(isinstance(x, str) for x in labels)
        or len(set(labels)) != len(labels)
    ):
        raise fail('"labels" must be a list of distinct device names')
    matrix = _table(data.get("matrix"), labels, _LINK.fullmatch, "matrix", fail)
    p2p = {}
    p2p_tables = data.get("p2p") or {}
    if not isinstance(p2p_tables, dict):
        raise fail('"p2p" must map capabilities (read, write, …) to tables')
    for cap, table in p2p_tables.items():
        if cap not in P2P_CAPS:
            raise fail(f'unknown P2P capability "{cap}" (expected one of {", ".join(P2P_CAPS)})')
        p2p[cap] = _table(table, labels, lambda c: c in P2P_STATUS, f"p2p.{cap}", fail)
    gpus = {}
    entries = data.get("gpus") or []
    if not isinstance(entries, list):
        raise fail('"gpus" must be a list of GPU entries')
    for entry in entries:
        label = entry.get("label") if isinstance(entry, dict) else None
        if label not in labels or gpu_index(label) is None:
            raise fail(f"gpu entry {_short(entry)} does not name a GPU label of the matrix")
        fields = {f: entry.get(f) for f in _GPU_FIELDS}
        for f, value in fields.items():
            wanted, words = (int, "an integer") if f == "memory_total_mib" else (str, "a string")
            if value is not None and type(value) is not wanted:
                raise fail(f"gpu {label}: {f!r} must be {words} or null")
        gpus[label] = GpuInfo(label=label, index=gpu_index(label), **fields)
    for label in labels:
        index = gpu_index(label)
        if index is not None and label not in gpus:
            gpus[label] = GpuInfo(label=label, index=index)
    if not gpus:
        raise fail("no GPU among the labels (GPU0, GPU1, …)")
    try:
        notes = [Finding.from_json(n) for n in data.get("notes") or []]
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise fail(f'bad "notes" entry ({exc})') from exc
    nic_legend = data.get("nic_legend") or {}
    if not isinstance(nic_legend, dict) or not all(isinstance(v, str) for v in nic_legend.values()):
        raise fail('"nic_legend" must map NIC labels to device names')
    if data.get("legend") is not None and not isinstance(data.get("legend"), str):
        raise fail('"legend" must be a string or null')
    return Topology(
        source="machine-file",
        labels=list(labels),
        matrix=matrix,
        gpus={label: gpus[label] for label in labels if label in gpus},
        nic_legend={str(k): str(v) for k, v in nic_legend.items()},
        p2p=p2p,
        notes=notes,
        legend=data.get("legend"),
    )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _table(rows: Any, labels: list[str], valid: Any, what: str, fail: Any) -> Matrix:
    n = len(labels)
    if (
        not isinstance(rows, list)
        or len(rows) != n
        or any(not isinstance(r, list) or len(r) != n for r in rows)
    ):
        raise fail(f'"{what}" must be {n} rows of {n} cells, in the order of "labels"')
    table: Matrix = {}
    for i, row in enumerate(rows):
        table[labels[i]] = {}
        for j, cell in enumerate(row):
            if cell in ("X", "Χ") and i == j:
                cell = "X"
            elif i == j:
                raise fail(f'"{what}" row {labels[i]}: the diagonal must be "X", not {cell!r}')
            elif cell is not None and not (isinstance(cell, str) and valid(cell)):
                raise fail(f'"{what}" row {labels[i]} column {labels[j]}: unknown code {cell!r}')
            table[labels[i]][labels[j]] = cell
    return table


def load_machine(path: str | Path) -> Topology:
    """Read a machine file; a missing or malformed file is one clear :class:`InputError`."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise MachineFileError(f"machine file {path} does not exist") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise MachineFileError(f"cannot read machine file {path}: {exc}") from exc
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise MachineFileError(f"{path}: not valid JSON ({exc})") from exc
    return from_json(data, str(path))


class MachineBackend:
    """The :class:`~gpudiag.hw.Backend` over a machine file."""

    source = "machine-file"

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._topology: Topology | None = None

    def topology(self) -> Topology:
        if self._topology is None:
            self._topology = load_machine(self.path)
        return self._topology

    def gpus(self) -> list[GpuInfo]:
        return list(self.topology().gpus.values())
