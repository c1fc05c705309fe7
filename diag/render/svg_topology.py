"""The topology as a picture (SVG): one box per GPU in a row, NVLink as arcs above them
(an all-to-all NVLink island — NVSwitch — as one band, not n(n-1)/2 arcs), and the PCIe
paths as nested frames below: GPUs that reach each other through at most a single PCIe
switch (PIX), several (PXB), the host bridge (PHB), the host bridges of one CPU socket
(NODE) or across sockets (SYS). The same facts as ``nvidia-smi topo -m``, drawn.

Input: a topology result (``gpudiag topology``'s report, or its ``gpudiag.topology/1``
JSON: ``gpus`` and ``pairs``). At most :data:`MAX_GPUS` GPUs are drawn; beyond, the
picture says how many were left out.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpudiag.render.svg import INK, MUTED, OKABE_ITO, Svg, document, empty, esc, fit, text_w

MAX_GPUS = 16
#: PCIe paths from nearest to farthest, with what each crosses (nvidia-smi's legend).
PATHS = (
    ("PIX", "one PCIe switch"),
    ("PXB", "several PCIe switches"),
    ("PHB", "the PCIe host bridge"),
    ("NODE", "host bridges of one CPU socket"),
    ("SYS", "across CPU sockets (QPI/UPI)"),
)
#: A frame's tint per path (Okabe-Ito, light): kind to every reader, and named in text.
TINT = {"PIX": "#E8F4FB", "PXB": "#E3F1EC", "PHB": "#FBF3DC", "NODE": "#F7ECF2", "SYS": "#FBEDE3"}
EDGE = {"PIX": OKABE_ITO["sky"], "PXB": OKABE_ITO["green"], "PHB": OKABE_ITO["orange"],
        "NODE": OKABE_ITO["purple"], "SYS": OKABE_ITO["vermilion"]}  # fmt: skip
NVLINK = OKABE_ITO["blue"]
CULPRIT = OKABE_ITO["vermilion"]
CELL_W, CELL_H = 92, 44


def topology_svg(result: Any, marked: Mapping[tuple[int, int], str] | None = None) -> str:
    """The SVG of a topology result (or its JSON). ``marked``: GPU pairs another check found
    broken → the finding's code, drawn as a red dashed link under the GPUs."""
    data = document(result)
    gpus = _gpus(data)
    title = "GPU topology: NVLink islands and PCIe paths"
    if len(gpus) < 1:
        return empty(title, "no GPU in this topology")
    left_out = max(len(gpus) - MAX_GPUS, 0)
    gpus = gpus[:MAX_GPUS]
    shown = {g["index"] for g in gpus}
    pairs = [p for p in data.get("pairs") or [] if isinstance(p, dict) and {p.get("a"), p.get("b")} <= shown]
    levels = _levels(sorted(shown), pairs)
    order = _order(sorted(shown), levels)
    nvlink = {(min(p["a"], p["b"]), max(p["a"], p["b"])): p for p in pairs if p.get("kind") == "nvlink"}
    islands = _islands(sorted(shown), nvlink)
    frames = _frames(levels, islands)

    # x of each GPU: gaps wide enough for the frames that close and open between neighbours
    pad = {level: 8 + 9 * k for k, level in enumerate(sorted({f[0] for f in frames}, key=_rank))}
    x, xs = 16.0, {}
    for i, g in enumerate(order):
        if i:
            prev = order[i - 1]
            closing = max(
                (pad[lv] for lv, members in frames if prev in members and g not in members), default=0
            )
            opening = max(
                (pad[lv] for lv, members in frames if g in members and prev not in members), default=0
            )
            x += CELL_W + 12 + closing + opening
        else:
            x += max((pad[lv] for lv, members in frames if g in members), default=0)
        xs[g] = x
    right = x + CELL_W + max((pad[lv] for lv, members in frames if order[-1] in members), default=0) + 16

    arcs, bands = _arcs(islands, nvlink, order)
    arc_h = max((18 + 16 * abs(order.index(a) - order.index(b)) for a, b in arcs), default=0)
    top = 56 + (arc_h + 20 if arcs else 0) + (26 if bands else 0) + 6 * len(pad)
    label_rows = len(pad)
    bottom_frames = top + CELL_H + 8 + 18 * label_rows + 8
    key_y = bottom_frames + 22
    width = max(right + (190 if marked else 0), 620.0)
    bad = sorted((a, b, code) for (a, b), code in (marked or {}).items() if a in xs and b in xs and a != b)[
        :8
    ]
    key_y += 30 * len(bad)
    rows = 1 + bool(not frames and nvlink) + bool(_p2p_notes(pairs)) + bool(left_out)
    svg = Svg(width, key_y + 20 * rows + 8, title)
    n_isl = sum(1 for i in islands if len(i) > 1)
    svg.heading(
        title,
        f"{len(order)} GPU{'s' if len(order) != 1 else ''}; "
        + (f"{n_isl} NVLink island{'s' if n_isl != 1 else ''}" if n_isl else "no NVLink"),
    )

    # PCIe frames, outermost first; each level's name on its own row under the GPUs (drawn
    # last, on the frame's tint, so a marked pair's line passes behind it)
    labels: list[tuple[float, float, str, str]] = []
    for level, members in sorted(frames, key=lambda f: -_rank(f[0])):
        k = sorted(pad, key=_rank).index(level)
        xa = min(xs[m] for m in members) - pad[level]
        xb = max(xs[m] for m in members) + CELL_W + pad[level]
        ya = top - 6 * (k + 1)
        yb = top + CELL_H + 8 + 18 * (k + 1)
        svg.rect(xa, ya, xb - xa, yb - ya, TINT[level], stroke=EDGE[level], rx=6, **{"stroke-width": "1.5"})
        labels.append((xa + 6, yb - 5, fit(f"{level}: {dict(PATHS)[level]}", xb - xa - 12), TINT[level]))

    # NVLink: an all-to-all island as one band above its GPUs, other links as arcs
    base = top - 6 * len(pad) - 2
    for island, link in bands:
        xa, xb = min(xs[m] for m in island), max(xs[m] for m in island) + CELL_W
        y = base - 22.0
        svg.rect(xa, y, xb - xa, 16, NVLINK, rx=8)
        svg.text(xa + 8, y + 12, fit(f"{link} all-to-all: {len(island)} GPUs", xb - xa - 16), fill="#ffffff")
    arc_base = base - (26 if bands else 0)
    for a, b in arcs:
        pair = nvlink[(min(a, b), max(a, b))]
        xa, xb = xs[a] + CELL_W / 2, xs[b] + CELL_W / 2
        h = 18 + 16 * abs(order.index(a) - order.index(b))
        width_px = _arc_width(int(pair.get("nvlinks") or 1))
        svg.path(
            f"M{xa:.1f},{arc_base:.1f} C{xa:.1f},{arc_base - h * 1.3:.1f} {xb:.1f},{arc_base - h * 1.3:.1f} "
            f"{xb:.1f},{arc_base:.1f}",
            fill="none",
            stroke=NVLINK,
            **{"stroke-width": f"{width_px:.1f}"},
        )
        if len(arcs) > 6:  # too many to label: the legend names each link's line width
            continue
        label = esc(pair.get("link") or "NV", 8)
        mx, my = (xa + xb) / 2, arc_base - h * 0.975
        w = text_w(str(pair.get("link") or "NV")[:8]) + 6
        svg.rect(mx - w / 2, my - 10, w, 14, "#ffffff", rx=3)
        svg.text(mx, my + 1, label, fill=NVLINK, **{"text-anchor": "middle"})

    for g in order:
        info = next(x for x in gpus if x["index"] == g)
        svg.rect(xs[g], top, CELL_W, CELL_H, "#ffffff", stroke=INK, rx=4, **{"stroke-width": "1.5"})
        svg.text(xs[g] + CELL_W / 2, top + 18, f"GPU {g}", **{"text-anchor": "middle", "font-weight": "bold"})
        second = info.get("name") or (f"CPU {info['cpu_affinity']}" if info.get("cpu_affinity") else "")
        if second:
            svg.text(
                xs[g] + CELL_W / 2, top + 35, fit(second, CELL_W - 8, size=11), size=11, fill=MUTED,
                **{"text-anchor": "middle"},
            )  # fmt: skip

    for k, (a, b, code) in enumerate(bad):
        xa, xb = sorted((xs[a] + CELL_W / 2, xs[b] + CELL_W / 2))
        yk = bottom_frames + 14 + 30 * k
        svg.line(xa, top + CELL_H, xa, yk, CULPRIT, **{"stroke-width": "2", "stroke-dasharray": "4 3"})
        svg.line(xb, top + CELL_H, xb, yk, CULPRIT, **{"stroke-width": "2", "stroke-dasharray": "4 3"})
        svg.line(xa, yk, xb, yk, CULPRIT, **{"stroke-width": "3", "stroke-dasharray": "6 3"})
        label = f"GPU {a}–{b}: {code}"
        svg.rect(xb + 6, yk - 10, text_w(label) + 8, 16, "#ffffff")
        svg.text(xb + 10, yk + 3, fit(label, 300), fill=CULPRIT, **{"font-weight": "bold"})
    for x, y, label, tint in labels:
        plain = label.replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">")
        svg.rect(x - 2, y - 11, text_w(plain) + 4, 14, tint)
        svg.text(x, y, label, fill=INK)
    y = _nvlink_key(svg, key_y, {str(p.get("link")): int(p.get("nvlinks") or 1) for p in nvlink.values()})
    if not frames and nvlink:
        svg.text(16, y, "the PCIe paths behind NVLink pairs are not in nvidia-smi's matrix", fill=MUTED)
        y += 20
    notes = _p2p_notes(pairs)
    if notes:
        svg.text(16, y, fit("P2P not OK: " + notes, width - 32), fill=OKABE_ITO["vermilion"])
        y += 20
    if left_out:
        svg.text(16, y, fit(f"… and {left_out} more GPUs not drawn (first {MAX_GPUS} shown)", width - 32))
    return svg.text_out()


