"""gpudiag bench records the NCCL log of its DDP cases and shows what NCCL chose per pair.

The hardware boundary is faked with data: ranks' logs are written from a real NCCL log
(tests/data/nccl/SOURCES.md; #1817, one process driving eight L20s, SHM on some pairs),
split by the device that printed each line, as NCCL's processes would have written them;
NVML is the project's fake (tests/data/nvml). Everything else is real: bench's DDP over gloo
on CPU, the ranks' output redirected to private files, the files read and removed.
"""

from __future__ import annotations

import io
import json
import os
import tempfile
from pathlib import Path

import pytest
import torch

import gpudiag
from gpudiag.cleanup import clean_up
from gpudiag.hw.sources import read_machine_or_capture
from gpudiag.render import render
from gpudiag.transport.analysis import analyze
from gpudiag.transport.capture import NcclCapture, read_rank_logs
from gpudiag.transport.reader import read_log
from tests.helpers import DATA, models
from tests.helpers.nccl_logs import LOG, rank_lines

NV18 = DATA / "topo" / "h100_8gpu_nv18_8nic_spaces.txt"
NVSWITCH = DATA / "nvml" / "h100_8gpu_nvswitch.json"


def pair_table(report: object) -> set[tuple[int, int, str, tuple[int, ...]]]:
    return {(p.from_rank, p.to_rank, p.transport, tuple(p.channels)) for p in report.pairs}  # type: ignore[attr-defined]


def whole_log_report() -> object:
    log = read_log([(LOG.read_text(encoding="utf-8"), LOG.name)])
    return analyze(log, read_machine_or_capture(str(NV18)))


def test_a_folder_of_rank_logs_reads_as_the_log_they_came_from(tmp_path: Path) -> None:
    for rank in range(2):
        lines = [f"gpudiag rank {rank} of 2: backend nccl, pid 1, NCCL_DEBUG=INFO", *rank_lines(rank, 2)]
        (tmp_path / f"launch1-rank{rank}.log").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (tmp_path / "notes.txt").write_text("not a rank log\n")
    report = read_rank_logs(tmp_path, read_machine_or_capture(str(NV18)))
    assert report is not None
    assert pair_table(report) == pair_table(whole_log_report())
    assert [f.code for f in report.findings] == ["nccl-slow-path"]
    assert [name for name, _ in report.nccl_logs] == ["launch1-rank0.log", "launch1-rank1.log"]


def test_a_folder_without_nccl_lines_reads_as_nothing(tmp_path: Path) -> None:
    (tmp_path / "launch1-rank0.log").write_text("gpudiag rank 0 of 2: backend gloo, pid 1, NCCL_DEBUG=\n")
    assert read_rank_logs(tmp_path) is None
    assert read_rank_logs(tmp_path / "missing") is None


def test_the_capture_folder_is_private_and_removed_at_the_end_on_errors_and_on_a_signal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("NCCL_DEBUG", raising=False)
    monkeypatch.delenv("NCCL_DEBUG_SUBSYS", raising=False)
    with NcclCapture() as capture, capture.ranks("case1") as folder:
        assert capture.folder is not None and folder.parent == capture.folder
        assert capture.folder.stat().st_mode & 0o077 == 0
        assert os.environ["NCCL_DEBUG"] == "INFO" and os.environ["NCCL_DEBUG_SUBSYS"] == "INIT,P2P,NET,GRAPH"
        kept = capture.folder
    assert not kept.exists() and "NCCL_DEBUG" not in os.environ
    with pytest.raises(KeyboardInterrupt), NcclCapture() as capture:
        kept = capture.folder
        raise KeyboardInterrupt
    assert kept is not None and not kept.exists()
    with NcclCapture() as capture:  # what the signal thread does on Ctrl-C stuck in C++
        kept = capture.folder
        clean_up()
        assert kept is not None and not kept.exists()


def _printing_mlp() -> torch.nn.Module:
    """flat_mlp; inside a DDP rank it first prints that rank's lines of the real NCCL log to
    its stdout, where NCCL writes them."""
    rank = os.environ.get("RANK")
    if rank is not None:
        print("\n".join(rank_lines(int(rank), int(os.environ["WORLD_SIZE"]))), flush=True)
    return models.flat_mlp()


def _bench() -> gpudiag.checks.bench.BenchResult:
    return gpudiag.bench(
        _printing_mlp,
        input_shape=(3, 4, 4),
        num_classes=4,
        batch_size=4,
        steps=2,
        warmup=1,
        strategies=("ddp",),
    )


def _leftovers() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("gpudiag-bench-nccl-*")}


