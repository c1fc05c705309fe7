"""What differs between two result documents of one check, for ``replay``: the numbers each
check's registry entry compares (``compare``), beyond status and finding codes. Pure
functions of JSON documents."""

from __future__ import annotations

import math
from typing import Any

#: Relative slack on gradcheck's norm ratio where both runs differ from single.
RATIO_SLACK = 0.05


def _gradcheck_numbers(there: dict[str, Any], here: dict[str, Any]) -> list[str]:
    def key(c: dict[str, Any]) -> tuple[str, str, str]:
        return (c["strategy"], c["mode"], str(sorted(c.get("options", {}).items())))

    out = []
    theirs = {key(c): c for c in there.get("comparisons", [])}
    ours = {key(c): c for c in here.get("comparisons", [])}
    for k in sorted(theirs.keys() | ours.keys()):
        a, b = theirs.get(k), ours.get(k)
        label = f"{k[0]} ({k[1]})"
        if a is None or b is None:
            out.append(f"{label}: compared {'there' if a else 'here'} only")
        elif a["ok"] != b["ok"]:
            out.append(
                f"{label}: {'agrees' if a['ok'] else 'differs'} there (rel_norm_err {a['rel_norm_err']}), "
                f"{'agrees' if b['ok'] else 'differs'} here (rel_norm_err {b['rel_norm_err']})"
            )
        elif not a["ok"] and not _close(a["norm_ratio"], b["norm_ratio"]):
            out.append(f"{label}: norm ratio {a['norm_ratio']} there, {b['norm_ratio']} here")
    return out


def _close(a: Any, b: Any) -> bool:
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
        return str(a) == str(b)  # "nan"/"inf" as JSON strings
    if not (math.isfinite(a) and math.isfinite(b)):
        return a == b
    return abs(a - b) <= RATIO_SLACK * max(abs(a), abs(b), 1e-12)


def _differing(theirs: dict[str, Any], ours: dict[str, Any], describe: Any) -> list[str]:
    """``name: <there> there, <here> here`` for each name whose value differs."""
    return [
        f"{name}: {describe(theirs.get(name))} there, {describe(ours.get(name))} here"
        for name in sorted(theirs.keys() | ours.keys())
        if theirs.get(name) != ours.get(name)
    ]


def _nancheck_numbers(there: dict[str, Any], here: dict[str, Any]) -> list[str]:
    """Each run's status and first bad step."""

    def runs(doc: dict[str, Any]) -> dict[str, tuple[str, Any]]:
        out = {f"GPU {s['device']} alone": (s["status"], s["first_bad_step"]) for s in doc.get("singles", [])}
        out.update(
            {f"pair ({p['a']},{p['b']})": (p["status"], p["first_bad_step"]) for p in doc.get("pairs", [])}
        )
        return out

    def describe(run: tuple[str, Any] | None) -> str:
        if run is None:
            return "not run"
        return run[0] if run[1] is None else f"{run[0]} (step {run[1]})"

    return _differing(runs(there), runs(here), describe)


def _peer_numbers(there: dict[str, Any], here: dict[str, Any]) -> list[str]:
    """The number of wrong copies per direction."""

    def wrong(doc: dict[str, Any]) -> dict[str, int]:
        return {
            f"{p['src']}->{p['dst']}": sum(1 for c in p.get("copies", []) if c.get("wrong"))
            for p in doc.get("pairs", [])
        }

    def describe(count: int | None) -> str:
        return "not tested" if count is None else f"{count} wrong copies"

    return _differing(wrong(there), wrong(here), describe)


def _topology_numbers(there: dict[str, Any], here: dict[str, Any]) -> list[str]:
    """The link of each GPU pair."""

    def links(doc: dict[str, Any]) -> dict[str, Any]:
        return {f"pair ({p['a']},{p['b']})": p["link"] for p in doc.get("pairs", [])}

    return _differing(links(there), links(here), str)


def _transport_numbers(there: dict[str, Any], here: dict[str, Any]) -> list[str]:
    """The transport of each directed pair."""

    def paths(doc: dict[str, Any]) -> dict[str, Any]:
        return {f"pair {p['from_rank']}->{p['to_rank']}": p["transport"] for p in doc.get("pairs", [])}

    return _differing(paths(there), paths(here), str)


NUMBERS = {
    "transport": _transport_numbers,
    "gradcheck": _gradcheck_numbers,
    "nancheck": _nancheck_numbers,
    "peer": _peer_numbers,
    "topology": _topology_numbers,
}
