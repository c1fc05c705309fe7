"""Issue 44: terminal escapes a dump or a log carries are printed escaped, never raw — in
``report`` / ``doctor`` / ``replay`` output in every format, a bundle's REPORT.md, the
sweep's summary and ``env`` — and outputs are written whole even when a name cannot be
encoded (a lone surrogate)."""

from __future__ import annotations

import io
import json
import pickle
import zipfile
from pathlib import Path
from typing import ClassVar

import pytest

from gpudiag.render import PrintableStream, printable, render
from tests.helpers import FR, invoke

#: A screen clear, an OSC 52 clipboard write, a bell, a carriage return, a bidi override
#: and a C1 CSI: each would act on the terminal if printed as it is.
HOSTILE = "\x1b[2J\x1b]52;c;ZXZpbA==\x07\rtxt\u202eevil\x9b31m"
RAW = ("\x1b", "\x07", "\r", "\u202e", "\x9b")


def _hostile_dumps(folder: Path) -> None:
    for source in sorted((FR / "gloo" / "skip" / "pickle").iterdir()):
        tree = pickle.loads(source.read_bytes())  # (our own test data)
        for entry in tree["entries"]:
            entry["profiling_name"] = f"gloo:all_reduce{HOSTILE}"
            for frame in entry["frames"]:
                frame["name"] = f"{frame['name']}{HOSTILE}"
                frame["filename"] = f"/x/\udc80{HOSTILE}.py"  # (a lone surrogate too)
        (folder / source.name).write_bytes(pickle.dumps(tree, protocol=2))


def test_printable_escapes_controls_and_keeps_text() -> None:
    assert printable("a\tb\nc") == "a\tb\nc"
    out = printable(HOSTILE + "\udc80")
    assert not any(c in out for c in RAW) and "\\x1b[2J" in out and "\\u202e" in out and "\\udc80" in out
    stream = io.StringIO()
    PrintableStream(stream).write("x\x1by")
    assert stream.getvalue() == "x\\x1by"


@pytest.mark.usefixtures("no_gpu")
@pytest.mark.parametrize("fmt", ["text", "markdown", "json"])
def test_report_and_replay_print_no_raw_control_character(tmp_path: Path, fmt: str) -> None:
    hang = tmp_path / "hang"
    hang.mkdir()
    _hostile_dumps(hang)
    bundle = tmp_path / "b\x1b[2J\x07\u202e.zip"  # (a name the report prints, as replay does)
    done = invoke(["report", "--checks", "hang", "--hang", str(hang), "-o", str(bundle), "--format", fmt])
    assert done.exit_code == 1, done.output
    with zipfile.ZipFile(bundle) as archive:
        report_md = archive.read("REPORT.md").decode()
        json.loads(archive.read("report.json"))
    replayed = invoke(["replay", str(bundle), "--format", fmt])
    for text in (done.stdout, report_md, replayed.stdout):
        assert not any(c in text for c in RAW), repr(text[:2000])
    shown = [t for t in (done.stdout, report_md, replayed.stdout) if "\\x1b[2J" in t or "\\u001b[2J" in t]
    assert shown, "the hostile names are shown somewhere, escaped"
    if fmt == "json":
        json.loads(done.stdout)


def test_env_and_the_generic_renderers_escape_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", f"eth0{HOSTILE}")
    for fmt in ("text", "markdown", "json"):
        done = invoke(["env", "--format", fmt])
        assert done.exit_code == 0, done.output
        assert not any(c in done.stdout for c in RAW), (fmt, repr(done.stdout[:2000]))
        assert "eth0" in done.stdout
    from gpudiag.findings import Finding
    from gpudiag.render import generic

    class Result:  # (any CheckResult: what a check registered without a renderer returns)
        verdict, simulated = "fail", False
        findings: ClassVar = [Finding("rank-hung", "error", f"stuck{HOSTILE}", cause=HOSTILE, fix=HOSTILE)]

        def to_json(self) -> dict[str, str]:
            return {"schema": f"gpudiag.x{HOSTILE}/1"}

    for fmt in ("text", "markdown", "json"):
        stream = io.StringIO()
        getattr(generic, fmt)(Result(), PrintableStream(stream))  # (as render() hands it a stream)
        assert not any(c in stream.getvalue() for c in RAW), fmt
        assert "stuck" in stream.getvalue() or fmt == "json"


def test_render_writes_json_whole_when_a_name_cannot_be_encoded() -> None:
    class Ascii(io.StringIO):
        encoding = "ascii"

        def write(self, text: str) -> int:
            text.encode("ascii")  # (raises on what this stream cannot take)
            return super().write(text)

    class Result:
        def to_json(self) -> dict[str, str]:
            return {"schema": "gpudiag.x/1", "name": "caf\xe9 \udc80"}

    stream = Ascii()
    render("env", Result(), "json", stream)
    assert json.loads(stream.getvalue())["name"] == "caf\xe9 \udc80"
