"""What can be wrong with a DCP checkpoint, found from its ``.metadata`` and file sizes.

Each check returns findings (:class:`gpudiag.findings.Finding`), every one of them listed,
not only the first: a rank's file missing (``dcp-file-missing``, with the rank that saved
it and the tensors it holds) or shorter than the byte ranges it must hold
(``dcp-file-truncated``); chunks that do not tile their tensor (``dcp-coverage-gap``: a
gap, an overlap, a chunk outside the tensor or without stored bytes); an optimizer whose
state misses entries some parameters have (``optimizer-state-partial``); and against a
model (``--model``) every missing and unexpected key, shape and dtype difference, and the
wrapper segments (``_orig_mod.``, ``_checkpoint_wrapped_module.``…, at any depth) whose
removal makes the keys match (``key-path-wrapper``).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from typing import Any

from gpudiag.errors import InputError
from gpudiag.findings import Finding
from gpudiag.repro.checkpoint.dcp_metadata import Chunk, Entry, Metadata, saving_rank
from gpudiag.repro.checkpoint.keys import WRAPPER_PREFIXES
from gpudiag.unpickle import one_line

#: Segments wrappers insert that are never a real module's name (``module`` can be one:
#: it counts as a wrapper only as the leading segment).
INNER_WRAPPERS = tuple(p.rstrip(".") for p in WRAPPER_PREFIXES if p != "module.")
_SHOWN = 5


def _names(keys: Iterable[str], limit: int = _SHOWN) -> str:
    keys = list(keys)
    shown = ", ".join(one_line(k, 100) for k in keys[:limit])
    return shown + (f" … ({len(keys)} in all)" if len(keys) > limit else "")


def _rank_text(name: str) -> str:
    rank, _ = saving_rank(name)
    return f"saved by rank {rank}" if rank is not None else "not named __RANK_N.distcp"


def file_findings(meta: Metadata) -> tuple[list[Finding], dict[str, int | None]]:
    """Missing and truncated data files, and each file's size (None when missing)."""
    users: dict[str, list[tuple[Entry, Chunk]]] = {}
    for entry in meta.entries:
        for chunk in entry.chunks:
            if chunk.file is not None:
                users.setdefault(chunk.file, []).append((entry, chunk))
    findings, sizes = [], {}
    for name in meta.files():
        path = meta.folder / name
        try:
            info = os.stat(path)
        except FileNotFoundError:
            size: int | None = None
        except OSError as exc:
            raise_unreadable(path, exc)
        else:
            if not stat.S_ISREG(info.st_mode):
                raise InputError(f"cannot read {path}: not a regular file")
            size = info.st_size
        sizes[name] = size
        keys = list(dict.fromkeys(e.key for e, _ in users[name]))
        if size is None:
            need = max(c.begin + c.length for _, c in users[name])
            findings.append(
                Finding(
                    "dcp-file-missing",
                    "error",
                    f"{name} is missing ({_rank_text(name)}, {need} bytes, "
                    f"{len(keys)} entries: {_names(keys, 3)})",
                    {"file": name, "rank": saving_rank(name)[0], "bytes": need, "keys": keys},
                    cause="saved on node-local disks (each node kept its ranks' files), or a copy cut short",
                    fix=f"copy {name} from the disk of the node that ran rank {saving_rank(name)[0]} "
                    f"into {meta.folder}",
                )
            )
            continue
        past = [(e, c) for e, c in users[name] if c.begin + c.length > size]
        if past:
            need = max(c.begin + c.length for _, c in past)
            first = min(past, key=lambda p: p[1].begin)[1]
            cut = list(dict.fromkeys(e.key for e, _ in past))
            findings.append(
                Finding(
                    "dcp-file-truncated",
                    "error",
                    f"{name} is truncated: {size} bytes, its byte ranges need {need} "
                    f"({_rank_text(name)}; first range cut: bytes "
                    f"{first.begin}-{first.begin + first.length}; "
                    f"{len(cut)} entries lost: {_names(cut, 3)})",
                    {"file": name, "rank": saving_rank(name)[0], "bytes": size, "needed": need, "keys": cut},
                    cause="a copy cut short, a full disk during the save, or a save that was killed",
                    fix="copy the file again from where the job saved it; compare sizes with `ls -l`",
                )
            )
    return findings, sizes


def raise_unreadable(path: os.PathLike[str], exc: OSError) -> None:
    raise InputError(f"cannot read {path}: {exc.strerror or exc}") from None


