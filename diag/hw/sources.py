"""Where a topology comes from: a capture file, a machine file, or live NVML.

``--machine`` takes either file everywhere (told apart by content), and the examples that
ship with gpudiag (``diag/examples``: ``seed_8gpu_topo.txt``, ``seed_8gpu_machine.json``)
by name from any folder. Files are read bounded (:data:`MAX_BYTES`): ``/dev/zero`` or a
huge file is refused, not read into memory.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from gpudiag.errors import InputError
from gpudiag.hw.machine import MachineFileError, from_json
from gpudiag.hw.nvml import NvmlBackend
from gpudiag.topology.capture import parse_capture
from gpudiag.topology.model import Topology

#: The largest capture or machine file read (8 MiB; a 64-GPU capture is about 40 KB).
MAX_BYTES = 8 << 20
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def example(path: str) -> Path | None:
    """The bundled example ``path`` names when no such file exists here: its bare name
    (``seed_8gpu_machine.json``) or a path ending in ``examples/NAME`` (as the README writes
    it, ``diag/examples/seed_8gpu_machine.json``), so docs' commands work from any folder."""
    given = Path(path)
    if given.exists() or given.parent.name not in ("", "examples"):
        return None
    bundled = EXAMPLES / given.name
    return bundled if given.name and bundled.is_file() else None


def read_text_file(path: str) -> tuple[str, str]:
    """(text, display name) of a capture or machine file; ``-`` is standard input.

    Accepts UTF-8 and the UTF-16 that Windows shells write on redirection.
    """
    if path == "-":
        data = sys.stdin.buffer.read(MAX_BYTES + 1)
        name = "<stdin>"
    else:
        name = Path(path).name
        try:
            with open(example(path) or path, "rb") as stream:
                data = stream.read(MAX_BYTES + 1)
        except FileNotFoundError as exc:
            raise InputError(f"{path} does not exist") from exc
        except IsADirectoryError as exc:
            raise InputError(f"{path} is a folder, not a capture file") from exc
        except OSError as exc:
            raise InputError(f"cannot read {path}: {exc.strerror}") from exc
    if len(data) > MAX_BYTES:
        raise InputError(f"{name}: larger than {MAX_BYTES >> 20} MiB, not a topology capture or machine file")
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        return data.decode("utf-16", "replace"), name
    if b"\x00" in data:
        raise InputError(f"{name}: not a text file")
    return data.decode("utf-8", "replace"), name


def read_topology(from_file: str | None = None, machine: str | None = None) -> Topology:
    """The topology from a capture (``nvidia-smi topo -m`` text), a machine file, or NVML."""
    if from_file is not None and machine is not None:
        raise InputError("give either --from-file or --machine, not both")
    if from_file is not None:
        text, name = read_text_file(from_file)
        return parse_capture(text, name)
    if machine is not None:
        return read_machine_or_capture(machine)
    with NvmlBackend() as backend:
        return backend.topology()


def read_machine_or_capture(path: str) -> Topology:
    """A machine file (JSON, as ``--save-machine`` writes) or an ``nvidia-smi topo -m``
    capture, told apart by content: what ``--machine`` means for every command."""
    text, name = read_text_file(path)
    if text.lstrip().startswith("{"):
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise MachineFileError(f"{path}: not valid JSON ({exc})") from exc
        return from_json(data, path)
    return parse_capture(text, name)


def topology_report(from_file: str | None = None, machine: str | None = None) -> Any:
    """``gpudiag topology`` as a function: the topology from a capture, a machine file or
    NVML, its pairs ranked and its findings (a :class:`~gpudiag.topology.analysis.TopologyReport`)."""
    from gpudiag.topology.analysis import analyze

    return analyze(read_topology(from_file=from_file, machine=machine))
