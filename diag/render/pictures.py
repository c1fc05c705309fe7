"""The pictures of a report bundle: ``<check>.svg`` for each check that has one
(topology, hang, bench, gradcheck) and ``REPORT.html``, one self-contained page — the
checks' table, each check's findings and its picture inline, ``REPORT.md`` at the end — with
no script, no stylesheet or font from elsewhere, no external URL: it opens from the bundle
offline, in any browser. Everything comes from the report's JSON (``report.json``), so a
bundle read back draws the same.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from gpudiag.render.svg import empty, esc
from gpudiag.render.svg_bench import bench_svg
from gpudiag.render.svg_gradcheck import gradcheck_svg
from gpudiag.render.svg_hang import hang_svg
from gpudiag.render.svg_topology import topology_svg

#: check name → its picture (from the check's result JSON).
PICTURES: dict[str, Callable[[Any], str]] = {
    "topology": topology_svg,
    "hang": hang_svg,
    "bench": bench_svg,
    "gradcheck": gradcheck_svg,
}
HTML_NAME = "REPORT.html"
#: What a damaged result raises while drawn: the bundle gets a picture saying so instead.
_DAMAGED = (TypeError, ValueError, KeyError, AttributeError, IndexError, ZeroDivisionError, OverflowError)
#: status → its chip's colours (background, text); the word is always written, so the colour
#: only repeats it (no emoji: a minimal container has no font for them).
STATUS_COLOURS = {
    "pass": ("#D4EDE4", "#00553D"),
    "warning": ("#FBEBC8", "#6B4500"),
    "warn": ("#FBEBC8", "#6B4500"),
    "fail": ("#F8D7C4", "#7A2E00"),
    "error": ("#F8D7C4", "#7A2E00"),
}


def picture(name: str, result: Any, marked: Mapping[tuple[int, int], str] | None = None) -> str:
    """The SVG of check ``name``'s result; a result it cannot draw gives a picture that says
    so. ``marked``: for the topology, GPU pairs found broken (:func:`broken_pairs`)."""
    try:
        return topology_svg(result, marked) if name == "topology" else PICTURES[name](result)
    except _DAMAGED as exc:
        return empty(f"{name}: no picture", f"its result could not be drawn ({type(exc).__name__})")


def check_pictures(report: Mapping[str, Any]) -> dict[str, str]:
    """``<check>.svg`` → SVG for each check of a ``gpudiag.report/1`` document that has a
    picture and a result."""
    out = {}
    marked = broken_pairs(report)
    for check in report.get("checks") or []:
        if not isinstance(check, dict) or not isinstance(check.get("result"), dict):
            continue
        if check.get("name") in PICTURES:
            out[f"{check['name']}.svg"] = picture(check["name"], check["result"], marked)
    return out


def broken_pairs(report: Mapping[str, Any]) -> dict[tuple[int, int], str]:
    """GPU pairs an error finding names (nancheck's ``pairs``, peer's ``directions``) → its code."""
    out: dict[tuple[int, int], str] = {}
    for check in report.get("checks") or []:
        for f in (check.get("findings") or []) if isinstance(check, dict) else []:
            if (
                not isinstance(f, dict)
                or f.get("severity") != "error"
                or not isinstance(f.get("evidence"), dict)
            ):
                continue
            for key in ("pairs", "directions"):
                for pair in f["evidence"].get(key) or []:
                    if (
                        isinstance(pair, list | tuple)
                        and len(pair) == 2
                        and all(type(g) is int for g in pair)
                    ):
                        out.setdefault((min(pair), max(pair)), str(f.get("code"))[:40])
    return out


def bundle_pictures(report: Mapping[str, Any], markdown: str) -> dict[str, bytes]:
    """The files the bundle gains: each check's SVG and ``REPORT.html`` (the report's
    document and its ``REPORT.md``)."""
    svgs = check_pictures(report)
    files = {name: text.encode() for name, text in svgs.items()}
    files[HTML_NAME] = report_html(report, markdown, svgs).encode()
    return files


_CSS = """
body { font-family: sans-serif; max-width: 960px; margin: 2em auto; padding: 0 1em; color: #222; }
table { border-collapse: collapse; margin: 1em 0; }
td, th { border: 1px solid #ccc; padding: 4px 8px; text-align: left; vertical-align: top; }
th { background: #f0f0f0; }
.banner { background: #FBF3DC; border-left: 4px solid #E69F00; padding: 8px 12px; margin: 8px 0; }
.finding { margin: 8px 0 8px 1em; }
code, pre { font-family: monospace; background: #f5f5f5; }
pre { padding: 8px; overflow-x: auto; white-space: pre-wrap; }
figure { margin: 1em 0; overflow-x: auto; }
.chip { border-radius: 4px; padding: 1px 6px; white-space: nowrap; }
"""


def report_html(report: Mapping[str, Any], markdown: str, svgs: Mapping[str, str]) -> str:
    """``REPORT.html``: self-contained (inline CSS and SVG, no script, no external URL)."""
    head = (
        f"gpudiag {esc(report.get('gpudiag'), 40)} · torch {esc(report.get('torch'), 40)} · "
        f"{esc(report.get('created'), 40)}"
    )
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        "<title>gpudiag report</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>gpudiag report</h1>",
        f"<p>{head}</p>",
    ]
    for key in ("rehearsal", "simulation"):
        if report.get(key):
            parts.append(f'<p class="banner">{esc(report[key], 2000)}</p>')
    checks = [c for c in report.get("checks") or [] if isinstance(c, dict)]
    parts.append("<table><tr><th>check</th><th>status</th><th>headline</th></tr>")
    for c in checks:
        status = str(c.get("status"))
        shown = f"{status}{' (simulated)' if c.get('simulated') else ''}"
        back, ink = STATUS_COLOURS.get(status, ("#EEEEEE", "#333333"))
        parts.append(
            f'<tr><td><a href="#{_anchor(c.get("name"))}">{esc(c.get("name"), 40)}</a></td>'
            f'<td><span class="chip" style="background:{back};color:{ink}">{esc(shown, 60)}</span></td>'
            f"<td>{_md(c.get('headline'), 1000)}</td></tr>"
        )
    parts.append("</table>")
    for c in checks:
        name = str(c.get("name"))
        svg = svgs.get(f"{name}.svg")
        findings = [f for f in c.get("findings") or [] if isinstance(f, dict)]
        if svg is None and not findings:
            continue
        parts.append(f'<h2 id="{_anchor(name)}">{esc(name, 40)} — {esc(c.get("status"), 20)}</h2>')
        for f in findings:
            parts.append(
                f'<div class="finding"><b><code>{esc(f.get("code"), 60)}</code></b> '
                f"({esc(f.get('severity'), 20)}) — {_md(f.get('message'), 2000)}"
            )
            for key in ("cause", "fix"):
                if f.get(key):
                    parts.append(f"<br>{key}: {_md(f[key], 2000)}")
            parts.append("</div>")
        if svg is not None:
            parts.append(f"<figure>{_inline(svg)}</figure>")
        if c.get("command"):
            parts.append(f"<p>Run it alone: <code>{esc(c['command'], 2000)}</code></p>")
    parts.append("<h2>REPORT.md</h2><details><summary>the Markdown report, as pasted into an issue</summary>")
    parts.append(f"<pre>{esc(markdown, 2_000_000)}</pre></details>")
    parts.append("</body></html>\n")
    return "\n".join(parts)


def _md(text: Any, limit: int) -> str:
    """Escaped text with Markdown's inline code (`` `…` ``) as ``<code>`` (all else plain)."""
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", esc(text, limit))


def _anchor(name: Any) -> str:
    return "check-" + re.sub(r"[^a-z0-9-]", "-", str(name).lower())[:40]


def _inline(svg: str) -> str:
    """An SVG as an HTML element: the HTML parser puts ``<svg>`` in the SVG namespace
    itself, so the page names no URL at all."""
    return svg.replace(' xmlns="http://www.w3.org/2000/svg"', "", 1)
