"""``gpudiag bench`` output in every format: ``text`` (the seeds' kind of table —
strategy × GPUs → step time, samples/s, speedup — and a bar per phase), ``json``
(``gpudiag.bench/1``; ``--compare``: ``gpudiag.bench-compare/1``) and ``markdown``.

A result is a bench result or, from ``--compare``, a comparison (it has ``only_before``);
both are read by their attributes (the core imports nothing from ``checks``).
"""

from __future__ import annotations

import math
from typing import Any, TextIO

from gpudiag.render import jsonout
from gpudiag.render import markdown as md
from gpudiag.render.text import findings as text_findings
from gpudiag.render.text import text_console

BAR_WIDTH = 30
RANKS_SHOWN = 8  # DDP ranks listed under a case, slowest first
_STRATEGY = {"single": "single", "dp": "DataParallel", "ddp": "DDP"}


def _is_comparison(result: Any) -> bool:
    return hasattr(result, "only_before")


def _ms(seconds: float | None) -> str:
    return "—" if seconds is None or not math.isfinite(seconds) else f"{1e3 * seconds:.2f} ms"


def _num(x: float | None, fmt: str = ".1f") -> str:
    return "—" if x is None or not math.isfinite(x) else format(x, fmt)


def _mib(memory: dict[int, int] | None) -> str:
    if memory is None:
        return "n/a (virtual)"
    return ", ".join(f"{d}: {b / 2**20:.0f} MiB" for d, b in sorted(memory.items())) or "—"


def _batch(case: Any) -> str:
    return f"{case.batch} ({case.per_gpu_batch}/GPU)"


def _seconds(seconds: float) -> str:
    return (
        "—"
        if not math.isfinite(seconds)
        else f"{seconds:.1f} s"
        if seconds < 600
        else f"{seconds / 60:.1f} min"
    )


def table_rows(result: Any) -> list[list[str]]:
    """The seeds' table: one row per case."""
    epoch = result.epoch_samples
    rows = []
    for c in result.cases:
        if c.error is not None or not c.steps:
            rows.append([_STRATEGY.get(c.strategy, c.strategy), str(c.gpus), c.dtype, _batch(c), "failed"])
            continue
        rows.append(
            [
                _STRATEGY.get(c.strategy, c.strategy),
                str(c.gpus),
                c.dtype,
                _batch(c),
                _seconds(c.epoch_time(epoch)),
                _ms(c.p50),
                _ms(c.p95),
                _num(c.samples_per_s),
                _num(c.samples_per_s_per_gpu),
                _num(c.speedup, ".2f") + "×" if c.speedup is not None else "—",
                f"{100 * c.efficiency:.0f} %" if c.efficiency is not None else "—",
            ]
            + ([] if result.simulated else [_mib(c.peak_memory)])
        )
    return rows


def header(result: Any) -> list[str]:
    """The table's columns: no peak memory on virtual devices (there is none to measure)."""
    return HEADER[:-1] if result.simulated else HEADER


HEADER = [
    "strategy",
    "GPUs",
    "dtype",
    "batch",
    "epoch",
    "step p50",
    "step p95",
    "samples/s",
    "per GPU",
    "speedup",
    "efficiency",
    "peak memory",
]


def _rank_line(r: dict[str, Any]) -> str:
    host = f" ({r['host']})" if r.get("host") else ""
    compute, wait = _ms(r.get("compute_s")), _ms(r.get("allreduce_s"))
    return f"rank {r['rank']}{host}: compute {compute}, all-reduce wait {wait}"


def _phases(case: Any) -> list[tuple[str, float, float]]:
    """(phase, mean seconds, share of the step) of the phases that took any time."""
    total = case.step_time
    return [(n, s, s / total if total > 0 else 0.0) for n, s in case.phases.items() if s > 0]


def _hidden_under(phases: list[tuple[str, float, float]]) -> str | None:
    """The phase row a DDP case's hidden all-reduce is printed under: its exposed
    ``allreduce`` row, else ``backward`` (the one it hides under)."""
    names = [n for n, _, _ in phases]
    return "allreduce" if "allreduce" in names else "backward" if "backward" in names else None


def _hidden_line(case: Any) -> str:
    return (
        f"└ {case.label}: {_ms(case.allreduce_hidden)} more all-reduce per step hidden under backward "
        "(overlapped, not in the step)"
    )


