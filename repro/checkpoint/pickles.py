"""Read and rewrite the pickle inside a torch checkpoint without loading any tensor data.

A torch zip checkpoint (``torch.save``) holds ``<name>/data.pkl`` — the object tree, in
which every tensor is a call ``torch._utils._rebuild_tensor_v2(storage, offset, size,
stride, …)`` whose storage is a *persistent id* naming a record ``<name>/data/<key>`` —
and the records themselves. :class:`SafeUnpickler` rebuilds the tree with
:class:`TensorRef` placeholders (dtype, shape, storage key: no bytes read) and refuses
anything outside a small allowlist of globals, so a malicious pickle never runs code.
:func:`dumps` writes a tree of placeholders back as the same calls and persistent ids,
so torch loads the result exactly as it loaded the original.
"""

from __future__ import annotations

import codecs
import collections
import io
import pickle
import pickletools
from dataclasses import dataclass, field
from typing import Any

from gpudiag.errors import InputError

#: torch storage class name → (dtype name, bytes per element).
STORAGE_TYPES = {
    "FloatStorage": ("float32", 4),
    "DoubleStorage": ("float64", 8),
    "HalfStorage": ("float16", 2),
    "BFloat16Storage": ("bfloat16", 2),
    "LongStorage": ("int64", 8),
    "IntStorage": ("int32", 4),
    "ShortStorage": ("int16", 2),
    "CharStorage": ("int8", 1),
    "ByteStorage": ("uint8", 1),
    "BoolStorage": ("bool", 1),
    "ComplexFloatStorage": ("complex64", 8),
    "ComplexDoubleStorage": ("complex128", 16),
}
_BUILTINS = {
    "set",
    "frozenset",
    "slice",
    "complex",
    "bytearray",
    "tuple",
    "list",
    "dict",
    "int",
    "float",
    "bool",
    "str",
    "range",
}


class UnsafeCheckpoint(InputError):
    """The pickle needs globals outside the allowlist (``names``): loading it would run
    arbitrary code. Refused unless the user trusts the file."""

    def __init__(self, source: str, names: list[str]):
        shown = ", ".join(names[:8]) + (" …" if len(names) > 8 else "")
        super().__init__(
            f"{source} needs arbitrary pickled objects ({shown}); loading it could run code. If you "
            "trust this file, pass --trust-checkpoint"
        )
        self.names = names


@dataclass(frozen=True)
class StorageRef:
    """A storage record: ``key`` names ``<archive>/data/<key>``; ``numel`` elements."""

    type_name: str
    key: str
    location: str
    numel: int

    @property
    def dtype(self) -> str:
        return STORAGE_TYPES[self.type_name][0]

    @property
    def itemsize(self) -> int:
        return STORAGE_TYPES[self.type_name][1]

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass
class TensorRef:
    """A tensor without its data: a view (offset, size, stride) of a storage record."""

    storage: StorageRef
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    requires_grad: bool = False
    hooks: Any = field(default_factory=collections.OrderedDict)
    extra: tuple[Any, ...] = ()  # further _rebuild_tensor_v2 arguments (metadata), kept as read

    @property
    def dtype(self) -> str:
        return self.storage.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.size)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.size:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.storage.itemsize


@dataclass
class ParamRef:
    """An ``nn.Parameter`` around a :class:`TensorRef`."""

    data: TensorRef
    requires_grad: bool
    hooks: Any

    @property
    def dtype(self) -> str:
        return self.data.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    @property
    def storage(self) -> StorageRef:
        return self.data.storage


def is_tensor(value: Any) -> bool:
    """A tensor placeholder, or a real tensor (checkpoints loaded by torch itself)."""
    if isinstance(value, (TensorRef, ParamRef)):
        return True
    import sys

    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _rebuild_tensor(
    storage: StorageRef,
    offset: int,
    size: Any,
    stride: Any,
    requires_grad: bool = False,
    hooks: Any = None,
    *extra: Any,
) -> TensorRef:
    return TensorRef(
        storage,
        int(offset),
        tuple(size),
        tuple(stride),
        bool(requires_grad),
        collections.OrderedDict() if hooks is None else hooks,
        extra,
    )


def _rebuild_parameter(data: TensorRef, requires_grad: bool, hooks: Any) -> ParamRef:
    return ParamRef(data, bool(requires_grad), hooks)


#: torch attributes a checkpoint may name that are plain values (dtypes) or value types.
TORCH_NAMES = frozenset(
    {
        "Size",
        "device",
        "float32",
        "float",
        "float64",
        "double",
        "float16",
        "half",
        "bfloat16",
        "int64",
        "long",
        "int32",
        "int",
        "int16",
        "short",
        "int8",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "bool",
        "complex64",
        "cfloat",
        "complex128",
        "cdouble",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
    }
)


@dataclass(frozen=True)
class GlobalRef:
    """A torch global kept by name (a dtype, ``torch.Size``, ``torch.device``, a storage
    type): torch is not imported to read or write a checkpoint's structure."""

    module: str
    name: str

    def __call__(self, *args: Any) -> Call:
        return Call(self, args)


