"""``gpudiag transport`` output in every format: ``text`` (a table of pairs — ranks,
devices or bus ids, hosts, transport, channels, what the topology offers — then unread
lines and findings), ``json`` (``gpudiag.transport/1``) and ``markdown``.

The result is read by its attributes (a :class:`~gpudiag.transport.report.TransportReport`).
"""

from __future__ import annotations

from typing import Any, TextIO

from gpudiag.render import jsonout
from gpudiag.render import markdown as md
from gpudiag.render.text import findings as text_findings
from gpudiag.render.text import text_console

#: Unread lines listed one by one; the rest are counted.
UNREAD_SHOWN = 20
HEADER = ["from", "to", "devices", "hosts", "transport", "raw", "channels", "topology offers"]


def _end(rank: int, device: int | None, busid: str | None) -> str:
    if device is not None:
        return f"{rank}[{device}]"
    if busid is not None:
        return f"{rank}[{busid}]"
    return str(rank)


def rows(report: Any) -> list[list[str]]:
    """One row per directed pair and transport."""
    out = []
    for p in report.pairs:
        if p.from_device is not None or p.to_device is not None:
            devices = f"{_dev(p.from_device)} -> {_dev(p.to_device)}"
        elif p.from_busid is not None:
            devices = f"{p.from_busid} -> {p.to_busid}"
        else:
            devices = "—"
        hosts = p.from_host if p.from_host == p.to_host else f"{p.from_host or '?'} -> {p.to_host or '?'}"
        offers = p.offers or "—"
        if p.offers and p.p2p:
            offers += f" (P2P {p.p2p})"
        out.append(
            [
                str(p.from_rank),
                str(p.to_rank),
                devices,
                hosts or "?",
                p.transport,
                getattr(p, "shown_raw", p.raw),
                str(len(p.channels)),
                offers,
            ]
        )
    return out


def _dev(device: int | None) -> str:
    return "?" if device is None else str(device)


def _summary(report: Any) -> list[str]:
    log = report.log
    lines = [
        f"NCCL {', '.join(log.versions) or 'version not in the log'}; "
        f"{len(log.connections)} transport line(s) of {log.lines}; {len(report.pairs)} pair(s)"
        + (f"; topology from {report.topology_source}" if report.topology_source else "")
    ]
    if log.hosts:
        lines.append(
            f"hosts: {', '.join(log.hosts[:8])}"
            + (f" and {len(log.hosts) - 8} more" if len(log.hosts) > 8 else "")
        )
    if log.ib_devices:
        lines.append(f"InfiniBand devices: {', '.join(log.ib_devices)}")
    nvls = getattr(log, "collnet_nvls", [])
    if nvls:
        lines.append(
            f"NVLS/CollNet: {nvls[0]}" + (f" (and {len(nvls) - 1} more such lines)" if len(nvls) > 1 else "")
        )
    lines += getattr(log, "notes", [])
    lines += report.host_notes
    lines += getattr(report, "notes", [])
    return lines


def _warn_lines(report: Any) -> list[str]:
    """NCCL's WARN lines (distinct messages), as the log wrote them (control characters
    escaped by the reader)."""
    log = report.log
    shown = list(getattr(log, "warnings", []))
    total = getattr(log, "warn_lines", len(shown))
    return shown + ([f"({total} WARN lines in all)"] if total > len(shown) else [])


def verdict_line(report: Any) -> str:
    """The closing sentence: never an all-clear the log alone cannot give."""
    if any(f.severity != "info" for f in report.findings):
        return ""
    if not report.pairs:
        return ""
    if getattr(report, "unjudged", False):
        return (
            "Not judged: some pairs need the topology of their host (see nccl-needs-topology); "
            "the others took the path expected of them."
        )
    return "No pair took a slower path than the log and topology show it could."


def _unread(report: Any) -> list[str]:
    items = report.unread
    out = [str(u) for u in items[:UNREAD_SHOWN]]
    if len(items) > UNREAD_SHOWN:
        out.append(f"and {len(items) - UNREAD_SHOWN} more")
    return out


def pairs_text(report: Any, out: Any) -> None:
    """The summary lines, the table of pairs and the unread lines on a rich console (also
    ``gpudiag bench``'s NCCL section)."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    for line in _summary(report):
        out.print(escape(line))
    if report.pairs:
        table = Table(box=box.SIMPLE, show_edge=False, pad_edge=False)
        for name in HEADER:
            table.add_column(name)
        for row in rows(report):
            table.add_row(*(escape(cell) for cell in row))
        out.print(table)
    if report.unread:
        out.print(f"\n[bold]Lines that could not be read ({len(report.unread)})[/bold]")
        for line in _unread(report):
            out.print(f"  {escape(line)}")
    warns = _warn_lines(report)
    if warns:
        out.print(f"\n[bold]NCCL WARN lines ({len(getattr(report.log, 'warnings', []))})[/bold]")
        for line in warns:
            out.print(f"  {escape(line)}")


def pairs_markdown(report: Any) -> list[str]:
    """The summary, the table of pairs and the unread lines as Markdown lines (no heading)."""
    out = [*[f"{line}  " for line in _summary(report)], ""]
    if report.pairs:
        out += [md.table(HEADER, [[cell.replace("|", "\\|") for cell in row] for row in rows(report)]), ""]
    if report.unread:
        out += [
            "### Lines that could not be read",
            "",
            *["- " + line.replace("|", "\\|") for line in _unread(report)],
            "",
        ]
    warns = _warn_lines(report)
    if warns:
        out += ["### NCCL WARN lines", "", *["- `" + line.replace("`", "'") + "`" for line in warns], ""]
    return out


def text(report: Any, stream: TextIO) -> None:
    with text_console(stream) as out:
        pairs_text(report, out)
        text_findings(out, [f for f in report.findings if f.severity != "info"], "Findings")
        text_findings(out, [f for f in report.findings if f.severity == "info"], "Notes")
        closing = verdict_line(report)
        if closing:
            out.print("\n" + closing)


def json(report: Any, stream: TextIO) -> None:
    jsonout.write(report.to_json(), stream)


def markdown(report: Any, stream: TextIO) -> None:
    out = ["## NCCL transports", "", *pairs_markdown(report)]
    stream.write("\n".join(out) + "\n")
    stream.write(md.findings([f for f in report.findings if f.severity != "info"], "Findings"))
    stream.write(md.findings([f for f in report.findings if f.severity == "info"], "Notes"))
    closing = verdict_line(report)
    if closing:
        stream.write("\n" + closing + "\n")
