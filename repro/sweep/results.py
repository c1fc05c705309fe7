"""What a sweep leaves in its folder, and reading it back.

``sweep/`` holds:

- ``results.jsonl``: one line per node that answered, schema ``gpudiag.sweep-node/1``
  (:func:`node_record` builds it: kilobytes — host, GPUs, versions, topology digest,
  per-check status/codes/headline, figures, the all-node all-reduce and pair tests);
- ``sweep.json`` (``gpudiag.sweep-run/1``): how the sweep ran — the expected hosts and
  where that list came from, the command, backend, the NCCL settings it pinned, notes;
- ``rules.json``: the rules it was judged by (edit, then ``--summary sweep/ --rules``);
- ``SUMMARY.md``: the verdicts (:func:`summary_markdown`);
- ``nodes/<host>.zip``: each node's full report bundle, redacted on the node itself.

:func:`read_sweep` reads the folder back (bounded; a damaged line is an error naming it),
so ``gpudiag sweep --summary sweep/`` re-judges anywhere.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpudiag.errors import InputError
from gpudiag.fileio import open_regular, read_bounded
from gpudiag.render import printable
from gpudiag.repro.sweep.judge import HEALTHY, NO_RESULT, FleetVerdict
from gpudiag.repro.sweep.links import pair_rounds
from gpudiag.repro.sweep.rules import FIGURES, check_rules, parse_json

NODE_SCHEMA = "gpudiag.sweep-node/1"
RUN_SCHEMA = "gpudiag.sweep-run/1"
RESULTS, SUMMARY, RUN, RULES, NODES = "results.jsonl", "SUMMARY.md", "sweep.json", "rules.json", "nodes"
MAX_LINE_BYTES = 1 << 20  # a node's line is kilobytes; a megabyte is a damaged file
MAX_RESULTS_BYTES = 4 << 30


def sweep_files(folder: Path, listed: Collection[str] | None = None) -> list[str]:
    """What in ``folder`` a sweep does not write (relative names, sorted): anything but
    results.jsonl, sweep.json, rules.json, SUMMARY.md as regular files and ``nodes/``
    holding only ``*.zip`` regular files — and, when the manifest ``listed`` the files
    the sweep wrote (``files`` in sweep.json), anything not in that list. Empty for a
    folder :func:`~gpudiag.repro.sweep.run.write_sweep` wrote."""
    foreign: list[str] = []
    for entry in sorted(folder.iterdir()):
        if entry.name == NODES and entry.is_dir() and not entry.is_symlink():
            foreign += [
                f"{NODES}/{e.name}"
                for e in sorted(entry.iterdir())
                if e.suffix != ".zip" or e.is_symlink() or not e.is_file()
            ]
        elif entry.name not in (RESULTS, RUN, RULES, SUMMARY) or entry.is_symlink() or not entry.is_file():
            foreign.append(entry.name)
    if listed is not None:
        present = (
            [f"{NODES}/{e.name}" for e in sorted((folder / NODES).glob("*"))]
            if (folder / NODES).is_dir()
            else []
        )
        present += [e.name for e in sorted(folder.iterdir()) if e.name != NODES]
        foreign += [name for name in present if name not in listed and name not in foreign]
    return sorted(foreign)


@dataclass
class Sweep:
    """A sweep folder read back: the node records, how it ran, the rules it used."""

    records: list[dict[str, Any]]
    run: dict[str, Any] = field(default_factory=dict)
    rules: dict[str, Any] | None = None


def check_record(data: Any, where: str) -> dict[str, Any]:
    """A node record with the fields judging needs, or :class:`InputError` naming ``where``."""
    if not isinstance(data, dict) or data.get("schema") != NODE_SCHEMA:
        raise InputError(f"{where}: not a {NODE_SCHEMA} record")
    if not isinstance(data.get("host"), str) or not data["host"]:
        raise InputError(f"{where}: no host")
    if isinstance(data.get("node"), bool) or not isinstance(data.get("node"), int):
        raise InputError(f"{where}: node must be an integer")
    for key, kind in (
        ("checks", list),
        ("pairs", list),
        ("figures", dict),
        ("versions", dict),
        ("problems", list),
        ("notes", list),
    ):
        if key in data and data[key] is not None and not isinstance(data[key], kind):
            raise InputError(f"{where}: {key} must be a {kind.__name__}")
    _check_fields(data, where)
    for pair in data.get("pairs") or []:
        if not isinstance(pair, dict) or not all(isinstance(pair.get(k), int) for k in ("round", "peer")):
            raise InputError(f"{where}: each pair test needs integer round and peer")
    if not all(isinstance(n, str) for n in data.get("notes") or []):
        raise InputError(f"{where}: notes must be strings")
    for problem in data.get("problems") or []:
        if not isinstance(problem, dict) or set(problem) - {"code", "message", "expected", "measured"}:
            raise InputError(f"{where}: a problem has code, message, expected, measured")
    return data


def _check_fields(data: dict[str, Any], where: str) -> None:
    """The typed fields judging reads: a wrong type is bad input naming the field, never
    an internal error; figures are finite, non-negative numbers."""
    gpus = data.get("gpus")
    if gpus is not None and (isinstance(gpus, bool) or not isinstance(gpus, int) or not 0 <= gpus <= 1 << 16):
        raise InputError(f"{where}: gpus must be a whole number from 0 to 65536, got {gpus!r}")
    aliases = data.get("aliases")
    if aliases is not None and (
        not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases)
    ):
        raise InputError(f"{where}: aliases must be a list of host names")
    if data.get("host_facts") is not None and not isinstance(data["host_facts"], dict):
        raise InputError(f"{where}: host_facts must be an object")
    digest = data.get("topology_digest")
    if digest is not None and not isinstance(digest, str):
        raise InputError(f"{where}: topology_digest must be a string")
    for key, value in (data.get("versions") or {}).items():
        if value is not None and not isinstance(value, (str, int, float)):
            raise InputError(f"{where}: versions.{key} must be a string")
    for check in data.get("checks") or []:
        if not isinstance(check, dict) or not isinstance(check.get("name"), str):
            raise InputError(f"{where}: each check needs a name")
        if not isinstance(check.get("status", ""), str):
            raise InputError(f"{where}: check {check['name']}: status must be a string")
    for key, value in (data.get("figures") or {}).items():
        if value is None:
            continue
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or value < 0
        ):
            raise InputError(f"{where}: figures.{key} must be a finite number ≥ 0, got {value!r}")


def results_jsonl(records: Sequence[Mapping[str, Any]]) -> str:
    """One compact JSON line per node, in node order."""
    ordered = sorted(records, key=lambda r: (int(r["node"]), str(r["host"])))
    return "".join(json.dumps(r, separators=(",", ":"), sort_keys=True) + "\n" for r in ordered)


def read_results(path: str | Path) -> list[dict[str, Any]]:
    """The records of a ``results.jsonl`` (blank lines skipped)."""
    path = Path(path)
    try:
        with open_regular(path, "sweep file") as f:  # (a FIFO or /dev/zero refused unread)
            size = os.fstat(f.fileno()).st_size
            if size > MAX_RESULTS_BYTES:
                raise InputError(f"{path}: {size} bytes, more than a sweep writes")
            records = []
            for number, line in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), 1):
                if len(line) > MAX_LINE_BYTES:
                    raise InputError(f"{path}:{number}: line longer than {MAX_LINE_BYTES} bytes")
                if not line.strip():
                    continue
                records.append(check_record(parse_json(line, f"{path}:{number}"), f"{path}:{number}"))
    except OSError as exc:
        raise InputError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    if not records:
        raise InputError(f"{path}: no node records (an empty sweep judges nothing)")
    return records


def read_sweep(folder: str | Path) -> Sweep:
    """A sweep folder (or a results.jsonl file) read back."""
    folder = Path(folder)
    if folder.is_file():
        return Sweep(read_results(folder))
    if not (folder / RESULTS).is_file():
        raise InputError(f"{folder}: no {RESULTS} (not a gpudiag sweep folder)")
    sweep = Sweep(read_results(folder / RESULTS))
    for name in (RUN, RULES):
        path = folder / name
        if not path.is_file():
            continue
        data = parse_json(read_bounded(path, "sweep file"), str(path))
        if name == RUN:
            if not isinstance(data, dict) or data.get("schema") != RUN_SCHEMA:
                raise InputError(f"{path}: not a {RUN_SCHEMA} document")
            sweep.run = data
        else:
            sweep.rules = check_rules(data, str(path))
    return sweep


# -- SUMMARY.md and the terminal ---------------------------------------------------------


def _cell(value: Any) -> str:
    """A value as a table cell or list item: numbers to 4 digits, a mapping as ``KEY=value``
    items (``none`` when empty: ``nccl_env`` with no variable set), a list comma-separated."""
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, Mapping):
        text = ", ".join(f"{k}={v}" for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))) or "none"
    elif isinstance(value, (list, tuple)):
        text = ", ".join(str(v) for v in value) or "none"
    else:
        text = str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def headline(verdict: FleetVerdict) -> str:
    """``4 node(s): 3 healthy, 1 problem, 0 no result — named: node2``; a sweep that
    stopped before the end says so (``— the sweep did not finish; named: node1``)."""
    data = verdict.to_json()
    named = ", ".join(v.host for v in verdict.named[:8]) + (" …" if len(verdict.named) > 8 else "")
    line = f"{len(verdict.nodes)} node(s): {data['healthy']} healthy, {data['problem']} problem, "
    line += f"{data['no_result']} no result"
    if verdict.failed:  # (never "healthy — nobody named" for a sweep that stopped half way)
        line += " — the sweep did not finish"
        return line + (f"; named: {named}" if named else "; no rank named (see the notes)")
    return line + (f" — named: {named}" if named else " — nobody named")


def simulation_line(verdict: FleetVerdict) -> str | None:
    if not verdict.simulated:
        return None
    return (
        "simulated: CPU virtual devices and gloo, not GPUs and NCCL — the verdicts show the sweep works, "
        "not that the nodes' GPUs and links do"
    )


def summary_markdown(
    verdict: FleetVerdict, records: Sequence[Mapping[str, Any]], run: Mapping[str, Any]
) -> str:
    """SUMMARY.md: the verdict first, then the named nodes, every node, the fleet and the
    pairwise link test."""
    out = [f"# gpudiag sweep: {headline(verdict)}", ""]
    sim = simulation_line(verdict)
    if sim:
        out += [f"> **{sim}**", ""]
    for key, label in (("created", "created"), ("command", "command"), ("backend", "backend")):
        if run.get(key):
            value = " ".join(run[key]) if isinstance(run[key], list) else run[key]
            out.append(f"- {label}: `{value}`")
    if run.get("expected_from"):
        out.append(f"- expected hosts from {run['expected_from']}: {len(run.get('expected_hosts') or [])}")
    if run.get("pinned"):
        out.append(
            "- set by the sweep for its run (not the nodes' own settings): "
            + ", ".join(f"`{k}={v}`" for k, v in sorted(run["pinned"].items()))
        )
    if run.get("user_settings"):
        out.append(
            "- already set by the user, left as they were: "
            + ", ".join(f"`{k}={v}`" for k, v in sorted(run["user_settings"].items()))
        )
    if run.get("injected"):
        out.append("- **rehearsal** — injected: " + ", ".join(f"`{s}`" for s in run["injected"]))
    out.append("")
    named = verdict.named
    out += ["## Named nodes", ""]
    if not named:
        out += ["Nobody: every node is healthy.", ""]
    else:
        out += ["| host | verdict | code | what | expected | measured |", "|---|---|---|---|---|---|"]
        for v in named:
            for p in v.problems:
                cells = [
                    _cell(v.host),
                    v.status,
                    f"`{p.code}`",
                    _cell(p.message),
                    _cell(p.expected),
                    _cell(p.measured),
                ]
                out.append("| " + " | ".join(cells) + " |")
        out.append("")
    by_host = {str(r["host"]): r for r in records}
    out += ["## Every node", ""]
    out += ["| node | host | verdict | GPUs | machine type | " + " | ".join(FIGURES) + " | checks |"]
    out += ["|---" * (6 + len(FIGURES)) + "|"]
    for v in verdict.nodes:
        rec = by_host.get(v.host, {})
        figures = rec.get("figures") or {}
        checks = ", ".join(f"{c['name']} {c['status']}" for c in rec.get("checks") or [])
        status = v.status + (" (simulated)" if v.simulated and v.status != NO_RESULT else "")
        row = [_cell(v.node), _cell(v.host), status, _cell(rec.get("gpus")), _cell(rec.get("machine_type"))]
        row += [_cell(figures.get(f)) for f in FIGURES] + [_cell(checks or None)]
        out.append("| " + " | ".join(row) + " |")
    out += ["", "## Fleet", ""]
    for figure, value in verdict.medians.items():
        out.append(f"- median {figure}: {_cell(value)}")
    for key, value in verdict.majority.items():
        out.append(f"- majority {key}: {_cell(value)}")
    rounds = pair_rounds(records)
    if rounds:
        hosts = {int(r["node"]): str(r["host"]) for r in records}
        out += [
            "",
            "## Pairwise link test",
            "",
            "| round | pair | bus bandwidth (GB/s) | values |",
            "|---|---|---|---|",
        ]
        for rnd in sorted(rounds):
            for (a, b), entries in sorted(rounds[rnd].items()):
                bws = [e.get("busbw_gbps") for e in entries if isinstance(e.get("busbw_gbps"), (int, float))]
                ok = all(e.get("ok") for e in entries)
                out.append(
                    f"| {rnd} | {_cell(hosts.get(a, a))} ↔ {_cell(hosts.get(b, b))} | "
                    f"{_cell(min(bws) if bws else None)} | {'exact' if ok else '**wrong**'} |"
                )
    notes = list(verdict.notes) + [f"{v.host}: {n}" for v in verdict.nodes for n in v.notes]
    notes += list(run.get("notes") or [])
    if notes:
        out += ["", "## Notes", ""] + [f"- {_cell(n)}" for n in notes]
    return printable("\n".join(out) + "\n")


def summary_text(verdict: FleetVerdict) -> str:
    """The terminal's view: the headline, then one line per problem."""
    lines = [f"gpudiag sweep: {headline(verdict)}"]
    sim = simulation_line(verdict)
    if sim:
        lines.append(sim)
    for v in verdict.named:
        for p in v.problems:
            detail = (
                ""
                if p.expected is None and p.measured is None
                else f" (expected {_cell(p.expected)}, measured {_cell(p.measured)})"
            )
            lines.append(f"  {v.host}: {v.status}: {p.code}: {p.message}{detail}")
    healthy = [v.host for v in verdict.nodes if v.status == HEALTHY]
    if healthy:
        shown = ", ".join(healthy[:10]) + (f" and {len(healthy) - 10} more" if len(healthy) > 10 else "")
        lines.append(f"  healthy: {shown}")
    return printable("\n".join(lines) + "\n")
