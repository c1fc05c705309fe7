"""Inspect and repair checkpoint keys (``module.``, ``_orig_mod.``…) safely, at disk speed.

``inspect(path, model=None) -> InspectResult`` and ``convert(src, dst, …) -> ConvertResult``
are the API; ``gpudiag ckpt inspect|convert`` is a thin layer over them.

Safety: torch checkpoints are read by a restricted unpickler (:mod:`.pickles`) — a pickle
that needs other objects is refused unless the caller trusts the file; nothing is
executed. The input is never modified and the output may not be the input; the output is
written to a temporary file in its folder, fsynced and renamed, never over an existing
file without ``force``, and read back and compared with the input before it is kept.

Speed: renaming keys of a torch zip checkpoint rewrites only its small pickle and copies
every tensor record byte for byte (:mod:`.torchzip`); safetensors get a new header and
the data section copied. Memory stays bounded by the largest single record.
"""

from __future__ import annotations

import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpudiag.errors import InputError
from gpudiag.fileio import atomic_output
from gpudiag.repro.checkpoint import keys as K
from gpudiag.repro.checkpoint import pickles, torchzip
from gpudiag.repro.checkpoint.pickles import UnsafeCheckpoint, is_tensor

INSPECT_SCHEMA = "gpudiag.ckpt-inspect/1"
CONVERT_SCHEMA = "gpudiag.ckpt-convert/1"
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_SAFETENSORS_MAX_HEADER = 100 << 20


# -- reading ---------------------------------------------------------------------------------


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
    except ValueError as exc:
        raise InputError(f"{path}: damaged safetensors header ({exc})") from exc
    metadata = header.pop("__metadata__", {}) or {}
    tensors = {}
    for key, entry in header.items():
        begin, end = entry["data_offsets"]
        tensors[key] = SafetensorsRef(entry["dtype"], tuple(entry["shape"]), int(begin), int(end))
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
            f"{path} is a torch.distributed.checkpoint (DCP) folder; convert it to one file first with "
            "torch.distributed.checkpoint.format_utils.dcp_to_torch_save(dcp_dir, 'model.pt')"
        )
    if fmt == "safetensors":
        tensors, meta, start = _read_safetensors_header(path)
        return Loaded(path, fmt, tensors, safetensors_meta=meta, data_start=start)
    if fmt == "torch-zip":
        archive = torchzip.open_archive(path, name)
        try:
            return Loaded(path, fmt, pickles.loads(archive.pickle, name), archive=archive)
        except UnsafeCheckpoint:
            if not trust:
                raise
    return Loaded(path, fmt, _torch_load(path, trust), trusted=trust)


def _torch_load(path: Path, trust: bool) -> Any:
    import pickle

    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=not trust, mmap=False)
    except pickle.UnpicklingError as exc:
        if trust:
            raise InputError(f"{path}: cannot be loaded ({exc})") from exc
        raise UnsafeCheckpoint(str(path), [str(exc).splitlines()[0][:120]]) from exc
    except (EOFError, RuntimeError, ValueError, OSError) as exc:
        raise InputError(f"{path}: damaged or truncated checkpoint ({type(exc).__name__}: {exc})") from exc


# -- inspecting ------------------------------------------------------------------------------


def _dtype(value: Any) -> str:
    if isinstance(value, (pickles.TensorRef, pickles.ParamRef, SafetensorsRef)):
        return str(value.dtype)
    return str(value.dtype).removeprefix("torch.")


def _shape(value: Any) -> tuple[int, ...]:
    return tuple(value.shape)


def _nbytes(value: Any) -> int:
    if hasattr(value, "nbytes") and not callable(value.nbytes):
        return int(value.nbytes)
    return int(value.numel() * value.element_size())


def state_dicts(loaded: Loaded) -> list[tuple[K.Path, dict[str, Any]]]:
    if loaded.format == "safetensors":
        return [((), loaded.tree)]
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


def plan_for_model(path: K.Path, state: dict[str, Any], target: dict[str, tuple[int, ...]]) -> K.Plan | None:
    """The renaming that makes ``state`` load strictly into the model, or None."""
    auto = K.auto_plan(path, state)
    candidates = [K.Plan(path), auto]
    for p in K.WRAPPER_PREFIXES:
        candidates.append(K.Plan(path, list(auto.strip), p))
    for plan in candidates:
        renamed = {plan.rename(k): v for k, v in state.items()}
        if len(renamed) == len(state) and match_report(renamed, target)["loads_strictly"]:
            return plan
    return None


@dataclass
class InspectResult:
    path: str
    format: str
    state_dicts: list[dict[str, Any]]
    entries: list[dict[str, Any]]
    model: dict[str, Any] | None
    warnings: list[str]

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": INSPECT_SCHEMA,
            "path": self.path,
            "format": self.format,
            "state_dicts": self.state_dicts,
            "entries": self.entries,
            "model": self.model,
            "warnings": self.warnings,
        }