def _headline(result: Any) -> str:
    cfg = result.config
    convention = (
        f"batch {cfg.get('batch_size')} per GPU (global batch grows with the GPUs)"
        if cfg.get("convention") == "per_gpu"
        else f"global batch {cfg.get('batch_size')} (split over the GPUs)"
    )
    data = f"data {cfg.get('data')}"
    workers = cfg.get("loader_workers")
    if workers is not None:
        data = f"data: DataLoader, {workers} worker{'s' if workers != 1 else ''} per process"
    where = f" · machine {cfg['machine']}" if cfg.get("machine") else ""
    if cfg.get("devices_asked"):
        where += f" · devices {','.join(map(str, cfg['devices_asked']))}"
    return (
        f"model {cfg.get('model')} · input {'×'.join(map(str, cfg.get('input_shape', [])))} · {convention} · "
        f"{cfg.get('steps')} timed steps after {cfg.get('warmup')} warm-up · {data} · "
        f"epoch = {result.epoch_samples:,} samples{where} · timing: {cfg.get('timing')}{_floor(cfg)}"
    )


def _floor(cfg: dict[str, Any]) -> str:
    """Bench's own cost per step and the step time figures are trusted above (``step_overhead``)."""
    overhead, floor = cfg.get("step_overhead_s"), cfg.get("trusted_step_floor_s")
    if not overhead or not floor:
        return ""
    return f" (its own cost {_ms(overhead)} per step: steps under {_ms(floor)} not trusted)"


def text(result: Any, stream: TextIO) -> None:
    if _is_comparison(result):
        _text_compare(result, stream)
        return
    from rich.markup import escape
    from rich.table import Table

    with text_console(stream) as out:
        simulated = " [yellow](simulated)[/yellow]" if result.simulated else ""
        out.print(f"[bold]bench[/bold] {result.verdict.upper()}{simulated}")
        out.print(escape(_headline(result)))
        if result.simulation:
            out.print(f"[yellow]{escape(result.simulation)}[/yellow]")
        table = Table(show_edge=False, pad_edge=False, box=None, header_style="bold")
        columns = header(result)
        for i, name in enumerate(columns):
            table.add_column(name, justify="left" if i in (0, 2, 3) or name == "peak memory" else "right")
        for row in table_rows(result):
            table.add_row(*row)
        out.print()
        out.print(table)
        for c in result.cases:
            if c.error is not None:
                out.print(f"\n[red]{escape(c.label)} failed:[/red] {escape(c.error)}")
                continue
            out.print(f"\n[bold]{escape(c.label)}[/bold] · {_ms(c.step_time)} per step (mean)")
            phases = _phases(c)
            for name, seconds, share in phases:
                bar = "█" * max(1, round(share * BAR_WIDTH)) if share >= 0.005 else "▏"
                out.print(f"  {name:<10} {bar:<{BAR_WIDTH}} {100 * share:5.1f} %  {_ms(seconds)}")
                if c.allreduce_hidden and name == _hidden_under(phases):
                    out.print(f"  {'':<10} {_hidden_line(c)}")
            ranks = sorted(c.ranks, key=lambda r: -r.get("compute_s", 0.0))
            if len(ranks) > 1:
                shown = ranks[:RANKS_SHOWN]
                more = f" (slowest {RANKS_SHOWN} of {len(ranks)})" if len(ranks) > RANKS_SHOWN else ""
                out.print(f"  ranks{more}, per step:")
                for r in shown:
                    out.print(f"    {escape(_rank_line(r))}")
        for s in result.skipped:
            out.print(f"\nskipped {escape(s['case'])}: {escape(s['reason'])}")
        _transport_text(result, out)
        text_findings(out, result.findings, "Findings")


def _transport_text(result: Any, out: Any) -> None:
    """The NCCL section: what NCCL chose per pair in a DDP case (``gpudiag transport``'s
    table; its findings are among bench's), and the note on the log."""
    from rich.markup import escape

    from gpudiag.render.transport import pairs_text

    report, note = getattr(result, "transport", None), getattr(result, "transport_note", None)
    if report is None and not note:
        return
    if report is not None:
        out.print(f"\n[bold]NCCL transports[/bold] of {escape(result.transport_case or 'the DDP case')}")
        pairs_text(report, out)
    if note:
        out.print(f"{'' if report is not None else chr(10)}NCCL log: {escape(note)}")


def _transport_markdown(result: Any) -> list[str]:
    from gpudiag.render.transport import pairs_markdown

    report, note = getattr(result, "transport", None), getattr(result, "transport_note", None)
    lines: list[str] = []
    if report is not None:
        title = f"### NCCL transports of {result.transport_case or 'the DDP case'}"
        lines += [title, "", *pairs_markdown(report)]
    if note:
        lines += [f"NCCL log: {note}", ""]
    return lines


