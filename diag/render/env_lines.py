"""The ``gpudiag.env/1`` document (``gpudiag env``, a bundle's env section) as plain
lines, shared by the text and Markdown views: a renderer, so it lives in the core and
needs nothing from the check that collects the document."""

from __future__ import annotations

import json
from typing import Any


def env_lines(document: dict[str, Any]) -> list[str]:
    """The ``gpudiag.env/1`` document as plain ``key: value`` lines under section titles
    (shared by the text and Markdown views); long values are indented below their key."""
    lines: list[str] = []
    for name, fields in document.get("sections", {}).items():
        lines.append(f"{name}:")
        if not fields:
            lines.append("  (none)")
        for key, value in fields.items():
            if isinstance(value, dict) and "matrix" in value and "labels" in value:
                value = _matrix_text(value)
            elif isinstance(value, (dict, list)):
                value = json.dumps(value, separators=(", ", ": "))
            text = "N/A" if value is None else str(value)
            if "\n" in text:
                lines.append(f"  {key}:")
                lines += [f"    {line}" for line in text.splitlines()]
            else:
                lines.append(f"  {key}: {text}")
    missing = document.get("missing") or {}
    if missing:
        lines.append("could not collect:")
        lines += [f"  {key}: {why}" for key, why in missing.items()]
    return lines


def _matrix_text(machine: dict[str, Any]) -> str:
    """A machine file's link matrix as ``nvidia-smi topo -m`` lays it out."""
    labels = machine["labels"]
    width = max(len(str(x)) for x in [*labels, *(c for row in machine["matrix"] for c in row if c)])
    rows = ["".ljust(width) + "  " + "  ".join(str(label).ljust(width) for label in labels)]
    for label, row in zip(labels, machine["matrix"], strict=False):
        rows.append(str(label).ljust(width) + "  " + "  ".join(str(c or "?").ljust(width) for c in row))
    return "\n".join(r.rstrip() for r in rows)
