"""Read an untrusted pickle with bounded work, optionally by torch's weights-only rules.

The C unpickler is fast but a small pickle can make it, or any later walk of what it
returns, run for hours: a tuple built as a DAG of shared references (``T1 = (T0, T0)``,
``T2 = (T1, T1)``…) is hashed as a tree when it becomes a dict key; keys crafted to share
one hash make a dict quadratic; an allowed builtin called on ``range(10**10)`` or
``str`` of a DAG allocates without limit; and a DAG of lists, 2 KB on disk, is a tree of
2**60 nodes to every walk. :class:`BoundedUnpickler` is Python's own unpickler
(``pickle._Unpickler``) with every opcode counted, every hashable container weighed as
it is built, every hashing and every call of a builtin checked; :func:`check_tree`
measures what it returned (tree size, nesting, cycles) in time linear in its distinct
objects. Beyond a limit: :class:`TooComplex`, a one-line InputError (exit 2).

With ``weights_only`` it also applies the rules of ``torch.load(weights_only=True)``
(torch/_weights_only_unpickler.py): only the opcodes that unpickler implements, APPEND
only to lists, SETITEM only to dicts, BUILD only on an OrderedDict; the globals are
checked by the subclass's ``find_class``. A pickle it accepts is one torch accepts.
"""

from __future__ import annotations

import collections
import io
import pickle
from collections.abc import Collection, Iterable
from typing import Any

from gpudiag.errors import InputError

#: Python's pure-Python unpickler, which this module extends (typeshed describes only the
#: public C one, so it is typed as Any here).
_PyUnpickler: Any = pickle._Unpickler

#: Opcodes executed per pickle (a tensor in a state dict takes about 25; one costs about a
#: microsecond). Pickles of real checkpoints use far fewer.
MAX_OPS = 4_000_000
#: Objects a walk of the tree visits (a shared object counts once per reference to it).
MAX_NODES = 4_000_000
#: Nesting of containers (our walks and the pickler recurse once per level).
MAX_DEPTH = 100
#: Size of a tuple (or other hashable container) as a tree: what hashing it costs.
MAX_KEY_NODES = 10_000
#: Keys of one dict or set with the same hash (crafted collisions make a dict quadratic).
MAX_SAME_HASH = 16

#: The opcodes torch's weights-only unpickler implements (torch 2.4 to 2.15).
WEIGHTS_ONLY_OPCODES = frozenset(
    op[0]
    for op in (
        pickle.GLOBAL,
        pickle.NEWOBJ,
        pickle.REDUCE,
        pickle.BUILD,
        pickle.APPEND,
        pickle.APPENDS,
        pickle.SETITEM,
        pickle.SETITEMS,
        pickle.MARK,
        pickle.TUPLE,
        pickle.TUPLE1,
        pickle.TUPLE2,
        pickle.TUPLE3,
        pickle.NONE,
        pickle.NEWFALSE,
        pickle.NEWTRUE,
        pickle.EMPTY_TUPLE,
        pickle.EMPTY_LIST,
        pickle.EMPTY_DICT,
        pickle.EMPTY_SET,
        pickle.BININT,
        pickle.BININT1,
        pickle.BININT2,
        pickle.BINFLOAT,
        pickle.BINUNICODE,
        pickle.SHORT_BINSTRING,
        pickle.BINPERSID,
        pickle.BINGET,
        pickle.LONG_BINGET,
        pickle.BINPUT,
        pickle.LONG_BINPUT,
        pickle.LONG1,
        pickle.PROTO,
        pickle.STOP,
    )
)

_HASHABLE_CONTAINERS = (tuple, frozenset)
_SCALARS = (str, bytes, int, float, bool, complex, type(None))
_CONSUMERS = (set, frozenset, list, tuple, dict, bytearray, collections.OrderedDict)
_HASHING = (set, frozenset, dict, collections.OrderedDict)


