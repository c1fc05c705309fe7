"""Check what ``convert`` wrote before it is kept, and say what it could not carry.

A torch output is read back by the rules of ``torch.load(weights_only=True)``
(:mod:`gpudiag.unpickle`): it is ``verified`` only if that read succeeds and every tensor — its
storage record, dtype, offset, shape, stride, and which tensors are one object — is the
input's. An output that weights-only loading refuses is kept only when it refuses the
input the same way (the output is then as loadable as the input was, and says so).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpudiag.errors import InputError
from gpudiag.repro.checkpoint import keys as K
from gpudiag.repro.checkpoint import pickles
from gpudiag.repro.checkpoint.pickles import UnsafeCheckpoint


def tensor_map(tree: Any) -> dict[str, tuple[Any, ...]]:
    """Every tensor in the tree by its path: (storage record, dtype, offset, shape, stride,
    the first path where the same tensor object appears)."""
    first: dict[int, str] = {}
    out = {}
    for path, ref in pickles.tensor_refs(tree):
        same = first.setdefault(id(ref), path)
        out[path] = (ref.storage.key, ref.dtype, ref.offset, ref.size, ref.stride, same)
    return out


def _why(exc: InputError) -> str:
    if isinstance(exc, UnsafeCheckpoint):
        return "it holds " + ", ".join(exc.names[:4])
    return str(exc).split(": ", 1)[-1]


def _refusal(exc: InputError, trusted: bool) -> str:
    source = "IN was read with --trust-checkpoint" if trusted else "as IN does"
    return (
        f"not verified for torch.load(weights_only=True): {_why(exc)} ({source}); load OUT "
        "with torch.serialization.add_safe_globals for those objects, or weights_only=False "
        "if you trust it"
    )


def weights_only_refusal(pickle_bytes: bytes, dst: Path, *, trusted: bool = False) -> str | None:
    """None if torch.load(weights_only=True) reads this pickle; otherwise a note saying why."""
    try:
        pickles.loads(pickle_bytes, str(dst), weights_only=True)
    except InputError as exc:
        return _refusal(exc, trusted)
    return None


def read_back(written: bytes, original: bytes, expected: dict[str, tuple[Any, ...]], dst: Path) -> str | None:
    """Read the written pickle by weights-only rules and compare its tensors with
    ``expected``; the refusal note when weights-only loading refuses the input as well."""
    refused = None
    try:
        back = pickles.loads(written, str(dst), weights_only=True)
    except InputError as exc:
        if weights_only_refusal(original, dst) is None:
            raise InputError(f"{dst}: verification failed: torch.load(weights_only=True) refuses it") from exc
        refused = _refusal(exc, trusted=False)
        back = pickles.loads(written, str(dst))
    if tensor_map(back) != expected:
        raise InputError(f"{dst}: verification failed: the tensors read back differ from the input's")
    return refused


def _real_tensors(tree: Any) -> list[Any]:
    import torch

    out: list[Any] = []

    def walk(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)

    walk(tree)
    return out


def sharing(tensors: list[Any]) -> list[tuple[int, int]]:
    """For each tensor: the index of the first that is the same object, and of the first
    on the same storage (empty storages are their own)."""
    same: dict[int, int] = {}
    storage: dict[int, int] = {}
    out = []
    for i, t in enumerate(tensors):
        s = t.untyped_storage()
        key = s.data_ptr() if s.nbytes() else -1 - i
        out.append((same.setdefault(id(t), i), storage.setdefault(key, i)))
    return out


def same_tensors(a: Any, b: Any) -> bool:
    """The same tensors in the same places, equal values, shared as in ``a``."""
    import torch

    left, right = _real_tensors(a), _real_tensors(b)
    return (
        len(left) == len(right)
        and all(
            x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
            for x, y in zip(left, right, strict=True)
        )
        and sharing(left) == sharing(right)
        and _same_layout(a, b)
    )


def _same_layout(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same_layout(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (
            isinstance(b, (list, tuple))
            and len(a) == len(b)
            and all(_same_layout(x, y) for x, y in zip(a, b, strict=True))
        )
    return True


def safetensors_notes(tree: Any, where: K.Path, dst: Path) -> list[str]:
    """What a safetensors OUT holds and what it cannot: it holds tensors only, of one
    state dict; everything else is dropped or, for plain values, kept in the sidecar."""
    state = tree
    for k in where:
        state = state[k]
    tensors = [k for k, v in state.items() if pickles.is_tensor(v)]
    notes = [f"safetensors holds tensors only: OUT has the {len(tensors)} tensors of {K.path_text(where)}"]
    others = [k for k in state if k not in set(tensors)]
    if others or getattr(state, "_metadata", None) is not None:
        parts = ([f"{len(others)} non-tensor entries ({others[0]!r}…)"] if others else []) + (
            ["its _metadata (module versions)"] if getattr(state, "_metadata", None) is not None else []
        )
        notes.append(f"dropped from {K.path_text(where)}: " + " and ".join(parts))
    if not where or (isinstance(tree, dict) and len(tree) == 1):
        return notes  # nothing outside the state dict: no sidecar
    dropped: dict[str, int] = {}
    for path, _ in _tensor_paths(K.replace_at(tree, where, None)):
        top = path.split("/")[1]
        dropped[top] = dropped.get(top, 0) + 1
    if dropped:
        shown = ", ".join(f"{k!r} ({n} tensor{'s' if n > 1 else ''})" for k, n in dropped.items())
        notes.append(f"dropped: every other tensor — {shown}; {dst.name}.json names them, without values")
    notes.append(f"kept: the other entries' plain values (numbers, strings…), in {dst.name}.json")
    return notes


def _tensor_paths(tree: Any, path: str = "") -> list[tuple[str, Any]]:
    """Every tensor (placeholder or real) in ``tree`` with its path."""
    if pickles.is_tensor(tree):
        return [(path, tree)]
    if isinstance(tree, dict):
        return [p for k, v in tree.items() for p in _tensor_paths(v, f"{path}/{k}")]
    if isinstance(tree, (list, tuple)):
        return [p for i, v in enumerate(tree) for p in _tensor_paths(v, f"{path}/{i}")]
    return []
