"""``REPORT.md``: a bundle's summary, ready to paste into a GitHub issue.

A summary line per check, then the findings with their evidence, how to reproduce, the
topology, and collapsible sections (``<details>``) for the long parts: environment,
skipped checks, the files of the bundle.
"""

from __future__ import annotations

import io
import json
import shlex
from typing import Any, TextIO

from gpudiag.render.markdown import finding_lines, table

STATUS_MARK = {
    "pass": "✅ pass",
    "explained": "☑️ explained",
    "warning": "⚠️ warning",
    "fail": "❌ fail",
    "skipped": "⏭️ skipped",
    "error": "💥 error",
}


def status_mark(check: Any) -> str:
    """``✅ pass``, ``✅ pass (simulated)`` …: a check's status for a Markdown table."""
    mark = STATUS_MARK.get(check.status, check.status)
    return f"{mark} (simulated)" if check.shown_status != check.status else mark


def _upper(sentence: str) -> str:
    return sentence[:1].upper() + sentence[1:]


def _details(summary: str, body: str) -> str:
    return f"<details><summary>{summary}</summary>\n\n{body.rstrip()}\n\n</details>\n"


def _code(text: str, lang: str = "") -> str:
    fence = "````" if "```" in text else "```"
    return f"{fence}{lang}\n{text.rstrip()}\n{fence}"


def report_markdown(report: Any) -> str:
    """The ``REPORT.md`` of a :class:`~gpudiag.repro.report.Report`."""
    doc = report.to_json()
    here = doc["here"]
    out = []
    if report.rehearsal:  # before anything else: the failures below were planted
        specs = " ".join(f"`--inject {shlex.quote(spec)}`" for spec in report.injected)
        out += [
            f"> **Rehearsal with injected faults:** {specs}. Failures they cause below were planted "
            "by gpudiag to test its detectors, not found on the machine.",
            "",
        ]
    out += [
        "# gpudiag report",
        "",
        f"gpudiag {doc['gpudiag']} · torch {doc['torch']} · {doc['created']} · "
        f"`{shlex.join(doc['command'])}`",
        "",
        f"Here: {here['cuda_gpus']} CUDA GPU(s); NVML {'ok' if here['nvml'] == 'ok' else 'not available'}"
        + (
            f"; virtual devices laid out like `{here['machine']}` ({here['machine_source']})"
            if here["machine"]
            else ""
        )
        + ".",
        "",
    ]
    if report.simulation:
        out += [f"**{_upper(report.simulation)}.**", ""]
    out += [
        table(
            ["check", "status", "headline", "time"],
            [[c.name, status_mark(c), c.headline, f"{c.seconds:.1f} s"] for c in report.checks],
        ),
        "",
    ]
    for check in report.checks:
        shown = [f for f in check.findings if f.severity != "info"]  # advice stays in report.json
        if not shown and check.status != "fail":
            continue
        out += [f"## {check.name} — {check.shown_status}", ""]
        for f in shown:
            out += finding_lines(f, severity=True)
            if f.evidence:
                out += ["", "  " + _details("evidence", _code(json.dumps(f.evidence), "json"))]
        out += ["", f"Run it alone: `{check.command}`", ""]
    if report.reproducible:
        names = " ".join(c.name for c in report.reproducible)
        out += [
            "## Reproduce",
            "",
            f"`python repro.py` (needs only torch; `python repro.py {report.reproducible[0].name}` for one "
            f"check: {names}) exits non-zero while the problem shows. `gpudiag replay BUNDLE` re-runs "
            "every check with this configuration and compares.",
            "",
        ]
    topology = next((c for c in report.checks if c.name == "topology" and c.report is not None), None)
    if topology is not None:
        from gpudiag.render import render

        text = io.StringIO()
        render("topology", topology.report, "markdown", text)
        out += [_details("Topology", text.getvalue())]
    transport = next((c for c in report.checks if c.name == "transport" and c.report is not None), None)
    if transport is not None:  # (the table of pairs; the findings are above)
        from gpudiag.render.transport import pairs_markdown

        out += [_details("NCCL transports", "\n".join(pairs_markdown(transport.report)))]
    env = doc.get("env")
    if env:
        from gpudiag.render.env_lines import env_lines

        out.append(_details("Environment", _code("\n".join(env_lines(env)))))
    skipped = [f"- {c.name}: {c.headline}" for c in report.checks if c.status == "skipped"]
    skipped += [f"- {c.name}: {s}" for c in report.checks for s in c.skipped]
    if skipped:
        out.append(_details("Skipped", "\n".join(skipped)))
    configs = [
        f"- {c.name}: `{c.command}`\n\n  ```json\n  {json.dumps(c.config)}\n  ```"
        for c in report.checks
        if c.config is not None
    ]
    out.append(_details("Configuration of each check", "\n".join(configs)))
    out.append(_details("Files in this bundle", "\n".join(f"- `{name}`" for name in report.file_names())))
    return "\n".join(out).rstrip() + "\n"


def report(report: Any, stream: TextIO) -> None:
    """``report`` / ``doctor --format markdown``: the bundle's REPORT.md."""
    stream.write(report_markdown(report))


doctor = report
