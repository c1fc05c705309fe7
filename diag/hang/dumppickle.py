"""A flight-recorder dump's pickle, read fast and strictly: containers and scalars only.

torch's recorder pickles (``_dump_fr_trace()``, C++'s pickler, protocol 2) hold dicts,
lists, tuples, text, numbers, booleans and None, and nothing else — no global, no call,
no set. :func:`loads` reads exactly that subset, and Python pickles of the same subset
(protocols 2 to 5), in one loop over the bytes: a 20,000-entry dump with 29 frames an
entry (1.9 million opcodes, 3.5 MB) in about a second where the general bounded
unpickler (:class:`gpudiag.unpickle.BoundedUnpickler`, which must also run torch's
checkpoints' calls) took several.

What makes an untrusted pickle dangerous cannot happen here: no global is resolved and
nothing is called; dict keys must be text, whole numbers below 2**60 or None/booleans,
whose hashes no pickle can make collide (text hashes are salted; small numbers hash to
themselves) — tuples, bytes and floats as keys are refused, so no crafted key makes
hashing exponential or a dict quadratic; opcodes are counted (``MAX_OPS``), marks nest at
most ``MAX_DEPTH`` deep. Anything else is :class:`~gpudiag.errors.InputError` with the
reason (``TooComplex`` past a bound). Shared references stay shared (the memo): the
callers' walks must count them (:func:`gpudiag.hang.reader.frames_of` does).
"""

from __future__ import annotations

import struct
from typing import Any

from gpudiag.errors import InputError
from gpudiag.unpickle import MAX_DEPTH, MAX_OPS, TooComplex, one_line

_KEY_LIMIT = 2**60
_NAMES = {
    0x63: "GLOBAL",
    0x93: "STACK_GLOBAL",
    0x52: "REDUCE",
    0x62: "BUILD",
    0x69: "INST",
    0x6F: "OBJ",
    0x81: "NEWOBJ",
    0x92: "NEWOBJ_EX",
    0x8F: "EMPTY_SET",
    0x90: "ADDITEMS",
    0x91: "FROZENSET",
    0x82: "EXT1",
    0x83: "EXT2",
    0x84: "EXT4",
}


class _Refused(Exception):
    """Why the pickle is not a dump (one phrase)."""


def _key(key: Any) -> Any:
    if isinstance(key, str) or key is None or isinstance(key, bool):
        return key
    if isinstance(key, int) and -_KEY_LIMIT < key < _KEY_LIMIT:
        return key
    raise _Refused(f"a dict key of type {type(key).__name__}, which no dump holds")


def _set_items(target: Any, items: list[Any]) -> None:
    if not isinstance(target, dict):
        raise _Refused(f"SETITEMS on a {type(target).__name__}")
    for i in range(0, len(items) - 1, 2):
        key = items[i]
        target[key if type(key) is str else _key(key)] = items[i + 1]


def loads(data: bytes, source: str, kind: str = "flight-recorder dump") -> Any:
    """The object ``data`` pickles (module docstring); InputError naming ``source`` if it
    is not a dump's kind of pickle, TooComplex past a bound."""
    try:
        return _loads(data, source, kind)
    except _Refused as exc:
        raise InputError(f"{source}: the dump's pickle is damaged or unsafe ({exc})") from None
    except (IndexError, struct.error, UnicodeDecodeError, ValueError, TypeError, KeyError) as exc:
        raise InputError(
            f"{source}: the dump's pickle is damaged or unsafe ({type(exc).__name__}: {one_line(str(exc))})"
        ) from None