def _text_compare(result: Any, stream: TextIO) -> None:
    from rich.markup import escape
    from rich.table import Table

    with text_console(stream) as out:
        simulated = " [yellow](simulated)[/yellow]" if result.simulated else ""
        out.print(f"[bold]bench compare[/bold]{simulated}: {escape(result.before)} → {escape(result.after)}")
        out.print("a change is beyond noise when it exceeds the larger run-to-run spread (p95 − p50)")
        for line in result.differences:
            out.print(f"[yellow]the runs differ — {escape(line)}[/yellow]")
        for line in result.failed:
            out.print(f"[red]failed {escape(line)}[/red]")
        for case in result.cases:
            table = Table(show_edge=False, pad_edge=False, box=None, header_style="bold")
            for i, name in enumerate(["figure", "before", "after", "change", "noise", "beyond noise"]):
                table.add_column(name, justify="left" if i == 0 else "right")
            for row in compare_rows(case):
                table.add_row(*row)
            out.print(f"\n[bold]{escape(case.label)}[/bold], batch {case.batch}")
            out.print(table)
        for label in result.only_before:
            out.print(f"\nonly before: {escape(label)}")
        for label in result.only_after:
            out.print(f"\nonly after: {escape(label)}")


def _figure_name(figure: str) -> str:
    """``step_p50_s`` → ``step p50``, ``phase:copy`` → ``copy``."""
    names = {"step_p50_s": "step p50", "step_p95_s": "step p95", "samples_per_s": "samples/s"}
    return names.get(figure, figure.removeprefix("phase:"))


def compare_rows(case: Any) -> list[list[str]]:
    rows = []
    for ch in case.changes:
        rate = ch.figure == "samples_per_s"
        value = _num if rate else _ms
        rel = f" ({100 * ch.relative:+.1f} %)" if ch.relative is not None else ""
        delta = (f"{ch.delta:+.1f}" if rate else f"{1e3 * ch.delta:+.2f} ms") + rel
        noise = f"±{100 * ch.noise:.1f} %" if rate else f"±{_ms(ch.noise)}"
        rows.append(
            [
                _figure_name(ch.figure),
                value(ch.before),
                value(ch.after),
                delta,
                noise,
                "yes" if ch.beyond_noise else "no",
            ]
        )
    return rows


def json(result: Any, stream: TextIO) -> None:
    jsonout.write(result.to_json(), stream)


def markdown(result: Any, stream: TextIO) -> None:
    if _is_comparison(result):
        lines = [f"## gpudiag bench compare{' (simulated)' if result.simulated else ''}", ""]
        lines.append(
            f"`{result.before}` → `{result.after}`; beyond noise: the change exceeds the larger p95 − p50."
        )
        lines += [f"- **the runs differ** — {line}" for line in result.differences]
        lines += [f"- **failed** {line}" for line in result.failed]
        lines += [f"- only before: {label}" for label in result.only_before]
        lines += [f"- only after: {label}" for label in result.only_after]
        for case in result.cases:
            lines += ["", f"### {case.label}, batch {case.batch}", ""]
            lines.append(
                md.table(["figure", "before", "after", "change", "noise", "beyond noise"], compare_rows(case))
            )
        stream.write("\n".join(lines) + "\n")
        return
    mark, sentence = md.simulated(result)
    lines = [f"## gpudiag bench: {result.verdict}{mark}", "", _headline(result), ""]
    if sentence:
        lines += [sentence, ""]
    columns = header(result)
    rows = [r + [""] * (len(columns) - len(r)) for r in table_rows(result)]
    lines += [md.table(columns, rows), ""]
    ok = [c for c in result.cases if c.error is None and c.steps]
    names = list(dict.fromkeys(n for c in ok for n in c.phases))
    phase_names = [n for n in names if any(c.phases.get(n) for c in ok)]
    if ok and phase_names:
        lines += ["### Phases (share of the step, mean ms)", ""]
        rows = [
            [c.label]
            + [
                f"{100 * c.phases.get(n, 0.0) / c.step_time:.1f} % ({1e3 * c.phases.get(n, 0.0):.2f})"
                if c.phases.get(n)
                else "—"
                for n in phase_names
            ]
            for c in ok
        ]
        lines += [md.table(["case", *phase_names], rows), ""]
    ranked = [c for c in ok if len(c.ranks) > 1]
    if ranked:
        lines += ["### Ranks (per step)", ""]
        rows = [
            [
                c.label,
                str(r["rank"]),
                str(r.get("host") or "—"),
                _ms(r.get("compute_s")),
                _ms(r.get("allreduce_s")),
            ]
            for c in ranked
            for r in c.ranks
        ]
        lines += [md.table(["case", "rank", "host", "compute", "all-reduce wait"], rows), ""]
    lines += _transport_markdown(result)
    stream.write("\n".join(lines) + "\n")
    stream.write(md.findings(result.findings, "Findings"))
