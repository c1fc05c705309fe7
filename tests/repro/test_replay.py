"""``gpudiag replay``: the model a bundle carries, the error of a check that errored, and no
MATCH when nothing was compared (issue 47)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpudiag.checks.suite import Here, plan
from tests.helpers import invoke

NO_GPU = Here(cuda_gpus=0, nvml="no NVML here (test)")

MODEL = """\
from torch import nn


def build():
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 4 * 4, 10))
"""


def gradcheck_entry(**config: object) -> dict:
    return {
        "name": "gradcheck",
        "status": "pass",
        "headline": "",
        "config": {**plan(NO_GPU, ["gradcheck"])[0][1], "strategies": ["dp"], **config},
        "findings": [],
        "result": None,
    }


def write_doc(folder: Path, checks: list[dict], **files: bytes) -> Path:
    folder.mkdir(parents=True)
    (folder / "report.json").write_text(json.dumps({"schema": "gpudiag.report/1", "checks": checks}))
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return folder


@pytest.fixture(scope="module")
def file_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real bundle of gradcheck on a model file given by its bare name, from its folder;
    the file is then deleted, so only the bundle's copy can run."""
    work = tmp_path_factory.mktemp("work")
    (work / "mymodel.py").write_text(MODEL)
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(work)
        args = ["--model", "mymodel.py:build", "--input-shape", "3,4,4", "--checks", "gradcheck"]
        result = invoke(["report", *args, "-o", "bundle"])
    assert result.exit_code == 0, result.output
    (work / "mymodel.py").unlink()
    return work / "bundle"


def test_the_bundle_carries_the_model_file_and_replay_runs_it_from_any_folder(
    file_bundle: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 47: from another folder, ``replay --trust-bundle`` said "DIFFERS, error here"
    without why: it looked for the model file in the current folder."""
    assert (file_bundle / "model" / "mymodel.py").read_text() == MODEL
    monkeypatch.chdir(tmp_path)
    result = invoke(["replay", str(file_bundle), "--trust-bundle"])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"replay of {file_bundle}: MATCH\n")
    assert "ran the bundle's copy of mymodel.py" in result.stdout
    assert not list(tmp_path.iterdir())  # (nothing written into the folder replay runs in)


def test_nothing_compared_is_not_a_match(file_bundle: Path) -> None:
    """Issue 47: without --trust-bundle the one check that mattered was skipped and replay
    said MATCH, exit 0."""
    result = invoke(["replay", str(file_bundle)])
    assert result.exit_code == 3, result.output
    first = result.stdout.splitlines()[0]
    assert first.startswith(f"replay of {file_bundle}: NOTHING COMPARED") and "MATCH" not in first
    assert "rerun with --trust-bundle" in result.stdout
    doc = json.loads(invoke(["replay", str(file_bundle), "--format", "json"]).stdout)
    assert doc["verdict"] == "nothing-compared" and doc["match"] is False


def test_a_check_that_errors_here_shows_its_error(tmp_path: Path) -> None:
    """Issue 47: "error here" came without the error."""
    bundle = write_doc(tmp_path / "b", [gradcheck_entry(model="cnn", input_shape=[4])])
    result = invoke(["replay", str(bundle)])
    assert result.exit_code == 1, result.output
    assert "DIFFERS" in result.stdout.splitlines()[0]
    assert "error here: built-in 'cnn' needs --input-shape C,H,W, got 4" in result.stdout


def test_an_older_bundle_runs_the_model_its_repro_script_carries(tmp_path: Path) -> None:
    """Bundles before ``model/`` kept a failing check's model file in repro.py's MODEL_SOURCES:
    read as a literal (nothing in repro.py runs), and run with --trust-bundle."""
    marker = tmp_path / "ran"
    repro = (
        "import sys\n"
        f"open({str(marker)!r}, 'w')\n"  # (would show if replay ran repro.py)
        f"MODEL_SOURCES: dict[str, str] = {{'gone.py': {MODEL!r}}}\n"
    )
    entry = gradcheck_entry(model="/no/such/folder/gone.py:build", input_shape=[3, 4, 4])
    bundle = write_doc(tmp_path / "b", [entry], **{"repro.py": repro.encode()})
    result = invoke(["replay", str(bundle), "--trust-bundle"])
    assert result.exit_code == 0, result.output
    assert "ran the bundle's copy of gone.py" in result.stdout and not marker.exists()