def _describe_entry(key: Any, value: Any) -> dict[str, Any]:
    kind = "other"
    if K.is_state_dict(value):
        kind = "model state dict"
    elif isinstance(value, dict) and "param_groups" in value:
        kind = "optimizer state"
    elif isinstance(value, dict) and ("last_epoch" in value or "_last_lr" in value):
        kind = "scheduler state"
    elif "rng" in str(key).lower() or (is_tensor(value) and _dtype(value) == "uint8"):
        kind = "RNG state" if "rng" in str(key).lower() else "tensor"
    elif is_tensor(value):
        kind = "tensor"
    elif isinstance(value, (int, float, str, bool)) or value is None:
        kind = "value"
    elif isinstance(value, dict):
        kind = "dict"
    shown = value if kind == "value" else None
    return {"key": str(key), "kind": kind, "value": shown}


def inspect(path: str | os.PathLike[str], *, model: str | None = None, trust: bool = False) -> InspectResult:
    """What the checkpoint holds, and with ``model`` whether it loads strictly."""
    loaded = load(path, trust=trust)
    found = state_dicts(loaded)
    infos = []
    for where, state in found:
        tensors = {k: v for k, v in state.items() if is_tensor(v) or isinstance(v, SafetensorsRef)}
        dtypes: dict[str, int] = {}
        for v in tensors.values():
            dtypes[_dtype(v)] = dtypes.get(_dtype(v), 0) + 1
        keys_list = list(state)
        infos.append(
            {
                "path": K.path_text(where),
                "tensors": len(tensors),
                "bytes": sum(_nbytes(v) for v in tensors.values()),
                "dtypes": dtypes,
                "prefixes": K.leading_prefixes(keys_list),
                "first_keys": keys_list[:3],
                "last_keys": keys_list[-2:],
                "has_metadata": getattr(state, "_metadata", None) is not None,
            }
        )
    entries = []
    if isinstance(loaded.tree, dict) and loaded.format != "safetensors":
        entries = [_describe_entry(k, v) for k, v in loaded.tree.items()]
    model_info = None
    if model is not None:
        target = model_keys(model)
        best = max(
            found,
            key=lambda f: len(
                set(K.Plan(f[0], K.leading_prefixes(list(f[1]))).rename(k) for k in f[1]) & set(target)
            ),
            default=None,
        )
        if best is None:
            model_info = {"state_dict": None, "loads_strictly": False, "transformation": None}
        else:
            where, state = best
            plan = plan_for_model(where, state, target)
            model_info = {
                "state_dict": K.path_text(where),
                **match_report(state, target),
                "transformation": _plan_text(plan) if plan is not None else None,
            }
    warnings = []
    if os.environ.get("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"):
        warnings.append(
            "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD is set: torch.load in this environment runs "
            "arbitrary pickles (gpudiag does not)"
        )
    return InspectResult(str(path), _format_name(loaded), infos, entries, model_info, warnings)


def _format_name(loaded: Loaded) -> str:
    """The container, and ``lightning`` when it is a Lightning checkpoint."""
    tree = loaded.tree
    if isinstance(tree, dict) and (
        "pytorch-lightning_version" in tree or {"state_dict", "global_step"} <= set(tree)
    ):
        return f"lightning ({loaded.format})"
    return loaded.format


def _plan_text(plan: K.Plan) -> str:
    parts = [f"--strip {p}" for p in plan.strip] + ([f"--add {plan.add}"] if plan.add else [])
    return " ".join(parts) if parts else "none needed"


# -- converting ------------------------------------------------------------------------------


@dataclass
class ConvertResult:
    src: str
    dst: str
    format_in: str
    format_out: str
    dry_run: bool
    mappings: list[dict[str, Any]]
    notes: list[str]
    sidecar: str | None = None
    verified: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": CONVERT_SCHEMA,
            "src": self.src,
            "dst": self.dst,
            "format_in": self.format_in,
            "format_out": self.format_out,
            "dry_run": self.dry_run,
            "mappings": self.mappings,
            "notes": self.notes,
            "sidecar": self.sidecar,
            "verified": self.verified,
        }


def _plans(loaded: Loaded, strip: list[str], add: str | None, model: str | None) -> list[K.Plan]:
    found = state_dicts(loaded)
    if not found:
        raise InputError(f"{loaded.path}: no model state dict found in the checkpoint")
    if model is not None:
        target = model_keys(model)
        plans = []
        for where, state in found:
            plan = plan_for_model(where, state, target)
            if plan is not None:
                plans.append(plan)
        if not plans:
            where, state = found[0]
            report = match_report({K.auto_plan(where, state).rename(k): v for k, v in state.items()}, target)
            raise InputError(
                f"no renaming makes {K.path_text(where)} load strictly into {model}: "
                f"{len(report['missing'])} missing (e.g. {report['missing'][:2]}), "
                f"{len(report['unexpected'])} unexpected (e.g. {report['unexpected'][:2]}), "
                f"{len(report['shape_mismatches'])} shape mismatch(es)"
            )
        return plans
    if strip or add:
        out = []
        for where, state in found:
            plan = K.Plan(where, list(strip), add or "")
            K.apply(state, plan)  # collisions refused here, before anything is written
            out.append(plan)
        return out
    return [K.auto_plan(where, state) for where, state in found]


def convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    model: str | None = None,
    strip: list[str] | tuple[str, ...] = (),
    add: str | None = None,
    to: str | None = None,
    dry_run: bool = False,
    trust: bool = False,
    force: bool = False,
) -> ConvertResult:
    """Rename the keys of ``src``'s model state dict(s) into ``dst``."""
    src, dst = Path(src), Path(dst)
    for p in [*strip, *([add] if add else [])]:
        if not p.endswith(".") or p.startswith("."):
            raise InputError(f"prefix {p!r} must end with a dot and name whole segments, e.g. module.")
    if dst.exists() and src.exists() and os.path.samefile(src, dst):
        raise InputError("OUT is IN: write the converted checkpoint to another file")
    loaded = load(src, trust=trust)
    fmt_out = to or ("safetensors" if loaded.format == "safetensors" else "pt")
    if fmt_out not in ("pt", "safetensors"):
        raise InputError(f"--to must be pt or safetensors, not {fmt_out!r}")
    plans = _plans(loaded, list(strip), add, model)
    mappings = []
    found = dict(state_dicts(loaded))
    notes = [n for plan in plans for n in plan.notes]
    for plan in plans:
        state = found[plan.path]
        old = list(state)
        new = [plan.rename(k) for k in old]
        mappings.append(
            {
                "state_dict": K.path_text(plan.path),
                "keys": len(old),
                "changed": sum(a != b for a, b in zip(old, new, strict=True)),
                "strip": plan.strip,
                "add": plan.add,
                "first": [old[0], new[0]],
                "last": [old[-1], new[-1]],
            }
        )
    if not any(plan.changes for plan in plans) and fmt_out == (
        "safetensors" if loaded.format == "safetensors" else "pt"
    ):
        notes.append("no key needed renaming")
    result = ConvertResult(str(src), str(dst), loaded.format, fmt_out, dry_run, mappings, notes)
    if dry_run:
        return result
    tree = loaded.tree
    for plan in plans:
        tree = K.replace_at(tree, plan.path, K.apply(found[plan.path], plan))
    if fmt_out == "safetensors":
        from gpudiag.repro.checkpoint.safetensors_io import write_safetensors

        result.sidecar = write_safetensors(loaded, tree, plans, dst, force)
    elif loaded.format == "torch-zip" and loaded.archive is not None and not loaded.trusted:
        _write_zip(loaded, tree, dst, force)
    elif loaded.format == "safetensors":
        from safetensors.torch import load_file

        tensors = load_file(str(loaded.path))
        renamed = {new: tensors[old] for old, new in zip(found[()], tree, strict=True)}
        _write_torch(loaded, renamed, dst, force)
        notes.append("safetensors to pt: the tensors pass through memory (torch.save needs them all)")
    else:
        _write_torch(loaded, tree, dst, force)
        notes.append(f"{loaded.format} input: written through torch.save (memory grows with the checkpoint)")
    result.verified = True
    return result


def _write_zip(loaded: Loaded, tree: Any, dst: Path, force: bool) -> None:
    assert loaded.archive is not None
    expected = _tensor_map(tree)
    with atomic_output(dst, force=force) as out:
        torchzip.rewrite(loaded.archive, pickles.dumps(tree), out)
        out.flush()
        # The data goes to disk (fsync) while it is read back from the page cache and
        # checked: the two overlap, and atomic_output's own fsync finds nothing left to do.
        # (fsyncing while copying was tried: it slowed the copy more than it saved.)
        with ThreadPoolExecutor(max_workers=1) as pool:
            synced = pool.submit(os.fsync, out.fileno())
            written = torchzip.open_archive(Path(out.name), str(dst))
            torchzip.verify_records(loaded.archive, written, str(dst))
            if _tensor_map(pickles.loads(written.pickle, str(dst))) != expected:
                raise InputError(f"{dst}: verification failed: the tensors read back differ from the input's")
            synced.result()


def _tensor_map(tree: Any) -> dict[str, tuple[Any, ...]]:
    """Every tensor in the tree by its path: (storage record, dtype, offset, shape, stride)."""
    out: dict[str, tuple[Any, ...]] = {}

    def walk(value: Any, path: str) -> None:
        if isinstance(value, pickles.ParamRef):
            value = value.data
        if isinstance(value, pickles.TensorRef):
            out[path] = (value.storage.key, value.dtype, value.offset, value.size, value.stride)
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{path}/{k}")
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(v, f"{path}/{i}")

    walk(tree, "")
    return out


def _write_torch(loaded: Loaded, tree: Any, dst: Path, force: bool) -> None:
    import torch

    with atomic_output(dst, force=force) as out:
        torch.save(tree, out)
        out.flush()
        back = torch.load(out.name, map_location="cpu", weights_only=not loaded.trusted)
        if not _same_tensors(tree, back):
            raise InputError(f"{dst}: verification failed: the tensors read back differ from the input's")


def _same_tensors(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same_tensors(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (
            isinstance(b, (list, tuple))
            and len(a) == len(b)
            and all(_same_tensors(x, y) for x, y in zip(a, b, strict=False))
        )
    return True
