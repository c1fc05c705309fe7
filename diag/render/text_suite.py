"""The text view of ``report``, ``doctor`` and ``replay``: the suite's table, what was
skipped and simulated, the bundle; replay's comparison lines (Markdown reuses them)."""

from __future__ import annotations

from typing import Any, TextIO

from gpudiag.render.text import capitalised, findings, text_console

SUITE_STYLE = {
    "pass": "green",
    "explained": "yellow",
    "warning": "yellow",
    "fail": "bold red",
    "skipped": "dim",
    "error": "bold magenta",
}


def report(report: Any, stream: TextIO) -> None:
    with text_console(stream) as out:
        _suite(out, report, doctor=False)


def doctor(report: Any, stream: TextIO) -> None:
    with text_console(stream) as out:
        _suite(out, report, doctor=True)


def _suite(out: Any, report: Any, doctor: bool) -> None:
    """The summary table of a report or doctor run, what was skipped, the findings, the bundle."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    here = report.here
    where = f"{here.cuda_gpus} CUDA GPU(s)"
    if here.machine is not None:
        where += f"; virtual devices laid out like {escape(str(here.machine_source))}"
    if report.rehearsal:
        out.print(f"[bold yellow]{escape(capitalised(report.rehearsal))}[/bold yellow]")
    out.print(f"[bold]gpudiag {'doctor' if doctor else 'report'}[/bold] · {where}")
    if report.simulation:
        out.print(f"[yellow]{escape(capitalised(report.simulation))}[/yellow]")
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for column in ("check", "status", "headline", "time"):
        table.add_column(column)
    for c in report.checks:
        style = SUITE_STYLE.get(c.status, "")
        status = f"[{style}]{c.status}[/{style}]" + (" (simulated)" if c.shown_status != c.status else "")
        table.add_row(c.name, status, escape(c.headline), f"{c.seconds:.1f} s")
    out.print(table)
    skipped = [(c.name, c.headline) for c in report.checks if c.status == "skipped"]
    skipped += [(c.name, s) for c in report.checks for s in c.skipped]
    if skipped:
        out.print("[bold]Skipped[/bold]")
        for name, why in skipped:
            out.print(f"  {name}: {escape(why)}")
    problems = [f for c in report.checks for f in c.findings if f.severity != "info"]
    findings(out, problems, "Findings")
    if report.bundle_path:
        out.print(
            f"\nBundle: {escape(str(report.bundle_path))} — REPORT.md to paste into an issue"
            + (", repro.py to reproduce with torch alone" if report.reproducible else "")
            + f"; `gpudiag replay {escape(str(report.bundle_path))}` re-runs it."
        )
    elif doctor and any(c.status in ("fail", "error") for c in report.checks):
        out.print("\nFor a bug report: the same with -o bug.zip writes a bundle (REPORT.md, repro.py, logs).")
    if doctor and here.cuda_gpus == 0 and here.machine is None:
        out.print(
            "\nNo GPU here. To diagnose a GPU machine from its capture: run `nvidia-smi topo -m > topo.txt` "
            "there, then `gpudiag doctor --machine topo.txt` here (nancheck and peer then run, simulated, "
            "on CPU virtual devices laid out like it)."
        )


def replay_lines(report: Any) -> list[str]:
    """Plain lines of a replay (text and Markdown views)."""
    verdict = getattr(report, "verdict", "match" if report.match else "differs")
    head = f"replay of {report.bundle}: {verdict.replace('-', ' ').upper()}"
    left = [c.name for c in report.checks if not c.compared and c.name != "env" and c.here is not None]
    if verdict == "nothing-compared":
        head += " — no check ran here as it ran there (see why below)"
    elif left:
        head += f" (not compared: {', '.join(left)}; see why below)"
    lines = [head]
    if getattr(report, "rehearsal", None):
        lines.append(f"  the bundle is a {report.rehearsal}")
    for c in report.checks:
        here = "not run" if c.here is None else c.here.shown_status
        state = "match" if c.match and c.compared else ("DIFFERS" if not c.match else "not compared")
        lines.append(f"  {c.name}: {c.recorded.shown_status} there, {here} here — {state}")
        if c.note and c.note != "same result":
            lines.append(f"      {c.note}")
        lines += [f"      - {d}" for d in c.differences]
    if report.environment:
        lines.append("environment differences (there → here):")
        lines += [f"  {d}" for d in report.environment]
    return lines


def replay(report: Any, stream: TextIO) -> None:
    stream.write("\n".join(replay_lines(report)) + "\n")
