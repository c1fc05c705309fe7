"""The torch zip container: read its pickle, write a copy with a new pickle, verify it.

``torch.save`` writes an uncompressed zip: ``<archive>/data.pkl`` (the object tree),
``<archive>/data/<key>`` (one record per storage), and small records (``version``,
``byteorder``, ``.data/serialization_id``…), each record's data aligned to 64 bytes.
:func:`rewrite` writes the same archive with another ``data.pkl``: every other record is
copied byte for byte through a bounded buffer, keeps its CRC-32 and gets the same
alignment; the CRC-32 of the bytes written is computed as they are copied and checked
against the one the input's zip directory records, so no second pass over the output is
needed (:func:`same_records` then checks the output's directory).
"""

from __future__ import annotations

import os
import struct
import sys
import zipfile
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from gpudiag.errors import InputError
from gpudiag.unpickle import one_line

ALIGNMENT = 64
#: The most bytes read into memory for one record: the pickle, or a compressed record
#: (torch never compresses; a compressed record could inflate a thousandfold).
MAX_IN_MEMORY = 256 << 20
_CHUNK = 8 << 20
#: The copy's buffer: 1 MiB stays in the CPU's cache between the read, the CRC-32 and the
#: write (8 MiB buffers made the copy two to three times slower on the development VM).
_COPY_CHUNK = 1 << 20
#: Start writing back the output every this many bytes copied (see :class:`_Copier`).
_WRITEBACK = 8 << 20
_ZIP64_LIMIT = 0xFFFFFFFF


@dataclass(frozen=True)
class Record:
    name: str
    size: int
    crc: int
    data_offset: int  # where the stored bytes start in the file
    compressed: bool
    date_time: tuple[int, int, int, int, int, int]


@dataclass
class Archive:
    path: Path
    prefix: str  # "archive/" — the folder every record sits in
    records: list[Record]
    pickle: bytes

    @property
    def pickle_name(self) -> str:
        return self.prefix + "data.pkl"


def _data_offset(handle: BinaryIO, info: zipfile.ZipInfo) -> int:
    handle.seek(info.header_offset)
    header = handle.read(30)
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        raise InputError(f"damaged zip: no local header for {info.filename}")
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return info.header_offset + 30 + name_len + extra_len


def open_archive(path: Path, source: str) -> Archive:
    """Read the record table and the pickle of a torch zip checkpoint."""
    try:
        with zipfile.ZipFile(path) as zf, open(path, "rb") as handle:
            infos = zf.infolist()
            pickles = [i.filename for i in infos if i.filename.endswith("data.pkl")]
            if len(pickles) != 1:
                raise InputError(f"{source}: a zip file, but not a torch checkpoint (no data.pkl)")
            prefix = pickles[0][: -len("data.pkl")]
            records = [
                Record(
                    i.filename, i.file_size, i.CRC, _data_offset(handle, i), i.compress_type != 0, i.date_time
                )
                for i in infos
            ]
            size = path.stat().st_size
            for r in records:
                if not r.compressed and r.data_offset + r.size > size:
                    raise InputError(f"{source}: truncated (record {one_line(r.name)} runs past the end)")
                if (r.compressed or r.name == pickles[0]) and r.size > MAX_IN_MEMORY:
                    raise InputError(
                        f"{source}: record {one_line(r.name)} is {r.size} bytes; gpudiag reads at most "
                        f"{MAX_IN_MEMORY} bytes into memory (the pickle, a compressed record)"
                    )
            data = zf.read(pickles[0])
    except InputError:
        raise
    except Exception as exc:  # zipfile raises many kinds on a damaged file
        raise InputError(
            f"{source}: damaged or truncated torch checkpoint ({type(exc).__name__}: {one_line(str(exc))})"
        ) from exc
    return Archive(path, prefix, records, data)


def read_record(zf: zipfile.ZipFile, name: str, source: str) -> bytes:
    """One record's bytes; a damaged record (bad CRC, bad deflate data) is an InputError."""
    try:
        return zf.read(name)
    except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError, RuntimeError, ValueError) as exc:
        kind = type(exc).__name__
        raise InputError(f"{source}: damaged record {one_line(name)} ({kind}: {one_line(str(exc))})") from exc


