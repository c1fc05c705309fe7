"""Plain SVG, written by gpudiag itself: the drawing primitives the pictures share
(:mod:`gpudiag.render.svg_topology`, ``svg_hang``, ``svg_bench``, ``svg_gradcheck``).

No plotting library: an SVG is text, a training container gains no dependency, and the
pictures change only when gpudiag does (docs/reporting.md, "Pictures"). Every text that
comes from an input (GPU names from a capture, group names from a dump, module names from
a model) passes through :func:`esc`: XML-escaped, control characters dropped, cut to a
length, so a hostile name can neither break the document nor inject markup. Sizes are in
CSS pixels; labels are monospace so their width is known (:data:`CHAR_W` per character at
:data:`FONT` px) and layouts never overlap by guess.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

#: Label font size (px) and the width of one monospace character at that size (px).
FONT = 12
CHAR_W = 7.3
#: No picture is larger than this (bytes); callers bound their rows so it holds.
MAX_BYTES = 512 * 1024

#: Okabe & Ito's colour-blind-safe palette (Color Universal Design, 2008).
OKABE_ITO = {
    "orange": "#E69F00",
    "sky": "#56B4E9",
    "green": "#009E73",
    "yellow": "#F0E442",
    "blue": "#0072B2",
    "vermilion": "#D55E00",
    "purple": "#CC79A7",
    "black": "#000000",
}
#: Paul Tol's "muted" qualitative scheme (colour-blind safe, nine colours and a pale grey).
TOL_MUTED = (
    "#332288",
    "#88CCEE",
    "#44AA99",
    "#117733",
    "#999933",
    "#DDCC77",
    "#CC6677",
    "#882255",
    "#AA4499",
    "#DDDDDD",
)
INK = "#222222"
MUTED = "#666666"

_INVALID_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ud800-\udfff\ufffe\uffff]")


def esc(value: Any, limit: int = 80) -> str:
    """``value`` as text safe inside an SVG/HTML element or a quoted attribute: characters
    XML 1.0 forbids dropped, cut to ``limit`` characters (an ellipsis marks the cut), then
    ``& < > " '`` escaped."""
    text = _INVALID_XML.sub("", str(value))
    if len(text) > limit:
        text = text[: max(limit - 1, 0)] + "…"
    return (
        text.replace("&", "&amp;")
        .replace("<", "&lt;")
        .replace(">", "&gt;")
        .replace('"', "&quot;")
        .replace("'", "&#39;")
    )


