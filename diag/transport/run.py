"""``gpudiag transport`` as a function: read the logs (bounded), the topology if asked,
and analyse; or refuse to run NCCL where fewer than two GPUs are."""

from __future__ import annotations

import sys
import zlib
from pathlib import Path

from gpudiag.errors import CannotRunHere, InputError
from gpudiag.fileio import read_bounded
from gpudiag.transport import rx
from gpudiag.transport.analysis import TransportReport, analyze
from gpudiag.transport.reader import read_log
from gpudiag.transport.records import visible

#: The largest log read (256 MiB; a 100,000-line INFO log of 64 ranks is about 15 MB).
MAX_LOG_BYTES = 256 << 20


def read_log_file(path: str) -> tuple[str, str]:
    """(text, display name) of a log; ``-`` is standard input. gzip is read as it is
    (``.gz``, bounded as the text it holds); UTF-8 (bad bytes replaced) or UTF-16 with its
    byte-order mark, as Windows shells redirect. A block of NUL bytes (a log cut by a
    crash) is kept for the reader, which skips it with a note; NUL bytes all through the
    file (UTF-16 or UTF-32 without a mark, a binary file) are refused: the redactor could
    not read a secret in such text."""
    if path == "-":
        data, name = sys.stdin.buffer.read(MAX_LOG_BYTES + 1), "<stdin>"
    else:  # (a FIFO or a folder refused without waiting, as every input file is)
        name, data = Path(path).name, read_bounded(path, "NCCL log", MAX_LOG_BYTES + 1)
    name = visible(name)
    if data.startswith(b"\x1f\x8b"):
        data = _gunzip(data, name)
    if len(data) > MAX_LOG_BYTES:
        raise InputError(
            f"{name}: larger than {MAX_LOG_BYTES >> 20} MiB; give the part with the `NCCL INFO` lines"
        )
    for magic, kind in _PACKED:
        if data.startswith(magic):
            raise InputError(f"{name}: a {kind} file, not a text log; unpack it first")
    if data.startswith((b"\xff\xfe\x00\x00", b"\x00\x00\xfe\xff")):
        raise InputError(f"{name}: not a text file (UTF-32); save the log as UTF-8")
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        return data.decode("utf-16", "replace"), name
    if b"\x00" in data and len(_NUL_BYTES.findall(data[: 1 << 20])) > MAX_NUL_BLOCKS:
        raise InputError(
            f"{name}: not a text file (NUL bytes all through it: UTF-16 or UTF-32 without a "
            "byte-order mark, or binary); save the log as UTF-8"
        )
    return data.decode("utf-8", "replace"), name


#: Blocks of NUL bytes a log may hold and still be read as text (a crash leaves one or two).
MAX_NUL_BLOCKS = 16
#: A run of NUL bytes in a log file.
_NUL_BYTES = rx.compile(rb"\x00++")
#: Packed files a log may be given as by mistake, by their first bytes.
_PACKED = ((b"\xfd7zXZ\x00", "xz"), (b"BZh", "bzip2"), (b"PK\x03\x04", "zip"), (b"\x28\xb5\x2f\xfd", "zstd"))


def _gunzip(data: bytes, name: str) -> bytes:
    """The text a gzip file holds, at most :data:`MAX_LOG_BYTES` + 1 bytes of it (a small
    file that unpacks to gigabytes is stopped there); :class:`InputError` when damaged."""
    unpacker = zlib.decompressobj(wbits=31)
    try:
        out = unpacker.decompress(data, MAX_LOG_BYTES + 1)
    except zlib.error as exc:
        raise InputError(f"{name}: a damaged gzip file ({exc})") from None
    return out


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
