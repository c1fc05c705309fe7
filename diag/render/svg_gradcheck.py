"""gradcheck as a picture (SVG): the relative gradient error of each module (its
parameters' largest ``rel_norm_err`` against the reference), one row per module in the
model's order, on a log scale, one marker per comparison (strategy × mode: distinct
shape and colour), with the tolerance as a vertical line. Where the error starts and
where it stays shows which layers differ. From ``gpudiag gradcheck``'s report or its
``gpudiag.gradcheck/1`` JSON.

A model with more than :data:`MAX_ROWS` modules is drawn by module depth: parameters are
grouped by the first few components of their names (``layer1.0``, then ``layer1``), the
deepest grouping that fits.
"""

from __future__ import annotations

import math
from typing import Any

from gpudiag.render.svg import INK, MUTED, OKABE_ITO, Svg, document, empty, esc, fit, num

MAX_ROWS = 48
MAX_COMPARISONS = 6
ROW_H = 18
LABEL_W = 220
FLOOR = 1e-12
#: (colour, marker) per comparison: colour-blind-safe colours and distinct shapes.
STYLES = (
    (OKABE_ITO["vermilion"], "circle"),
    (OKABE_ITO["blue"], "square"),
    (OKABE_ITO["green"], "triangle"),
    (OKABE_ITO["purple"], "diamond"),
    (OKABE_ITO["orange"], "cross"),
    (OKABE_ITO["sky"], "triangle-down"),
)


def gradcheck_svg(result: Any) -> str:
    """The SVG of a gradcheck report (or its JSON)."""
    data = document(result)
    title = "gradcheck: gradient error by module"
    comparisons = [
        c for c in data.get("comparisons") or [] if isinstance(c, dict) and isinstance(c.get("params"), list)
    ][:MAX_COMPARISONS]
    names = []
    for c in comparisons:
        for p in c["params"]:
            if isinstance(p, dict) and isinstance(p.get("name"), str) and p["name"] not in names:
                names.append(p["name"])
    if not names:
        return empty(title, "no compared parameter")
    depth, rows = _rows(names)
    tolerance = (
        num((data.get("tolerance") or {}).get("rel_norm_err"))
        if isinstance(data.get("tolerance"), dict)
        else None
    )

    errors: list[dict[str, float]] = []
    for c in comparisons:
        per: dict[str, float] = {}
        for p in c["params"]:
            if isinstance(p, dict) and isinstance(p.get("name"), str):
                e = num(p.get("rel_norm_err"))
                module = _module(p["name"], depth)
                if e is not None:
                    per[module] = max(per.get(module, 0.0), e)
        errors.append(per)
    values = [v for per in errors for v in per.values() if v > 0] + ([tolerance] if tolerance else [])
    lo = math.floor(math.log10(max(min(values, default=FLOOR), FLOOR)))
    hi = math.ceil(math.log10(max(max(values, default=1.0), FLOOR * 10)))
    hi = max(hi, lo + 1)

    width = 900.0
    x0 = 16 + LABEL_W
    track = width - x0 - 24
    top = 84
    height = top + len(rows) * ROW_H + 120

    def x_of(v: float) -> float:
        return x0 + track * (math.log10(max(v, 10.0**lo)) - lo) / (hi - lo)

    svg = Svg(width, height, title)
    by = "" if depth is None else f"; modules cut to {depth} name parts"
    svg.heading(
        title, f"each module's largest relative norm error of its parameters' gradients, log scale{by}"
    )
    for e in range(lo, hi + 1):
        x = x_of(10.0**e)
        svg.line(x, top - 6, x, top + len(rows) * ROW_H, "#DDDDDD")
        svg.text(x, top - 10, f"1e{e}", size=11, fill=MUTED, **{"text-anchor": "middle"})
    for i, module in enumerate(rows):
        y = top + i * ROW_H
        if i % 2 == 0:
            svg.rect(12, y, width - 24, ROW_H, "#F5F5F5")
        svg.text(16, y + 13, fit(module, LABEL_W - 8), size=11)
    if tolerance:
        x = x_of(tolerance)
        svg.line(
            x, top - 4, x, top + len(rows) * ROW_H, INK, **{"stroke-dasharray": "6 3", "stroke-width": "1.5"}
        )
    for k, per in enumerate(errors):
        colour, shape = STYLES[k]
        dy = (k - (len(errors) - 1) / 2) * min(5.0, 15 / len(errors))  # equal errors stay visible
        for i, module in enumerate(rows):
            if module in per:
                svg.raw(
                    _marker(shape, x_of(max(per[module], FLOOR)), top + i * ROW_H + ROW_H / 2 + dy, colour)
                )

    y = top + len(rows) * ROW_H + 24
    items = []
    for k, c in enumerate(comparisons):
        colour, shape = STYLES[k]
        label = f"{c.get('strategy')} ×{c.get('world_size')} {c.get('mode')}"
        items.append((colour, shape, label))
    x = 16.0
    for colour, shape, label in items:
        w = 22 + len(label) * 7.3 + 18
        if x + w > width - 16:
            x, y = 16.0, y + 20
        svg.raw(_marker(shape, x + 6, y - 4, colour))
        svg.text(x + 16, y, fit(label, w))
        x += w
    y += 22
    if tolerance:
        svg.line(16, y - 4, 40, y - 4, INK, **{"stroke-dasharray": "6 3", "stroke-width": "1.5"})
        svg.text(46, y, esc(f"tolerance {tolerance:.1e} ({(data.get('tolerance') or {}).get('dtype')})"))
        y += 20
    note = f"verdict: {data.get('verdict')}; at or below 1e{lo}: drawn at the left edge"
    svg.text(16, y, fit(note, width - 32), fill=MUTED)
    return svg.text_out()


