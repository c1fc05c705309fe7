"""The table of finding codes (gpudiag.codes) against docs/findings.md and the types that
carry a code: every code documented once, every carrier refuses an unregistered code."""

from __future__ import annotations

import re

import pytest

from gpudiag.codes import CODES, SECTIONS, UnknownCode, lookup
from gpudiag.findings import Finding
from tests.helpers import ROOT

FINDINGS_MD = ROOT / "docs" / "findings.md"


def documented() -> dict[str, list[tuple[str, str]]]:
    """code → [(its ``##`` section heading, the severity its text opens with)], from the
    ``### `code` `` headings of docs/findings.md."""
    found: dict[str, list[tuple[str, str]]] = {}
    section, lines = "", FINDINGS_MD.read_text().splitlines()
    for i, line in enumerate(lines):
        if line.startswith("## "):
            section = line[3:].strip()
        elif line.startswith("### "):
            text = next(following for following in lines[i + 1 :] if following.strip())
            severity = re.match(r"\*(info|warning|error)\b", text)
            for code in re.findall(r"`([a-z0-9-]+)`", line):
                found.setdefault(code, []).append((section, severity.group(1) if severity else "?"))
    return found


def test_the_table_is_the_headings_of_the_findings_page() -> None:
    docs = documented()
    assert sorted(CODES) == sorted(docs), "gpudiag.codes and docs/findings.md list different codes"
    for name, code in CODES.items():
        assert SECTIONS[code.section] in [section for section, _ in docs[name]], name
        assert code.severity in [severity for _, severity in docs[name]], name
        assert code.title and "\n" not in code.title and not code.title.endswith("."), name


def test_an_unregistered_code_fails_at_construction() -> None:
    from gpudiag.repro.sweep.judge import Problem
    from gpudiag.runtime.launch import RankFailure

    assert lookup("link-corruption").severity == "error"
    with pytest.raises(UnknownCode, match="not-a-code"):
        Finding("not-a-code", "warning", "made up")
    with pytest.raises(UnknownCode):
        Problem("node-made-up", "made up")
    with pytest.raises(UnknownCode):
        RankFailure("rank-made-up", 0, "made up")
    assert RankFailure("rank-hung", 1, "no answer").code == "rank-hung"


def test_a_finding_from_another_version_reads_back_as_foreign() -> None:
    """A bundle written by a newer gpudiag replays here: its unknown code is kept, marked."""
    finding = Finding.from_json({"code": "from-the-future", "severity": "info", "message": "m"})
    assert finding.foreign and finding.to_json()["code"] == "from-the-future"
    assert not Finding.from_json(Finding("gpu-lost", "error", "m").to_json()).foreign
