"""Read and rewrite the pickle inside a torch checkpoint without loading any tensor data.

A torch zip checkpoint (``torch.save``) holds ``<name>/data.pkl`` — the object tree, in
which every tensor is a call ``torch._utils._rebuild_tensor_v2(storage, offset, size,
stride, …)`` whose storage is a *persistent id* naming a record ``<name>/data/<key>`` —
and the records themselves. :class:`SafeUnpickler` rebuilds the tree with
:class:`TensorRef` placeholders (dtype, shape, storage key: no bytes read) and refuses
anything outside a small allowlist of globals, so a malicious pickle never runs code; its
work is bounded (:mod:`gpudiag.unpickle`). :func:`dumps` writes a tree of placeholders back as
the same calls and persistent ids — an object met twice (a tied weight) as a reference to
the first, as torch writes it — so torch loads the result exactly as it loaded the
original. ``loads(…, weights_only=True)`` reads by the rules of
``torch.load(weights_only=True)``: what it accepts, torch accepts.
"""

from __future__ import annotations

import codecs
import collections
import io
import pickle
import pickletools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from gpudiag.errors import InputError
from gpudiag.unpickle import BoundedUnpickler, TooComplex, check_tree, one_line

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
        shown = ", ".join(one_line(n, 80) for n in names[:8]) + (" …" if len(names) > 8 else "")
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

    def tree_parts(self) -> list[Any]:
        """What a walk of the tree (and the pickler) descends into."""
        return [self.hooks, *self.extra]


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

    def tree_parts(self) -> list[Any]:
        return [self.data, self.hooks]


def tensor_refs(tree: Any, path: str = "") -> Iterator[tuple[str, TensorRef]]:
    """Every tensor placeholder in ``tree`` (a parameter's data) with its path, in order;
    a tensor met under several paths is given under each."""
    if isinstance(tree, ParamRef):
        tree = tree.data
    if isinstance(tree, TensorRef):
        yield path, tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from tensor_refs(v, f"{path}/{k}")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from tensor_refs(v, f"{path}/{i}")


def is_tensor(value: Any) -> bool:
    """A tensor placeholder, or a real tensor (checkpoints loaded by torch itself)."""
    if isinstance(value, (TensorRef, ParamRef)):
        return True
    import sys

    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _ints(value: Any, minimum: int | None) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(
        type(v) is int and (minimum is None or v >= minimum) for v in value
    ):
        raise pickle.UnpicklingError("a tensor's size or stride is not a list of integers")
    return tuple(value)


def _rebuild_tensor(
    storage: StorageRef,
    offset: int,
    size: Any,
    stride: Any,
    requires_grad: bool = False,
    hooks: Any = None,
    *extra: Any,
) -> TensorRef:
    """The placeholder for ``torch._utils._rebuild_tensor_v2``, with torch's own checks:
    a storage, integer offset, size and stride, the view inside the storage."""
    size, stride = _ints(size, 0), _ints(stride, None)
    if not isinstance(storage, StorageRef) or type(offset) is not int or offset < 0:
        raise pickle.UnpicklingError("a tensor without a storage or with a bad offset")
    if len(size) != len(stride) or len(extra) > 1 or (extra and not isinstance(extra[0], (dict, type(None)))):
        raise pickle.UnpicklingError("a tensor with inconsistent shape, stride or metadata")
    if all(size):  # a tensor with a 0-size dimension reads nothing
        last = offset + sum((n - 1) * s for n, s in zip(size, stride, strict=True))
        if min(stride, default=0) < 0 or last >= storage.numel:
            raise pickle.UnpicklingError("a tensor view runs past the end of its storage")
    return TensorRef(
        storage,
        offset,
        size,
        stride,
        bool(requires_grad),
        collections.OrderedDict() if hooks is None else hooks,
        extra,
    )


def _rebuild_parameter(data: TensorRef, requires_grad: bool, hooks: Any) -> ParamRef:
    if not isinstance(data, TensorRef):
        raise pickle.UnpicklingError("a parameter without a tensor")
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

    def tree_parts(self) -> tuple[Any, ...]:
        return self.args


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


