"""Read ``nvidia-smi topo -m`` and ``nvidia-smi topo -p2p`` text as users paste it.

What this accepts (every case has a real capture in ``../shared/fixtures/topo``):

- raw tab-separated output, tabs expanded to spaces, single spaces, CRLF, ANSI escapes,
  trailing spaces and trailing empty cells, text before the matrix and after the legend;
- every legend generation (modern ``SYS/NODE/PHB/PXB/PIX/NV#``, legacy ``SOC``, the oldest
  "Path traverses" wording) and the cells ``X SYS SOC NODE PHB PXB PIX PSB CPU NV<n>``;
- NIC columns named by device (``mlx5_0``, printed order kept) or ``NIC<k>`` with a
  ``NIC Legend:`` block; NIC rows without affinity cells;
- ``CPU Affinity``, ``NUMA Affinity`` and ``GPU NUMA ID`` columns when present (also as
  truncated or shortened header words), values kept as printed, ``N/A`` as None;
- damage from copying: merged cells (``SYSSYS``, ``PXBSYS``, `` X SYS``), a merged header
  (``GPU0GPU1…``, ``NIC7NIC8``), a non-ASCII self marker (Greek ``Χ``), a dashed rule;
- Markdown tables of the matrix (pipes, bold labels), as in GitHub issues;
- ``topo -p2p`` status matrices (``OK CNS GNS TNS NS DR U``), alone or after a ``-m`` matrix.

Cells are found with a regular expression rather than by splitting on whitespace, which
is what repairs merged cells. What cannot be reconstructed raises :class:`CaptureError`
naming the line — never a wrong matrix. A capture cut off before its last rows (an
excerpt) is completed from the transposed cells where the matrix is symmetric and says so.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from gpudiag.errors import InputError
from gpudiag.findings import Finding
from gpudiag.topology.model import GpuInfo, Matrix, Topology, gpu_index

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
#: Device names: GPUs, NICs by number, or RDMA device names such as mlx5_0, mlx5_bond_0.
_LABEL = re.compile(r"GPU\d+|NIC\d+|[a-z][a-z0-9]*(?:_[a-z]+)*_?\d+", re.ASCII)
#: Affinity column headings, full or shortened as seen in pastes.
_AFFINITY_HEADING = re.compile(
    r"(?P<gpu_numa_id>GPU\s*NUMA(?:\s*ID)?)|(?P<cpu_affinity>CPU(?:\s*Aff\w*)?)"
    r"|(?P<numa_affinity>NUMA(?:\s*Aff\w*)?)"
)
#: Self markers: Latin X, Greek Chi, Cyrillic Ha (all look alike on a page).
_SELF = "XΧХ"
_LINK_CELL = r"NV(?:[1-9]|[1-9][0-9])(?![0-9])|SYS|SOC|NODE|PHB|PXB|PIX|PSB|CPU"
_P2P_CELL = r"OK|CNS|GNS|TNS|NS|DR|U"
_CELL = re.compile(rf"(?:{_LINK_CELL}|{_P2P_CELL}|[{_SELF}])(?![a-z])")
_SEPARATORS = re.compile(r"[\s|]*")
_RULE = re.compile(r"^[\s\-=+|:]+$")
_NIC_LEGEND_LINE = re.compile(r"^\s*(NIC[0-9]+)\s*:\s*(\S+)\s*$")
_LEGEND_KEY = re.compile(r"^\s*(X|SOC|SYS|NODE|PHB|PXB|PIX|PSB|NV#|OK|GNS)\s*=\s*(.*)$")
_P2P_CODES = frozenset(_P2P_CELL.split("|"))
_NA = {"N/A", "NA", "n/a", "-"}

#: Outputs of other tools that people paste instead of ``nvidia-smi topo -m``.
_FOREIGN = (
    (
        re.compile(r"ROCm System Management Interface|between two GPUs"),
        "this is `rocm-smi --showtopo` output (AMD); gpudiag reads `nvidia-smi topo -m`",
    ),
    (
        re.compile(r"P2P \(Peer-to-Peer\) GPU Bandwidth Latency Test|P2P Connectivity Matrix"),
        "this is cuda-samples `p2pBandwidthLatencyTest` output; gpudiag reads "
        "`nvidia-smi topo -m` (and `nvidia-smi topo -p2p rw`)",
    ),
)


class CaptureError(InputError):
    """A capture that cannot be read; the message names the line and what was wrong."""

    def __init__(self, message: str, line: int | None = None, source: str = "capture"):
        where = f"{source}, line {line}: " if line is not None else f"{source}: "
        super().__init__(where + message)
        self.line = line


@dataclass
class _Block:
    """One matrix found in the text: header labels, rows of cells, affinity values."""

    kind: str  # "links" or "p2p"
    header_line: int
    labels: list[str]
    affinity_columns: list[str]
    rows: dict[str, list[str]] = field(default_factory=dict)
    affinity: dict[str, dict[str, str | None]] = field(default_factory=dict)
    row_lines: dict[str, int] = field(default_factory=dict)


def parse_capture(text: str, source: str = "capture") -> Topology:
    """Parse ``nvidia-smi topo -m`` output (optionally followed by ``topo -p2p`` output).

    ``source`` names the input in error messages (a file name or ``<stdin>``).
    Raises :class:`CaptureError` for anything that cannot be read faithfully.
    """
    lines = _clean(text).split("\n")
    for pattern, message in _FOREIGN:
        if any(pattern.search(line) for line in lines):
            raise CaptureError(message, source=source)
    notes: list[Finding] = []
    blocks = _find_blocks(lines, source, notes)
    if not blocks:
        raise CaptureError(
            "no `nvidia-smi topo -m` matrix found (expected a header line `GPU0 GPU1 …`)",
            source=source,
        )
    links = [b for b in blocks if b.kind == "links"]
    p2p_blocks = [b for b in blocks if b.kind == "p2p"]
    if len(links) > 1:
        raise CaptureError(
            f"two topology matrices (headers on lines {links[0].header_line} and "
            f"{links[1].header_line}); paste one `nvidia-smi topo -m` output",
            source=source,
        )
    main = links[0] if links else p2p_blocks[0]
    labels = main.labels
    matrix = _complete(main, notes) if links else _unknown_matrix(labels)
    p2p: dict[str, Matrix] = {}
    for block in p2p_blocks:
        unknown = [lbl for lbl in block.labels if lbl not in labels]
        if unknown:
            raise CaptureError(
                f"the P2P matrix names {', '.join(unknown)}, which the topology matrix lacks",
                block.header_line,
                source,
            )
        statuses = _complete(block, notes)
        merged = p2p.setdefault("reported", {})
        for row, cells in statuses.items():
            for col, status in cells.items():
                old = merged.setdefault(row, {}).get(col)
                merged[row][col] = status if old in (None, "OK") else old
    gpus = {}
    for label in labels:
        index = gpu_index(label)
        if index is None:
            continue
        values = main.affinity.get(label, {})
        gpus[label] = GpuInfo(
            label=label,
            index=index,
            cpu_affinity=values.get("cpu_affinity"),
            numa_affinity=values.get("numa_affinity"),
            gpu_numa_id=values.get("gpu_numa_id"),
        )
    if not gpus:
        raise CaptureError("the matrix has no GPU rows", main.header_line, source)
    return Topology(
        source="nvidia-smi",
        labels=labels,
        matrix=matrix,
        gpus=gpus,
        nic_legend=_nic_legend(lines),
        p2p=p2p,
        notes=notes,
        legend=_legend_generation(lines),
    )


def _clean(text: str) -> str:
    text = _ANSI.sub("", text.replace("\ufeff", ""))
    text = re.sub(r"\r+\n", "\n", text).replace("\r", "\n")
    # Pipes and bold markers come from Markdown tables (GitHub issues, gpudiag's own
    # --format markdown); nvidia-smi never prints them.
    return re.sub(r"[|*`]", " ", text.replace("\xa0", " "))


def _header(line: str) -> tuple[list[str], list[str]] | None:
    """(device labels, affinity column keys) if the line is a matrix header, else None."""
    columns = [(m.start(), m.lastgroup) for m in _AFFINITY_HEADING.finditer(line)]
    rest = _AFFINITY_HEADING.sub(" ", line)
    labels = _LABEL.findall(rest)
    if not labels or gpu_index(labels[0]) is None:
        return None
    if _LABEL.sub("", rest).strip(" \t|"):
        return None
    return labels, [name for _, name in columns if name]


def _find_blocks(lines: list[str], source: str, notes: list[Finding]) -> list[_Block]:
    blocks = []
    i = 0
    while i < len(lines):
        header = _header(lines[i])
        if header is None:
            i += 1
            continue
        labels, affinity_columns = header
        if len(set(labels)) != len(labels):
            raise CaptureError("the header names a device twice", i + 1, source)
        block = _Block("links", i + 1, labels, affinity_columns)
        i = _read_rows(block, lines, i + 1, source, notes)
        if block.rows:
            blocks.append(block)
    return blocks


def _read_rows(block: _Block, lines: list[str], start: int, source: str, notes: list[Finding]) -> int:
    """Read the rows after a header; returns the index of the first line after them."""
    kinds: set[str] = set()
    i = start
    while i < len(lines):
        line = lines[i]
        if not line.strip() or _RULE.match(line):
            if block.rows and not _more_rows(block, lines, i):
                break
            i += 1
            continue
        stripped = line.lstrip(" \t|")
        match = _LABEL.match(stripped)
        if match is None:
            break
        label = match.group(0)
        if label not in block.labels:
            raise CaptureError(f"row {label} is not a column of the header", i + 1, source)
        if label in block.rows:
            raise CaptureError(f"row {label} appears twice", i + 1, source)
        cells, tail = _cells(stripped[match.end() :], len(block.labels), label, i + 1, source)
        _check_diagonal(block.labels, label, cells, i + 1, source)
        kinds.update("p2p" if c in _P2P_CODES else "links" for c in cells if c != "X")
        block.rows[label] = cells
        block.row_lines[label] = i + 1
        block.affinity[label] = _affinity(block, label, tail, i + 1, notes)
        i += 1
    if len(kinds) > 1:
        raise CaptureError("the matrix mixes link codes and P2P status codes", block.header_line, source)
    block.kind = kinds.pop() if kinds else "links"
    return i


def _more_rows(block: _Block, lines: list[str], blank: int) -> bool:
    """Whether the next non-blank line after ``blank`` is a row still to come (pastes
    with a blank line between rows)."""
    for line in lines[blank + 1 :]:
        if line.strip():
            match = _LABEL.match(line.lstrip(" \t|"))
            label = match.group(0) if match else None
            return label in block.labels and label not in block.rows
    return False


def _cells(text: str, count: int, label: str, line: int, source: str) -> tuple[list[str], str]:
    """The first ``count`` cells of a row (merged cells split) and the text after them."""
    cells: list[str] = []
    pos = 0
    for _ in range(count):
        pos = _SEPARATORS.match(text, pos).end()  # type: ignore[union-attr]
        match = _CELL.match(text, pos)
        if match is None:
            found = text[pos:].split()[0] if text[pos:].split() else "end of line"
            raise CaptureError(
                f"row {label} has {len(cells)} readable cells, the header has {count} "
                f"columns (stopped at {found!r})",
                line,
                source,
            )
        cell = match.group(0)
        cells.append("X" if cell in _SELF else cell)
        pos = match.end()
    tail = text[pos:]
    extra = tail.split()
    if extra and _CELL.fullmatch(extra[0]):
        raise CaptureError(f"row {label} has more cells than the header has columns ({count})", line, source)
    if tail[:1].isalpha():
        raise CaptureError(f"row {label}: cannot tell where {tail.split()[0]!r} ends", line, source)
    return cells, tail


def _check_diagonal(labels: list[str], row: str, cells: list[str], line: int, source: str) -> None:
    own = labels.index(row)
    for col, cell in enumerate(cells):
        if (cell == "X") != (col == own):
            what = "X off the diagonal" if cell == "X" else f"{cell!r} where X (self) belongs"
            raise CaptureError(f"row {row} column {labels[col]}: {what}", line, source)


def _affinity(block: _Block, label: str, tail: str, line: int, notes: list[Finding]) -> dict[str, str | None]:
    values = tail.replace("|", " ").split()
    columns = block.affinity_columns
    if gpu_index(label) is None and not values:
        return {}
    if len(values) > len(columns):
        notes.append(
            Finding(
                "capture-extra-values",
                "warning",
                f"line {line}: {len(values) - len(columns)} value(s) after the cells of "
                f"{label} have no column heading and were ignored",
                {"line": line, "values": values[len(columns) :]},
            )
        )
    elif len(values) < len(columns) and gpu_index(label) is not None:
        notes.append(
            Finding(
                "capture-missing-values",
                "warning",
                f"line {line}: {label} has {len(values)} affinity value(s) for "
                f"{len(columns)} column(s); the missing ones are unknown",
                {"line": line},
            )
        )
    return {column: (None if value in _NA else value) for column, value in zip(columns, values, strict=False)}


def _complete(block: _Block, notes: list[Finding]) -> Matrix:
    """The full matrix of a block; rows an excerpt cut off are filled from the columns."""
    labels = block.labels
    missing = [label for label in labels if label not in block.rows]
    matrix: Matrix = {row: dict(zip(labels, cells, strict=True)) for row, cells in block.rows.items()}
    if not missing:
        return {label: matrix[label] for label in labels}
    unknown = 0
    for row in missing:
        matrix[row] = {}
        for col in labels:
            if col == row:
                matrix[row][col] = "X"
            elif col in block.rows:
                matrix[row][col] = block.rows[col][labels.index(row)]
            else:
                matrix[row][col] = None
                unknown += 1
    notes.append(
        Finding(
            "truncated-capture",
            "warning",
            f"the capture has no row for {', '.join(missing)} (cut off?); those cells were "
            f"taken from the columns, {unknown} remain unknown",
            {"missing_rows": missing, "unknown_cells": unknown},
            fix="paste the whole `nvidia-smi topo -m` output",
        )
    )
    return {label: matrix[label] for label in labels}


def _unknown_matrix(labels: list[str]) -> Matrix:
    return {r: {c: ("X" if r == c else None) for c in labels} for r in labels}


def _nic_legend(lines: list[str]) -> dict[str, str]:
    legend = {}
    for line in lines:
        match = _NIC_LEGEND_LINE.match(line)
        if match:
            legend[match.group(1)] = match.group(2)
    return legend


def _legend_generation(lines: list[str]) -> str | None:
    """``oldest`` ("Path traverses"), ``soc`` (SOC key), ``modern`` (SYS/NODE), or None."""
    keys = {}
    for line in lines:
        match = _LEGEND_KEY.match(line)
        if match:
            keys[match.group(1)] = match.group(2)
    if not keys:
        return None
    if any(text.startswith("Path traverses") for text in keys.values()):
        return "oldest"
    if "SOC" in keys:
        return "soc"
    if "SYS" in keys or "NODE" in keys:
        return "modern"
    return None
