"""``gpudiag transport`` as a function: read the logs (bounded), the topology if asked,
and analyse; or refuse to run NCCL where fewer than two GPUs are."""

from __future__ import annotations

import sys
from pathlib import Path

from gpudiag.errors import CannotRunHere, InputError
from gpudiag.fileio import read_bounded
from gpudiag.transport.analysis import TransportReport, analyze
from gpudiag.transport.reader import read_log

#: The largest log read (256 MiB; a 100,000-line INFO log of 64 ranks is about 15 MB).
MAX_LOG_BYTES = 256 << 20


def read_log_file(path: str) -> tuple[str, str]:
    """(text, display name) of a log; ``-`` is standard input. UTF-8 (bad bytes
    replaced) or UTF-16 with its byte-order mark, as Windows shells redirect; text with NUL
    characters is refused (UTF-32 among them: the redactor could not read a secret in it)."""
    if path == "-":
        data, name = sys.stdin.buffer.read(MAX_LOG_BYTES + 1), "<stdin>"
    else:  # (a FIFO or a folder refused without waiting, as every input file is)
        name, data = Path(path).name, read_bounded(path, "NCCL log", MAX_LOG_BYTES + 1)
    if len(data) > MAX_LOG_BYTES:
        raise InputError(
            f"{name}: larger than {MAX_LOG_BYTES >> 20} MiB; give the part with the `NCCL INFO` lines"
        )
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        text = data.decode("utf-16", "replace")
    elif b"\x00" in data[:65536]:
        text = "\x00"
    else:
        text = data.decode("utf-8", "replace")
    if "\x00" in text[:65536]:  # (UTF-32's mark starts as UTF-16's: decoded so, every other character is NUL)
        raise InputError(f"{name}: not a text file")
    return text, name


def read_logs(logs: list[str]) -> list[tuple[str, str]]:
    """``(text, name)`` of each log file (bounded); :class:`InputError` when none of
    them holds an NCCL line."""
    texts = [read_log_file(path) for path in logs]
    log = read_log(texts)
    if not log.connections and log.nccl_lines == 0:
        names = ", ".join(name for _, name in texts)
        raise InputError(f"{names}: no NCCL line in it (expected the output of a run with NCCL_DEBUG=INFO)")
    return texts


def transport_report(logs: list[str], machine: str | None = None) -> TransportReport:
    """The pairs and findings of one or more ``NCCL_DEBUG=INFO`` logs, with the topology
    of ``machine`` (a capture or machine file) beside them when given."""
    texts = read_logs(logs)
    log = read_log(texts)
    topology = None
    if machine is not None:
        from gpudiag.hw.sources import read_machine_or_capture

        topology = read_machine_or_capture(machine)
    return analyze(log, topology)


def refuse_live(gpus: int) -> None:
    """Raise :class:`CannotRunHere` (exit 3) when fewer than two GPUs can be used."""
    if gpus < 2:
        raise CannotRunHere(
            f"gpudiag transport runs NCCL between two or more GPUs and this machine has {gpus}; "
            "give a saved NCCL_DEBUG=INFO log with --from-log FILE"
        )
