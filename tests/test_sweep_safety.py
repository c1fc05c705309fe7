"""gpudiag sweep under stress (issue 36): what it reads is bounded and checked, what it
writes replaces only its own earlier folder, what it says names the node that failed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpudiag.cli import cli
from tests.test_sweep import _write_sweep, node

DEEP = "[" * 200_000 + "]" * 200_000


def _summary(folder: Path, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["sweep", "--summary", str(folder), *args])
    return result.exit_code, result.stderr


# -- 4, 18: bounded, checked reads of --rules, --baseline and --summary ---------------------


@pytest.mark.parametrize("flag", ["--rules", "--baseline"])
def test_rules_and_baseline_over_64_mib_are_refused_unread(tmp_path: Path, flag: str) -> None:
    _write_sweep(tmp_path / "sweep", [node(0), node(1)], [])
    big = tmp_path / "big.json"
    with big.open("wb") as f:  # (sparse: no disk used)
        f.truncate((64 << 20) + 10)
    code, err = _summary(tmp_path / "sweep", flag, str(big))
    assert code == 2 and err.count("\n") == 1 and "larger than 64 MiB" in err, err


@pytest.mark.parametrize("flag", ["--rules", "--baseline"])
def test_rules_and_baseline_that_are_not_utf8_are_one_line_exit_2(tmp_path: Path, flag: str) -> None:
    _write_sweep(tmp_path / "sweep", [node(0), node(1)], [])
    bad = tmp_path / "latin1.json"
    bad.write_bytes('{"schema": "gpudiag.sweep-rules/1", "x": "caf\xe9"}'.encode("latin-1"))
    code, err = _summary(tmp_path / "sweep", flag, str(bad))
    assert code == 2 and err.count("\n") == 1 and "not UTF-8" in err, err


def test_rules_from_dev_zero_or_a_fifo_are_refused_at_once(tmp_path: Path) -> None:
    """(In a child with a deadline: the old reader grew without bound on /dev/zero and
    blocked forever on a FIFO.)"""
    _write_sweep(tmp_path / "sweep", [node(0), node(1)], [])
    fifo = tmp_path / "rules.fifo"
    os.mkfifo(fifo)
    for source in ("/dev/zero", str(fifo)):
        run = subprocess.run(
            [sys.executable, "-m", "gpudiag", "sweep", "--summary", str(tmp_path / "sweep"), "--rules", source],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
        assert "Traceback" not in run.stderr


@pytest.mark.parametrize("where", ["--rules", "results.jsonl", "sweep.json", "rules.json"])
def test_deeply_nested_json_is_one_line_exit_2_not_recursion_error(tmp_path: Path, where: str) -> None:
    folder = tmp_path / "sweep"
    _write_sweep(folder, [node(0), node(1)], [])
    args: list[str] = []
    if where == "--rules":
        (tmp_path / "deep.json").write_text(DEEP)
        args = ["--rules", str(tmp_path / "deep.json")]
    elif where == "results.jsonl":
        with (folder / where).open("a") as f:
            f.write(DEEP + "\n")
    else:
        (folder / where).write_text(DEEP)
    code, err = _summary(folder, *args)
    assert code == 2 and err.count("\n") == 1 and "nested too deep" in err, err
    assert "RecursionError" not in err