def coverage_findings(meta: Metadata) -> list[Finding]:
    """Every tensor's chunks must tile its global shape exactly: inside it, no two
    overlapping, their volumes summing to the tensor's."""
    findings = []
    for entry in meta.entries:
        if not entry.is_tensor:
            continue
        problem = _coverage_problem(entry)
        if problem:
            findings.append(
                Finding(
                    "dcp-coverage-gap",
                    "error",
                    f"tensor {one_line(entry.key, 120)} {list(entry.shape)}: {problem}",
                    {
                        "key": entry.key,
                        "shape": list(entry.shape),
                        "chunks": [_chunk_json(c) for c in entry.chunks],
                    },
                    cause="a save from an inconsistent plan, files of two checkpoints mixed, "
                    "or a crafted .metadata",
                    fix="restore the checkpoint from the job's own copy; loading it would give wrong values",
                )
            )
    for text in meta.unstored:
        findings.append(
            Finding(
                "dcp-coverage-gap",
                "error",
                f"{one_line(text, 160)}: .metadata lists it but records no byte range for it",
                {"entry": text},
                cause="a .metadata from another save, or a crafted one",
                fix="restore .metadata from the save that wrote these files",
            )
        )
    return findings


def _chunk_json(c: Chunk) -> dict[str, Any]:
    return {
        "offsets": list(c.offsets),
        "sizes": list(c.sizes),
        "file": c.file,
        "begin": c.begin,
        "length": c.length,
    }


def _coverage_problem(entry: Entry) -> str | None:
    shape = entry.shape
    if not entry.chunks:
        return "no chunk stores it"
    for c in entry.chunks:
        if any(o + s > d for o, s, d in zip(c.offsets, c.sizes, shape, strict=True)):
            return f"the chunk at offsets {list(c.offsets)} sizes {list(c.sizes)} reaches past the tensor"
    boxes = sorted((c for c in entry.chunks if c.numel), key=lambda c: c.offsets)
    active: list[Chunk] = []
    for c in boxes:  # sweep along the first dimension: only chunks meeting there can overlap
        if shape:
            active = [a for a in active if a.offsets[0] + a.sizes[0] > c.offsets[0]]
        for a in active:
            if all(
                max(x, y) < min(x + s, y + t)
                for x, s, y, t in zip(a.offsets, a.sizes, c.offsets, c.sizes, strict=True)
            ):
                return f"chunks at offsets {list(a.offsets)} and {list(c.offsets)} overlap"
        active.append(c)
    covered = sum(c.numel for c in entry.chunks)
    if covered != entry.numel:
        return f"its chunks cover {covered} of its {entry.numel} elements (a gap)"
    return None


def optimizer_findings(meta: Metadata, params: dict[str, list[str]] | None = None) -> list[Finding]:
    """Per optimizer group (keys ``G.state.PARAM.NAME``): every parameter that has state
    has every state name some parameter has; with ``params`` (the parameters each group's
    ``param_groups`` list, read by verify), every listed parameter has state once any does."""
    by_group: dict[str, dict[str, set[str]]] = {}
    for entry in meta.entries:
        path = entry.path
        if len(path) >= 4 and path[1] == "state" and isinstance(path[2], (str, int)):
            param = str(path[2])  # a name (get_state_dict) or a position (optimizer.state_dict())
            by_group.setdefault(str(path[0]), {}).setdefault(param, set()).add(".".join(map(str, path[3:])))
    findings = []
    for group, state in by_group.items():
        names = set().union(*state.values())
        partial = {p: sorted(names - have) for p, have in state.items() if names - have}
        without = [p for p in (params or {}).get(group, []) if p not in state]
        if partial or without:
            parts = [f"{p} lacks {', '.join(m)}" for p, m in list(partial.items())[:3]]
            if len(partial) > 3:
                parts.append(f"… ({len(partial)} parameters in all)")
            if without:
                parts.append(
                    f"{len(without)} parameters of its param_groups have no state ({_names(without, 3)})"
                )
            findings.append(
                Finding(
                    "optimizer-state-partial",
                    "warning",
                    f"optimizer {group!r}: state incomplete — " + "; ".join(parts),
                    {"group": group, "partial": partial, "without_state": without},
                    cause="a save before every parameter had a step, a rank whose optimizer state "
                    "was not gathered, "
                    "or frozen parameters left in the optimizer",
                    fix="check the saving job's optimizer; resuming from it restarts these moments from zero",
                )
            )
    return findings


def strip_wrappers(key: str) -> str:
    """``key`` without wrapper segments: leading ``module.``/``_orig_mod.``… and the inner
    ones that are never module names (``layers.0._checkpoint_wrapped_module._orig_mod.w``
    → ``layers.0.w``)."""
    parts = key.split(".")
    while parts and parts[0] + "." in WRAPPER_PREFIXES and len(parts) > 1:
        parts = parts[1:]
    return ".".join(p for p in parts if p not in INNER_WRAPPERS) or key


def wrapper_segments(keys: Iterable[str]) -> dict[str, int]:
    """Which wrapper segments the keys carry (``"_orig_mod" -> 12``), at any depth."""
    counts: dict[str, int] = {}
    for key in keys:
        parts = key.split(".")
        seen = set(p for p in parts if p in INNER_WRAPPERS)
        if parts and parts[0] == "module" and len(parts) > 1:
            seen.add("module")
        for s in seen:
            counts[s] = counts.get(s, 0) + 1
    return counts


