"""Read a checkpoint's structure: detect the format, parse safetensors headers, unpickle
torch checkpoints safely and within bounds (:mod:`.pickles`, :mod:`gpudiag.unpickle`), and find
the model state dicts in what was read."""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpudiag.errors import InputError
from gpudiag.repro.checkpoint import keys as K
from gpudiag.repro.checkpoint import pickles, torchzip
from gpudiag.repro.checkpoint.pickles import UnsafeCheckpoint
from gpudiag.unpickle import check_tree, one_line

_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_SAFETENSORS_MAX_HEADER = 100 << 20


def detect_format(path: Path) -> str:
    """``torch-zip``, ``torch-legacy``, ``safetensors`` or ``dcp``; InputError otherwise."""
    if path.is_dir():
        if (path / ".metadata").exists():
            return "dcp"
        raise InputError(f"{path} is a folder, not a checkpoint")
    try:
        with open(path, "rb") as handle:
            head = handle.read(16)
        size = path.stat().st_size
    except FileNotFoundError as exc:
        raise InputError(f"{path} does not exist") from exc
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc.strerror}") from exc
    if size == 0:
        raise InputError(f"{path} is empty")
    if head.startswith(b"PK\x03\x04"):
        return "torch-zip"
    if len(head) >= 9:
        n = struct.unpack("<Q", head[:8])[0]
        if 2 <= n <= min(size - 8, _SAFETENSORS_MAX_HEADER) and head[8:9] == b"{":
            return "safetensors"
    if head[:1] == b"\x80":
        return "torch-legacy"
    raise InputError(f"{path} is not a checkpoint (neither torch.save output nor safetensors)")


@dataclass
class SafetensorsRef:
    """A tensor in a safetensors file: dtype, shape and its byte range in the data section."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


#: Bytes per element of the safetensors dtypes gpudiag knows (others are read, not checked).
_SAFETENSORS_ITEMSIZE = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
    "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
}  # fmt: skip


def _safetensors_entry(key: Any, entry: Any) -> SafetensorsRef:
    """One header entry, checked: dtype, shape and offsets of the right types and sizes."""
    if not isinstance(entry, dict) or not isinstance(entry.get("dtype"), str):
        raise ValueError(f"entry {str(key)[:60]!r} has no dtype")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise ValueError(f"entry {key[:60]!r} has no valid shape")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
        raise ValueError(f"entry {key[:60]!r} has no valid data_offsets")
    begin, end = offsets
    numel = 1
    for d in shape:
        numel *= d
    itemsize = _SAFETENSORS_ITEMSIZE.get(entry["dtype"])
    if not 0 <= begin <= end or (itemsize is not None and end - begin != numel * itemsize):
        raise ValueError(f"entry {key[:60]!r}: data_offsets do not match its dtype and shape")
    return SafetensorsRef(entry["dtype"], tuple(shape), begin, end)


def _read_safetensors_header(path: Path) -> tuple[dict[str, Any], dict[str, str], int]:
    """(tensors by key in file order, __metadata__, data section offset)."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        n = struct.unpack("<Q", handle.read(8))[0]
        raw = handle.read(n)
    if len(raw) != n:
        raise InputError(f"{path}: truncated safetensors header")
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        metadata = header.pop("__metadata__", {}) or {}
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise ValueError("__metadata__ is not a map of strings")
        tensors = {key: _safetensors_entry(key, entry) for key, entry in header.items()}
    except (ValueError, RecursionError) as exc:
        raise InputError(f"{path}: damaged safetensors header ({one_line(str(exc))})") from exc
    data_start = 8 + n
    if any(t.end + data_start > size for t in tensors.values()):
        raise InputError(f"{path}: truncated (tensor data runs past the end of the file)")
    return tensors, metadata, data_start


@dataclass
class Loaded:
    """A checkpoint read for inspection or conversion."""

    path: Path
    format: str
    tree: Any
    archive: torchzip.Archive | None = None
    safetensors_meta: dict[str, str] = field(default_factory=dict)
    data_start: int = 0
    trusted: bool = False


def load(path: str | os.PathLike[str], *, trust: bool = False) -> Loaded:
    """Read a checkpoint's structure; tensors stay on disk where the format allows."""
    path = Path(path)
    fmt = detect_format(path)
    name = str(path)
    if fmt == "dcp":
        raise InputError(
            f"{path} is a torch.distributed.checkpoint (DCP) folder: `gpudiag ckpt inspect|verify DIR` "
            "reads it, `gpudiag ckpt convert DIR OUT.pt` makes one file of it (--strip/--add/--model "
            "are for single files)"
        )
    if fmt == "safetensors":
        tensors, meta, start = _read_safetensors_header(path)
        return Loaded(path, fmt, tensors, safetensors_meta=meta, data_start=start)
    if fmt == "torch-zip":
        archive = torchzip.open_archive(path, name)
        try:
            tree = pickles.loads(archive.pickle, name)
        except UnsafeCheckpoint:
            if not trust:
                raise
        else:
            torchzip.check_storages(archive, pickles.tensor_refs(tree), name)
            return Loaded(path, fmt, tree, archive=archive)
    tree = _torch_load(path, trust)
    check_tree(tree, name, "checkpoint")
    return Loaded(path, fmt, tree, trusted=trust)


