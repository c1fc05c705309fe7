"""``ckpt inspect`` and ``ckpt convert`` results as plain lines, verdict first (shared by
the text and Markdown views)."""

from __future__ import annotations

from typing import Any


def ckpt_lines(kind: str, doc: dict[str, Any]) -> list[str]:
    """Plain lines shared by the text and markdown views of ckpt results."""
    lines = []
    if kind == "inspect" and doc.get("format") == "dcp":
        lines += dcp_lines(doc)
    elif kind == "inspect":
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


def _size(n: int | None) -> str:
    if n is None:
        return "missing"
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} bytes" if unit == "bytes" else f"{n:.1f} {unit}"
        n = n / 1024  # type: ignore[assignment]
    return str(n)


def dcp_lines(doc: dict[str, Any]) -> list[str]:
    """A DCP folder (``ckpt inspect|verify DIR``): the verdict and every finding first,
    then the groups, files, wrappers and the first tensors (``--format json`` has all)."""
    files = doc["files"]
    total = sum(f["bytes"] or 0 for f in files)
    saved = f"saved by {doc['world_size']} rank(s)" if doc["world_size"] else "ranks unknown"
    lines = [
        f"{doc['path']}: dcp (torch.distributed.checkpoint {doc['version'] or '?'}), {saved}, "
        f"{len(files)} file(s), {_size(total)}"
    ]
    findings = doc["findings"]
    bad = [f for f in findings if f["severity"] in ("warning", "error")]
    if not bad:
        what = "every byte range read and checked" if doc["command"] == "verify" else "structure checked"
        lines.append(f"  healthy: {what}, no problem found")
    else:
        errors = sum(f["severity"] == "error" for f in bad)
        lines.append(f"  {len(bad)} problem(s): {errors} error(s), {len(bad) - errors} warning(s)")
    for f in findings:
        lines.append(f"  {f['severity']} {f['code']}: {f['message']}")
        if f.get("fix") and f["severity"] != "info":
            lines.append(f"    fix: {f['fix']}")
    m = doc["model"]
    if m is not None:
        where = f" (group {m['group']!r})" if m["group"] else ""
        state = (
            "loads strictly into --model" if m["loads_strictly"] else "does NOT load strictly into --model"
        )
        lines.append(f"  {state}{where}" + (f"; fix: {m['rename']}" if m.get("rename") else ""))
    for g in doc["groups"]:
        name = g["name"] or "(top level)"
        lines.append(f"  group {name}: {g['tensors']} tensors, {g['objects']} objects, {_size(g['bytes'])}")
    for f in files:
        rank = f"rank {f['rank']}" if f["rank"] is not None else "rank ?"
        lines.append(f"  file {f['name']}: {rank}, {_size(f['bytes'])}")
    if doc["wrappers"]:
        shown = ", ".join(f"{k}. x{v}" for k, v in doc["wrappers"].items())
        lines.append(f"  wrapper segments in keys: {shown} (`ckpt convert --keys auto` removes them)")
    tensors = doc["tensors"]
    for t in tensors[:5]:
        lines.append(f"  tensor {t['key']} {t['shape']} {t['dtype']} in {len(t['chunks'])} chunk(s)")
    if len(tensors) > 5:
        lines.append(
            f"  … {len(tensors)} tensors and {len(doc['objects'])} objects in all (--format json lists them)"
        )
    if doc["command"] == "verify" and doc["verified_bytes"] is not None:
        lines.append(f"  read: {_size(doc['verified_bytes'])} of tensor values, each range's CRC-32 checked")
    return lines