def model_findings(
    state: dict[str, Entry], target: dict[str, tuple[tuple[int, ...], str]], group: str, model: str
) -> tuple[list[Finding], dict[str, Any]]:
    """Compare a checkpoint group's tensors (``state``: key within the group → entry) with
    the model's state dict (key → (shape, dtype)): every difference, named."""
    where = f"{group}." if group else ""
    missing = [k for k in target if k not in state]
    unexpected = [k for k in state if k not in target]
    findings = []
    renamed = {strip_wrappers(k): k for k in state}
    fixable = [k for k in missing if strip_wrappers(k) in renamed] if len(renamed) == len(state) else []
    segments = wrapper_segments(unexpected)
    if fixable and segments:
        findings.append(
            Finding(
                "key-path-wrapper",
                "warning",
                f"{len(fixable)} model keys are in the checkpoint under wrapper segments "
                f"{', '.join(s + '.' for s in segments)} (e.g. {renamed[strip_wrappers(fixable[0])]!r} for "
                f"{fixable[0]!r}); removing them makes the keys match",
                {"segments": segments, "examples": {k: renamed[strip_wrappers(k)] for k in fixable[:_SHOWN]}},
                cause="saved from a torch.compile'd / activation-checkpointed / DDP-wrapped model "
                "(an inner _orig_mod. under checkpointing: torchtitan #2622)",
                fix="gpudiag ckpt convert DIR OUT.pt --keys auto (removes them), "
                "or load with the same wrappers",
            )
        )
    if missing:
        findings.append(
            Finding(
                "keys-missing",
                "error",
                f"{len(missing)} keys of --model are not in the checkpoint"
                f"{' group ' + repr(group) if group else ''}: " + _names(missing),
                {"keys": missing, "group": group},
                cause="another model, other wrappers, or a save of part of the model",
                fix="dcp.load(strict=True) fails on these; see key-path-wrapper if listed",
            )
        )
    if unexpected:
        findings.append(
            Finding(
                "keys-unexpected",
                "warning",
                f"{len(unexpected)} checkpoint keys are not in --model (dcp.load ignores them silently): "
                + _names(where + k for k in unexpected),
                {"keys": [where + k for k in unexpected]},
                cause="another model, other wrappers, or layers removed since the save",
                fix="check that the model is the one that was trained",
            )
        )
    shapes, casts = [], []
    for k, (shape, dtype) in target.items():
        entry = state.get(k)
        if entry is None:
            continue
        if entry.shape != shape:
            shapes.append({"key": where + k, "checkpoint": list(entry.shape), "model": list(shape)})
        elif entry.dtype != dtype:
            casts.append({"key": where + k, "checkpoint": entry.dtype, "model": dtype})
    if shapes:
        shown = "; ".join(f"{s['key']} {s['checkpoint']} vs {s['model']}" for s in shapes[:3])
        findings.append(
            Finding(
                "shape-mismatch",
                "error",
                f"{len(shapes)} tensors differ in shape from --model (checkpoint vs model): {shown}"
                + (" …" if len(shapes) > 3 else ""),
                {"tensors": shapes},
                cause="another model configuration (width, vocabulary, heads)",
                fix="build the model with the configuration the checkpoint was saved from",
            )
        )
    if casts:
        pairs = sorted({f"{c['checkpoint']}->{c['model']}" for c in casts})
        findings.append(
            Finding(
                "dtype-cast-silent",
                "warning",
                f"{len(casts)} tensors would be cast silently on load ({', '.join(pairs)}): "
                + _names(c["key"] for c in casts),
                {"tensors": casts},
                cause="a model built in another dtype than the one trained (bf16 model, fp32 checkpoint)",
                fix="build the model in the checkpoint's dtype, or cast on purpose after loading",
            )
        )
    info = {
        "group": group or None,
        "missing": missing,
        "unexpected": [where + k for k in unexpected],
        "shape_mismatches": shapes,
        "dtype_casts": casts,
        "loads_strictly": not (missing or unexpected or shapes),
        "rename": "remove wrapper segments (--keys auto)" if fixable and segments else None,
    }
    return findings, info


def model_state(model: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """The model's state dict keys → (shape, dtype name), outer wrappers peeled."""
    from gpudiag.models import resolve_model, unwrap

    module, _ = unwrap(resolve_model(model)())
    return {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in module.state_dict().items()}


def choose_group(meta: Metadata, target: dict[str, Any]) -> tuple[str, dict[str, Entry]]:
    """The top-level group (``model``, or the root) whose tensors best match the model's
    keys, wrapper segments removed; its entries keyed within the group."""
    groups: dict[str, dict[str, Entry]] = {"": {}}
    for entry in meta.entries:
        if entry.is_tensor:
            groups[""][entry.key] = entry
            if len(entry.path) > 1:
                rest = ".".join(map(str, entry.path[1:]))
                groups.setdefault(str(entry.path[0]), {})[rest] = entry
    wanted = {strip_wrappers(k) for k in target}

    def score(item: tuple[str, dict[str, Entry]]) -> tuple[int, int]:
        state = item[1]
        return (len({strip_wrappers(k) for k in state} & wanted), -len(state))

    return max(groups.items(), key=score)
