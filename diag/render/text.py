"""Human-readable output with rich: colour and tables on a terminal, plain text when piped."""

from __future__ import annotations

import io
import os
from typing import Any, TextIO

from gpudiag.render.ckpt_lines import ckpt_lines
from gpudiag.topology.model import GpuPair, link_rank, path_of

#: Colour per path class, best (green) to worst (red).
LINK_STYLE = {
    "NVLINK": "bold green",
    "PIX": "cyan",
    "PXB": "cyan",
    "PHB": "yellow",
    "NODE": "dark_orange",
    "SYS": "red",
}
SEVERITY_MARK = {"error": ("✖", "bold red"), "warning": ("▲", "yellow"), "info": ("•", "cyan")}
SOURCE_NAME = {
    "nvml": "live NVML",
    "nvidia-smi": "an `nvidia-smi topo` capture",
    "machine-file": "a machine file",
}


#: The width of text that is not going to a terminal: wide enough that no table cell is
#: ever cut (tables size to their content; nothing here expands to the full width).
PIPED_WIDTH = 10_000


def _console_class() -> Any:
    """rich's Console, writing the text it is given through :func:`gpudiag.render.printable`
    (a control character in a dump or log shown escaped, never sent to the terminal) while its
    own styles and control segments pass. The hook, ``Console._render_buffer``, is rich's
    private method (rich 13–14): where it is missing, the plain Console (render() then escapes
    the piped output as a whole)."""
    from rich.console import Console
    from rich.segment import Segment

    from gpudiag.render import printable

    if not hasattr(Console, "_render_buffer"):
        return Console

    class PrintableConsole(Console):
        def _render_buffer(self, buffer: Any) -> str:
            safe = (s if s.control else Segment(printable(s.text), s.style, s.control) for s in buffer)
            return super()._render_buffer(safe)

    return PrintableConsole


class text_console:
    """A rich console for ``stream``: colour and the terminal's width on a terminal;
    when piped, plain text with nothing cut or wrapped (:data:`PIPED_WIDTH`) and
    trailing blanks removed, so output is stable for scripts and golden files.
    ``NO_COLOR`` (any value) turns colour off, ``FORCE_COLOR`` (any value) on even when
    piped (https://no-color.org, https://force-color.org); NO_COLOR wins."""

    def __init__(self, stream: TextIO):
        self.stream = stream
        self.is_tty = hasattr(stream, "isatty") and stream.isatty()
        no_color = bool(os.environ.get("NO_COLOR"))
        colour = not no_color and (self.is_tty or bool(os.environ.get("FORCE_COLOR")))
        self.buffer = io.StringIO()
        self.console = _console_class()(
            file=stream if self.is_tty else self.buffer,
            force_terminal=self.is_tty or colour,
            no_color=not colour,
            width=None if self.is_tty else PIPED_WIDTH,
            highlight=False,
            emoji=False,
            soft_wrap=not self.is_tty,
        )

    def __enter__(self) -> Any:
        return self.console

    def __exit__(self, *exc: object) -> None:
        if not self.is_tty:
            lines = self.buffer.getvalue().split("\n")
            self.stream.write("\n".join(line.rstrip() for line in lines))


def styled(code: str | None) -> str:
    """A matrix cell as rich markup."""
    if code is None:
        return "[dim]?[/dim]"
    if code == "X":
        return "[dim]X[/dim]"
    style = LINK_STYLE.get(path_of(code) or "", "")
    return f"[{style}]{code}[/{style}]" if style else code


def findings(out: Any, items: list[Any], title: str) -> None:
    from rich.markup import escape

    if not items:
        return
    out.print(f"\n[bold]{title}[/bold]")
    for f in items:
        mark, style = SEVERITY_MARK.get(f.severity, ("•", ""))
        out.print(f"  [{style}]{mark}[/{style}] [bold]{f.code}[/bold]: {escape(f.message)}")
        if f.cause:
            out.print(f"      cause: {escape(f.cause)}")
        if f.fix:
            out.print(f"      fix: {escape(f.fix)}")


def topology(report: Any, stream: TextIO) -> None:
    with text_console(stream) as out:
        _topology(out, report)