def _nvlink_key(svg: Svg, y: float, links: dict[str, int]) -> float:
    """A line sample per NVLink width (NV1, NV2, …) at ``y``; returns the y below."""
    x = 16.0
    for link, count in sorted(links.items(), key=lambda kv: kv[1])[:8]:
        svg.line(x, y - 4, x + 28, y - 4, NVLINK, **{"stroke-width": f"{_arc_width(count):.1f}"})
        label = f"NVLink {link[:8]} ({count} link{'s' if count != 1 else ''})"
        svg.text(x + 34, y, esc(label))
        x += 34 + text_w(label) + 20
    return y + 22 if links else y


def _arc_width(nvlinks: int) -> float:
    return min(1.5 + 1.2 * max(nvlinks, 1), 7.0)  # NV1 2.7 px, NV2 3.9, NV4 6.3, more 7


def _gpus(data: dict[str, Any]) -> list[dict[str, Any]]:
    gpus = data.get("gpus")
    if not isinstance(gpus, dict):
        return []
    out = [g for g in gpus.values() if isinstance(g, dict) and isinstance(g.get("index"), int)]
    return sorted(out, key=lambda g: g["index"])


def _rank(level: str) -> int:
    return [p for p, _ in PATHS].index(level)


def _levels(gpus: list[int], pairs: list[dict[str, Any]]) -> dict[str, list[frozenset[int]]]:
    """For each PCIe path, the groups of GPUs joined by NVLink or a path no farther
    (single linkage: NVLink pairs count as nearest, their PCIe path is not shown)."""
    out = {}
    for level, _ in PATHS:
        parent = {g: g for g in gpus}

        def find(g: int, parent: dict[int, int] = parent) -> int:
            while parent[g] != g:
                g = parent[g]
            return g

        for p in pairs:
            path = p.get("path")
            near = p.get("kind") == "nvlink" or (path in TINT and _rank(path) <= _rank(level))
            if near and p["a"] in parent and p["b"] in parent:
                parent[find(p["a"])] = find(p["b"])
        groups: dict[int, set[int]] = {}
        for g in gpus:
            groups.setdefault(find(g), set()).add(g)
        out[level] = sorted((frozenset(s) for s in groups.values()), key=min)
    return out