#: The globals above that ``torch.load(weights_only=True)`` also allows by default.
WEIGHTS_ONLY_GLOBALS = frozenset(
    {
        "collections.OrderedDict",
        "torch._utils._rebuild_tensor_v2",
        "torch._utils._rebuild_parameter",
        "_codecs.encode",
        "builtins.set",
        "builtins.bytearray",
        "builtins.complex",
        "__builtin__.set",
        "__builtin__.bytearray",
        "__builtin__.complex",
        "torch.Size",
        "torch.device",
        *(f"torch.{n}" for n in STORAGE_TYPES),
        *(f"torch.{n}" for n in TORCH_NAMES if n not in {"float", "double", "half", "long", "int", "short"}),
    }
    - {"torch.cfloat", "torch.cdouble"}
)


class SafeUnpickler(BoundedUnpickler):
    """Unpickles a checkpoint's object tree with placeholders for tensors; refuses every
    global outside the allowlist (with ``weights_only``, outside torch's); bounded."""

    weighed_types = (tuple, frozenset, Call)
    kind = "checkpoint"

    def __init__(
        self, data: bytes | io.IOBase, source: str, *, weights_only: bool = False, legacy: bool = False
    ):
        super().__init__(data, source, weights_only=weights_only)
        self.data = data
        self.legacy = legacy  # a legacy (not zip) torch file: storage references carry a 6th item

    def find_class(self, module: str, name: str) -> Any:
        found = _allowed(module, name)
        if found is None or (self.weights_only and f"{module}.{name}" not in WEIGHTS_ONLY_GLOBALS):
            unsafe = []
            if isinstance(self.data, bytes):
                unsafe = [g for g in globals_in(self.data) if _allowed(*g.rsplit(".", 1)) is None]
            raise UnsafeCheckpoint(self.source, unsafe or [f"{module}.{name}"])
        return found

    def _check_weights_only_call(self, func: Any) -> None:
        if isinstance(func, GlobalRef) and func.name not in ("Size", "device"):
            raise pickle.UnpicklingError(f"a call of torch.{func.name} (torch refuses it)")

    def persistent_load(self, pid: Any) -> StorageRef:
        if not (isinstance(pid, tuple) and len(pid) in (5, 6) and pid[0] == "storage"):
            raise InputError(f"{self.source}: unknown storage reference ({type(pid).__name__})")
        kind, key, location, numel = pid[1:5]
        if not isinstance(kind, GlobalRef) or kind.name not in STORAGE_TYPES:
            raise InputError(f"{self.source}: unsupported storage type ({type(kind).__name__})")
        if len(pid) == 6 and not self.legacy:
            raise InputError(f"{self.source}: a legacy storage reference in a zip checkpoint")
        if not (isinstance(key, str) and isinstance(location, str) and type(numel) is int and numel >= 0):
            raise InputError(f"{self.source}: damaged storage reference")
        return StorageRef(kind.name, key, location, numel)


def loads(data: bytes | io.IOBase, source: str, *, weights_only: bool = False, legacy: bool = False) -> Any:
    """The object tree of a checkpoint pickle, tensors as :class:`TensorRef`; refused with
    one line when damaged, unsafe or too complex (its work and its walks are bounded).
    ``data`` may be a file positioned at a pickle (a legacy torch file holds several)."""
    try:
        tree = SafeUnpickler(data, source, weights_only=weights_only, legacy=legacy).load()
    except (UnsafeCheckpoint, InputError):
        raise
    except RecursionError as exc:
        raise TooComplex(source, "nested too deep", "checkpoint") from exc
    except Exception as exc:
        raise InputError(
            f"{source}: the checkpoint's pickle is damaged ({type(exc).__name__}: {one_line(str(exc))})"
        ) from exc
    check_tree(tree, source, "checkpoint")
    return tree


_REBUILD_TENSOR = GlobalRef("torch._utils", "_rebuild_tensor_v2")
_REBUILD_PARAMETER = GlobalRef("torch._utils", "_rebuild_parameter")


#: Python's pure-Python pickler (typeshed describes only the public C one: typed as Any).
_PyPickler: Any = pickle._Pickler


class _Pickler(_PyPickler):  # the Python pickler: it lets us write torch's globals by name
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, StorageRef):
            return ("storage", GlobalRef("torch", obj.type_name), obj.key, obj.location, obj.numel)
        return None

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        if isinstance(obj, (TensorRef, ParamRef, Call)) and id(obj) in self.memo:
            # Met before (a tied weight): a reference to the first, as torch writes it. Without
            # this the Python pickler writes it again, then POP + BINGET, which torch's
            # weights-only unpickler refuses ("Unsupported operand 48").
            self.write(self.get(self.memo[id(obj)][0]))
            return
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
