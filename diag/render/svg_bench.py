"""bench as a picture (SVG): one bar per measured case (strategy × GPUs × precision), the
median step split into its phases (data, copy, scatter, replicate, forward, gather,
backward, all-reduce, optimizer, other), samples/s at the right. The phases' colours are
Paul Tol's muted scheme; a phase wide enough carries its name too, so colour is never the
only way to tell them apart. From ``gpudiag bench``'s report or its ``gpudiag.bench/1``
JSON; at most :data:`MAX_CASES` bars (the rest counted).
"""

from __future__ import annotations

from typing import Any

from gpudiag.render.svg import INK, MUTED, TOL_MUTED, Svg, document, empty, esc, fit, num, text_w

MAX_CASES = 24
PHASES = (
    "data",
    "copy",
    "scatter",
    "replicate",
    "forward",
    "gather",
    "backward",
    "allreduce",
    "optimizer",
    "other",
)
COLOUR = dict(zip(PHASES, TOL_MUTED, strict=True))
#: Phases on a dark colour get white text.
DARK = {"data", "forward", "backward", "gather", "allreduce"}
BAR_H, GAP = 24, 10
LABEL_W, RATE_W = 150, 150


def bench_svg(result: Any) -> str:
    """The SVG of a bench report (or its JSON)."""
    data = document(result)
    title = "bench: where each strategy's step goes"
    cases = [
        c for c in data.get("cases") or [] if isinstance(c, dict) and isinstance(c.get("phases_s"), dict)
    ]
    cases = [c for c in cases if c.get("error") is None]
    if not cases:
        return empty(title, "no measured case")
    left_out = max(len(cases) - MAX_CASES, 0)
    cases = cases[:MAX_CASES]
    totals = [sum(max(num(v) or 0.0, 0.0) for v in c["phases_s"].values()) for c in cases]
    longest = max(totals) or 1.0

    width = 900.0
    x0 = 16 + LABEL_W
    track = width - x0 - RATE_W - 16
    top = 70
    height = top + len(cases) * (BAR_H + GAP) + 110
    svg = Svg(width, height, title)
    simulated = " (simulated: CPU virtual devices)" if data.get("simulated") else ""
    model = (data.get("config") or {}).get("model") if isinstance(data.get("config"), dict) else None
    svg.heading(title, f"median step per case, split into phases; model {str(model)[:60]}{simulated}")
    svg.text(x0 + track + 8, top - 8, "samples/s", size=11, fill=MUTED)

    for i, (case, total) in enumerate(zip(cases, totals, strict=True)):
        y = top + i * (BAR_H + GAP) + 0.0
        name = f"{case.get('strategy')} ×{case.get('gpus')} {case.get('dtype')}"
        svg.text(16, y + 16, fit(name, LABEL_W - 8))
        x = float(x0)
        for phase in PHASES:
            seconds = max(num(case["phases_s"].get(phase)) or 0.0, 0.0)
            w = track * seconds / longest
            if w <= 0:
                continue
            svg.rect(x, y, w, BAR_H, COLOUR[phase], stroke="#ffffff", **{"stroke-width": "0.5"})
            label = f"{phase} {seconds * 1e3:.0f} ms"
            if text_w(label) + 8 > w:
                label = phase
            if text_w(label) + 8 <= w:
                svg.text(x + 4, y + 16, esc(label), fill="#ffffff" if phase in DARK else INK, size=11)
            x += w
        rate = num(case.get("samples_per_s"))
        step = total * 1e3
        svg.text(
            x0 + track + 8, y + 16, esc(f"{rate:,.0f}" if rate is not None else "–") + f" · {step:.0f} ms"
        )

    y = top + len(cases) * (BAR_H + GAP) + 16.0
    used = [p for p in PHASES if any((num(c["phases_s"].get(p)) or 0) > 0 for c in cases)]
    y = svg.legend(16, y, [(COLOUR[p], p) for p in used], width - 32)
    svg.text(16, y, f"bar length: median step time (longest {longest * 1e3:.0f} ms)", fill=MUTED)
    if left_out:
        svg.text(16, y + 20, f"… and {left_out} more cases not drawn (first {MAX_CASES} shown)", fill=MUTED)
    return svg.text_out()