def _topology(out: Any, report: Any) -> None:
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    topo = report.topology
    out.print(
        f"[bold]GPU topology[/bold] from {SOURCE_NAME.get(topo.source, topo.source)} · "
        f"{len(topo.gpu_labels)} GPU(s), {len(topo.nic_labels)} NIC(s) · GPU numbers are "
        "nvidia-smi's (PCI bus order)"
    )
    gpus = list(topo.gpus.values())
    if any(g.name or g.pci_bus_id for g in gpus):
        live = topo.source == "nvml"
        table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
        for column in ("GPU", "name", "PCI bus id", "memory", "UUID") + (("torch",) if live else ()):
            table.add_column(column)
        for g in gpus:
            torch = ("hidden" if g.torch_index is None else f"cuda:{g.torch_index}",)
            table.add_row(
                str(g.index),
                escape(g.name or "N/A"),
                g.pci_bus_id or "N/A",
                f"{g.memory_total_mib} MiB" if g.memory_total_mib is not None else "N/A",
                escape(g.uuid or "N/A"),
                *(torch if live else ()),
            )
        out.print(table)

    affinity = topo.affinity_columns()
    matrix = Table(box=box.SIMPLE_HEAD, pad_edge=False, title_justify="left")
    matrix.add_column("")
    for label in topo.labels:
        matrix.add_column(label, justify="center")
    for _, heading in affinity:
        matrix.add_column(heading)
    for row in topo.labels:
        cells = [styled(topo.cell(row, col)) for col in topo.labels]
        info = topo.gpus.get(row)
        extra = [escape(getattr(info, key) or "N/A") if info else "" for key, _ in affinity]
        matrix.add_row(f"[bold]{row}[/bold]", *cells, *extra)
    out.print(matrix)
    if topo.nic_legend:
        out.print(escape("NICs: " + ", ".join(f"{k} = {v}" for k, v in topo.nic_legend.items())))

    if report.pairs:
        out.print("\n[bold]GPU pairs, best first[/bold]")
        pairs = Table(box=box.SIMPLE_HEAD, pad_edge=False)
        for column in ("link", "kind", "P2P", "pairs"):
            pairs.add_column(column)
        for (link, p2p), group in grouped_pairs(report.pairs):
            first = group[0]
            pairs.add_row(
                styled(link),
                first.kind or "unknown",
                p2p or "—",
                pair_list(group, len(report.pairs)),
            )
        out.print(pairs)
    findings(out, report.warnings, "Warnings")
    findings(out, report.advice, "Advice")


def pair_list(group: list[GpuPair], total: int) -> str:
    """``(0,1) (2,3)``, or ``all 28 pairs`` when the group holds every pair."""
    if len(group) == total > 2:
        return f"all {total} pairs"
    return " ".join(f"({p.a},{p.b})" for p in group)


def grouped_pairs(pairs: list[GpuPair]) -> list[tuple[tuple[str | None, str | None], list[GpuPair]]]:
    """Pairs grouped by (link, P2P status), best link first, in first-seen order."""
    groups: dict[tuple[str | None, str | None], list[GpuPair]] = {}
    for p in pairs:
        groups.setdefault((p.link, p.p2p), []).append(p)
    return sorted(groups.items(), key=lambda kv: -link_rank(kv[0][0]))


def gradcheck(report: Any, stream: TextIO) -> None:
    with text_console(stream) as out:
        _gradcheck(out, report)


VERDICT_STYLE = {"pass": "bold green", "explained": "bold yellow", "fail": "bold red"}
#: The comparison table's columns (text and markdown).
GRADCHECK_COLUMNS = (
    "strategy",
    "mode",
    "result",
    "rel norm err",
    "cosine",
    "norm ratio",
    "max abs err",
    "worst param",
    "first bad param",
)


def _gradcheck(out: Any, report: Any) -> None:
    from gpudiag.render.gradcheck_text import render

    render(out, report, _rehearsal, _simulated(report), findings)


STATUS_STYLE = {
    "ok": "green",
    "diverged": "bold red",
    "exploded": "yellow",
    "crashed": "magenta",
    "hung": "magenta",
}


def nancheck(report: Any, stream: TextIO) -> None:
    with text_console(stream) as out:
        _nancheck(out, report)


def _rehearsal(out: Any, config: dict[str, Any]) -> None:
    """First, when faults were injected on purpose: say so (and which)."""
    from rich.markup import escape

    from gpudiag.runtime.faults import rehearsal

    sentence = rehearsal(config.get("inject") or [])
    if sentence:
        out.print(f"[bold yellow]{escape(capitalised(sentence))}[/bold yellow]")


