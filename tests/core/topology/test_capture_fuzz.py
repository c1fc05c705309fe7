"""Random damage to the real captures gives a valid topology or the parser's own error;
whitespace-only damage gives exactly the original matrix."""

from __future__ import annotations

import re

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpudiag.topology import CaptureError, Topology, parse_capture
from tests.helpers import TOPO, fuzz_examples

CAPTURES = {p.name: p.read_text(encoding="utf-8") for p in sorted(TOPO.glob("*.txt"))}
VALID_CELL = re.compile(r"X|NV\d+|SYS|SOC|NODE|PHB|PXB|PIX|PSB|CPU")
VALID_P2P = re.compile(r"X|OK|CNS|GNS|TNS|NS|DR|U")
SETTINGS = settings(
    max_examples=fuzz_examples(300),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def assert_valid(topo: Topology) -> None:
    labels = topo.labels
    assert labels and len(set(labels)) == len(labels)
    assert set(topo.matrix) == set(labels)
    for row in labels:
        assert list(topo.matrix[row]) == labels
        for col in labels:
            cell = topo.cell(row, col)
            assert (cell == "X") == (row == col)
            assert cell is None or VALID_CELL.fullmatch(cell)
    for table in topo.p2p.values():
        for row, cells in table.items():
            for col, status in cells.items():
                assert status is None or VALID_P2P.fullmatch(status), (row, col, status)
    assert topo.gpus and all(label in labels for label in topo.gpus)


@st.composite
def damaged(draw: st.DrawFn) -> str:
    text = CAPTURES[draw(st.sampled_from(sorted(CAPTURES)))]
    for _ in range(draw(st.integers(1, 4))):
        lines = text.split("\n")
        op = draw(st.sampled_from(["delete", "insert", "replace", "drop_line", "dup_line", "join", "swap"]))
        if op in ("delete", "insert", "replace") and text:
            i = draw(st.integers(0, len(text) - 1))
            char = draw(st.sampled_from(list("\t X\r\n0123456789-,SYNODEPIXBHVΧ|:")))
            if op == "delete":
                text = text[:i] + text[i + 1 :]
            elif op == "insert":
                text = text[:i] + char + text[i:]
            else:
                text = text[:i] + char + text[i + 1 :]
            continue
        i = draw(st.integers(0, max(0, len(lines) - 2)))
        if op == "drop_line":
            del lines[i]
        elif op == "dup_line":
            lines.insert(i, lines[i])
        elif op == "join" and i + 1 < len(lines):
            lines[i : i + 2] = [lines[i] + lines[i + 1]]
        elif op == "swap" and i + 1 < len(lines):
            lines[i], lines[i + 1] = lines[i + 1], lines[i]
        text = "\n".join(lines)
    return text


@SETTINGS
@given(damaged())
def test_damage_gives_a_valid_topology_or_a_capture_error(text: str) -> None:
    try:
        topo = parse_capture(text)
    except CaptureError as exc:
        assert "\n" not in str(exc)
        return
    assert_valid(topo)


def reflow(text: str, how: str) -> str:
    if how == "tabs-to-spaces":
        return text.expandtabs(8)
    if how == "single-spaces":
        return "\n".join(" ".join(line.split()) for line in text.split("\n"))
    if how == "crlf":
        return text.replace("\n", "\r\n")
    if how == "trailing-blanks":
        return "\n".join(line + " \t " for line in text.split("\n"))
    if how == "ansi":
        return "\x1b[1m" + text.replace("GPU0", "\x1b[4mGPU0\x1b[0m", 1)
    raise AssertionError(how)


@SETTINGS
@given(
    st.sampled_from([n for n in sorted(CAPTURES) if "rocm" not in n and "Latency" not in n]),
    st.lists(
        st.sampled_from(["tabs-to-spaces", "single-spaces", "crlf", "trailing-blanks", "ansi"]), max_size=3
    ),
)
def test_whitespace_damage_gives_the_same_topology(name: str, hows: list[str]) -> None:
    original = parse_capture(CAPTURES[name])
    text = CAPTURES[name]
    for how in hows:
        text = reflow(text, how)
    topo = parse_capture(text)
    assert topo.labels == original.labels
    assert topo.matrix == original.matrix
    assert topo.p2p == original.p2p
    assert topo.nic_legend == original.nic_legend