def _module(name: str, depth: int | None) -> str:
    parts = name.split(".")
    module = parts[:-1] or parts  # a parameter's module: its name without the last part
    return ".".join(module if depth is None else module[:depth]) or name


def _rows(names: list[str]) -> tuple[int | None, list[str]]:
    """(depth, modules in first-seen order): the full module names when at most
    :data:`MAX_ROWS`, else the deepest prefix depth that fits, else the first ones."""
    candidates: list[int | None] = [None, *range(max(n.count(".") for n in names), 0, -1)]
    for depth in candidates:
        rows = list(dict.fromkeys(_module(n, depth) for n in names))
        if len(rows) <= MAX_ROWS:
            return depth, rows
    return 1, list(dict.fromkeys(_module(n, 1) for n in names))[:MAX_ROWS]


def _marker(shape: str, x: float, y: float, colour: str) -> str:
    r = 5.0
    attrs = f'fill="{colour}" stroke="{INK}" stroke-width="0.6"'
    if shape == "circle":
        return f'<circle cx="{x:.1f}" cy="{y:.1f}" r="{r}" {attrs}/>'
    if shape == "square":
        return f'<rect x="{x - r:.1f}" y="{y - r:.1f}" width="{2 * r}" height="{2 * r}" {attrs}/>'
    if shape == "cross":
        return (
            f'<path d="M{x - r:.1f},{y - r:.1f} L{x + r:.1f},{y + r:.1f} M{x - r:.1f},{y + r:.1f} '
            f'L{x + r:.1f},{y - r:.1f}" stroke="{colour}" stroke-width="2.5"/>'
        )
    points = {
        "triangle": [(x, y - r - 1), (x + r + 1, y + r), (x - r - 1, y + r)],
        "triangle-down": [(x, y + r + 1), (x + r + 1, y - r), (x - r - 1, y - r)],
        "diamond": [(x, y - r - 1), (x + r + 1, y), (x, y + r + 1), (x - r - 1, y)],
    }[shape]
    return f'<polygon points="{" ".join(f"{a:.1f},{b:.1f}" for a, b in points)}" {attrs}/>'
