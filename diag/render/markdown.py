"""Markdown output, ready to paste into a GitHub issue."""

from __future__ import annotations

from typing import Any, TextIO

from gpudiag.render.text import GRADCHECK_COLUMNS, SOURCE_NAME, grouped_pairs


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = [_row(header), _row(["---"] * len(header))]
    lines += [_row(r) for r in rows]
    return "\n".join(lines)


def finding_lines(f: Any, severity: bool = False) -> list[str]:
    """One finding as a list item with its cause and fix (and its severity, if asked)."""
    lines = [f"- **`{f.code}`**" + (f" ({f.severity})" if severity else "") + f" — {f.message}"]
    if f.cause:
        lines.append(f"  - cause: {f.cause}")
    if f.fix:
        lines.append(f"  - fix: {f.fix}")
    return lines


def simulated(report: Any) -> list[str]:
    """`` (simulated)`` and the sentence saying what was, for a result from virtual devices."""
    sentence = getattr(report, "simulation", None)
    return [" (simulated)", f"*{sentence[:1].upper()}{sentence[1:]}.*"] if sentence else ["", ""]


def findings(items: list[Any], title: str) -> str:
    if not items:
        return ""
    lines = [f"### {title}", ""]
    for f in items:
        lines += finding_lines(f)
    return "\n".join(lines) + "\n\n"


def topology(report: Any, stream: TextIO) -> None:
    topo = report.topology
    gpus = list(topo.gpus.values())
    out = [
        "## GPU topology",
        "",
        f"From {SOURCE_NAME.get(topo.source, topo.source)}; {len(topo.gpu_labels)} GPU(s), "
        f"{len(topo.nic_labels)} NIC(s). GPU numbers are nvidia-smi's (PCI bus order).",
        "",
    ]
    if any(g.name or g.pci_bus_id for g in gpus):
        rows = [
            [
                str(g.index),
                g.name or "N/A",
                g.pci_bus_id or "N/A",
                "N/A" if g.memory_total_mib is None else f"{g.memory_total_mib} MiB",
            ]
            for g in gpus
        ]
        out += [table(["GPU", "name", "PCI bus id", "memory"], rows), ""]
    affinity = topo.affinity_columns()
    rows = []
    for r in topo.labels:
        info = topo.gpus.get(r)
        extra = [(getattr(info, k) or "N/A") if info else "" for k, _ in affinity]
        rows.append([f"**{r}**", *[topo.cell(r, c) or "?" for c in topo.labels], *extra])
    out += [table(["", *topo.labels, *[h for _, h in affinity]], rows), ""]
    if topo.nic_legend:
        out += ["NICs: " + ", ".join(f"{k} = `{v}`" for k, v in topo.nic_legend.items()), ""]
    if report.pairs:
        rows = [
            [
                link or "?",
                group[0].kind or "unknown",
                p2p or "—",
                " ".join(f"({p.a},{p.b})" for p in group),
            ]
            for (link, p2p), group in grouped_pairs(report.pairs)
        ]
        out += ["### GPU pairs, best first", "", table(["link", "kind", "P2P", "pairs"], rows), ""]
    stream.write("\n".join(out) + "\n")
    stream.write(findings(report.warnings, "Warnings"))
    stream.write(findings(report.advice, "Advice"))


def gradcheck(report: Any, stream: TextIO) -> None:
    cfg = report.config
    mark, sentence = simulated(report)
    out = [
        f"## gradcheck: **{report.verdict}**{mark}",
        "",
        *([sentence, ""] if sentence else []),
        f"Model `{cfg.get('model', '?')}`, batch {cfg['batch_size']}, world size {cfg['world_size']} "
        f"({cfg['devices']['kind']} devices), {cfg['dtype']}, loss `{cfg['loss']}`, {cfg['steps']} step(s), "
        f"seed {cfg['seed']}. Tolerance: relative norm error ≤ {report.tolerance['rel_norm_err']:.3g} "
        f"({report.tolerance['basis']}); " + ", ".join(f"{k} {v}" for k, v in report.settings.items()) + ".",
        "",
    ]
    rows = [
        [
            c.strategy
            + (" (" + ", ".join(f"{k}={v}" for k, v in c.options.items()) + ")" if c.options else ""),
            c.mode,
            "ok" if c.ok else "**differs**",
            f"{c.rel_norm_err:.2e}",
            f"{c.cosine:.6f}",
            f"{c.norm_ratio:.4f}",
            f"{c.max_abs_err:.2e}",
            f"`{c.worst_param}`" if c.worst_param else "—",
            f"`{c.first_bad_param}`" if c.first_bad_param else "—",
        ]
        for c in report.comparisons
    ]
    out += [table(list(GRADCHECK_COLUMNS), rows), ""]
    stream.write("\n".join(out) + "\n")
    stream.write(findings(report.findings, "Findings"))


def _where(transfer: dict[str, Any] | None) -> str:
    return f"{transfer['phase']} {transfer['src']}->{transfer['dst']}" if transfer else "—"


def nancheck(report: Any, stream: TextIO) -> None:
    rows = [
        [
            " & ".join(f"GPU{g}" for g in o.devices),
            (report.links.get(o.devices) or "") if len(o.devices) == 2 else "alone",
            "ok" if o.ok else f"**{o.status}**",
            str(o.first_bad_step or "—"),
            _where(o.first_bad_transfer),
        ]
        for o in [*report.singles, *report.pairs]
    ]
    mark, sentence = simulated(report)
    out = [
        f"## nancheck: **{report.verdict}**{mark}",
        "",
        *([sentence, ""] if sentence else []),
        f"{report.strategy}, {report.steps} steps per run, model `{report.config.get('model', '?')}`.",
        "",
        table(["run", "link", "status", "first bad step", "first bad data"], rows),
        "",
    ]
    stream.write("\n".join(out) + "\n")
    stream.write(findings(report.findings, "Findings"))


def ckpt_inspect(result: Any, stream: TextIO) -> None:
    from gpudiag.render.ckpt_lines import ckpt_lines

    stream.write("## Checkpoint\n\n```\n" + "\n".join(ckpt_lines("inspect", result.to_json())) + "\n```\n")


def ckpt_convert(result: Any, stream: TextIO) -> None:
    from gpudiag.render.ckpt_lines import ckpt_lines

    stream.write(
        "## Checkpoint conversion\n\n```\n" + "\n".join(ckpt_lines("convert", result.to_json())) + "\n```\n"
    )


def peer(report: Any, stream: TextIO) -> None:
    from gpudiag.render.text import _peer_lines

    stream.write("## peer\n\n```\n" + "\n".join(_peer_lines(report)) + "\n```\n\n")
    stream.write(findings(report.findings, "Findings"))


def env(report: Any, stream: TextIO) -> None:
    from gpudiag.render.env_lines import env_lines

    text = "\n".join(env_lines(report.to_json()))
    stream.write(f"## Environment (gpudiag env)\n\n```\n{text}\n```\n")


def replay(report: Any, stream: TextIO) -> None:
    from gpudiag.render.text_suite import replay_lines

    stream.write("## gpudiag replay\n\n```\n" + "\n".join(replay_lines(report)) + "\n```\n")
