"""gpudiag peer: host probes with canned outputs, and the pair tests on virtual devices."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpudiag.checks.peer import conclude, peer
from gpudiag.hw.host import Runner, acs_redirects, collect, iommu_mode
from gpudiag.hw.machine import load_machine
from gpudiag.parsers import parse_sizes
from tests.helpers import SEED_MACHINE, invoke
from tests.helpers.hosts import Canned, epyc_host

SEED = str(SEED_MACHINE)


def test_host_probes_on_a_machine_with_iommu_and_acs() -> None:
    facts = collect(epyc_host(), env={"NCCL_DEBUG": "INFO", "HOME": "/root"}, home="/nonexistent")
    assert facts.iommu_mode == "translated" and facts.iommu_units == ["ivhd0", "ivhd1"]
    assert len(facts.kernel_lines) == 3 and "IO_PAGE_FAULT" in facts.kernel_lines[1]
    assert len(facts.acs_redirect) == 1 and facts.acs_redirect[0].startswith("00:01.1 PCI bridge")
    assert facts.nccl == {"NCCL_DEBUG": "INFO", "NCCL_P2P_LEVEL": "SYS (/etc/nccl.conf)"}
    codes = [f.code for f in conclude([], facts)]
    assert codes == ["iommu-enabled", "acs-redirect", "nccl-env-override"]


def test_missing_tools_are_reported_not_fatal() -> None:
    facts = collect(Canned({}, {}, {}), env={})
    assert facts.iommu_mode == "unknown"
    assert set(facts.missing) == {"cmdline", "iommu", "dmesg", "lspci"}
    assert conclude([], facts) == []


def test_a_tool_that_hangs_times_out() -> None:
    out = Runner(timeout=0.2).run(["sleep", "5"])
    assert out.text is None and "did not answer" in out.reason
    assert Runner().run(["definitely-not-a-tool-xyz"]).reason.endswith("is not installed")


@pytest.mark.parametrize(
    ("cmdline", "units", "mode"),
    [
        ("quiet iommu=pt intel_iommu=on", ["dmar0"], "passthrough"),
        ("quiet", ["dmar0"], "translated"),
        ("intel_iommu=off", [], "off"),
        ("quiet", [], "off"),
        ("", [], "unknown"),
    ],
)
def test_iommu_mode(cmdline: str, units: list[str], mode: str) -> None:
    assert iommu_mode(cmdline, units) == mode


def test_acs_parser_ignores_devices_without_redirect() -> None:
    assert acs_redirects("01:00.0 VGA\n\t\tACSCtl:\tSrcValid- ReqRedir- CmpltRedir-\n") == []


def test_corrupting_link_fails_copies_and_allreduce_with_a_clean_control() -> None:
    report = peer(
        machine=load_machine(SEED), pairs="5-6,6-7", inject=("5->6:zero",), runner=Canned({}, {}, {})
    )
    assert report.verdict == "fail" and report.exit_code() == 1
    bad = {(r.src, r.dst) for r in report.pairs for c in r.copies if c["wrong"]}
    assert bad == {(5, 6)}
    sizes = sorted({c["bytes"] for r in report.pairs for c in r.copies if c["dtype"] == "fp32"})
    assert sizes == [4096, 65536, 1 << 20]
    codes = {f.code: f for f in report.findings}
    assert codes["p2p-copy-mismatch"].evidence["directions"] == [(5, 6)]
    assert codes["allreduce-wrong-values"].evidence["control_ok"] is True
    assert codes["allreduce-wrong-values"].evidence["pair"] == [5, 6]


def test_healthy_pairs_pass() -> None:
    report = peer(machine=load_machine(SEED), pairs="0-1", runner=Canned({}, {}, {}))
    assert report.verdict == "pass" and report.findings == []
    assert all(c["wrong"] == 0 for r in report.pairs for c in r.copies)
    assert any("bandwidth" in s for s in report.skipped)


@pytest.mark.usefixtures("no_gpu")
def test_cli_without_gpus_is_skipped_with_the_host_probes() -> None:
    """Issue 17: bare `gpudiag peer` without GPUs said `peer PASS · none devices`, exit 0."""
    result = invoke(["peer", "--format", "json"])
    assert result.exit_code == 3  # cannot run here (DESIGN.md)
    doc = json.loads(result.output)
    assert doc["schema"] == "gpudiag.peer/1" and doc["pairs"] == [] and doc["devices"] == "none"
    assert doc["verdict"] == "skipped" and doc["simulated"] is False
    assert "not enough GPUs" in doc["reason"] and any("host probes only" in s for s in doc["skipped"])
    assert doc["host"]["iommu_mode"]  # the host probes ran and are shown
    text = invoke(["peer"])
    assert text.exit_code == 3 and "PASS" not in text.stdout
    first = text.stdout.splitlines()[0]
    assert first.startswith("peer SKIPPED · GPU tests: not enough GPUs") and "host:" in text.stdout


def test_a_machine_file_is_simulated_everywhere(tmp_path: Path) -> None:
    """Issue 17: copies on CPU virtual devices are never a plain pass of the real machine."""
    args = ["peer", "--machine", SEED, "--pairs", "0-1", "--sizes", "4K"]
    doc = json.loads(invoke([*args, "--format", "json"]).output)
    assert doc["verdict"] == "pass" and doc["simulated"] is True
    assert "virtual devices laid out like" in doc["simulation"] and SEED in doc["simulation"]
    text = invoke(args)
    assert text.exit_code == 0 and text.stdout.startswith("peer PASS (simulated)")
    assert "simulated on CPU virtual devices" in text.stdout
    markdown = invoke([*args, "--format", "markdown"]).stdout
    assert "peer PASS (simulated)" in markdown and "not over the machine's GPU links" in markdown
    one_gpu = tmp_path / "one.txt"
    one_gpu.write_text("\tGPU0\tCPU Affinity\nGPU0\t X \t0-7\n\nLegend:\n\n  X    = Self\n")
    single = invoke(["peer", "--machine", str(one_gpu), "--format", "json"])
    assert single.exit_code == 3, single.output
    assert json.loads(single.stdout)["verdict"] == "skipped"
    assert "not enough GPUs" in json.loads(single.stdout)["reason"]


def test_cli_on_a_machine_file() -> None:
    result = invoke(["peer", "--machine", SEED, "--pairs", "6-7", "--sizes", "4K", "--inject", "7->6:nan"])
    assert result.exit_code == 1 and "p2p-copy-mismatch" in result.output


def test_parse_sizes() -> None:
    assert parse_sizes("4K,1M,256MiB") == (4096, 1 << 20, 256 << 20)
    with pytest.raises(Exception, match="bad --sizes"):
        parse_sizes("4Q")


@pytest.mark.gpu
def test_bandwidth_direct_and_staged_on_a_gpu() -> None:
    from gpudiag.checks.peer import bandwidth
    from gpudiag.runtime import DeviceSet

    result = bandwidth(DeviceSet.cuda([0]), 0, 0, 1 << 24)
    assert result["bytes"] == 1 << 24 and result["direct_gbs"] > 0 and result["staged_gbs"] > 0


@pytest.mark.multi_gpu
def test_peer_on_two_cuda_gpus() -> None:
    report = peer(pairs="0-1", sizes=(4096, 1 << 20), runner=Canned({}, {}, {}))
    assert report.devices == "cuda" and [(p.src, p.dst) for p in report.pairs] == [(0, 1), (1, 0)]
    for pair in report.pairs:
        assert isinstance(pair.grant["torch"], bool)
        assert pair.bandwidth is not None and pair.bandwidth["direct_gbs"] > 0
        assert len(pair.copies) == 8 and all(c["wrong"] == 0 for c in pair.copies)
    allreduce = report.pairs[0].allreduce
    assert allreduce is not None
    assert allreduce["configured"]["wrong"] == 0 and allreduce["p2p_disabled"]["wrong"] == 0
    assert report.verdict == "pass"


@pytest.mark.multi_gpu
def test_peer_names_an_injected_fault_on_cuda() -> None:
    report = peer(pairs="0-1", sizes=(4096,), inject=("1->0:nan",), runner=Canned({}, {}, {}))
    codes = {f.code for f in report.findings}
    assert {"p2p-copy-mismatch", "allreduce-wrong-values"} <= codes and report.verdict == "fail"


def test_a_peer_rehearsal_says_so_first() -> None:
    machine = str(SEED_MACHINE)
    args = ["peer", "--machine", machine, "--pairs", "5-6", "--sizes", "4K", "--inject", "5->6:zero"]
    text = invoke(args)
    assert text.stdout.startswith("Rehearsal with injected faults (--inject '5->6:zero')"), text.stdout
    doc = json.loads(invoke([*args, "--format", "json"]).stdout)
    assert doc["rehearsal"].startswith("rehearsal with injected faults")


def test_peer_honours_the_step_of_a_fault() -> None:
    """Issue 47: ``peer --inject '5->6:nan@3'`` reported PASS under the rehearsal banner (its
    copies and all-reduce were all step 1). Each round of copies is a step: @3 adds a third."""
    report = peer(
        machine=load_machine(SEED),
        pairs="5-6",
        sizes=(4096,),
        inject=("5-6:nan@3",),
        runner=Canned({}, {}, {}),
    )
    assert report.verdict == "fail" and report.unfired == []
    forward = next(r for r in report.pairs if (r.src, r.dst) == (5, 6))
    assert [c["step"] for c in forward.copies] == [1, 1, 2, 2, 3, 3]  # fp32, fp16 per round
    assert [c["step"] for c in forward.copies if c["wrong"]] == [3, 3]
    assert forward.allreduce is not None and forward.allreduce["configured"]["first_wrong_step"] == 3
    first = {f.code: f for f in report.findings}["p2p-copy-mismatch"]
    assert "step 3" in first.message


def test_a_step_beyond_the_last_round_is_refused_before_anything_runs() -> None:
    from gpudiag.checks.peer import MAX_ROUNDS
    from gpudiag.runtime.faults import InjectSpecError

    with pytest.raises(InjectSpecError, match="can never fire"):
        peer(machine=load_machine(SEED), pairs="5-6", inject=(f"5->6:nan@{MAX_ROUNDS + 1}",))


def test_a_fault_that_hit_nothing_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rehearsal whose fault never fired must not read as a pass of a planted fault."""
    from gpudiag.runtime.faults import FaultPlan

    monkeypatch.setattr(FaultPlan, "due", lambda self, src, dst, step: [])
    monkeypatch.setattr(FaultPlan, "due_on_rank", lambda self, rank, step: [])
    args = ["peer", "--machine", SEED, "--pairs", "5-6", "--sizes", "4K", "--inject", "5->6:nan@2"]
    text = invoke(args)
    assert text.exit_code == 0, text.output
    assert text.stdout.splitlines()[1].startswith("Not fired: --inject '5->6:nan@2' hit no copy")
