"""Where a topology comes from: a capture file, a machine file, or live NVML."""

from __future__ import annotations

import sys
from pathlib import Path

from gpudiag.errors import InputError
from gpudiag.hw.machine import load_machine
from gpudiag.hw.nvml import NvmlBackend
from gpudiag.topology.capture import parse_capture
from gpudiag.topology.model import Topology


def read_text_file(path: str) -> tuple[str, str]:
    """(text, display name) of a capture; ``-`` is standard input.

    Accepts UTF-8 and the UTF-16 that Windows shells write on redirection.
    """
    if path == "-":
        data = sys.stdin.buffer.read()
        name = "<stdin>"
    else:
        name = Path(path).name
        try:
            data = Path(path).read_bytes()
        except FileNotFoundError as exc:
            raise InputError(f"{path} does not exist") from exc
        except IsADirectoryError as exc:
            raise InputError(f"{path} is a folder, not a capture file") from exc
        except OSError as exc:
            raise InputError(f"cannot read {path}: {exc.strerror}") from exc
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
        return load_machine(machine)
    with NvmlBackend() as backend:
        return backend.topology()


def read_machine_or_capture(path: str) -> Topology:
    """A machine file (JSON, as ``--save-machine`` writes) or an ``nvidia-smi topo -m``
    capture, told apart by content (``--machine`` of ``report`` and ``doctor``)."""
    text, name = read_text_file(path)
    if text.lstrip().startswith("{"):
        return load_machine(path)
    return parse_capture(text, name)