def _scan_legacy(path: Path) -> None:
    """Read a legacy torch file's pickles (magic number, protocol, system info, object
    tree) with the bounded reader before torch reads them: torch's reader has no bounds."""
    with open(path, "rb") as stream:
        if pickles.loads(stream, str(path)) != _LEGACY_MAGIC:
            raise InputError(f"{path} is a pickle, but not a checkpoint written by torch.save")
        for _ in range(2):  # protocol version, system info
            pickles.loads(stream, str(path))
        pickles.loads(stream, str(path), legacy=True)


def _torch_load(path: Path, trust: bool) -> Any:
    if not trust:
        _scan_legacy(path)
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=not trust, mmap=False)
    except Exception as exc:  # after the scan, whatever torch refuses is a damaged file
        message = one_line(str(exc).splitlines()[0]) if str(exc).strip() else ""
        if not trust and "Weights only load failed" in str(exc):
            raise UnsafeCheckpoint(str(path), [message]) from exc
        kind = type(exc).__name__
        raise InputError(f"{path}: damaged or truncated checkpoint ({kind}: {message})") from exc


def _shape(value: Any) -> tuple[int, ...]:
    return tuple(value.shape)


def state_dicts(loaded: Loaded) -> list[tuple[K.Path, dict[str, Any]]]:
    if loaded.format == "safetensors":
        return [((), loaded.tree)] if loaded.tree else []
    return K.find_state_dicts(loaded.tree)


def model_keys(model_spec: str) -> dict[str, tuple[int, ...]]:
    """Keys and shapes of ``model_spec``'s state dict (``--model``, as for gradcheck)."""
    from gpudiag.models import resolve_model, unwrap

    model, _ = unwrap(resolve_model(model_spec)())
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def match_report(state: dict[str, Any], target: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    missing = [k for k in target if k not in state]
    unexpected = [k for k in state if k not in target]
    shapes = [
        {"key": k, "checkpoint": list(_shape(v)), "model": list(target[k])}
        for k, v in state.items()
        if k in target and _shape(v) != target[k]
    ]
    return {
        "missing": missing,
        "unexpected": unexpected,
        "shape_mismatches": shapes,
        "loads_strictly": not (missing or unexpected or shapes),
    }


def candidate_plans(path: K.Path, state: dict[str, Any]) -> list[K.Plan]:
    """The renamings tried against a model: none, the wrapper prefixes peeled, and each
    wrapper prefix added after that."""
    auto = K.auto_plan(path, state)
    candidates = [K.Plan(path), auto]
    for p in K.WRAPPER_PREFIXES:
        candidates.append(K.Plan(path, list(auto.strip), p))
    return candidates


def plan_for_model(path: K.Path, state: dict[str, Any], target: dict[str, tuple[int, ...]]) -> K.Plan | None:
    """The renaming that makes ``state`` load strictly into the model, or None."""
    for plan in candidate_plans(path, state):
        renamed = {plan.rename(k): v for k, v in state.items()}
        if len(renamed) == len(state) and match_report(renamed, target)["loads_strictly"]:
            return plan
    return None


def plan_text(plan: K.Plan) -> str:
    """A renaming as ``ckpt convert``'s options (``--strip module.``), or ``as it is``."""
    parts = [f"--strip {p}" for p in plan.strip] + ([f"--add {plan.add}"] if plan.add else [])
    return " ".join(parts) if parts else "as it is"


def rename_report(
    path: K.Path, state: dict[str, Any], target: dict[str, tuple[int, ...]]
) -> list[dict[str, Any]]:
    """What each renaming fixes, best first: ``fits`` — the model's keys the renamed state
    dict then fills with the right shape, of ``keys`` — and what remains (the missing and
    unexpected keys, the shape mismatches). A DataParallel checkpoint of a 10-class
    resnet18 against the 1000-class model: ``--strip module.`` fits 120 of 122, the head's
    two shapes remain — a different model, not a naming problem."""
    out: dict[str, dict[str, Any]] = {}
    for plan in candidate_plans(path, state):
        renamed = {plan.rename(k): v for k, v in state.items()}
        text = plan_text(plan)
        if text in out or len(renamed) != len(state):  # (a renaming that merges keys is no fix)
            continue
        report = match_report(renamed, target)
        fits = sum(1 for k, v in renamed.items() if k in target and _shape(v) == target[k])
        out[text] = {"rename": text, "fits": fits, "keys": len(target), **report}
    return sorted(out.values(), key=lambda r: -r["fits"])