def _loads(data: bytes, source: str, kind: str) -> Any:  # (one loop, one branch per opcode)
    stack: list[Any] = []
    marks: list[list[Any]] = []
    memo: dict[int, Any] = {}
    unpack_from = struct.unpack_from
    i = 0
    ops = 0
    n = len(data)
    while True:
        if i >= n:
            raise _Refused("it ends before its STOP")
        op = data[i]
        i += 1
        ops += 1
        if ops > MAX_OPS:
            raise TooComplex(source, f"more than {MAX_OPS} pickle operations", kind)
        if op == 0x68:  # BINGET
            stack.append(memo[data[i]])
            i += 1
        elif op == 0x28:  # MARK
            marks.append(stack)
            if len(marks) > MAX_DEPTH:
                raise TooComplex(source, f"containers nested more than {MAX_DEPTH} deep", kind)
            stack = []
        elif op == 0x5D:  # EMPTY_LIST
            stack.append([])
        elif op == 0x65:  # APPENDS
            items = stack
            stack = marks.pop()
            if not isinstance(stack[-1], list):
                raise _Refused(f"APPENDS to a {type(stack[-1]).__name__}")
            stack[-1].extend(items)
        elif op == 0x4B:  # BININT1
            stack.append(data[i])
            i += 1
        elif op == 0x4D:  # BININT2
            stack.append(data[i] | data[i + 1] << 8)
            i += 2
        elif op == 0x4E:  # NONE
            stack.append(None)
        elif op == 0x7D:  # EMPTY_DICT
            stack.append({})
        elif op == 0x75:  # SETITEMS
            items = stack
            stack = marks.pop()
            _set_items(stack[-1], items)
        elif op == 0x4A:  # BININT
            stack.append(unpack_from("<i", data, i)[0])
            i += 4
        elif op == 0x86:  # TUPLE2
            stack[-2:] = [(stack[-2], stack[-1])]
        elif op == 0x8A or op == 0x8B:  # LONG1, LONG4
            size = data[i] if op == 0x8A else unpack_from("<i", data, i)[0]
            i += 1 if op == 0x8A else 4
            if size < 0 or i + size > n:
                raise _Refused("a number longer than the pickle")
            stack.append(int.from_bytes(data[i : i + size], "little", signed=True))
            i += size
        elif op == 0x88:  # NEWTRUE
            stack.append(True)
        elif op == 0x89:  # NEWFALSE
            stack.append(False)
        elif op == 0x71:  # BINPUT
            memo[data[i]] = stack[-1]
            i += 1
        elif op == 0x72:  # LONG_BINPUT
            memo[unpack_from("<I", data, i)[0]] = stack[-1]
            i += 4
        elif op == 0x94:  # MEMOIZE
            memo[len(memo)] = stack[-1]
        elif op == 0x6A:  # LONG_BINGET
            stack.append(memo[unpack_from("<I", data, i)[0]])
            i += 4
        elif op in (0x58, 0x8C, 0x8D, 0x42, 0x43, 0x8E):  # text and bytes
            width = {0x58: 4, 0x8C: 1, 0x8D: 8, 0x42: 4, 0x43: 1, 0x8E: 8}[op]
            size = int.from_bytes(data[i : i + width], "little")
            i += width
            if i + size > n:
                raise _Refused("a string longer than the pickle")
            raw = data[i : i + size]
            i += size
            stack.append(raw.decode("utf-8", "surrogatepass") if op in (0x58, 0x8C, 0x8D) else bytes(raw))
        elif op == 0x47:  # BINFLOAT
            stack.append(unpack_from(">d", data, i)[0])
            i += 8
        elif op == 0x29:  # EMPTY_TUPLE
            stack.append(())
        elif op == 0x85:  # TUPLE1
            stack[-1] = (stack[-1],)
        elif op == 0x87:  # TUPLE3
            stack[-3:] = [(stack[-3], stack[-2], stack[-1])]
        elif op == 0x74:  # TUPLE
            items = stack
            stack = marks.pop()
            stack.append(tuple(items))
        elif op == 0x6C:  # LIST
            items = stack
            stack = marks.pop()
            stack.append(items)
        elif op == 0x64:  # DICT
            items = stack
            stack = marks.pop()
            made: dict[Any, Any] = {}
            _set_items(made, items)
            stack.append(made)
        elif op == 0x61:  # APPEND
            value = stack.pop()
            if not isinstance(stack[-1], list):
                raise _Refused(f"APPEND to a {type(stack[-1]).__name__}")
            stack[-1].append(value)
        elif op == 0x73:  # SETITEM
            value = stack.pop()
            key = stack.pop()
            _set_items(stack[-1], [key, value])
        elif op == 0x30:  # POP
            stack.pop()
        elif op == 0x31:  # POP_MARK
            stack = marks.pop()
        elif op == 0x32:  # DUP
            stack.append(stack[-1])
        elif op == 0x80:  # PROTO
            i += 1
        elif op == 0x95:  # FRAME (the frames' bytes follow in line)
            i += 8
        elif op == 0x2E:  # STOP
            if len(stack) != 1 or marks:
                raise _Refused("its stack is not one object at STOP")
            return stack[0]
        elif op == 0x93 and len(stack) >= 2 and all(isinstance(s, str) for s in stack[-2:]):
            raise _Refused(
                f"a global ({one_line(stack[-2], 60)}.{one_line(stack[-1], 60)}), which no dump holds"
            )
        elif op == 0x63:
            end = data.find(b"\n", i, i + 200)
            module = data[i:end].decode("ascii", "replace") if end > 0 else "?"
            raise _Refused(f"a global ({one_line(module, 60)}.…), which no dump holds")
        elif op in (0x50, 0x51):
            raise _Refused("a persistent id, which no dump holds")
        else:
            raise _Refused(f"opcode {_NAMES.get(op, hex(op))}, which no dump holds")
