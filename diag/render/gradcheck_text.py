"""gradcheck's text output: the answer first, the evidence after.

The first lines are the verdict with the run's settings, then one row per cause — its
finding code, a table-cell phrase, the strategies it concerns and its one-line fix — so a
reader (or ``head -5``) has the answer before any table. After a blank line come the
simulation and tolerance notes, the comparison table, the per-parameter errors (strategies
whose errors are the same shown once; bars only where they tell parameters apart) and the
findings in full prose.
"""

from __future__ import annotations

import math
from typing import Any

#: A cause as a table cell, by finding code (the message has the numbers and the prose).
CAUSE_CELL = {
    "batchnorm-per-replica": "BatchNorm statistics per device",
    "dropout-active": "random draws per device (dropout, drop path)",
    "random-in-forward": "random draws without an expected value",
    "nondeterministic-op": "non-deterministic kernels",
    "loss-scale-world-size": "loss scaled by the world size (a bug in the loss)",
    "uneven-shards": "batch does not split evenly over the ranks",
    "unused-parameters": "parameters without a gradient",
    "batch-size-in-forward": "per-device normalisation in the model (x.shape[0])",
    "unseeded-random": "a random draw no seed reaches (a bug in the model)",
    "state-in-forward": "parameters written in forward (per-replica state)",
    "nonfinite-gradient": "NaN/Inf in the gradients",
    "ranks-diverged": "DDP ranks hold different parameters",
    "numerics-differ": "processes ran under other numeric settings",
    "numerics-changed": "the model changed torch's numeric flags",
    "rank-crashed": "a DDP rank crashed",
    "rank-hung": "a DDP rank hung",
    "syncbn-skipped": "SyncBatchNorm cannot run here",
    "mismatch-unexplained": "a difference no known cause accounts for",
}
#: The one-line fix, by code (else the finding's fix up to its first ';').
FIX_CELL = {
    "batchnorm-per-replica": "SyncBatchNorm under DDP (nn.SyncBatchNorm.convert_sync_batchnorm)",
    "dropout-active": "expected in training; compare with dropout off",
    "loss-scale-world-size": "a mean-reduced loss, or a summed local loss times W",
    "unused-parameters": "DistributedDataParallel(find_unused_parameters=True)",
    "batch-size-in-forward": "normalise by the global batch, or in the loss",
    "unseeded-random": "draw from a generator seeded from the run's seed",
    "state-in-forward": "initialise from data before wrapping; update parameters in the optimizer only",
}
#: Answer rows shown above everything else (the rest are in the findings below).
ANSWER_ROWS = 3
#: A bar is drawn only where the largest and smallest error of a section are this far apart.
BARS_SPREAD = 3.0
BAR_WIDTH = 16


def _strategies(finding: Any) -> str:
    ev = finding.evidence
    names = ev.get("strategies") or ([ev["strategy"]] if isinstance(ev.get("strategy"), str) else [])
    return ", ".join(dict.fromkeys(names))


def _fix_cell(finding: Any) -> str:
    if finding.code in FIX_CELL:
        return FIX_CELL[finding.code]
    return (finding.fix or "").split(";")[0].strip()


def answer_rows(report: Any) -> list[tuple[str, str, str, str, str]]:
    """(severity, code, cause cell, strategies, fix) per distinct finding code, errors
    first; info findings only when nothing else is said."""
    order = {"error": 0, "warning": 1, "info": 2}
    chosen: dict[str, Any] = {}
    for f in sorted(report.findings, key=lambda f: order.get(f.severity, 3)):
        if f.severity == "info" and any(g.severity != "info" for g in report.findings):
            continue
        chosen.setdefault(f.code, f)
    return [
        (f.severity, f.code, CAUSE_CELL.get(f.code, f.message.split(":")[0]), _strategies(f), _fix_cell(f))
        for f in chosen.values()
    ]


def _bar(err: float, low: float, high: float, tol: float) -> str:
    """A log-scale bar from ``low`` (empty) to ``high`` (full); red above ``tol``."""
    if not math.isfinite(err):
        return "[bold red]" + "█" * BAR_WIDTH + "[/bold red]"
    span = math.log10(high / low) if high > low > 0 else 1.0
    level = 0.0 if err <= low else min(1.0, math.log10(err / low) / span)
    style = "red" if err > tol else "green"
    return f"[{style}]{'█' * max(1, round(level * BAR_WIDTH)):<{BAR_WIDTH}}[/{style}]"


def _sections(report: Any) -> list[tuple[list[Any], Any]]:
    """Comparisons that differ, those with the same per-parameter errors (to 3 digits)
    grouped: (comparisons, the first of them)."""
    groups: dict[tuple[Any, ...], list[Any]] = {}
    for c in report.comparisons:
        if c.ok or not c.params:
            continue
        key = (c.mode, tuple((p.name, f"{p.rel_norm_err:.3g}") for p in c.params))
        groups.setdefault(key, []).append(c)
    return [(cs, cs[0]) for cs in groups.values()]


