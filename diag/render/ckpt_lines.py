"""``ckpt inspect`` and ``ckpt convert`` results as plain lines, verdict first (shared by
the text and Markdown views)."""

from __future__ import annotations

from typing import Any


def ckpt_lines(kind: str, doc: dict[str, Any]) -> list[str]:
    """Plain lines shared by the text and markdown views of ckpt results."""
    lines = []
    if kind == "inspect":
        lines += inspect_lines(doc)
        lines += [f"  warning: {w}" for w in doc["warnings"]]
    else:
        verb = "would write" if doc["dry_run"] else "wrote"
        lines.append(f"{doc['src']} ({doc['format_in']}) -> {doc['dst']} ({doc['format_out']}): {verb}")
        for m in doc["mappings"]:
            how = " ".join([*(f"strip {p}" for p in m["strip"]), *([f"add {m['add']}"] if m["add"] else [])])
            lines.append(
                f"  {m['state_dict']}: {m['changed']} of {m['keys']} keys renamed ({how or 'unchanged'})"
            )
            lines.append(f"    first: {m['first'][0]!r} -> {m['first'][1]!r}")
            lines.append(f"    last:  {m['last'][0]!r} -> {m['last'][1]!r}")
        if doc["sidecar"]:
            lines.append(f"  sidecar: {doc['sidecar']} (the other entries' plain values; tensors named only)")
        if doc["verified"] and doc["format_out"] == "safetensors":
            lines.append("  verified: read back, every tensor written matches the input")
        elif doc["verified"]:
            lines.append(
                "  verified: read back as torch.load(weights_only=True) reads it; every tensor, "
                "and which tensors share storage, matches the input"
            )
        lines += [f"  note: {n}" for n in doc["notes"]]
    return lines


def inspect_lines(doc: dict[str, Any]) -> list[str]:
    """The verdict first (the format; whether it loads into --model, or the wrapper
    prefix to strip), then each state dict with its keys summarised, then the other entries
    (``--format json`` has every key)."""
    lines = [f"{doc['path']}: {doc['format']}"]
    m = doc["model"]
    if m is not None:
        fix = m.get("transformation")
        if m.get("loads_strictly"):
            lines.append("  loads strictly into --model as it is")
        elif fix:
            lines.append(f"  does NOT load strictly into --model as it is; fix: {fix}")
        else:
            lines.append(f"  does NOT load strictly into --model: {_no_fix(m)}")
        renames = m.get("renames") or []
        remains = renames[0] if renames and renames[0]["rename"] != "as it is" and not fix else m
        for what in ("missing", "unexpected"):
            if remains.get(what):
                lines.append(f"    {len(remains[what])} {what}, e.g. {remains[what][:3]}")
        for mismatch in (remains.get("shape_mismatches") or [])[:3]:
            lines.append(
                f"    shape {mismatch['key']}: checkpoint {mismatch['checkpoint']}, model {mismatch['model']}"
            )
        if len(renames) > 1 and not m.get("loads_strictly"):
            some = [f"{r['rename']}: {r['fits']}" for r in renames if r["fits"]]
            none = len(renames) - len(some)
            lines.append(
                f"    keys each renaming fits (of {renames[0]['keys']}): "
                + "; ".join(some + ([f"{none} other(s): 0"] if none else []))
            )
    else:
        for sd in doc["state_dicts"]:
            prefixes = "".join(sd["prefixes"])
            lines.append(
                f"  {sd['path']}: wrapper prefix {prefixes} on every key; `gpudiag ckpt convert` strips it"
                if prefixes
                else f"  {sd['path']}: no wrapper prefix on its keys"
            )
        if not doc["state_dicts"]:
            lines.append("  no model state dict found")
    root = any(sd["path"] == "(root)" for sd in doc["state_dicts"])
    for sd in doc["state_dicts"]:
        dtypes = ", ".join(f"{k} x{v}" for k, v in sd["dtypes"].items())
        prefixes = "".join(sd["prefixes"]) or "none"
        lines.append(
            f"  state dict {sd['path']}: {sd['tensors']} tensors, {sd['bytes'] / 2**20:.1f} MiB "
            f"({dtypes}); wrapper prefix {prefixes}"
        )
        lines += keys_summary(sd)
    for e in [] if root else doc["entries"]:  # a root state dict's entries are its keys
        if e["kind"] != "model state dict":
            value = f" = {e['value']!r}" if e["value"] is not None else ""
            lines.append(f"  {e['key']}: {e['kind']}{value}")
    return lines


def _no_fix(model: dict[str, Any]) -> str:
    """Why no renaming makes it load, from the best renaming: what it fixes and what remains."""
    renames = model.get("renames") or []
    if not renames:
        return "no renaming of prefixes makes it load"
    best = renames[0]
    if not best["fits"]:
        return (
            f"no renaming of prefixes makes any of its {best['keys']} keys fit: another model's checkpoint?"
        )
    left = []
    if best["shape_mismatches"]:
        left.append(f"{len(best['shape_mismatches'])} shape(s) differ")
    if best["missing"]:
        left.append(f"{len(best['missing'])} key(s) missing")
    if best["unexpected"]:
        left.append(f"{len(best['unexpected'])} unexpected")
    where = f"{best['rename']} fixes" if best["rename"] != "as it is" else "as it is, it fits"
    return (
        f"{where} {best['fits']} of {best['keys']} keys; left: {', '.join(left)} (below) — "
        "no renaming fixes those: the model is not the checkpoint's (e.g. another class count)"
    )


def keys_summary(sd: dict[str, Any]) -> list[str]:
    """A state dict's keys in two lines: how many, the first and last few, and the
    top-level names under the wrapper prefix with their counts."""
    keys = sd.get("keys") or [*sd["first_keys"], *sd["last_keys"]]
    count = len(keys)
    shown = [repr(k) for k in keys] if count <= 6 else [*map(repr, keys[:3]), "…", *map(repr, keys[-2:])]
    lines = [f"    keys ({count}): " + ", ".join(shown)]
    modules = sd.get("modules") or {}
    if len(modules) > 1:
        names = [f"{name} x{n}" for name, n in modules.items()]
        more = f", … ({len(names)} in all)" if len(names) > 8 else ""
        lines.append("    top-level names: " + ", ".join(names[:8]) + more)
    return lines