def check_storages(archive: Archive, tensors: Iterable[tuple[str, Any]], source: str) -> None:
    """Every storage a tensor names is a record of the archive, of the size its
    reference declares (torch refuses the file otherwise)."""
    sizes = {r.name: r.size for r in archive.records}
    for path, ref in tensors:
        name = f"{archive.prefix}data/{ref.storage.key}"
        if name not in sizes:
            raise InputError(f"{source}: damaged (tensor {one_line(path)} has no record {one_line(name)})")
        if sizes[name] != ref.storage.nbytes:
            raise InputError(f"{source}: damaged (record {one_line(name)} does not hold the storage's bytes)")


def _dos_time(date_time: tuple[int, ...]) -> tuple[int, int]:
    y, mo, d, h, mi, s = date_time
    return (h << 11) | (mi << 5) | (s // 2), ((max(y, 1980) - 1980) << 9) | (mo << 5) | d


class _Writer:
    """A minimal zip writer: stored records, known CRC and size, 64-byte data alignment,
    zip64 where sizes or offsets need it."""

    def __init__(self, out: BinaryIO):
        self.out = out
        self.central: list[bytes] = []
        self.count = 0

    def add(self, name: str, size: int, crc: int, date_time: tuple[int, ...], write_data: object) -> None:
        encoded = name.encode("utf-8")
        offset = self.out.tell()
        zip64 = size >= _ZIP64_LIMIT
        extra = struct.pack("<HHQQ", 1, 16, size, size) if zip64 else b""
        pad = (-(offset + 30 + len(encoded) + len(extra))) % ALIGNMENT
        if 0 < pad < 4:
            pad += ALIGNMENT
        if pad:
            extra += struct.pack("<HH", 0x4246, pad - 4) + b"\0" * (pad - 4)  # "FB" padding, as torch
        dos_time, dos_date = _dos_time(date_time)
        small = _ZIP64_LIMIT if zip64 else size
        version = 45 if zip64 else 20
        self.out.write(
            struct.pack(
                "<IHHHHHIIIHH",
                0x04034B50,
                version,
                0,
                0,
                dos_time,
                dos_date,
                crc,
                small,
                small,
                len(encoded),
                len(extra),
            )
            + encoded
            + extra
        )
        write_data(self.out)  # type: ignore[operator]
        big_offset = offset >= _ZIP64_LIMIT
        central_extra = b""
        if zip64 or big_offset:
            fields = ([size, size] if zip64 else []) + ([offset] if big_offset else [])
            central_extra = struct.pack("<HH", 1, 8 * len(fields)) + struct.pack(f"<{len(fields)}Q", *fields)
        self.central.append(
            struct.pack(
                "<IHHHHHHIIIHHHHHII",
                0x02014B50,
                45 if central_extra else 20,
                version,
                0,
                0,
                dos_time,
                dos_date,
                crc,
                small,
                small,
                len(encoded),
                len(central_extra),
                0,
                0,
                0,
                0,
                _ZIP64_LIMIT if big_offset else offset,
            )
            + encoded
            + central_extra
        )
        self.count += 1

    def finish(self) -> None:
        start = self.out.tell()
        for entry in self.central:
            self.out.write(entry)
        size = self.out.tell() - start
        if self.count >= 0xFFFF or start >= _ZIP64_LIMIT or size >= _ZIP64_LIMIT:
            z64 = self.out.tell()
            self.out.write(
                struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, self.count, self.count, size, start)
            )
            self.out.write(struct.pack("<IIQI", 0x07064B50, 0, z64, 1))
        self.out.write(
            struct.pack(
                "<IHHHHIIH",
                0x06054B50,
                0,
                0,
                min(self.count, 0xFFFF),
                min(self.count, 0xFFFF),
                min(size, _ZIP64_LIMIT),
                min(start, _ZIP64_LIMIT),
                0,
            )
        )


