"""The torch zip container: read its pickle, write a copy with a new pickle, verify it.

``torch.save`` writes an uncompressed zip: ``<archive>/data.pkl`` (the object tree),
``<archive>/data/<key>`` (one record per storage), and small records (``version``,
``byteorder``, ``.data/serialization_id``…), each record's data aligned to 64 bytes.
:func:`rewrite` writes the same archive with another ``data.pkl``: every other record is
copied byte for byte (``os.copy_file_range``: the kernel copies, memory stays flat), keeps
its CRC-32 and gets the same alignment. :func:`verify` reads the output back and checks
every record against the input's CRC-32.
"""

from __future__ import annotations

import os
import struct
import zipfile
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from gpudiag.errors import InputError
from gpudiag.repro.checkpoint.unpickle import one_line

ALIGNMENT = 64
#: The most bytes read into memory for one record: the pickle, or a compressed record
#: (torch never compresses; a compressed record could inflate a thousandfold).
MAX_IN_MEMORY = 256 << 20
_CHUNK = 8 << 20
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


def _copy_range(src: BinaryIO, dst: BinaryIO, offset: int, size: int) -> None:
    """Copy ``size`` bytes at ``offset`` of ``src`` to the current position of ``dst``."""
    dst.flush()
    position = dst.tell()
    done = 0
    try:
        while done < size:
            n = os.copy_file_range(src.fileno(), dst.fileno(), size - done, offset + done, position + done)
            if n == 0:
                raise InputError("the input ended while copying (truncated?)")
            done += n
        dst.seek(position + size)
        return
    except OSError:
        pass  # file systems without copy_file_range: copy through a bounded buffer
    src.seek(offset + done)
    dst.seek(position + done)
    while done < size:
        chunk = src.read(min(_CHUNK, size - done))
        if not chunk:
            raise InputError("the input ended while copying (truncated?)")
        dst.write(chunk)
        done += len(chunk)


def rewrite(archive: Archive, new_pickle: bytes, out: BinaryIO) -> None:
    """Write ``archive`` with ``new_pickle`` as its data.pkl into ``out``."""
    writer = _Writer(out)
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
                    lambda f, r=record: _copy_range(src, f, r.data_offset, r.size),
                )
        writer.finish()


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


def verify_records(original: Archive, written: Archive, source: str) -> None:
    """Every record of the output has the input's name, size and bytes (CRC-32 read back
    from the output's data, against the CRC-32 the input's directory records). Records are
    checked on two threads: zlib releases the GIL, so reading and summing overlap."""
    from concurrent.futures import ThreadPoolExecutor

    before = {r.name: r for r in original.records if r.name != original.pickle_name}
    after = {r.name: r for r in written.records if r.name != written.pickle_name}
    if before.keys() != after.keys():
        raise InputError(f"{source}: verification failed: the records differ from the input's")

    def same(name: str) -> bool:
        old, new = before[name], after[name]
        return new.size == old.size and crc_of(written.path, new.data_offset, new.size) == old.crc

    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        for name, ok in zip(before, pool.map(same, before), strict=True):
            if not ok:
                raise InputError(f"{source}: verification failed: record {one_line(name)} differs from IN's")
