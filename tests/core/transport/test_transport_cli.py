"""`gpudiag transport` on the command line: formats, exit codes, one-line errors, and the
refusal to run NCCL where fewer than two GPUs are."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpudiag.cli import cli
from tests.helpers import NCCL, TOPO

SHM_LOG = str(NCCL / "nccl1817_shm_and_p2p_direct_one_process.log")
NV18 = str(TOPO / "h100_8gpu_nv18_8nic_spaces.txt")


def run(*args: str, stdin: str | None = None):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(cli, ["transport", *args], input=stdin)


def test_json_document_and_exit_1_on_a_slow_path() -> None:
    result = run("--from-log", SHM_LOG, "--machine", NV18, "--format", "json")
    assert result.exit_code == 1, result.output
    doc = json.loads(result.output)
    assert doc["schema"] == "gpudiag.transport/1" and doc["topology"] == "nvidia-smi"
    assert [f["code"] for f in doc["findings"]] == ["nccl-slow-path"]
    assert {
        (p["from_rank"], p["to_rank"], p["transport"], p["channel_count"], p["offers"]) for p in doc["pairs"]
    } >= {
        (1, 2, "SHM", 2, "NV18"),
        (2, 3, "P2P/direct", 2, "NV18"),
    }


@pytest.mark.parametrize("fmt", ["text", "markdown"])
def test_text_and_markdown_show_every_pair_and_the_unread_line(fmt: str) -> None:
    result = run("--from-log", str(NCCL / "nccl952_ipc_read_socket_anonymised_host.log"), "--format", fmt)
    assert result.exit_code == 0, result.output
    assert "NET/Socket/3" in result.output and "P2P/IPC/read" in result.output
    assert "line 17" in result.output and "<cluster_name>:921" in result.output


def test_several_logs_and_stdin() -> None:
    a = str(NCCL / "nccl1189_h20_2hosts_ib_send_receive_cumem.log")
    b = (NCCL / "nccl1597_aws_libfabric_plugin.log").read_text(encoding="utf-8")
    result = run("--from-log", a, "--from-log", "-", "--format", "json", stdin=b)
    assert result.exit_code == 1, result.output  # (the libfabric run's NCCL WARN lines)
    doc = json.loads(result.output)
    assert [f["code"] for f in doc["findings"]] == ["nccl-warn"]
    assert doc["sources"] == [Path(a).name, "<stdin>"]
    assert [(u["source"], u["line"]) for u in doc["unread"]] == [(Path(a).name, 15)]


def test_a_log_without_transport_lines_is_not_an_error() -> None:
    result = run("--from-log", str(NCCL / "nccl2.28.9_ws1_h200_info.log"))
    assert result.exit_code == 0 and "nccl-no-transport-lines" in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--from-log", "no-such.log"], "NCCL log no-such.log: cannot read it (No such file"),
        (["--from-log", "pyproject.toml"], "no NCCL line"),
        (["--from-log", SHM_LOG, "--machine", "no-such-capture.txt"], "does not exist"),
        (["--from-log", SHM_LOG, "--format", "dot"], "Invalid value"),
    ],
)
def test_bad_input_is_exit_2_with_one_line(args: list[str], message: str) -> None:
    result = run(*args)
    assert result.exit_code == 2
    assert message in result.output and "Traceback" not in result.output


def test_without_a_log_on_fewer_than_two_gpus_is_exit_3_naming_from_log(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("gpudiag.hw.cuda.cuda_device_count", lambda: 1)
    result = run()
    assert result.exit_code == 3
    assert "--from-log" in result.output and "has 1" in result.output


@pytest.mark.multi_gpu
def test_live_run_reads_its_own_nccl_log() -> None:
    """On two GPUs or more: NCCL's own connection lines are read into a pair per ring
    hop, every pair on this host, none over the network."""
    result = run("--format", "json")
    assert result.exit_code in (0, 1), result.output
    doc = json.loads(result.output)
    assert doc["nccl_version"] is not None and doc["pairs"], doc
    assert all(not p["transport"].startswith("NET/") for p in doc["pairs"])
    assert len(doc["hosts"]) == 1


def test_the_live_run_asks_nccl_for_its_lines_and_restores_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gpudiag.transport.capture import nccl_debug

    monkeypatch.delenv("NCCL_DEBUG_SUBSYS", raising=False)
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    with nccl_debug():
        assert os.environ["NCCL_DEBUG_SUBSYS"] == "INIT,P2P,NET,GRAPH"
        assert os.environ["NCCL_DEBUG"] == "WARN"  # (the user's own value is kept)
    assert "NCCL_DEBUG_SUBSYS" not in os.environ and os.environ["NCCL_DEBUG"] == "WARN"


def test_a_fifo_given_as_a_log_is_refused_without_waiting(tmp_path: Path) -> None:
    """--from-log on a FIFO waited for a writer for ever; it is refused like every input file."""

    fifo = tmp_path / "nccl.log"
    os.mkfifo(fifo)
    result = run("--from-log", str(fifo))
    assert result.exit_code == 2 and "a FIFO, not a file" in result.output


def test_a_folder_given_as_a_log_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """A folder was "internal error: IsADirectoryError", exit 1 (the bounded reader opened it
    as a file before looking), in transport --from-log and report --nccl-log alike."""
    result = run("--from-log", str(tmp_path))
    assert result.exit_code == 2 and "a folder, not a file" in result.output
    assert "internal error" not in result.output