class _Copier:
    """One reused buffer of :data:`_COPY_CHUNK` bytes (memory stays flat whatever the
    record's size), and the writing back of what was copied started as the copy goes.

    The kernel is asked to start writing back every :data:`_WRITEBACK` bytes copied
    (``sync_file_range(SYNC_FILE_RANGE_WRITE)``: it returns at once, it promises nothing),
    so the disk works while the copy goes on and the final fsync — which alone makes the
    file durable — finds little left to do. Where that call is missing, nothing is started
    early and the fsync does it all."""

    def __init__(self) -> None:
        self.view = memoryview(bytearray(_COPY_CHUNK))
        self.started = 0  # the output's bytes before this offset are being written back
        self.writeback = _sync_file_range()

    def written(self, fd: int, end: int) -> None:
        """The output holds its bytes up to ``end``: start writing back a large enough run."""
        if self.writeback is not None and end - self.started >= _WRITEBACK:
            self.writeback(fd, self.started, end - self.started, 2)  # SYNC_FILE_RANGE_WRITE
            self.started = end


def _sync_file_range() -> Any:
    """libc's ``sync_file_range`` (Linux), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    call.restype = ctypes.c_int
    return call


def _copy_range(src: BinaryIO, dst: BinaryIO, offset: int, size: int, copier: _Copier | None = None) -> int:
    """Copy ``size`` bytes at ``offset`` of ``src`` to the current position of ``dst``;
    the CRC-32 of the bytes written, summed from the very buffer that was written."""
    copier = copier or _Copier()
    dst.flush()
    position = dst.tell()
    fd_in, fd_out = src.fileno(), dst.fileno()
    crc, done = 0, 0
    while done < size:
        view = copier.view[: min(_COPY_CHUNK, size - done)]
        n = os.preadv(fd_in, [view], offset + done)
        if n <= 0:
            raise InputError("the input ended while copying (truncated?)")
        view = view[:n]
        crc = zlib.crc32(view, crc)
        written = 0
        while written < n:
            written += os.pwrite(fd_out, view[written:], position + done + written)
        done += n
        copier.written(fd_out, position + done)
    dst.seek(position + size)
    return crc


def rewrite(archive: Archive, new_pickle: bytes, out: BinaryIO) -> None:
    """Write ``archive`` with ``new_pickle`` as its data.pkl into ``out``."""
    writer = _Writer(out)
    copier = _Copier()
    with open(archive.path, "rb") as src, zipfile.ZipFile(archive.path) as zf:
        for record in archive.records:
            if record.name == archive.pickle_name:
                crc = zlib.crc32(new_pickle)
                writer.add(
                    record.name,
                    len(new_pickle),
                    crc,
                    record.date_time,
                    lambda f, data=new_pickle: f.write(data),
                )
            elif record.compressed:
                data = read_record(zf, record.name, str(archive.path))  # rare: torch never compresses
                writer.add(
                    record.name,
                    len(data),
                    zlib.crc32(data),
                    record.date_time,
                    lambda f, data=data: f.write(data),
                )
            else:
                writer.add(
                    record.name,
                    record.size,
                    record.crc,
                    record.date_time,
                    lambda f, r=record: _copy_checked(src, f, r, str(archive.path), copier),
                )
        writer.finish()


def _copy_checked(src: BinaryIO, dst: BinaryIO, record: Record, source: str, copier: _Copier) -> None:
    """Copy one stored record; the CRC-32 of the bytes written must be the one IN's zip
    directory records for it (else IN is damaged, or changed while it was copied)."""
    if _copy_range(src, dst, record.data_offset, record.size, copier) != record.crc:
        raise InputError(
            f"{source}: record {one_line(record.name)} does not match its CRC-32 "
            "(the file is damaged, or changed while it was copied)"
        )


def crc_of(path: Path, offset: int, size: int) -> int:
    """CRC-32 of a byte range, read in bounded chunks into one reused buffer."""
    crc = 0
    buffer = bytearray(min(_CHUNK, max(size, 1)))
    view = memoryview(buffer)
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < size:
            n = os.preadv(fd, [view[: min(len(buffer), size - done)]], offset + done)
            if n <= 0:
                break
            crc = zlib.crc32(view[:n], crc)
            done += n
    finally:
        os.close(fd)
    return crc


def same_records(original: Archive, written: Archive, source: str) -> None:
    """The output's zip directory lists the input's records (but the pickle) with the same
    names, sizes and CRC-32s. The bytes were checked as they were written (:func:`rewrite`);
    this reads only the directory, not the data again."""
    before = {r.name: (r.size, r.crc) for r in original.records if r.name != original.pickle_name}
    after = {r.name: (r.size, r.crc) for r in written.records if r.name != written.pickle_name}
    if before != after:
        raise InputError(f"{source}: verification failed: the records differ from the input's")