def _nancheck(out: Any, report: Any) -> None:
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    style = VERDICT_STYLE.get(report.verdict, "bold")
    cfg = report.config
    _rehearsal(out, cfg)
    out.print(
        f"[bold]nancheck[/bold] [{style}]{report.verdict.upper()}[/{style}]{_simulated(report)} · "
        f"{report.strategy} · {report.steps} step(s) per run · model {cfg.get('model', '?')} · "
        + (f"virtual devices of {cfg.get('machine')}" if cfg.get("devices") == "virtual" else "CUDA devices")
    )
    if report.simulation:
        out.print(f"[yellow]{escape(capitalised(report.simulation))}[/yellow]")
    singles = {o.devices[0]: o for o in report.singles}
    pairs = {o.devices: o for o in report.pairs}
    gpus = sorted(set(singles) | {g for p in pairs for g in p})
    matrix = Table(
        box=box.SIMPLE_HEAD, pad_edge=False, title="pairs (link, coloured by outcome); diagonal: GPU alone"
    )
    matrix.add_column("")
    for g in gpus:
        matrix.add_column(f"GPU{g}", justify="center")
    for a in gpus:
        row = []
        for b in gpus:
            if a == b:
                o = singles.get(a)
                row.append(
                    "" if o is None else f"[{STATUS_STYLE[o.status]}]{'alone' if o.ok else o.status}[/]"
                )
                continue
            o = pairs.get((min(a, b), max(a, b)))
            if o is None:
                row.append("[dim]·[/dim]")
            else:
                link = report.links.get(o.devices) or "?"
                row.append(f"[{STATUS_STYLE[o.status]}]{link if o.ok else link + '✗'}[/]")
        matrix.add_row(f"[bold]GPU{a}[/bold]", *row)
    out.print(matrix)
    bad = [o for o in report.pairs if not o.ok] + [o for o in report.singles if not o.ok]
    if bad:
        table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
        for column in ("run", "status", "first bad step", "first bad data"):
            table.add_column(column)
        for o in bad:
            where = o.first_bad_transfer
            table.add_row(
                " & ".join(f"GPU{g}" for g in o.devices),
                f"[{STATUS_STYLE[o.status]}]{o.status}[/]",
                str(o.first_bad_step or "—"),
                f"{where['phase']} {where['src']}->{where['dst']} at step {where['step']}"
                if where
                else (o.error or "—"),
            )
        out.print(table)
    findings(out, report.findings, "Findings")
    if not report.findings:
        what = "virtual device alone and every pair" if report.simulated else "GPU and every pair"
        simulated = " (simulated, on the CPU)" if report.simulated else ""
        out.print(f"\nEvery {what} trained without non-finite values or explosion{simulated}.")


def ckpt_inspect(result: Any, stream: TextIO) -> None:
    with text_console(stream) as out:
        from rich.markup import escape

        for line in ckpt_lines("inspect", result.to_json()):
            out.print(escape(line))


def ckpt_convert(result: Any, stream: TextIO) -> None:
    with text_console(stream) as out:
        from rich.markup import escape

        for line in ckpt_lines("convert", result.to_json()):
            out.print(escape(line))


def _peer_lines(report: Any) -> list[str]:
    """Plain lines shared by the text and markdown views of ``peer``."""
    from gpudiag.runtime.faults import quoted, rehearsal

    sentence = rehearsal(getattr(report, "inject", []))
    lines = [capitalised(sentence)] if sentence else []
    unfired = getattr(report, "unfired", [])
    if unfired:
        lines.append(
            "Not fired: " + " ".join(f"--inject {quoted(s)}" for s in unfired) + " hit no copy and no "
            "all-reduce, so nothing below was planted by it"
        )
    if report.verdict == "skipped":
        lines.append(f"peer SKIPPED · {report.reason}")
    else:
        lines.append(f"peer {report.verdict.upper()}{_simulated(report)} · {report.devices} devices")
    if report.simulation:
        lines.append(f"  {report.simulation}")
    for r in report.pairs:
        wrong = [c for c in r.copies if c["wrong"]]
        copies = f"{len(r.copies)} copies, {len(wrong)} wrong" if r.copies else "no copies"
        grant = ", ".join(f"{k} {v}" for k, v in r.grant.items() if v is not None) or "unknown"
        line = f"  {r.src}->{r.dst} over {r.link or '?'}: grant {grant}; {copies}"
        if r.bandwidth:
            line += f"; direct {r.bandwidth['direct_gbs']} GB/s vs staged {r.bandwidth['staged_gbs']} GB/s"
        lines.append(line)
        if r.allreduce:
            for label, res in r.allreduce.items():
                state = "hung" if res.get("hung") else f"{res.get('wrong')} wrong"
                if (res.get("first_wrong_step") or 1) > 1:
                    state += f" (from step {res['first_wrong_step']})"
                lines.append(f"    all-reduce {label}: {state}")
    host = report.host
    lines.append(
        f"  host: IOMMU {host.iommu_mode}; {len(host.acs_redirect)} ACS redirect(s); "
        f"{len(host.kernel_lines)} kernel log line(s); NCCL settings {host.nccl or 'none'}"
    )
    lines += [f"  could not collect {k}: {v}" for k, v in host.missing.items()]
    lines += [f"  skipped: {s}" for s in report.skipped if s != report.reason]
    return lines


def _simulated(report: Any) -> str:
    """`` (simulated)`` after the verdict of a result from CPU virtual devices."""
    return " (simulated)" if getattr(report, "simulated", False) else ""


def capitalised(sentence: str) -> str:
    return sentence[:1].upper() + sentence[1:]


def peer(report: Any, stream: TextIO) -> None:
    with text_console(stream) as out:
        from rich.markup import escape

        for line in _peer_lines(report):
            out.print(escape(line))
        findings(out, report.findings, "Findings")


def env(report: Any, stream: TextIO) -> None:
    from gpudiag.render.env_lines import env_lines

    stream.write("\n".join(env_lines(report.to_json())) + "\n")
