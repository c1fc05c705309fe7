"""Inspect and repair checkpoint keys (``module.``, ``_orig_mod.``…) safely, at disk speed.

``inspect(path, model=None) -> InspectResult`` and ``convert(src, dst, …) -> ConvertResult``
are the API; ``gpudiag ckpt inspect|convert`` is a thin layer over them.

Safety: torch checkpoints are read by a restricted unpickler (:mod:`.pickles`) — a pickle
that needs other objects is refused unless the caller trusts the file; nothing is
executed, and the work of reading is bounded whatever the file holds (:mod:`gpudiag.unpickle`).
The input is never modified and the output may not be the input; the output is written
to a temporary file in its folder, fsynced and renamed, never over an existing file
without ``force``, with the mode ``torch.save`` would give it (0666 less the umask); each
copied record's bytes are checked against the input's CRC-32 as they are written, and the
small pickle is read back — by the rules of ``torch.load(weights_only=True)`` — and
compared with the input before it is kept (:mod:`.converting`, :mod:`.verify`).

Speed: renaming keys of a torch zip checkpoint rewrites only its small pickle and copies
every tensor record byte for byte (:mod:`.torchzip`); safetensors get a new header and
the data section copied. Memory stays bounded by the largest single record.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from gpudiag.repro.checkpoint import keys as K
from gpudiag.repro.checkpoint import pickles
from gpudiag.repro.checkpoint.converting import CONVERT_SCHEMA, ConvertResult, convert
from gpudiag.repro.checkpoint.pickles import is_tensor
from gpudiag.repro.checkpoint.reading import (
    Loaded,
    SafetensorsRef,
    detect_format,
    load,
    match_report,
    model_keys,
    plan_for_model,
    rename_report,
    state_dicts,
)

__all__ = [
    "CONVERT_SCHEMA",
    "INSPECT_SCHEMA",
    "ConvertResult",
    "InspectResult",
    "Loaded",
    "convert",
    "detect_format",
    "inspect",
    "load",
]

INSPECT_SCHEMA = "gpudiag.ckpt-inspect/1"


def _dtype(value: Any) -> str:
    if isinstance(value, (pickles.TensorRef, pickles.ParamRef, SafetensorsRef)):
        return str(value.dtype)
    return str(value.dtype).removeprefix("torch.")


def _nbytes(value: Any) -> int:
    if hasattr(value, "nbytes") and not callable(value.nbytes):
        return int(value.nbytes)
    return int(value.numel() * value.element_size())


@dataclass
class InspectResult:
    path: str
    format: str
    state_dicts: list[dict[str, Any]]
    entries: list[dict[str, Any]]
    model: dict[str, Any] | None
    warnings: list[str]

    def __repr__(self) -> str:
        loads = {None: "", True: " · loads into the model", False: " · does not load into the model"}
        keys = sum(len(sd.get("keys", [])) for sd in self.state_dicts)
        counts = f"state dicts {len(self.state_dicts)} · keys {keys}"
        return f"<InspectResult {self.format} · {counts}{loads[self.loads]}>"

    @property
    def loads(self) -> bool | None:
        """Whether the checkpoint loads strictly into ``--model`` as it is; None without one."""
        return None if self.model is None else bool(self.model.get("loads_strictly"))

    def exit_code(self) -> int:
        """1 when it does not load strictly into ``--model`` (a problem found), else 0."""
        return 1 if self.loads is False else 0

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


def inspect(path: str | os.PathLike[str], *, model: str | None = None, trust: bool = False) -> Any:
    """What the checkpoint holds, and with ``model`` whether it loads strictly: an
    :class:`InspectResult`, or for a DCP folder a :class:`.dcp.DcpReport`."""
    if os.path.isdir(path):
        from gpudiag.repro.checkpoint import dcp

        return dcp.inspect(path, model=model)
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
                "modules": _modules(keys_list, K.leading_prefixes(keys_list)),
                "keys": [str(k) for k in keys_list],
                "has_metadata": getattr(state, "_metadata", None) is not None,
            }
        )
    entries = []
    if isinstance(loaded.tree, dict) and loaded.format != "safetensors":
        entries = [_describe_entry(k, v) for k, v in loaded.tree.items()]
    model_info: dict[str, Any] | None = None
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
                "renames": rename_report(where, state, target),
            }
    warnings = []
    if os.environ.get("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"):
        warnings.append(
            "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD is set: torch.load in this environment runs "
            "arbitrary pickles (gpudiag does not)"
        )
    return InspectResult(str(path), _format_name(loaded), infos, entries, model_info, warnings)


def _modules(keys: list[Any], prefixes: list[str]) -> dict[str, int]:
    """How many keys each top-level name has once the wrapper prefixes are off
    (``{"conv1": 1, "bn1": 5, "layer1": 30, …}``), in the order they first appear."""
    strip = "".join(prefixes)
    counts: dict[str, int] = {}
    for key in keys:
        name = str(key).removeprefix(strip).split(".", 1)[0]
        counts[name] = counts.get(name, 0) + 1
    return counts


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