@pytest.mark.usefixtures("no_gpu")
def test_bench_on_nccl_shows_the_transport_table_and_explains_a_slow_path(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """bench's DDP ranks (gloo here, standing in for NCCL: `records` says yes) print a real
    NCCL log; bench reads it, places it on the NVML topology (the fake NVSwitch H100) and
    says that the NV18 pairs went over SHM — among bench's own findings, in every format."""
    monkeypatch.setattr("gpudiag.checks.bench.run.records", lambda kind: True)
    monkeypatch.setenv("GPUDIAG_NVML_SCENARIO", str(NVSWITCH))
    monkeypatch.delenv("NCCL_DEBUG", raising=False)
    monkeypatch.delenv("NCCL_DEBUG_SUBSYS", raising=False)
    before = _leftovers()
    result = _bench()
    printed = capfd.readouterr()
    assert "NCCL INFO" not in printed.out + printed.err  # (the ranks' output went to the private log)
    assert _leftovers() == before and "NCCL_DEBUG" not in os.environ
    assert result.transport is not None and result.transport_case == "ddp ×2 fp32"
    assert pair_table(result.transport) == pair_table(whole_log_report())
    assert {p.offers for p in result.transport.pairs} == {"NV18"}
    assert "nccl-slow-path" in [f.code for f in result.findings] and result.verdict == "warn"
    doc = json.loads(json.dumps(result.to_json()))
    assert doc["transport"]["schema"] == "gpudiag.transport/1" and doc["transport_case"] == "ddp ×2 fp32"
    assert {(p["from_rank"], p["to_rank"]) for p in doc["transport"]["pairs"]} >= {(1, 2), (3, 4), (7, 0)}
    text, md = io.StringIO(), io.StringIO()
    render("bench", result, "text", text)
    render("bench", result, "markdown", md)
    assert "NCCL transports of ddp ×2 fp32" in text.getvalue() and "SHM/direct/direct" in text.getvalue()
    assert "nccl-slow-path" in text.getvalue()
    assert "### NCCL transports of ddp ×2 fp32" in md.getvalue()
    assert "| 1 | 2 | 1 -> 2 |" in md.getvalue() and "NV18 (P2P OK)" in md.getvalue()


@pytest.mark.usefixtures("no_gpu")
def test_the_users_nccl_debug_is_kept_and_said(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("gpudiag.checks.bench.run.records", lambda kind: True)
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    monkeypatch.delenv("NCCL_DEBUG_SUBSYS", raising=False)
    result = _bench()
    assert result.transport is not None  # (the stand-in ranks print INFO lines whatever the level)
    assert result.transport_note is not None and "NCCL_DEBUG=WARN set by you" in result.transport_note
    assert os.environ["NCCL_DEBUG"] == "WARN" and "NCCL_DEBUG_SUBSYS" not in os.environ


@pytest.mark.usefixtures("no_gpu")
def test_on_gloo_nothing_is_captured_and_nothing_said(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(NcclCapture, "__enter__", lambda self: pytest.fail("captured without NCCL"))
    result = gpudiag.bench(
        models.flat_mlp, input_shape=(3, 4, 4), num_classes=4, batch_size=4, steps=2, warmup=1,
        strategies=("ddp",),
    )  # fmt: skip
    assert result.transport is None and result.transport_note is None
    assert result.to_json()["transport"] is None
    text = io.StringIO()
    render("bench", result, "text", text)
    assert "NCCL" not in text.getvalue()


@pytest.mark.multi_gpu
def test_bench_on_two_gpus_reads_its_ddp_ranks_nccl_log() -> None:
    """The real thing: DDP over NCCL on two GPUs; every pair on this host, none over the network."""
    result = gpudiag.bench(
        "mlp", input_shape=(8,), batch_size=8, steps=3, warmup=1, strategies=("ddp",), gpus=[2]
    )
    assert result.transport is not None and result.transport.pairs, result.transport_note
    assert all(not p.transport.startswith("NET/") for p in result.transport.pairs)
    assert result.to_json()["transport"]["nccl_version"] is not None


def _ok(rank: int, world: int) -> bytes:
    return b"ok"


def test_a_capture_inside_a_reports_rank_logs_leaves_its_numbering_alone(tmp_path: Path) -> None:
    """report runs each check inside rank_logs; the live transport check captures its own
    ranks inside that. The inner block restarted the outer numbering, so the outer block's
    next launch overwrote launch1's logs."""
    from gpudiag.runtime.launch import launch, rank_logs

    with rank_logs(tmp_path) as outer:
        launch(_ok, 1)
        launch(_ok, 1)
        with NcclCapture() as capture, capture.ranks("inner"):
            launch(_ok, 1)
        launch(_ok, 1)
    assert sorted(p.name for p in outer.glob("*.log")) == [f"launch{n}-rank0.log" for n in (1, 2, 3)]


@pytest.mark.usefixtures("no_gpu")
def test_ranks_that_print_no_nccl_line_give_a_note_naming_the_users_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NCCL_DEBUG_FILE set by the user: NCCL writes its lines there, not to the ranks'
    stdout, so bench's log has none; it says where they went instead of a table."""
    monkeypatch.setattr("gpudiag.checks.bench.run.records", lambda kind: True)
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("NCCL_DEBUG_FILE", "/tmp/nccl.%h.%p")
    result = gpudiag.bench(
        models.flat_mlp, input_shape=(3, 4, 4), num_classes=4, batch_size=4, steps=2, warmup=1,
        strategies=("ddp",),
    )  # fmt: skip
    assert result.transport is None and result.to_json()["transport"] is None
    note = result.transport_note or ""
    assert "holds no NCCL line" in note and "NCCL_DEBUG_FILE=/tmp/nccl.%h.%p" in note
    assert "NCCL_DEBUG=INFO set by you" in note
    text = io.StringIO()
    render("bench", result, "text", text)
    assert "NCCL log: the DDP ranks' log holds no NCCL line" in text.getvalue()
