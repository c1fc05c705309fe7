"""Read a torch.distributed.checkpoint (DCP) folder's ``.metadata`` without trusting it.

A DCP folder (``torch.distributed.checkpoint.save`` with its ``FileSystemWriter``) holds
``.metadata`` — a pickle of ``torch.distributed.checkpoint.metadata.Metadata`` — and the data
files ``__R_K.distcp`` (R the rank that wrote it, K its file number on that rank). The
metadata names every entry of the flattened state dict (``model.layers.0.weight``,
``optim.state.…``): a tensor (``TensorStorageMetadata``: dtype, global size, the chunks
that tile it, each ``offsets``/``sizes``) or a pickled object (``BytesStorageMetadata``);
``storage_data`` maps each chunk (``MetadataIndex(fqn, offset)``) to a byte range of a file
(``_StorageInfo(relative_path, offset, length)``); ``planner_data`` maps each flat key to
its path in the nested state dict (``("model", "layers.0.weight")``).

torch reads this file with a plain ``pickle.load`` (torch 2.14): a crafted ``.metadata``
runs code. Here it is read by :class:`gpudiag.unpickle.BoundedUnpickler` with a
``find_class`` that knows only DCP's metadata types (as torch 2.11 to 2.14 write them,
and the older ``_shard`` location of ``TensorProperties``), a few torch names (dtypes,
``torch.Size``, layouts) and ``pathlib`` paths — each given back as a stand-in, never the
real class, so nothing pickled runs and torch is not imported. Any other global:
:class:`UnsafeMetadata` (``dcp-metadata-unsafe``, exit 2).
"""

from __future__ import annotations

import collections
import os
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpudiag.errors import InputError
from gpudiag.fileio import read_bounded
from gpudiag.repro.checkpoint.pickles import STORAGE_TYPES, globals_in
from gpudiag.unpickle import BoundedUnpickler, TooComplex, check_tree, one_line

METADATA = ".metadata"
#: The largest ``.metadata`` read (a 10,000-tensor model's is a few MiB).
MAX_METADATA_BYTES = 256 << 20

#: dtype names torch pickles (``torch.float32`` …) → bytes per element.
ITEMSIZE = {
    **{dtype: size for dtype, size in STORAGE_TYPES.values()},
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
}
_DTYPE_ALIASES = {"float": "float32", "double": "float64", "half": "float16", "long": "int64", "int": "int32"}
_DTYPE_ALIASES |= {"short": "int16", "cfloat": "complex64", "cdouble": "complex128"}

