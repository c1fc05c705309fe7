"""A hang as a picture (SVG): one lane per rank, along its group's collective sequence
numbers. Each lane is a bar of the collectives the rank got through and a box where it
stopped — the collective it waits in (pending, hatched) or its last one (completed) —
with the operation and group written in it; the rank that hangs the job is marked, a rank
that left no dump is a dashed empty lane. From ``gpudiag hang``'s verdict (a
:class:`~gpudiag.hang.result.HangResult` or its ``gpudiag.hang/1`` JSON).

Up to :data:`MAX_LANES` ranks get a lane each; a larger job is summarised: neighbouring
ranks that stopped at the same place share one lane (``ranks 8–63``), culprits and
missing ranks keep their own.
"""

from __future__ import annotations

from typing import Any

from gpudiag.render.svg import INK, MUTED, OKABE_ITO, Svg, document, empty, fit, ranges, wrap

MAX_LANES = 64
LANE_H, LANE_GAP = 22, 6
LABEL_W = 120
STOP_W = 230
CULPRIT = OKABE_ITO["vermilion"]
PENDING = OKABE_ITO["orange"]
DONE = OKABE_ITO["sky"]
MISSING = "#BBBBBB"


def hang_svg(result: Any) -> str:
    """The SVG of a hang verdict (or its JSON)."""
    data = document(result)
    title = "Hang timeline: where each rank stopped"
    rows = [r for r in data.get("ranks") or [] if isinstance(r, dict) and isinstance(r.get("rank"), int)]
    if not rows:
        return empty(title, "no rank in this verdict")
    culprits = {r for r in data.get("culprit_ranks") or [] if isinstance(r, int)}
    lanes = _lanes(rows, culprits)
    seqs = [int(r["seq"]) for r in rows if isinstance(r.get("seq"), int)]
    top_seq = max(seqs, default=1)

    width = 900.0
    x0 = 16 + LABEL_W
    track = width - x0 - STOP_W - 16  # px for sequence numbers 1 … top_seq - 1
    step = track / max(top_seq, 1)
    top = 86
    height = top + len(lanes) * (LANE_H + LANE_GAP) + 100
    svg = Svg(width, height, title)
    verdict = str(data.get("verdict") or "?")
    world = data.get("world_size")
    subtitle = f"verdict: {verdict}; {world} ranks" + (f"; hangs: {_names(culprits)}" if culprits else "")
    if len(lanes) < len(rows):
        subtitle += f"; {len(rows)} ranks in {len(lanes)} lanes (neighbours that stopped alike share one)"
    svg.heading(title, subtitle)
    svg.raw(
        '<defs><pattern id="pending" width="6" height="6" patternUnits="userSpaceOnUse" '
        'patternTransform="rotate(45)"><rect width="6" height="6" fill="#FBE3B0"/>'
        f'<line x1="0" y1="0" x2="0" y2="6" stroke="{PENDING}" stroke-width="3"/></pattern></defs>'
    )
    svg.text(
        x0, top - 12, "collectives completed (by sequence number in the rank's group) →", size=11, fill=MUTED
    )
    svg.text(x0 + track + 8, top - 12, "where it stopped", size=11, fill=MUTED)

    for i, (label, row, culprit) in enumerate(lanes):
        y = top + i * (LANE_H + LANE_GAP)
        if i % 2 == 0:
            svg.rect(12, y - 3, width - 24, LANE_H + 6, "#F5F5F5")
        weight = {"font-weight": "bold"} if culprit else {}
        svg.text(16, y + 15, fit(label, LABEL_W - 8), fill=CULPRIT if culprit else INK, **weight)
        if row.get("dump") is None:
            svg.rect(x0, y, track + STOP_W, LANE_H, "#ffffff", stroke=MISSING, **{"stroke-dasharray": "5 4"})
            svg.text(x0 + 8, y + 15, "no dump: dead, or killed before it could dump", fill=MUTED)
            continue
        seq = row.get("seq") if isinstance(row.get("seq"), int) else None
        done = (seq - 1 if row.get("state") == "pending" else seq) if seq else 0
        if done:
            svg.rect(x0, y + 5, step * min(done, top_seq), LANE_H - 10, DONE)
        xs = x0 + step * min(done, top_seq) + 2
        pending = row.get("state") == "pending"
        stroke = CULPRIT if culprit else INK
        svg.rect(
            xs, y, x0 + track + STOP_W - xs, LANE_H, "url(#pending)" if pending else "#ffffff",
            stroke=stroke, rx=3, **{"stroke-width": "2.5" if culprit else "1"},
        )  # fmt: skip
        what = f"{row.get('op') or '?'} #{seq if seq is not None else '?'} in {row.get('group') or '?'}"
        what += " (pending)" if pending else " (completed, last)"
        svg.rect(xs + 4, y + 3, min(len(what) * 7.3 + 8, x0 + track + STOP_W - xs - 8), LANE_H - 6, "#ffffff")
        svg.text(xs + 8, y + 15, fit(what, x0 + track + STOP_W - xs - 16))

    y = top + len(lanes) * (LANE_H + LANE_GAP) + 18
    y = svg.legend(
        16,
        y,
        [(DONE, "completed"), ("url(#pending)", "waiting in it (pending)"), ("#ffffff", "no dump")],
        width - 32,
    )
    for i, line in enumerate(wrap(data.get("summary") or "", width - 32)):
        svg.text(16, y + 18 * i, line, fill=MUTED)
    return svg.text_out()


def _key(row: dict[str, Any]) -> tuple[Any, ...]:
    return (row.get("dump") is None, row.get("group"), row.get("seq"), row.get("op"), row.get("state"))


def _lanes(rows: list[dict[str, Any]], culprits: set[int]) -> list[tuple[str, dict[str, Any], bool]]:
    """(label, row, is culprit) per lane: one per rank up to :data:`MAX_LANES`, else runs
    of neighbouring ranks that stopped alike (culprits alone)."""
    rows = sorted(rows, key=lambda r: r["rank"])
    if len(rows) <= MAX_LANES:
        return [(f"rank {r['rank']}", r, r["rank"] in culprits) for r in rows]
    runs: list[list[dict[str, Any]]] = []
    for r in rows:
        alone = r["rank"] in culprits
        if runs and not alone and runs[-1][0]["rank"] not in culprits and _key(runs[-1][-1]) == _key(r):
            runs[-1].append(r)
        else:
            runs.append([r])
    if len(runs) > MAX_LANES:  # too varied to show each run: keep culprits, then the first ones
        keep = [x for x in runs if x[0]["rank"] in culprits]
        runs = sorted(
            keep + [x for x in runs if x not in keep][: MAX_LANES - len(keep)], key=lambda x: x[0]["rank"]
        )
    out = []
    for run in runs:
        ranks = [r["rank"] for r in run]
        label = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}–{ranks[-1]}"
        out.append((label, run[0], ranks[0] in culprits))
    return out


def _names(ranks: set[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ranges(sorted(ranks))