def render(out: Any, report: Any, rehearsal: Any, simulated: str, findings: Any) -> None:
    """The whole text report on the rich console ``out``."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    cfg = report.config
    style = {"pass": "bold green", "explained": "bold yellow", "fail": "bold red"}.get(report.verdict, "bold")
    rehearsal(out, cfg)
    out.print(
        f"[bold]gradcheck[/bold] [{style}]{report.verdict.upper()}[/{style}]{simulated}"
        f" · model {escape(str(cfg.get('model', '?')))}"
        f" · batch {cfg['batch_size']} · world size {cfg['world_size']} ({cfg['devices']['kind']} devices)"
        f" · {cfg['dtype']} · loss {escape(str(cfg['loss']))} · {cfg['steps']} step(s)"
    )
    rows = answer_rows(report)
    if not rows:
        strategies = ", ".join(dict.fromkeys(c.strategy for c in report.comparisons)) or "single alone"
        out.print(f"  [green]✔[/green] every strategy agrees with single within tolerance ({strategies})")
    answer = Table(box=None, show_header=False, pad_edge=False, padding=(0, 2, 0, 0))
    for _ in range(4):
        answer.add_column()
    marks = {"error": "[bold red]✖[/bold red]", "warning": "[yellow]▲[/yellow]", "info": "[cyan]•[/cyan]"}
    for severity, code, cause, strategies, fix in rows[:ANSWER_ROWS]:
        answer.add_row(
            f"  {marks.get(severity, '•')} [bold]{code}[/bold]",
            escape(cause) + (f" [dim]({escape(strategies)})[/dim]" if strategies else ""),
            f"fix: {escape(fix)}" if fix else "",
        )
    if rows:
        out.print(answer)
    if len(rows) > ANSWER_ROWS:
        out.print(f"  [dim]… {len(rows) - ANSWER_ROWS} more below[/dim]")
    out.print()
    if report.simulation:
        note = "Simulated on CPU virtual devices (DDP over gloo): CUDA, NCCL and TF32 not exercised"
        out.print(f"[yellow]{note}[/yellow]")
    tol = report.tolerance["rel_norm_err"]
    measured = [c.float64["tolerance"] for c in report.comparisons if c.float64]
    extra = f"; measured from a float64 run: ≤ {max(measured):.3g}" if measured else ""
    out.print(f"tolerance: relative norm error ≤ {tol:.3g} ({report.tolerance['dtype']}{extra})")
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for column in ("strategy", "mode", "result", "rel norm err", "cosine", "norm ratio", "first bad param"):
        table.add_column(column)
    for c in report.comparisons:
        options = " ".join(f"{k}={v}" for k, v in c.options.items())
        table.add_row(
            c.strategy + (f" [dim]({options})[/dim]" if options else ""),
            c.mode,
            "[green]ok[/green]" if c.ok else "[red]differs[/red]",
            f"{c.rel_norm_err:.2e}",
            f"{c.cosine:.6f}",
            f"{c.norm_ratio:.4f}",
            escape(c.first_bad_param or "—"),
        )
    out.print(table)
    for n, (group, c) in enumerate(_sections(report)):
        if n:
            out.print()
        names = ", ".join(g.strategy for g in group)
        verb = "differs" if len(group) == 1 else "differ"
        out.print(f"[bold]Where {names} ({c.mode}) {verb}[/bold] — relative error per parameter")
        start = next((i for i, p in enumerate(c.params) if p.name == c.first_bad_param), 0)
        shown = c.params[max(0, start - 2) : start + 14]
        width = max(len(p.name) for p in shown)
        finite = [p.rel_norm_err for p in shown if math.isfinite(p.rel_norm_err) and p.rel_norm_err > 0]
        low, high = (min(finite), max(finite)) if finite else (0.0, 0.0)
        bars = bool(finite) and high > BARS_SPREAD * low
        for p in shown:
            value = f"{p.rel_norm_err:.2e}" if math.isfinite(p.rel_norm_err) else "non-finite"
            bar = _bar(p.rel_norm_err, low / 2, high, tol) + " " if bars else ""
            out.print(f"  {escape(p.name):<{width}}  {bar}{value}")
        if len(c.params) > len(shown):
            out.print(f"  [dim]… {len(c.params) - len(shown)} more parameter(s) in the JSON output[/dim]")
    findings(out, report.findings, "Findings")
    settings = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in report.settings.items())
    if report.findings:
        out.print()
    out.print(f"[dim]{escape(settings)}[/dim]")