def _frames(
    levels: dict[str, list[frozenset[int]]], islands: list[list[int]]
) -> list[tuple[str, frozenset[int]]]:
    """The frames to draw: a group of two or more GPUs at the first level it appears
    (the level whose path joins its parts); a group NVLink alone joins is an island, drawn
    by its links, not a frame."""
    seen = {frozenset(i) for i in islands}
    frames = []
    for level, _ in PATHS:
        for group in levels[level]:
            if len(group) > 1 and group not in seen:
                seen.add(group)
                frames.append((level, group))
    return frames


def _order(gpus: list[int], levels: dict[str, list[frozenset[int]]]) -> list[int]:
    """GPUs ordered so every group is contiguous: by their group at the farthest level,
    then the next nearer one, … then by number."""

    def key(g: int) -> tuple[int, ...]:
        return (*(min(next(s for s in levels[lv] if g in s)) for lv, _ in reversed(PATHS)), g)

    return sorted(gpus, key=key)


def _islands(gpus: list[int], nvlink: dict[tuple[int, int], Any]) -> list[list[int]]:
    parent = {g: g for g in gpus}

    def find(g: int) -> int:
        while parent[g] != g:
            g = parent[g]
        return g

    for a, b in nvlink:
        parent[find(a)] = find(b)
    groups: dict[int, list[int]] = {}
    for g in gpus:
        groups.setdefault(find(g), []).append(g)
    return sorted(groups.values(), key=min)


def _arcs(
    islands: list[list[int]], nvlink: dict[tuple[int, int], Any], order: list[int]
) -> tuple[list[tuple[int, int]], list[tuple[list[int], str]]]:
    """NVLink pairs to draw as arcs, and all-to-all islands (every pair the same link,
    three GPUs or more, contiguous in ``order``) to draw as one band."""
    arcs, bands = [], []
    for island in islands:
        if len(island) < 2:
            continue
        links = {nvlink.get((a, b), {}).get("link") for i, a in enumerate(island) for b in island[i + 1 :]}
        positions = sorted(order.index(g) for g in island)
        contiguous = positions[-1] - positions[0] == len(island) - 1
        if len(island) > 2 and None not in links and len(links) == 1 and contiguous:
            bands.append((island, str(links.pop())))
        else:
            arcs += [(a, b) for (a, b) in nvlink if a in island]
    return sorted(arcs, key=lambda ab: -abs(order.index(ab[0]) - order.index(ab[1]))), bands


def _p2p_notes(pairs: list[dict[str, Any]]) -> str:
    bad = [p for p in pairs if p.get("p2p") not in (None, "OK")]
    return ", ".join(f"{p['a']}-{p['b']} {str(p['p2p'])[:8]}" for p in bad[:12]) + (
        " …" if len(bad) > 12 else ""
    )