def one_line(text: str, limit: int = 200) -> str:
    """``text`` from a file, fit for a one-line message: control characters escaped, cut."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text[:limit])


class TooComplex(InputError):
    """The pickle needs more work than any file of its ``kind`` (a checkpoint, a
    flight-recorder dump) does: refused before it is done."""

    def __init__(self, source: str, what: str, kind: str = "pickle"):
        super().__init__(f"{source}: the {kind} is too complex to read safely ({what})")


def _children(obj: Any) -> Collection[Any]:
    """What a walk of the tree descends into: containers, placeholders' parts, attributes
    an OrderedDict carries (a state dict's ``_metadata``)."""
    if isinstance(obj, dict):
        out: list[Any] = [*obj.keys(), *obj.values()]
        if type(obj) is not dict and getattr(obj, "__dict__", None):
            out.append(vars(obj))
        return out
    if isinstance(obj, (list, tuple, set, frozenset)):
        return obj
    parts = getattr(obj, "tree_parts", None)
    return parts() if callable(parts) else ()


def _text(objs: Iterable[Any]) -> int:
    return sum(len(o) for o in objs if isinstance(o, (str, bytes)))


def check_tree(
    tree: Any, source: str, kind: str = "pickle", max_text: int | None = None, max_nodes: int = MAX_NODES
) -> None:
    """Refuse a tree that is cyclic, nested deeper than MAX_DEPTH, or has more than
    MAX_NODES nodes when walked as a tree; linear in the distinct objects. ``kind`` names
    the file in the error (``"checkpoint"``); ``max_nodes`` replaces MAX_NODES. With
    ``max_text``, also one whose strings and bytes, each counted once per reference to it
    (what printing the tree costs), hold more than ``max_text`` characters."""
    done: dict[int, tuple[int, int, int]] = {}  # id -> (tree size, depth, text)
    keep: list[Any] = []  # the objects whose ids are in done stay alive
    active: set[int] = set()
    stack: list[tuple[Any, list[Any] | None]] = [(tree, None)]
    while stack:
        obj, kids = stack[-1]
        if kids is None:
            if id(obj) in done:
                stack.pop()
                continue
            kids = [k for k in _children(obj) if not isinstance(k, _SCALARS)]
            stack[-1] = (obj, kids)
            active.add(id(obj))
            if len(active) > MAX_DEPTH:
                raise TooComplex(source, f"containers nested more than {MAX_DEPTH} deep", kind)
            for kid in kids:
                if id(kid) in active:
                    raise TooComplex(source, "a container holds itself", kind)
                if id(kid) not in done:
                    stack.append((kid, None))
            continue
        stack.pop()
        active.discard(id(obj))
        children = _children(obj)
        size = 1 + len(children) - len(kids) + sum(done[id(k)][0] for k in kids)
        depth = 1 + max((done[id(k)][1] for k in kids), default=0)
        text = _text(children) + sum(done[id(k)][2] for k in kids) if max_text is not None else 0
        if size > max_nodes:
            raise TooComplex(
                source, f"more than {max_nodes} objects when walked, shared references counted", kind
            )
        if max_text is not None and text > max_text:
            raise TooComplex(
                source, f"more than {max_text >> 20} MiB of text, shared references counted", kind
            )
        done[id(obj)] = (size, depth, text)
        keep.append(obj)


def _weighed_op(op: Any) -> Any:
    """An opcode that may create a tuple (or another hashable container): weigh it."""

    def run(self: BoundedUnpickler) -> None:
        op(self)
        top = self.stack[-1]
        if isinstance(top, self.weighed_types):
            self._weigh(top)

    return run


def _refused_op(code: int) -> Any:
    def run(self: BoundedUnpickler) -> None:
        raise pickle.UnpicklingError(f"Unsupported operand {code} (torch.load(weights_only=True) refuses it)")

    return run


class BoundedUnpickler(_PyUnpickler):
    """Python's unpickler, every step bounded (module docstring). Subclasses restrict
    ``find_class`` and ``persistent_load``; :meth:`check_call` guards calls."""

    weighed_types: tuple[type, ...] = _HASHABLE_CONTAINERS
    #: What the file is, in errors: "the checkpoint is too complex…".
    kind = "pickle"

    def __init__(self, file: bytes | io.IOBase, source: str, *, weights_only: bool = False):
        super().__init__(io.BytesIO(file) if isinstance(file, bytes) else file)
        self.source = source
        self.weights_only = weights_only
        self.work = 0  # hashing and builtin calls, charged against MAX_OPS
        self.weights: dict[int, tuple[int, int, Any]] = {}  # id -> (tree size, depth, object)
        self.hashes: dict[int, tuple[Any, collections.Counter[int]]] = {}
        self.dispatch = _WEIGHTS_ONLY if weights_only else _BOUNDED

    # -- weights and hashing -------------------------------------------------------------------

    def load(self) -> Any:
        """``pickle._Unpickler.load`` (the same in Python 3.10 to 3.13) counting opcodes."""
        self._unframer = pickle._Unframer(self._file_read, self._file_readline)  # type: ignore[attr-defined]
        self.read = self._unframer.read
        self.readinto = self._unframer.readinto
        self.readline = self._unframer.readline
        self.metastack: list[Any] = []
        self.stack: list[Any] = []
        self.append = self.stack.append
        self.proto = 0
        read = self.read
        dispatch = self.dispatch
        ops = 0
        try:
            while True:
                key = read(1)
                if not key:
                    raise EOFError
                ops += 1
                if ops > MAX_OPS:
                    raise TooComplex(self.source, f"more than {MAX_OPS} pickle operations", self.kind)
                dispatch[key[0]](self)
        except pickle._Stop as stop:  # type: ignore[attr-defined]
            return stop.value

    def _weight(self, obj: Any) -> tuple[int, int]:
        entry = self.weights.get(id(obj))
        return (entry[0], entry[1]) if entry is not None and entry[2] is obj else (1, 0)

    def _weigh(self, obj: Any) -> None:
        weights = self.weights
        entry = weights.get(id(obj))
        if entry is not None and entry[2] is obj:
            return
        size, depth = 1, 1
        for part in obj if isinstance(obj, _HASHABLE_CONTAINERS) else obj.args:
            entry = weights.get(id(part))
            if entry is not None and entry[2] is part:
                size += entry[0]
                depth = max(depth, entry[1] + 1)
            else:
                size += 1
        if size > MAX_KEY_NODES or depth > MAX_DEPTH:
            raise TooComplex(
                self.source, f"a tuple of more than {MAX_KEY_NODES} objects or {MAX_DEPTH} deep", self.kind
            )
        weights[id(obj)] = (size, depth, obj)

    def check_keys(self, target: Any, keys: Iterable[Any]) -> None:
        """Charge hashing ``keys`` (into ``target``) and refuse crafted hash collisions."""
        counter = None
        for key in keys:
            self.work += self._weight(key)[0]
            if isinstance(key, (str, bytes)) or (type(key) is int and -(2**60) < key < 2**60):
                continue  # str and bytes hashes are salted; small ints hash to themselves
            if counter is None:
                entry = self.hashes.get(id(target))
                if entry is None or entry[0] is not target:
                    entry = (target, collections.Counter())
                    self.hashes[id(target)] = entry
                counter = entry[1]
            h = hash(key)
            counter[h] += 1
            if counter[h] > MAX_SAME_HASH:
                raise TooComplex(self.source, f"more than {MAX_SAME_HASH} keys with the same hash", self.kind)
        if self.work > MAX_OPS:
            raise TooComplex(self.source, f"more than {MAX_OPS} pickle operations", self.kind)

    def check_call(self, func: Any, args: tuple[Any, ...]) -> None:
        """Refuse calls whose cost is not bounded by the pickle's size: a consumer of a
        huge range, ``str`` of a container, hashing crafted keys."""
        if func is str or func in (int, float, complex, bool):
            if not all(isinstance(a, _SCALARS) for a in args):
                raise pickle.UnpicklingError(f"{func.__name__}() of a container")
        elif func in _CONSUMERS and args:
            first = args[0]
            if isinstance(first, range) or (func is bytearray and isinstance(first, int)):
                n = len(first) if isinstance(first, range) else first
                self.work += max(n, 0) // (16 if func is bytearray else 1)
                if self.work > MAX_OPS:
                    raise TooComplex(self.source, f"{func.__name__}() of {n} items", self.kind)
            elif not isinstance(first, (list, tuple, set, frozenset, dict, str, bytes, bytearray)):
                raise pickle.UnpicklingError(f"{func.__name__}() of {type(first).__name__}")
            if func in _HASHING:
                items = first.keys() if isinstance(first, dict) else first
                if func in (dict, collections.OrderedDict) and not isinstance(first, dict):
                    items = [p[0] for p in first if isinstance(p, (tuple, list)) and p]
                self.check_keys(object(), items)

    # -- opcodes that hash, call or mutate ---------------------------------------------------------

    def load_reduce(self) -> None:
        args = self.stack[-1]
        if not isinstance(args, tuple):
            raise pickle.UnpicklingError("REDUCE arguments are not a tuple")
        self.check_call(self.stack[-2], args)
        if self.weights_only:
            self._check_weights_only_call(self.stack[-2])
        super().load_reduce()

    def load_newobj(self) -> None:
        args = self.stack[-1]
        if not isinstance(args, tuple) or not isinstance(self.stack[-2], type):
            raise pickle.UnpicklingError("NEWOBJ needs a class and a tuple")
        self.check_call(self.stack[-2], args)
        if self.weights_only:
            self._check_weights_only_call(self.stack[-2])
        super().load_newobj()

    def load_newobj_ex(self) -> None:
        if self.stack[-1]:
            raise pickle.UnpicklingError("NEWOBJ_EX with keyword arguments")
        self.check_call(self.stack[-3], self.stack[-2])
        super().load_newobj_ex()

    def _instantiate(self, klass: Any, args: list[Any]) -> None:
        self.check_call(klass, tuple(args))
        super()._instantiate(klass, args)

    def _check_weights_only_call(self, func: Any) -> None:
        """Hook for subclasses: torch calls only the globals it allows."""

    def load_setitem(self) -> None:
        target = self.stack[-3]
        self._check_target(target, dict, "SETITEM")
        self.check_keys(target, [self.stack[-2]])
        super().load_setitem()

    def load_setitems(self) -> None:
        target = self.metastack[-1][-1] if self.metastack and self.metastack[-1] else None
        self._check_target(target, dict, "SETITEMS")
        self.check_keys(target, self.stack[0::2])
        super().load_setitems()

    def load_additems(self) -> None:
        target = self.metastack[-1][-1] if self.metastack and self.metastack[-1] else None
        self.check_keys(target, self.stack)
        super().load_additems()

    def load_frozenset(self) -> None:
        self.check_keys(object(), self.stack)
        super().load_frozenset()

    def load_append(self) -> None:
        self._check_target(self.stack[-2], list, "APPEND")
        super().load_append()

    def load_appends(self) -> None:
        target = self.metastack[-1][-1] if self.metastack and self.metastack[-1] else None
        self._check_target(target, list, "APPENDS")
        super().load_appends()

    def load_build(self) -> None:
        inst = self.stack[-2]
        numpy = type(inst).__module__.startswith("numpy") and not self.weights_only  # a dtype's state
        if type(inst) is not collections.OrderedDict and not numpy:
            raise pickle.UnpicklingError(f"BUILD of a {type(inst).__name__} (only of an OrderedDict)")
        state = self.stack[-1]
        for part in state if isinstance(state, tuple) else (state,):
            if isinstance(part, dict):
                self.check_keys(object(), part.keys())
        super().load_build()

    def _check_target(self, target: Any, kind: type, op: str) -> None:
        """APPEND only to a list, SETITEM only to a dict (weights-only: exactly those types)."""
        exact = (list,) if kind is list else (dict, collections.OrderedDict)
        if not isinstance(target, kind) or (self.weights_only and type(target) not in exact):
            raise pickle.UnpicklingError(f"{op} on a {type(target).__name__}")


_CREATING = frozenset(
    op[0]
    for op in (
        pickle.TUPLE,
        pickle.TUPLE1,
        pickle.TUPLE2,
        pickle.TUPLE3,
        pickle.REDUCE,
        pickle.NEWOBJ,
        pickle.NEWOBJ_EX,
        pickle.FROZENSET,
        pickle.INST,
        pickle.OBJ,
    )
)
_BOUNDED: dict[int, Any] = {}
_WEIGHTS_ONLY: dict[int, Any] = {}
for _code, _op in _PyUnpickler.dispatch.items():
    _op = getattr(BoundedUnpickler, _op.__name__, _op)  # our overrides of load_*
    _BOUNDED[_code] = _weighed_op(_op) if _code in _CREATING else _op
    _WEIGHTS_ONLY[_code] = _BOUNDED[_code] if _code in WEIGHTS_ONLY_OPCODES else _refused_op(_code)
