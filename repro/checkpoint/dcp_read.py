"""Read the pieces of a DCP checkpoint's ``__R_K.distcp`` files without loading them whole.

``FileSystemWriter`` (torch 2.11 to 2.14, its default ``torch_save`` format) writes each
chunk of a tensor, and each pickled object, as a complete ``torch.save`` archive — an
uncompressed zip: ``archive/data.pkl`` and one ``archive/data/<key>`` record holding the
storage — one after another in the file, at the byte ranges ``.metadata`` records
(``_StorageInfo.offset``/``length``). :func:`open_piece` reads one such archive's zip
directory and small pickle through a window onto that byte range (never past it), by the
restricted reader of :mod:`.pickles`; a tensor piece becomes a :class:`Piece`: where its
values' bytes are in the ``.distcp`` file, its dtype, sizes and strides, and the CRC-32 the
zip records for them. Nothing is unpickled beyond placeholders, torch is not imported.
"""

from __future__ import annotations

import functools
import io
import os
import zipfile
import zlib
from dataclasses import dataclass
from typing import Any, BinaryIO

from gpudiag.errors import InputError
from gpudiag.repro.checkpoint import pickles
from gpudiag.repro.checkpoint.dcp_metadata import Chunk, Entry
from gpudiag.repro.checkpoint.torchzip import MAX_IN_MEMORY
from gpudiag.unpickle import one_line

_READ = 1 << 20


class Window(io.RawIOBase):
    """Bytes ``begin`` to ``begin + length`` of an open file, as a file of their own."""

    def __init__(self, handle: BinaryIO, begin: int, length: int):
        super().__init__()
        self.handle, self.begin, self.length, self.pos = handle, begin, length, 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.length}[whence]
        self.pos = max(0, min(self.length, base + pos))
        return self.pos

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), self.length - self.pos)
        if n <= 0:
            return 0
        got = os.preadv(self.handle.fileno(), [memoryview(buffer)[:n]], self.begin + self.pos)
        self.pos += got
        return got


@dataclass(frozen=True)
class Piece:
    """One stored chunk's values: ``begin``/``nbytes`` in its ``.distcp`` file is the
    storage record (whose zip CRC-32 is ``crc``); the chunk is the view ``offset``
    (elements), ``sizes``, ``strides`` of that storage."""

    file: str
    begin: int
    nbytes: int
    crc: int
    dtype: str
    offset: int
    sizes: tuple[int, ...]
    strides: tuple[int, ...]

    @property
    def contiguous(self) -> bool:
        """The chunk is the whole storage, row-major (then its bytes are read as they are)."""
        expect, step = [], 1
        for n in reversed(self.sizes):
            expect.append(step)
            step *= n
        numel = step
        return (
            self.offset == 0
            and all(
                s == e or n == 1 for s, e, n in zip(self.strides, reversed(expect), self.sizes, strict=True)
            )
            and numel * _itemsize(self.dtype) == self.nbytes
        )


def _itemsize(dtype: str) -> int:
    from gpudiag.repro.checkpoint.dcp_metadata import ITEMSIZE

    return ITEMSIZE[dtype]


def describe(entry: Entry, chunk: Chunk) -> str:
    """``FILE bytes A-B (tensor KEY, chunk at offsets …)`` for an error line."""
    what = f"tensor {one_line(entry.key, 120)}" if entry.is_tensor else f"object {one_line(entry.key, 120)}"
    at = f", chunk at offsets {list(chunk.offsets)}" if entry.is_tensor and len(entry.chunks) > 1 else ""
    return f"{chunk.where()} ({what}{at})"


class PieceError(InputError):
    """A stored piece is not what ``.metadata`` says (damaged, another format)."""


def _archive(handle: BinaryIO, entry: Entry, chunk: Chunk) -> tuple[zipfile.ZipFile, str, Any]:
    window = Window(handle, chunk.begin, chunk.length)
    where = describe(entry, chunk)
    try:
        zf = zipfile.ZipFile(window)
        names = [i.filename for i in zf.infolist() if i.filename.endswith("data.pkl")]
        if len(names) != 1:
            raise PieceError(f"{where}: not a torch.save archive (no data.pkl)")
        info = zf.getinfo(names[0])
        if info.file_size > MAX_IN_MEMORY or info.compress_type != 0:
            raise PieceError(f"{where}: its pickle is compressed or larger than {MAX_IN_MEMORY} bytes")
        tree = pickles.loads(zf.read(names[0]), where)
    except InputError:
        raise
    except Exception as exc:  # zipfile raises many kinds on damaged bytes
        raise PieceError(
            f"{where}: damaged (not the torch.save archive .metadata points to: "
            f"{type(exc).__name__}: {one_line(str(exc))})"
        ) from exc
    return zf, names[0][: -len("data.pkl")], tree


