"""Graphviz output: GPUs and NICs as nodes, links as edges (``dot -Tsvg``)."""

from __future__ import annotations

from typing import Any, TextIO

from gpudiag.topology.model import link_rank, path_of

EDGE_STYLE = {
    "NVLINK": 'color="#2e7d32", penwidth=3',
    "PIX": 'color="#00838f", penwidth=2',
    "PXB": 'color="#00838f", penwidth=2',
    "PHB": 'color="#f9a825"',
    "NODE": 'color="#ef6c00", style=dashed',
    "SYS": 'color="#c62828", style=dotted',
}
#: GPU↔NIC edges are drawn only for close NICs (at most through the host bridge).
_NIC_EDGE_MIN_RANK = link_rank("PHB")


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def topology(report: Any, stream: TextIO) -> None:
    topo = report.topology
    lines = [
        "graph topology {",
        "  layout=neato; overlap=false; splines=true;",
        "  node [fontname=Helvetica];",
    ]
    for label in topo.gpu_labels:
        info = topo.gpus[label]
        text = label + (f"\\n{info.name}" if info.name else "")
        lines.append(f'  {_quote(label)} [shape=box, style=filled, fillcolor="#e8f5e9", label="{text}"];')
    for label in topo.nic_labels:
        name = topo.nic_legend.get(label)
        text = label + (f"\\n{name}" if name else "")
        lines.append(f'  {_quote(label)} [shape=ellipse, label="{text}"];')
    labels = topo.labels
    for i, a in enumerate(labels):
        for b in labels[i + 1 :]:
            code = topo.cell(a, b)
            is_nic_edge = a in topo.nic_labels or b in topo.nic_labels
            if code is None or (is_nic_edge and link_rank(code) < _NIC_EDGE_MIN_RANK):
                continue
            style = EDGE_STYLE.get(path_of(code) or "", "")
            lines.append(f"  {_quote(a)} -- {_quote(b)} [label={_quote(code)}, {style}];")
    lines.append("}")
    stream.write("\n".join(lines) + "\n")