def fit(value: Any, width_px: float, size: float = FONT) -> str:
    """``value`` escaped and cut to what fits ``width_px`` at font ``size`` (px, monospace;
    :data:`FONT` by default)."""
    return esc(value, max(int(width_px // (CHAR_W * size / FONT)), 1))


def wrap(value: Any, width_px: float, lines: int = 2) -> list[str]:
    """``value`` in at most ``lines`` lines that fit ``width_px``, cut at spaces, each escaped
    (the last cut with an ellipsis when the text is longer)."""
    per = max(int(width_px // CHAR_W), 8)
    words, out, line = _INVALID_XML.sub("", str(value)).split(), [], ""
    for word in words:
        if line and len(line) + 1 + len(word) > per:
            out.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    out.append(line)
    if len(out) > lines:
        out = [*out[: lines - 1], " ".join(out[lines - 1 :])]
    return [esc(x, per) for x in out]


def text_w(text: str) -> float:
    """Width in px of ``text`` (unescaped) at :data:`FONT` in monospace."""
    return len(text) * CHAR_W


def document(result: Any) -> dict[str, Any]:
    """A result's JSON document: ``result.to_json()``, or ``result`` itself when it is one."""
    if isinstance(result, Mapping):
        return dict(result)
    to_json = getattr(result, "to_json", None)
    if to_json is None:
        raise TypeError(f"not a result: {type(result).__name__}")
    data = to_json()
    return dict(data) if isinstance(data, Mapping) else {}


def num(value: Any) -> float | None:
    """A finite number or None (JSON from a bundle may hold anything)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


class Svg:
    """An SVG being drawn: elements appended in order, then :meth:`text` closes it.
    Coordinates are rounded to 0.1 px; every string argument is already escaped."""

    def __init__(self, width: float, height: float, title: str) -> None:
        self.width = width
        self.height = height
        self.parts: list[str] = [f"<title>{esc(title, 200)}</title>"]

    def rect(self, x: float, y: float, w: float, h: float, fill: str, **attrs: Any) -> None:
        self.parts.append(
            f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(w, 0):.1f}" height="{max(h, 0):.1f}" '
            f'fill="{fill}"{_attrs(attrs)}/>'
        )

    def line(self, x1: float, y1: float, x2: float, y2: float, stroke: str, **attrs: Any) -> None:
        self.parts.append(
            f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" '
            f'stroke="{stroke}"{_attrs(attrs)}/>'
        )

    def path(self, d: str, **attrs: Any) -> None:
        self.parts.append(f'<path d="{d}"{_attrs(attrs)}/>')

    def text(self, x: float, y: float, content: str, *, size: int = FONT, **attrs: Any) -> None:
        """``content`` must be escaped already (:func:`esc`, :func:`fit`)."""
        family = attrs.pop("family", "monospace")
        fill = attrs.pop("fill", INK)
        self.parts.append(
            f'<text x="{x:.1f}" y="{y:.1f}" font-family="{family}" font-size="{size}" fill="{fill}"'
            f"{_attrs(attrs)}>{content}</text>"
        )

    def raw(self, element: str) -> None:
        """An element built by the caller from escaped parts (a ``<pattern>``, a marker)."""
        self.parts.append(element)

    def heading(self, title: str, subtitle: str | None = None) -> None:
        """The picture's title (and a muted second line) at its top left."""
        self.text(
            12, 22, fit(title, self.width - 24), size=15, family="sans-serif", **{"font-weight": "bold"}
        )
        if subtitle:
            self.text(12, 40, fit(subtitle, self.width - 24), fill=MUTED)

    def legend(self, x: float, y: float, items: list[tuple[str, str]], width: float) -> float:
        """Swatches with their names, wrapped within ``width``; returns the y below them."""
        cx = x
        for colour, name in items:
            w = 18 + text_w(name) + 16
            if cx + w > x + width and cx > x:
                cx, y = x, y + 20
            self.rect(cx, y - 10, 12, 12, colour, stroke=INK, **{"stroke-width": "0.5"})
            self.text(cx + 16, y, esc(name))
            cx += w
        return y + 20

    def text_out(self) -> str:
        width, height = math.ceil(self.width), math.ceil(self.height)
        body = "\n".join(self.parts)
        out = (
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" role="img">\n'
            f'<rect x="0" y="0" width="{width}" height="{height}" fill="#ffffff"/>\n{body}\n</svg>\n'
        )
        if len(out.encode()) > MAX_BYTES:
            raise ValueError(f"picture of {len(out.encode())} bytes: past {MAX_BYTES} (a bug in its bounds)")
        return out


def _attrs(attrs: dict[str, Any]) -> str:
    return "".join(f' {k.replace("_", "-")}="{esc(v, 200)}"' for k, v in attrs.items())


def empty(title: str, why: str, width: float = 560) -> str:
    """A small picture that says why there is nothing to draw."""
    svg = Svg(width, 70, title)
    svg.heading(title)
    svg.text(12, 56, fit(why, width - 24), fill=MUTED)
    return svg.text_out()


def ranges(numbers: list[int]) -> str:
    """``[0, 1, 2, 5]`` → ``0–2, 5``."""
    spans: list[list[int]] = []
    for n in sorted(set(numbers)):
        if spans and spans[-1][1] == n - 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ", ".join(f"{a}" if a == b else f"{a}–{b}" for a, b in spans)