_DCP = "torch.distributed.checkpoint.metadata"
_SHARD = "torch.distributed._shard.sharded_tensor.metadata"
_FS = "torch.distributed.checkpoint.filesystem"
#: (module, name) of each metadata class a ``.metadata`` may name.
_CLASSES = {
    (_DCP, "Metadata"): "Metadata",
    (_DCP, "TensorStorageMetadata"): "TensorStorageMetadata",
    (_DCP, "BytesStorageMetadata"): "BytesStorageMetadata",
    (_DCP, "ChunkStorageMetadata"): "ChunkStorageMetadata",
    (_DCP, "MetadataIndex"): "MetadataIndex",
    (_DCP, "StorageMeta"): "StorageMeta",
    (_DCP, "TensorProperties"): "TensorProperties",
    (_SHARD, "TensorProperties"): "TensorProperties",
    (_FS, "_StorageInfo"): "_StorageInfo",
}
_ENUMS = {(_DCP, "_MEM_FORMAT_ENCODING"), (_SHARD, "MEM_FORMAT_ENCODING")}
_PATHS = {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"}
_LAYOUTS = {"strided", "sparse_coo", "sparse_csr", "_mkldnn"}


class UnsafeMetadata(InputError):
    """``.metadata`` names globals outside DCP's metadata types: refused, never run."""

    def __init__(self, source: str, names: list[str]):
        shown = ", ".join(one_line(n, 80) for n in names[:6]) + (" …" if len(names) > 6 else "")
        super().__init__(
            f"dcp-metadata-unsafe: {source} needs objects outside DCP's metadata types ({shown}); "
            "refused, nothing in it was run (a crafted or foreign .metadata)"
        )
        self.names = names


class _Stub:
    """What a metadata class is read as: its pickled state, nothing run."""

    kind = ""
    state: Any = None  # NEWOBJ makes it with __new__ alone; BUILD sets this once

    def build(self, state: Any) -> None:
        if not isinstance(state, (dict, tuple)) or self.state is not None:
            raise pickle.UnpicklingError(f"a {self.kind} with a state of {type(state).__name__}")
        self.state = state

    def get(self, name: str, default: Any = None) -> Any:
        return self.state.get(name, default) if isinstance(self.state, dict) else default

    def tree_parts(self) -> list[Any]:
        state = self.state
        if isinstance(state, dict):
            return [*state.keys(), *state.values()]
        return list(state) if isinstance(state, tuple) else []


def _stub_class(kind: str) -> type[_Stub]:
    return type(kind, (_Stub,), {"kind": kind})


_STUBS = {kind: _stub_class(kind) for kind in set(_CLASSES.values())}


@dataclass(frozen=True)
class Name:
    """A torch name read from the pickle: ``torch.float32`` → ``Name("float32")``."""

    name: str


def _size(value: Any = ()) -> tuple[int, ...]:
    """``torch.Size(…)`` as a tuple of non-negative ints."""
    if not isinstance(value, (tuple, list)) or not all(type(v) is int and v >= 0 for v in value):
        raise pickle.UnpicklingError("a torch.Size that is not a list of non-negative integers")
    return tuple(value)


def _layout(name: Any) -> Name:
    if not isinstance(name, str) or name.removeprefix("torch.") not in _LAYOUTS:
        raise pickle.UnpicklingError("an unknown tensor layout")
    return Name(name.removeprefix("torch."))


def _enum(value: Any) -> int:
    if type(value) is not int:
        raise pickle.UnpicklingError("a memory format that is not an integer")
    return value


def _path(*parts: Any) -> str:
    if not all(isinstance(p, str) for p in parts):
        raise pickle.UnpicklingError("a path made of something other than strings")
    return os.path.join(*parts) if parts else ""


def _lookup(module: str, name: str) -> Any:
    """The stand-in for a global ``.metadata`` may name, or None."""
    kind = _CLASSES.get((module, name))
    if kind is not None:
        return _STUBS[kind]
    if (module, name) in _ENUMS:
        return _enum
    if module == "torch" and name == "Size":
        return _size
    if module == "torch" and (name in ITEMSIZE or name in _DTYPE_ALIASES):
        return Name(_DTYPE_ALIASES.get(name, name))
    if module == "torch" and name in _LAYOUTS:
        return Name(name)
    if module == "torch.serialization" and name == "_get_layout":
        return _layout
    if module == "pathlib" and name in _PATHS:
        return _path
    if module == "collections" and name == "OrderedDict":
        return collections.OrderedDict
    return None


class MetadataUnpickler(BoundedUnpickler):
    """The bounded unpickler, knowing only DCP's metadata types (module docstring)."""

    weighed_types = (tuple, frozenset)
    kind = "DCP metadata"

    def __init__(self, data: bytes, source: str):
        super().__init__(data, source)
        self.data = data
        # the opcode table is BoundedUnpickler's: BUILD goes to this class's load_build
        table: dict[int, Any] = dict(getattr(self, "dispatch", {}))
        table[pickle.BUILD[0]] = MetadataUnpickler.load_build
        self.dispatch = table

    def find_class(self, module: str, name: str) -> Any:
        found = _lookup(module, name)
        if found is None:
            names = [g for g in globals_in(self.data) if _lookup(*g.rpartition(".")[::2]) is None]
            raise UnsafeMetadata(self.source, names or [f"{module}.{name}"])
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("a persistent reference (DCP metadata has none)")

    def load_build(self) -> None:
        inst = self.stack[-2]
        if isinstance(inst, _Stub):
            state = self.stack.pop()
            if isinstance(state, dict):
                self.check_keys(object(), state.keys())
            inst.build(state)
            return
        super().load_build()


@dataclass(frozen=True)
class Chunk:
    """One stored piece of a tensor: where it sits in the global tensor (``offsets``,
    ``sizes``) and which bytes of which file hold it (a ``torch.save`` of the piece)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str | None
    begin: int = 0
    length: int = 0
    transforms: tuple[str, ...] = ()

    @property
    def numel(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n

    def where(self) -> str:
        return f"{self.file} bytes {self.begin}-{self.begin + self.length}"


@dataclass
class Entry:
    """One flat key of the checkpoint: a tensor (dtype, global shape, chunks) or, with
    ``dtype`` None, a pickled object stored in one chunk."""

    key: str
    path: tuple[Any, ...]
    dtype: str | None
    shape: tuple[int, ...]
    chunks: list[Chunk] = field(default_factory=list)

    @property
    def is_tensor(self) -> bool:
        return self.dtype is not None

    @property
    def itemsize(self) -> int:
        return ITEMSIZE.get(self.dtype or "", 0)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass
class Metadata:
    """What ``.metadata`` says, checked for types: the entries in the order torch saved
    them, and the problems found reading it (a chunk with no byte range)."""

    folder: Path
    entries: list[Entry]
    version: str | None
    unstored: list[str]  # "key (chunk at offsets …)" with no storage entry

    def files(self) -> list[str]:
        return sorted({c.file for e in self.entries for c in e.chunks if c.file is not None}, key=_file_order)


def _file_order(name: str) -> tuple[int, int, str]:
    rank, number = saving_rank(name)
    return (rank if rank is not None else 1 << 30, number if number is not None else 0, name)


def saving_rank(name: str) -> tuple[int | None, int | None]:
    """(rank, file number) from ``__R_K.distcp``; (None, None) for another name."""
    stem = name.removesuffix(".distcp")
    if stem.startswith("__") and stem != name:
        parts = stem[2:].split("_")
        if len(parts) == 2 and all(p.isdigit() for p in parts):
            return int(parts[0]), int(parts[1])
    return None, None


def _bad(source: str, what: str) -> InputError:
    return InputError(f"{source}: not DCP metadata as torch writes it ({what})")


def read_metadata(folder: str | os.PathLike[str]) -> Metadata:
    """Read and check ``folder/.metadata``; InputError (exit 2) naming what is wrong."""
    folder = Path(folder)
    path = folder / METADATA
    source = str(path)
    if not path.exists():
        raise InputError(f"{folder}: no .metadata file: not a torch.distributed.checkpoint folder")
    data = read_bounded(path, "DCP metadata", MAX_METADATA_BYTES)
    try:
        root = MetadataUnpickler(data, source).load()
    except InputError:
        raise
    except RecursionError as exc:
        raise TooComplex(source, "nested too deep", "DCP metadata") from exc
    except Exception as exc:
        raise InputError(
            f"{source}: damaged or truncated DCP metadata ({type(exc).__name__}: {one_line(str(exc))})"
        ) from exc
    check_tree(root, source, "DCP metadata")
    return _interpret(folder, root, source)


def _interpret(folder: Path, root: Any, source: str) -> Metadata:
    if not isinstance(root, _STUBS["Metadata"]) or not isinstance(root.state, dict):
        raise _bad(source, f"the root object is a {type(root).__name__}, not Metadata")
    items = root.get("state_dict_metadata")
    if not isinstance(items, dict) or not all(isinstance(k, str) for k in items):
        raise _bad(source, "state_dict_metadata is not a map of names")
    planner = root.get("planner_data") or {}
    if not isinstance(planner, dict):
        raise _bad(source, "planner_data is not a map")
    ranges = _storage(root.get("storage_data") or {}, source)
    version = root.get("version")
    entries, unstored = [], []
    for key, value in items.items():
        path = planner.get(key, (key,))
        if (
            not isinstance(path, (tuple, list))
            or not path
            or not all(isinstance(p, (str, int)) for p in path)
        ):
            raise _bad(source, f"planner_data of {one_line(key, 80)!r} is not a path")
        if isinstance(value, _STUBS["BytesStorageMetadata"]):
            chunk = ranges.get((key, None))
            if chunk is None:
                unstored.append(f"{key} (an object)")
                chunk = Chunk((), (), None)
            entries.append(Entry(key, tuple(path), None, (), [chunk]))
            continue
        if not isinstance(value, _STUBS["TensorStorageMetadata"]):
            raise _bad(source, f"entry {one_line(key, 80)!r} is a {type(value).__name__}")
        dtype = _dtype(value.get("properties"), key, source)
        shape = value.get("size")
        chunks_md = value.get("chunks")
        if not isinstance(shape, tuple) or not isinstance(chunks_md, list):
            raise _bad(source, f"tensor {one_line(key, 80)!r} has no size or chunk list")
        chunks = []
        for md in chunks_md:
            offsets = md.get("offsets") if isinstance(md, _Stub) else None
            sizes = md.get("sizes") if isinstance(md, _Stub) else None
            if not isinstance(offsets, tuple) or not isinstance(sizes, tuple) or len(offsets) != len(shape):
                raise _bad(source, f"a chunk of {one_line(key, 80)!r} has no offsets/sizes of its rank")
            if len(sizes) != len(shape):
                raise _bad(source, f"a chunk of {one_line(key, 80)!r} has sizes of another rank")
            found = ranges.get((key, offsets))
            if found is None:
                unstored.append(f"{key} (chunk at offsets {list(offsets)})")
                chunks.append(Chunk(offsets, sizes, None))
            else:
                chunks.append(Chunk(offsets, sizes, found.file, found.begin, found.length, found.transforms))
        entries.append(Entry(key, tuple(path), dtype, shape, chunks))
    return Metadata(folder, entries, version if isinstance(version, str) else None, unstored)


def _dtype(properties: Any, key: str, source: str) -> str:
    state = properties.state if isinstance(properties, _STUBS["TensorProperties"]) else None
    if isinstance(state, dict):
        dtype = state.get("dtype")
    elif isinstance(state, tuple) and state:
        dtype = state[0]
    else:
        dtype = None
    if not isinstance(dtype, Name) or dtype.name not in ITEMSIZE:
        raise _bad(source, f"tensor {one_line(key, 80)!r} has no known dtype")
    return dtype.name


def _storage(storage: Any, source: str) -> dict[tuple[str, tuple[int, ...] | None], Chunk]:
    """(key, chunk offsets) → its byte range, from ``storage_data``."""
    if not isinstance(storage, dict):
        raise _bad(source, "storage_data is not a map")
    out = {}
    for index, info in storage.items():
        if not isinstance(index, _STUBS["MetadataIndex"]) or not isinstance(info, _STUBS["_StorageInfo"]):
            raise _bad(source, "storage_data does not map MetadataIndex to _StorageInfo")
        fqn, offset = index.get("fqn"), index.get("offset")
        name, begin, length = info.get("relative_path"), info.get("offset"), info.get("length")
        transforms = info.get("transform_descriptors") or ()
        if not isinstance(fqn, str) or not (offset is None or isinstance(offset, tuple)):
            raise _bad(source, "a MetadataIndex without a name")
        if not isinstance(name, str) or type(begin) is not int or type(length) is not int:
            raise _bad(source, f"the byte range of {one_line(fqn, 80)!r} is not a file, offset and length")
        if begin < 0 or length < 0 or not _plain_name(name):
            raise _bad(
                source, f"the byte range of {one_line(fqn, 80)!r} is {one_line(name, 80)!r} {begin}+{length}"
            )
        if not isinstance(transforms, (list, tuple)) or not all(isinstance(t, str) for t in transforms):
            raise _bad(source, f"the transforms of {one_line(fqn, 80)!r} are not names")
        out[(fqn, offset)] = Chunk((), (), name, begin, length, tuple(transforms))
    return out


def _plain_name(name: str) -> bool:
    """A file name inside the folder: no separator, not ``..`` (a crafted path is refused)."""
    return (
        bool(name) and "/" not in name and "\\" not in name and name not in (".", "..") and "\0" not in name
    )