def open_piece(handle: BinaryIO, entry: Entry, chunk: Chunk) -> Piece:
    """The stored values of one tensor chunk, checked against the metadata: a tensor of
    the entry's dtype and the chunk's sizes, its storage record inside the byte range."""
    where = describe(entry, chunk)
    if chunk.transforms:
        raise PieceError(f"{where}: stored through extensions {list(chunk.transforms)} (unsupported)")
    zf, prefix, tree = _archive(handle, entry, chunk)
    if not isinstance(tree, (pickles.TensorRef, pickles.ParamRef)):
        raise PieceError(f"{where}: holds a {type(tree).__name__}, not a tensor")
    ref = tree.data if isinstance(tree, pickles.ParamRef) else tree
    if ref.dtype != entry.dtype:
        raise PieceError(f"{where}: stored as {ref.dtype}, .metadata says {entry.dtype}")
    if tuple(ref.size) != chunk.sizes:
        raise PieceError(f"{where}: stored with shape {list(ref.size)}, .metadata says {list(chunk.sizes)}")
    name = f"{prefix}data/{ref.storage.key}"
    try:
        info = zf.getinfo(name)
    except KeyError:
        raise PieceError(f"{where}: damaged (no storage record {one_line(name)})") from None
    if info.compress_type != 0 or info.file_size != ref.storage.nbytes:
        raise PieceError(f"{where}: damaged (storage record {one_line(name)} is not the storage's bytes)")
    window = zf.fp
    assert window is not None
    window.seek(info.header_offset)
    header = window.read(30)
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        raise PieceError(f"{where}: damaged (no zip header for {one_line(name)})")
    start = (
        info.header_offset
        + 30
        + int.from_bytes(header[26:28], "little")
        + int.from_bytes(header[28:30], "little")
    )
    if start + info.file_size > chunk.length:
        raise PieceError(f"{where}: damaged (storage record runs past the chunk's byte range)")
    return Piece(
        chunk.file or "",
        chunk.begin + start,
        info.file_size,
        info.CRC,
        ref.dtype,
        ref.offset,
        tuple(ref.size),
        tuple(ref.stride),
    )


class UnsafeObject(InputError):
    """An object entry needs globals outside the restricted reader's allowlist: not read."""


def read_object(handle: BinaryIO, entry: Entry, chunk: Chunk) -> Any:
    """A pickled (non-tensor) entry, read by the restricted reader: plain values, lists,
    dicts; tensors inside it are refused (DCP stores tensors as chunks), and so are
    arbitrary objects (:class:`UnsafeObject`: reading them could run code)."""
    where = describe(entry, chunk)
    if chunk.transforms:
        raise PieceError(f"{where}: stored through extensions {list(chunk.transforms)} (unsupported)")
    try:
        _, _, tree = _archive(handle, entry, chunk)
    except pickles.UnsafeCheckpoint as exc:
        shown = ", ".join(one_line(n, 80) for n in exc.names[:4])
        raise UnsafeObject(
            f"{where}: a pickled object needing {shown}; not read (reading it could run code)"
        ) from None
    if any(True for _ in pickles.tensor_refs(tree)):
        raise PieceError(f"{where}: an object entry holding tensors (unsupported)")
    return tree


def read_bytes(handle: BinaryIO, piece: Piece, into: memoryview | None = None) -> memoryview:
    """The piece's storage bytes (into ``into`` when given), their CRC-32 checked against
    the zip's: a mismatch names the file and byte range."""
    out = into if into is not None else memoryview(bytearray(piece.nbytes))
    crc, done = 0, 0
    fd = handle.fileno()
    while done < piece.nbytes:
        view = out[done : min(piece.nbytes, done + _READ)]
        n = os.preadv(fd, [view], piece.begin + done)
        if n <= 0:
            raise PieceError(
                f"{piece.file} bytes {piece.begin}-{piece.begin + piece.nbytes}: the file ended early"
            )
        crc = zlib.crc32(view[:n], crc)
        done += n
    if crc != piece.crc:
        raise PieceError(
            f"{piece.file} bytes {piece.begin}-{piece.begin + piece.nbytes}: the values do not match "
            "their CRC-32 (the file is damaged)"
        )
    return out


def _gf2_times(matrix: list[int], vector: int) -> int:
    out, i = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


def _gf2_square(matrix: list[int]) -> list[int]:
    return [_gf2_times(matrix, row) for row in matrix]


@functools.lru_cache(maxsize=64)
def _shift(length: int) -> tuple[int, ...]:
    """The GF(2) operator that advances a CRC-32 over ``length`` zero bytes (cached: a
    checkpoint's chunks have few distinct sizes)."""
    op = [1 << n for n in range(32)]  # the identity
    odd = [0xEDB88320] + [1 << n for n in range(31)]  # one zero bit
    even = _gf2_square(odd)  # two
    odd = _gf2_square(even)  # four
    while length:  # then 8 bits (one byte), 16, 32…: composed where length has a bit set
        even = _gf2_square(odd)
        if length & 1:
            op = [_gf2_times(even, column) for column in op]
        length >>= 1
        if not length:
            break
        odd = _gf2_square(even)
        if length & 1:
            op = [_gf2_times(odd, column) for column in op]
        length >>= 1
    return tuple(op)


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)``, without the
    bytes: ``crc1`` advanced over ``len2`` zero bytes, then ``crc2`` added (zlib's
    ``crc32_combine``, which Python's zlib does not expose)."""
    if len2 <= 0:
        return crc1
    return _gf2_times(list(_shift(len2)), crc1) ^ crc2
