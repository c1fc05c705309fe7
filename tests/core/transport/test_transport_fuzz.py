"""Random damage to the real NCCL logs: the reader never raises, and never reads a pair,
transport or channel that the undamaged log does not have."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpudiag.transport.analysis import analyze
from gpudiag.transport.reader import NcclLog, read_log
from tests.helpers import NCCL, fuzz_examples

LOGS = {p.name: p.read_text(encoding="utf-8") for p in sorted(NCCL.glob("*.log"))}
SETTINGS = settings(
    max_examples=fuzz_examples(200),
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


def _parts_a_number(text: str, at: int) -> bool:
    """Whether a break at ``at`` falls inside a run of digits (``31`` → ``3`` ``1``)."""
    return 0 < at < len(text) and text[at - 1].isdigit() and text[at].isdigit()


def _parts_a_token(text: str, at: int) -> bool:
    """Whether a break at ``at`` falls inside a word or number (``P2P/IPC`` cut to ``P2P/IP``)."""
    return 0 < at < len(text) and text[at - 1].isalnum() and text[at].isalnum()


def _glues(left: str, right: str) -> bool:
    """Whether putting ``left`` before ``right`` makes two numbers one (``31`` ``1`` → ``311``)."""
    return bool(left) and bool(right) and left[-1].isdigit() and right[0].isdigit()


def damage(text: str, op: str, index: int, at: int, piece: str) -> str:
    """``text`` with one damage ``op`` done at line ``index`` / character ``at`` (``piece`` the
    junk or prefix inserted), or unchanged where that damage could turn a rank's or a
    channel's digits into other digits — a line no reader could tell from a real one
    (``Channel 31/1`` with its ``/`` deleted is ``Channel 311``, a real channel). Letters are
    never inserted or deleted (they could spell or rename a transport)."""
    if op == "insert":
        return text if _parts_a_number(text, at) else text[:at] + piece + text[at:]
    if op == "delete":
        if at >= len(text) or text[at].isalnum() or _glues(text[:at], text[at + 1 :]):
            return text
        return text[:at] + text[at + 1 :]
    if op == "cut":
        return text if _parts_a_token(text, at) else text[:at]
    lines = text.split("\n")
    i = min(index, max(0, len(lines) - 1))
    if op == "drop":
        del lines[i]
    elif op == "dup":
        lines.insert(i, lines[i])
    elif op == "join" and i + 1 < len(lines) and not _glues(lines[i], lines[i + 1]):
        lines[i : i + 2] = [lines[i] + lines[i + 1]]
    elif op == "split" and not _parts_a_number(lines[i], at % (len(lines[i]) + 1)):
        cut = at % (len(lines[i]) + 1)
        lines[i : i + 1] = [lines[i][:cut], lines[i][cut:]]
    elif op == "prefix" and not _glues(piece, lines[i]):
        lines[i] = piece + lines[i]
    elif op == "swap" and i + 1 < len(lines):
        lines[i], lines[i + 1] = lines[i + 1], lines[i]
    return "\n".join(lines)


OPS = ["insert", "delete", "drop", "dup", "join", "split", "prefix", "cut", "swap"]


@st.composite
def damaged(draw: st.DrawFn) -> tuple[str, str]:
    name = draw(st.sampled_from(sorted(LOGS)))
    text = LOGS[name]
    for _ in range(draw(st.integers(1, 5))):
        op = draw(st.sampled_from(OPS))
        index = draw(st.integers(0, max(0, text.count("\n"))))
        at = draw(st.integers(0, len(text)))
        piece = draw(st.sampled_from(PREFIXES if op == "prefix" else JUNK))
        text = damage(text, op, index, at, piece)
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


LINE = "node:1:2 [5] NCCL INFO Channel 31/1 : 5[5] -> 0[0] via P2P/IPC"


@pytest.mark.parametrize(
    ("op", "at", "piece"),
    [
        ("delete", LINE.index("/1 :"), ""),  # Channel 31/1 → Channel 311 (issue 51's draw)
        ("insert", LINE.index("1/1 :"), "/"),  # Channel 31 → Channel 3/1
        ("split", LINE.index("1/1 :"), ""),  # a line ending Channel 3, the next 1/1 : …
        ("cut", LINE.index("IPC") + 2, ""),  # P2P/IPC → P2P/IP
    ],
)
def test_no_damage_turns_a_number_or_name_into_another(op: str, at: int, piece: str) -> None:
    assert damage(LINE, op, 0, at, piece) == LINE


def test_no_join_glues_two_numbers() -> None:
    parted = LINE.replace("Channel 31/1", "Channel 3\n1/1")
    assert damage(parted, "join", 0, 0, "") == parted


def test_a_damage_that_keeps_every_number_is_still_made() -> None:
    """The guards refuse only what renames: the damage generator still damages."""
    assert damage(LINE, "delete", 0, LINE.index(" : "), "") == LINE.replace("1 : 5", "1: 5")
    assert damage(LINE, "insert", LINE.index("Channel"), 0, "│") != LINE


@SETTINGS
@given(st.text(max_size=400))
def test_any_text_is_read_without_error(text: str) -> None:
    report = analyze(read_log([(text, "any")]))
    assert report.exit_code() in (0, 1)
