"""A pasted NCCL log's physical lines cleaned and cut into records, each in linear time.

What a paste does to NCCL's lines, undone here before :mod:`.reader` reads them:

* line ends of any kind (``\\n``, ``\\r\\n``, a lone ``\\r`` from an old Mac editor or a
  progress bar), a UTF-8 byte-order mark;
* docker's json-file wrapper (``{"log":"host:1:2 [0] NCCL INFO …\\n","stream":"stderr",…}``);
* terminal colours and other ANSI sequences (``\\x1b[0m`` at a line's end);
* several records on one physical line (a paste that lost its newlines, or two processes
  writing at once): a record starts at each NCCL prefix ``host:pid:tid [dev] NCCL INFO``.

Every control character left (C0, C1, DEL, bidirectional overrides) is written as an escape
(``\\x07``) so no byte of the log reaches a terminal as a command. Every regular expression
here and in :mod:`.reader` runs in time linear in its input (no nested quantifiers over
overlapping classes; possessive quantifiers where a class repeats), so a 1 MB line is read
in well under a second.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import NamedTuple

from gpudiag.transport import rx

#: ANSI sequences: CSI (``ESC [ … final``), OSC (``ESC ] … BEL`` or ``ESC \\``) and two-byte ones.
_ANSI = rx.compile(
    r"\x1b\[[0-?]*+[ -/]*+[@-~]?|\x1b\][^\x07\x1b\n]*+(?:\x07|\x1b\\)?|\x1b[@-Z\\-_]?"
    r"|\x9b[0-?]*+[ -/]*+[@-~]?"
)
#: Characters never shown as they are: C0 (but tab), DEL, C1, bidi controls, a BOM.
_CONTROL = rx.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069\ufeff]")
#: The same but line ends (a whole text is escaped before it is cut into lines).
_CONTROL_IN_TEXT = rx.compile(
    r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069\ufeff]"
)
_BREAK = rx.compile(r"\r\n|\r|\n")
#: A line that starts with NCCL's prefix (the usual case, read without looking back).
_PREFIX = rx.compile(
    r"([^\s:]{0,255}+):(\d{1,12}+):\d{1,12}+[ \t]{1,16}+\[\d{1,6}+\][ \t]{1,16}+"
    r"(?:[\w./-]{1,80}+:\d{1,6}+[ \t]{1,4}+)?NCCL[ \t]{1,4}+(?:INFO|WARN|TRACE|ABORT)\b"
)
#: The part of NCCL's prefix after ``host:pid:tid``: `` [dev] NCCL INFO`` (WARN lines put
#: the source location before ``NCCL``: `` [1] include/shm.h:28 NCCL WARN``).
_MARK = rx.compile(
    r"\[\d{1,6}+\][ \t]{1,16}+(?:[\w./-]{1,80}+:\d{1,6}+[ \t]{1,4}+)?"
    r"NCCL[ \t]{1,4}+(?:INFO|WARN|TRACE|ABORT)\b"
)
#: ``host:pid:tid`` and its space, read backwards from a mark (on the reversed text).
_BACK = rx.compile(r"[ \t]{1,16}+(\d{1,12}+):(\d{1,12}+):([^\s:]{0,255}+)")
#: How far before a mark its ``host:pid:tid`` may start.
_BACK_WINDOW = 320


def visible(text: str) -> str:
    """``text`` with every control character written as an escape (``\\x1b``, ``\\u202e``):
    safe to print on a terminal, in Markdown or JSON. Linear time."""
    return _CONTROL.sub(_escape, text) if _CONTROL.search(text) else text


def _visible_text(text: str) -> str:
    """:func:`visible` but keeping line ends (``\\n``)."""
    return _CONTROL_IN_TEXT.sub(_escape, text) if _CONTROL_IN_TEXT.search(text) else text


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


class Record(NamedTuple):
    """One record of a physical line: its ``text`` (prefix included, surrounding spaces
    gone), and the ``host``/``pid`` of its NCCL prefix (``host`` None when the prefix has
    no readable host: stripped, garbled by a merge; ``""`` where the author left it empty)."""

    text: str
    host: str | None
    pid: int | None
    prefixed: bool


def clean_text(text: str) -> str:
    """``text`` with every line end made ``\\n``, ANSI sequences and BOMs gone and other
    control characters escaped (each a pass in C over the whole text)."""
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    if "\x1b" in text or "\x9b" in text:
        text = _ANSI.sub("", text)
    return _visible_text(text.replace("\ufeff", ""))


def physical_lines(text: str) -> Iterator[tuple[int, str]]:
    """``(number, line)`` of each line (1-based) of a :func:`clean_text`, docker's json-file
    wrapper taken off (a docker record holding several lines gives them all under its
    line's number)."""
    if '{"log"' not in text:
        yield from enumerate(text.split("\n"), 1)
        return
    for number, line in enumerate(text.split("\n"), 1):
        for part in _unwrap(line):
            yield number, visible(part)


def ends_cut(text: str) -> bool:
    """Whether the text's last line has no line end (it may have been cut off)."""
    return bool(text) and not text.endswith(("\n", "\r"))


def _unwrap(line: str) -> list[str]:
    """The log text of one docker json-file line (``{"log": "…", …}``), split at its line
    ends; any other line as it is."""
    stripped = line.strip()
    if not (stripped.startswith('{"log"') and stripped.endswith("}")):
        return [line]
    try:
        value = json.loads(stripped)
    except ValueError:
        return [line]
    if not isinstance(value, dict) or not isinstance(value.get("log"), str):
        return [line]
    parts = _BREAK.split(value["log"])
    return parts[:-1] if len(parts) > 1 and parts[-1] == "" else parts


def one_record(line: str) -> Record | None:
    """The record of a line that starts with NCCL's prefix and holds no other (the usual
    line, read without looking back); None for any other line."""
    first = _PREFIX.match(line)
    if first is None or _MARK.search(line, first.end()) is not None:
        return None
    return Record(line, first.group(1), int(first.group(2)), True)


def records(line: str) -> list[Record]:
    """The records of a cleaned line (without its surrounding spaces): one per NCCL prefix
    in it (a record runs from its prefix to the next one), the text before the first
    prefix as a record of its own when it is not blank (a launcher's prefix, or a line
    whose NCCL prefix was stripped)."""
    if "NCCL" not in line:
        return [Record(line, None, None, False)] if line.strip() else []
    if single := one_record(line):
        return [single]
    starts: list[tuple[int, str | None, int | None]] = []
    for mark in _MARK.finditer(line):
        begin = mark.start()
        window = line[max(0, begin - _BACK_WINDOW) : begin][::-1]
        back = _BACK.match(window)
        if back is None:
            starts.append((begin, None, None))
            continue
        host_reversed = back.group(3)
        start = begin - back.end()
        before = window[back.end() : back.end() + 2]
        # (a host ended by `:` after a digit is the tail of another line's prefix: garbled)
        garbled = before[:1] == ":" and before[1:2].isdigit()
        starts.append((start, None if garbled else host_reversed[::-1], int(back.group(2)[::-1])))
    if not starts:
        return [Record(line, None, None, False)] if line.strip() else []
    out = []
    head = line[: starts[0][0]]
    if head.strip() and ("->" in head or "NCCL" in head or "via" in head):
        out.append(Record(head.strip(), None, None, False))
    ends = [s for s, _, _ in starts[1:]] + [len(line)]
    for index, ((start, host, pid), end) in enumerate(zip(starts, ends, strict=True)):
        first = index == 0 and not out  # (the first record keeps a launcher's prefix before it)
        out.append(Record((line[:end] if first else line[start:end]).strip(), host, pid, True))
    return out
