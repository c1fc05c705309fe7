"""Random damage to the real NCCL logs: the reader never raises, and never reads a pair,
transport or channel that the undamaged log does not have."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpudiag.transport.analysis import analyze
from gpudiag.transport.reader import NcclLog, read_log
from tests.helpers import NCCL

LOGS = {p.name: p.read_text(encoding="utf-8") for p in sorted(NCCL.glob("*.log"))}
SETTINGS = settings(
    max_examples=int(os.environ.get("FUZZ_EXAMPLES", "200")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
#: Characters inserted by the damage: no digits (a digit turns rank 12 into 125: a new
#: pair no reader could tell from a real one) and no letters (they could spell a transport).
JUNK = list(" \t│|┃<>*-:#[]()/\r")
PREFIXES = ["12  ", "│ ", "2025-11-12 20:42:20,261 - INFO - ", "[1,0]<stdout>:", "> ", "\t"]


def facts(log: NcclLog) -> dict[tuple[int, int, str], set[int]]:
    """(from, to, transport) → channels. A plugin's network name is free text
    (``NET/AWS Libfabric``): a deleted space is read as written, so names are compared
    without their spaces."""
    out: dict[tuple[int, int, str], set[int]] = {}
    for conn in log.connections:
        out.setdefault((conn.from_rank, conn.to_rank, conn.transport.replace(" ", "")), set()).add(
            conn.channel
        )
    return out


@st.composite
def damaged(draw: st.DrawFn) -> tuple[str, str]:
    name = draw(st.sampled_from(sorted(LOGS)))
    text = LOGS[name]
    for _ in range(draw(st.integers(1, 5))):
        lines = text.split("\n")
        op = draw(
            st.sampled_from(["insert", "delete", "drop", "dup", "join", "split", "prefix", "cut", "swap"])
        )
        i = draw(st.integers(0, max(0, len(lines) - 1)))
        if op == "insert" and text:
            at = draw(st.integers(0, len(text)))
            text = text[:at] + draw(st.sampled_from(JUNK)) + text[at:]
            continue
        if op == "delete" and text:
            at = draw(st.integers(0, len(text) - 1))
            if not text[at].isalnum():  # (deleting a digit renames a rank, a letter a network)
                text = text[:at] + text[at + 1 :]
            continue
        if op == "cut" and text:
            text = text[: draw(st.integers(0, len(text)))]
            continue
        if op == "drop":
            del lines[i]
        elif op == "dup":
            lines.insert(i, lines[i])
        elif op == "join" and i + 1 < len(lines):
            lines[i : i + 2] = [lines[i] + lines[i + 1]]
        elif op == "split" and lines[i]:
            at = draw(st.integers(0, len(lines[i])))
            lines[i : i + 1] = [lines[i][:at], lines[i][at:]]
        elif op == "prefix":
            lines[i] = draw(st.sampled_from(PREFIXES)) + lines[i]
        elif op == "swap" and i + 1 < len(lines):
            lines[i], lines[i + 1] = lines[i + 1], lines[i]
        text = "\n".join(lines)
    return name, text


@SETTINGS
@given(damaged())
def test_damage_never_invents_a_pair(case: tuple[str, str]) -> None:
    name, text = case
    original = facts(read_log([(LOGS[name], name)]))
    log = read_log([(text, name)])
    for key, channels in facts(log).items():
        assert key in original, (key, name)
        assert channels <= original[key], (key, channels, original[key])
    report = analyze(log)
    assert report.to_json()["schema"] == "gpudiag.transport/1"
    assert all(u.line >= 1 for u in log.unread)


@SETTINGS
@given(st.text(max_size=400))
def test_any_text_is_read_without_error(text: str) -> None:
    report = analyze(read_log([(text, "any")]))
    assert report.exit_code() in (0, 1)