@dataclass(frozen=True)
class Call:
    """``torch.Size([2])`` or ``torch.device('cpu')`` as read: written back the same way."""

    func: GlobalRef
    args: tuple[Any, ...]


def _allowed(module: str, name: str) -> Any:
    """The object a safe global stands for, or None."""
    if module == "collections" and name == "OrderedDict":
        return collections.OrderedDict
    if module == "torch._utils" and name == "_rebuild_tensor_v2":
        return _rebuild_tensor
    if module == "torch._utils" and name == "_rebuild_parameter":
        return _rebuild_parameter
    if module == "_codecs" and name == "encode":
        return codecs.encode
    if module in ("__builtin__", "builtins") and name in _BUILTINS:
        import builtins

        return getattr(builtins, name)
    if module == "torch" and (name in STORAGE_TYPES or name in TORCH_NAMES):
        return GlobalRef(module, name)
    if module in ("numpy.core.multiarray", "numpy._core.multiarray") and name == "scalar":
        try:
            from numpy._core.multiarray import scalar
        except ImportError:  # numpy < 2
            from numpy.core.multiarray import scalar  # type: ignore[no-redef]
        return scalar
    if module == "numpy" and name == "dtype":
        import numpy

        return numpy.dtype
    return None


def globals_in(data: bytes) -> list[str]:
    """Every ``module name`` global a pickle refers to (without running it)."""
    names: list[str] = []
    strings: list[str] = []
    for opcode, arg, _ in pickletools.genops(data):
        if opcode.name in ("GLOBAL", "INST"):
            names.append(str(arg).replace(" ", "."))
        elif opcode.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BINUNICODE8"):
            strings.append(str(arg))
        elif opcode.name == "STACK_GLOBAL" and len(strings) >= 2:
            names.append(f"{strings[-2]}.{strings[-1]}")
    return list(dict.fromkeys(names))


class SafeUnpickler(pickle.Unpickler):
    """Unpickles a checkpoint's object tree with placeholders for tensors; refuses every
    global outside the allowlist."""

    def __init__(self, data: bytes, source: str):
        super().__init__(io.BytesIO(data))
        self.source = source
        self.data = data

    def find_class(self, module: str, name: str) -> Any:
        found = _allowed(module, name)
        if found is None:
            unsafe = [g for g in globals_in(self.data) if _allowed(*g.rsplit(".", 1)) is None]
            raise UnsafeCheckpoint(self.source, unsafe or [f"{module}.{name}"])
        return found

    def persistent_load(self, pid: Any) -> StorageRef:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise InputError(f"{self.source}: unknown storage reference {pid!r:.80}")
        kind, key, location, numel = pid[1], pid[2], pid[3], pid[4]
        if not isinstance(kind, GlobalRef) or kind.name not in STORAGE_TYPES:
            raise InputError(f"{self.source}: unsupported storage type {kind!r:.60}")
        return StorageRef(kind.name, str(key), str(location), int(numel))


def loads(data: bytes, source: str) -> Any:
    """The object tree of a checkpoint pickle, tensors as :class:`TensorRef`."""
    try:
        return SafeUnpickler(data, source).load()
    except (UnsafeCheckpoint, InputError):
        raise
    except Exception as exc:
        raise InputError(
            f"{source}: the checkpoint's pickle is damaged ({type(exc).__name__}: {exc})"
        ) from exc


_REBUILD_TENSOR = GlobalRef("torch._utils", "_rebuild_tensor_v2")
_REBUILD_PARAMETER = GlobalRef("torch._utils", "_rebuild_parameter")


class _Pickler(pickle._Pickler):  # the Python pickler: it lets us write torch's globals by name
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, StorageRef):
            return ("storage", GlobalRef("torch", obj.type_name), obj.key, obj.location, obj.numel)
        return None

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        if isinstance(obj, GlobalRef):
            memo = self.memo.get(id(obj))
            if memo is not None:
                self.write(self.get(memo[0]))
                return
            self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
            self.memoize(obj)
            return
        if isinstance(obj, Call):
            self.save_reduce(obj.func, obj.args, obj=obj)
            return
        if isinstance(obj, TensorRef):
            args = (obj.storage, obj.offset, tuple(obj.size), tuple(obj.stride), obj.requires_grad, obj.hooks)
            self.save_reduce(_REBUILD_TENSOR, args + tuple(obj.extra), obj=obj)
            return
        if isinstance(obj, ParamRef):
            self.save_reduce(_REBUILD_PARAMETER, (obj.data, obj.requires_grad, obj.hooks), obj=obj)
            return
        super().save(obj, save_persistent_id)


def dumps(tree: Any) -> bytes:
    """Pickle a tree of placeholders back into torch's format (protocol 2, like torch.save)."""
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=2).dump(tree)
    return buffer.getvalue()
