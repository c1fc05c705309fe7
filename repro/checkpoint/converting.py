"""``convert``: rename the keys of a checkpoint's model state dict(s) into a new file.

The renaming is planned per state dict (:mod:`.keys`: auto, ``--strip``/``--add``, or the
one that fits ``--model``), the output written atomically in the input's format or as
safetensors, and checked (:mod:`.verify`) before it is kept: a torch zip's records by
their CRC-32 as they are copied, its pickle read back by weights-only rules.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpudiag.errors import InputError
from gpudiag.fileio import atomic_output
from gpudiag.repro.checkpoint import keys as K
from gpudiag.repro.checkpoint import pickles, torchzip, verify
from gpudiag.repro.checkpoint.reading import (
    Loaded,
    load,
    match_report,
    model_keys,
    plan_for_model,
    state_dicts,
)
from gpudiag.unpickle import one_line

CONVERT_SCHEMA = "gpudiag.ckpt-convert/1"


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

    def __repr__(self) -> str:
        state = "dry run" if self.dry_run else ("verified" if self.verified else "written, not verified")
        return (
            f"<ConvertResult {self.format_in} -> {self.format_out} · {state} · mappings {len(self.mappings)}>"
        )

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


def _check_prefixes(strip: list[str], add: str | None) -> None:
    if add is not None and not add:
        raise InputError("--add needs a prefix ending with a dot, e.g. module. (an empty one adds nothing)")
    for p in [*strip, *([add] if add else [])]:
        if not p.endswith(".") or p.startswith("."):
            raise InputError(f"prefix {p!r} must end with a dot and name whole segments, e.g. module.")


def _strip_notes(found: list[tuple[K.Path, dict[str, Any]]], strip: list[str]) -> list[str]:
    """How many keys each ``--strip`` prefix applies to (in order, as Plan.rename strips);
    a prefix no key of any state dict starts with is refused: writing an unchanged copy is
    not what was asked for."""
    notes = []
    for i, prefix in enumerate(strip):
        counts = []
        for where, state in found:
            plan = K.Plan(where, strip[:i])
            counts.append(sum(1 for k in state if plan.rename(k).startswith(prefix)))
        if not any(counts):
            where, state = found[0]
            raise InputError(
                f"--strip {prefix}: no key starts with it, nothing to strip (keys of {K.path_text(where)} "
                f"look like {next(iter(state))!r}; `gpudiag ckpt inspect` lists the prefixes)"
            )
        for (where, state), n in zip(found, counts, strict=True):
            if n < len(state):
                notes.append(
                    f"--strip {prefix}: {n} of {len(state)} keys of {K.path_text(where)} start with it; "
                    + ("only those were renamed" if n else "that state dict is unchanged")
                )
    return notes


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
        notes = _strip_notes(found, strip)
        out = []
        for where, state in found:
            plan = K.Plan(where, list(strip), add or "")
            K.apply(state, plan)  # collisions refused here, before anything is written
            out.append(plan)
        out[0].notes.extend(notes)
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
    _check_prefixes(list(strip), add)
    if dst.exists() and src.exists() and os.path.samefile(src, dst):
        raise InputError("OUT is IN: write the converted checkpoint to another file")
    loaded = load(src, trust=trust)
    fmt_out = to or ("safetensors" if loaded.format == "safetensors" else "pt")
    if fmt_out not in ("pt", "safetensors"):
        raise InputError(f"--to must be pt or safetensors, not {fmt_out!r}")
    plans = _plans(loaded, list(strip), add, model)
    found = dict(state_dicts(loaded))
    notes = [n for plan in plans for n in plan.notes]
    to_safetensors = fmt_out == "safetensors" and loaded.format != "safetensors"
    mappings = []
    for plan in plans[:1] if to_safetensors else plans:  # safetensors holds one state dict
        old = list(found[plan.path])
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
    tree = loaded.tree
    for plan in plans:
        tree = K.replace_at(tree, plan.path, K.apply(found[plan.path], plan))
    if to_safetensors:
        notes.extend(verify.safetensors_notes(tree, plans[0].path, dst))
    if dry_run:
        return result
    refused = None
    if fmt_out == "safetensors":
        from gpudiag.repro.checkpoint.safetensors_io import write_safetensors

        result.sidecar = write_safetensors(loaded, tree, plans, dst, force)
    elif loaded.format == "torch-zip" and loaded.archive is not None and not loaded.trusted:
        refused = _write_zip(loaded, tree, dst, force)
    elif loaded.format == "safetensors":
        from safetensors.torch import load_file

        try:
            tensors = load_file(str(loaded.path))
        except Exception as exc:  # safetensors' own checks of a damaged file
            raise InputError(f"{loaded.path}: damaged safetensors file ({one_line(str(exc))})") from exc
        renamed = {new: tensors[old] for old, new in zip(found[()], tree, strict=True)}
        refused = _write_torch(loaded, renamed, dst, force)
        notes.append("safetensors to pt: the tensors pass through memory (torch.save needs them all)")
    else:
        refused = _write_torch(loaded, tree, dst, force)
        notes.append(f"{loaded.format} input: written through torch.save (memory grows with the checkpoint)")
    if refused is not None:
        notes.append(refused)
    result.verified = refused is None
    return result


def _write_zip(loaded: Loaded, tree: Any, dst: Path, force: bool) -> str | None:
    """Write the renamed pickle and copy every record, each record's CRC-32 checked as it
    is written (:func:`torchzip.rewrite`); then read the output's directory and small
    pickle back — the pickle by weights-only rules — and compare them with what was
    meant. The reason torch's weights-only load refuses the output (as it refuses the
    input), or None. atomic_output fsyncs and renames once this returns."""
    assert loaded.archive is not None
    expected = verify.tensor_map(tree)
    with atomic_output(dst, force=force) as out:
        torchzip.rewrite(loaded.archive, pickles.dumps(tree), out)
        out.flush()
        written = torchzip.open_archive(Path(out.name), str(dst))
        torchzip.same_records(loaded.archive, written, str(dst))
        refused = verify.read_back(written.pickle, loaded.archive.pickle, expected, dst)
    return refused


def _write_torch(loaded: Loaded, tree: Any, dst: Path, force: bool) -> str | None:
    """torch.save, read back with torch.load (weights-only unless the input was trusted)
    and compared, tensors and their sharing; for a trusted input, also by the rules of
    weights-only: the reason it would be refused, or None."""
    import torch

    with atomic_output(dst, force=force) as out:
        torch.save(tree, out)
        out.flush()
        back = torch.load(out.name, map_location="cpu", weights_only=not loaded.trusted)
        if not verify.same_tensors(tree, back):
            raise InputError(f"{dst}: verification failed: the tensors read back differ from the input's")
        if not loaded.trusted:
            return None
        written = torchzip.open_archive(Path(out.name), str(dst))
        return verify.weights_only_refusal(written.pickle, dst, trusted=True)
