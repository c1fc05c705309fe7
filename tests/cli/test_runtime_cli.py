"""The options every runtime command shares: --inject (grammar, exit 2), --trace and --timeout."""

from __future__ import annotations

import json
from pathlib import Path

import click
from click.testing import CliRunner

from gpudiag.cli.options import runtime_options
from gpudiag.runtime import DeviceSet, RunConfig, run
from tests.helpers import models


@click.command()
@runtime_options
def probe(inject: tuple[str, ...], trace: str | None, timeout: float) -> None:
    x, y = models.batch(8)
    config = RunConfig("dp", DeviceSet.virtual(2), steps=2, faults=inject, timeout=timeout)
    result = run(models.mlp, x, y, config)
    if trace:
        result.recorder.write(trace)
    click.echo(json.dumps(sorted({f for t in result.recorder.transfers for f in t.faults})))


def test_inject_is_repeatable_and_reaches_the_runtime() -> None:
    result = CliRunner().invoke(probe, ["--inject", "0->1:nan@2x1", "--inject", "1->0:zero@1x1"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == ["0->1:nan@2x1", "1->0:zero@1x1"]


def test_bad_inject_is_a_usage_error_showing_the_grammar() -> None:
    result = CliRunner().invoke(probe, ["--inject", "0=>1:nan"])
    assert result.exit_code == 2
    assert "SRC->DST:KIND[@STEP][xCOUNT]" in result.output
    cut = CliRunner().invoke(probe, ["--inject", "0-"])  # what a shell leaves of 0->1:nan unquoted
    assert cut.exit_code == 2 and "quote the spec (--inject '5->6:nan@3')" in cut.output


def test_a_spec_without_the_arrow_survives_the_shell() -> None:
    """Issue 47: 5-6:nan@3 is 5->6:nan@3, with nothing for a shell to redirect."""
    result = CliRunner().invoke(probe, ["--inject", "0-1:nan@2"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == ["0->1:nan@2"]  # (the runtime reads it as that)


def test_trace_file_is_chrome_trace_or_jsonl(tmp_path: Path) -> None:
    for name in ("t.json", "t.jsonl"):
        path = tmp_path / name
        assert CliRunner().invoke(probe, ["--trace", str(path)]).exit_code == 0
        text = path.read_text()
        if name.endswith(".jsonl"):
            assert all(json.loads(line)["type"] for line in text.splitlines())
        else:
            assert json.loads(text)["traceEvents"]


def test_timeout_must_be_positive() -> None:
    for bad in ("0", "-1", "soon"):
        assert CliRunner().invoke(probe, ["--timeout", bad]).exit_code == 2
