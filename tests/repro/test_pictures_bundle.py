"""The report bundle holds the pictures (issue 47): ``<check>.svg`` for the checks that
have one and a self-contained ``REPORT.html`` beside ``REPORT.md``, in a folder and in a
zip, redacted like every other file, and a bundle with them still replays."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

from gpudiag.repro.bundle import read_bundle
from tests.helpers import FR, SEED_TOPO, invoke


def test_the_bundle_holds_the_pictures_and_report_html(tmp_path: Path) -> None:
    out = tmp_path / "bundle"
    hang = FR / "gloo" / "subgroup" / "json"
    result = invoke(
        [
            "report",
            "--machine",
            str(SEED_TOPO),
            "--checks",
            "topology,hang",
            "--hang",
            str(hang),
            "-o",
            str(out),
        ]
    )
    assert result.exit_code == 1, result.output  # the hang check finds rank 3
    assert {"REPORT.md", "REPORT.html", "topology.svg", "hang.svg"} <= {p.name for p in out.iterdir()}
    for name in ("topology.svg", "hang.svg"):
        ET.fromstring((out / name).read_bytes())
    page = (out / "REPORT.html").read_text(encoding="utf-8")
    assert page.count("<svg ") == 2 and "rank 3" in page and "GPU 7" in page
    document = read_bundle(out).document
    assert {"REPORT.html", "topology.svg", "hang.svg"} <= set(document["files"])  # listed as they are
    assert "`REPORT.html`" in (out / "REPORT.md").read_text(encoding="utf-8")


def test_a_zip_bundle_holds_them_too(tmp_path: Path) -> None:
    out = tmp_path / "r.zip"
    result = invoke(["report", "--machine", str(SEED_TOPO), "--checks", "env,topology", "-o", str(out)])
    assert result.exit_code == 0, result.output
    with zipfile.ZipFile(out) as archive:
        names = set(archive.namelist())
        assert {"REPORT.html", "topology.svg"} <= names and "hang.svg" not in names
        assert b"NV4" in archive.read("topology.svg")
        assert "topology.svg" in json.loads(archive.read("report.json"))["files"]
