"""gpudiag transport judges every slow path the log shows and gives no all-clear it cannot
give (issue 45): GPUDirect RDMA, pairs that need the topology, NCCL's WARN lines, inputs of
more than one run, pastes damaged in the ways real pastes are. Real logs from public threads
(tests/data/nccl/SOURCES.md); logs built inline are synthetic and say so."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

from click.testing import CliRunner

from gpudiag.cli import cli
from gpudiag.hw.sources import read_machine_or_capture
from gpudiag.transport.analysis import TransportReport, analyze
from gpudiag.transport.reader import read_log
from tests.helpers import NCCL, TOPO


def report(*names: str, text: str | None = None, machine: str | None = None) -> TransportReport:
    texts = [((NCCL / n).read_text(encoding="utf-8"), n) for n in names]
    if text is not None:
        texts.append((text, "inline"))
    topo = read_machine_or_capture(str(TOPO / machine)) if machine else None
    return analyze(read_log(texts), topo)


def codes(rep: TransportReport) -> list[str]:
    return [f.code for f in rep.findings]


def run(*args: str) -> Any:
    return CliRunner().invoke(cli, ["transport", *args])


# --- 1. GPUDirect RDMA -------------------------------------------------------------------


def test_ib_between_hosts_without_gdrdma_is_a_warning_with_its_causes_in_order() -> None:
    """NVIDIA/nccl#629: `[receive] via NET/IB/1` between two hosts (no /GDRDMA)."""
    rep = report("nccl629_direct_pointer_read_ib_no_gdr_2hosts.log")
    (gdr,) = rep.findings
    assert gdr.code == "nccl-no-gdrdma" and gdr.severity == "warning" and rep.exit_code() == 1
    cause = gdr.cause or ""
    order = [cause.index(word) for word in ("peermem", "ACS", "NCCL_NET_GDR_LEVEL", "NIC far from the GPU")]
    assert order == sorted(order)
    assert "GPU Direct RDMA Disabled for HCA" in (gdr.fix or "")


def test_gdrdma_on_both_ends_is_quiet() -> None:
    """NVIDIA/nccl#1189 and #429: `[send]`/`[receive] via NET/IB/N/GDRDMA` between hosts."""
    assert "nccl-no-gdrdma" not in codes(report("nccl1189_h20_2hosts_ib_send_receive_cumem.log"))
    assert "nccl-no-gdrdma" not in codes(report("nccl429_channel_busid_ib_gdrdma_2hosts.log"))


# Synthetic (no public paste showed it): one connection whose two ends disagree, in
# NCCL 2.19's line form; the sender without GDR read, the receiver with GDR write, and a
# second connection whose receiver has no GDR.
DISAGREE = """\
a:1:2 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/IB/0
b:3:4 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [receive] via NET/IB/0/GDRDMA
b:3:4 [0] NCCL INFO Channel 00/0 : 1[0] -> 0[0] [send] via NET/IB/0/GDRDMA
a:1:2 [0] NCCL INFO Channel 00/0 : 1[0] -> 0[0] [receive] via NET/IB/0
"""


def test_the_two_ends_of_one_connection_are_both_shown() -> None:
    rep = report(text=DISAGREE)
    by_pair = {(p.from_rank, p.to_rank): p for p in rep.pairs}
    assert by_pair[0, 1].shown_raw == "receive NET/IB/0/GDRDMA · send NET/IB/0"
    assert by_pair[0, 1].to_json()["raw_by_side"] == {"send": ["NET/IB/0"], "receive": ["NET/IB/0/GDRDMA"]}
    (gdr,) = rep.findings  # (0 -> 1 receives with GDR: a send side without it is NCCL's PCIe default)
    assert gdr.code == "nccl-no-gdrdma" and "1->0" in gdr.message and "0->1" not in gdr.message
    assert "the two ends disagree on 1->0" in gdr.message
    result = CliRunner().invoke(cli, ["transport", "--from-log", "-"], input=DISAGREE)
    assert result.exit_code == 1 and "send NET/IB/0" in result.output and "NET/IB/0/GDRDMA" in result.output


# --- 2. no all-clear without a topology --------------------------------------------------


def test_shm_on_one_host_without_a_topology_is_not_judged_exit_3() -> None:
    """NVIDIA/nccl#1817: SHM between GPUs of one host, and no --machine."""
    log = str(NCCL / "nccl1817_shm_and_p2p_direct_one_process.log")
    result = CliRunner().invoke(cli, ["transport", "--from-log", log])
    assert result.exit_code == 3, result.output
    assert "No pair took a slower path" not in result.output
    assert "Not judged" in result.output and "--machine topo.txt" in result.output
    doc = json.loads(CliRunner().invoke(cli, ["transport", "--from-log", log, "--format", "json"]).output)
    assert doc["verdict"] == "needs-topology"
    # with the topology the same log is judged
    nv18 = str(TOPO / "h100_8gpu_nv18_8nic_spaces.txt")
    assert CliRunner().invoke(cli, ["transport", "--from-log", log, "--machine", nv18]).exit_code == 1


def test_a_forcing_setting_is_named_as_the_cause_of_the_unjudged_pairs() -> None:
    """Synthetic: NCCL's own `set by environment` line with NCCL_P2P_LEVEL=LOC and SHM used."""
    text = (
        "h:1:2 [0] NCCL INFO NCCL_P2P_LEVEL set by environment to LOC\n"
        "h:1:2 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via SHM/direct/direct\n"
    )
    rep = report(text=text)
    judged = next(f for f in rep.findings if f.code == "nccl-needs-topology")
    assert "NCCL_P2P_LEVEL=LOC" in (judged.cause or "") and rep.exit_code() == 3


# --- 3. NCCL's WARN lines ----------------------------------------------------------------


def test_a_full_dev_shm_is_named_with_its_fix() -> None:
    """NVIDIA/nccl#290: SHM pairs, then `posix_fallocate failed : No space left on device`."""
    rep = report("nccl290_shm_full_direct_shared_memory_busid.log")
    shm = next(f for f in rep.findings if f.code == "nccl-shm-failed")
    assert "No space left on device" in shm.message
    assert "--ipc=host" in (shm.fix or "") and "--shm-size" in (shm.fix or "")
    assert rep.exit_code() == 1
    result = run("--from-log", str(NCCL / "nccl290_shm_full_direct_shared_memory_busid.log"))
    assert "NCCL WARN lines" in result.output and "posix_fallocate" in result.output
    assert "No pair took a slower path" not in result.output


def test_an_shm_attach_failure_and_a_timestamped_warn_line() -> None:
    """NVIDIA/nccl#1589 (attach failed) and pytorch/ci-infra#490 (a timestamp before NCCL's prefix)."""
    attach = report("nccl1589_shm_attach_failed_cumem_ib_gdrdma_shared.log")
    assert "nccl-shm-failed" in codes(attach)
    assert "nccl-no-gdrdma" not in codes(attach)  # (`NET/IB/9/GDRDMA/Shared` is GDR)
    ci = report("ci_infra490_timestamp_shm_extend_failed.log")
    assert codes(ci)[0] == "nccl-shm-failed" and ci.log.hosts == [
        "mt-l-x86iavx512-45-172-t4-4-csmpw-runner-g4sfw-workflow"
    ]
    markdown = run(
        "--from-log", str(NCCL / "ci_infra490_timestamp_shm_extend_failed.log"), "--format", "markdown"
    )
    assert "### NCCL WARN lines" in markdown.output


# --- 4. two inputs, one answer -----------------------------------------------------------


def test_a_device_log_and_a_bus_id_log_are_never_merged_into_fake_bus_ids() -> None:
    """NVIDIA/nccl#952 (device indexes) read with #429 (bus ids): each keeps its own kind."""
    rep = report("nccl952_ipc_read_socket_anonymised_host.log", "nccl429_channel_busid_ib_gdrdma_2hosts.log")
    alone = report("nccl952_ipc_read_socket_anonymised_host.log")
    devices = {(p.from_rank, p.to_rank): (p.from_device, p.to_device) for p in alone.pairs}
    for pair in rep.pairs:
        if (pair.from_rank, pair.to_rank) in devices and pair.from_busid is None:
            assert (pair.from_device, pair.to_device) == devices[pair.from_rank, pair.to_rank]
    assert rep.log.bracket_kind == "mixed"
    assert all(p.from_busid is None for p in rep.pairs if p.transport == "P2P/IPC")  # (#952's pairs)


def test_short_bus_ids_of_cloud_vms_are_bus_ids() -> None:
    """Synthetic, in NCCL 2.12's bus-id form as a cloud VM prints it (GPUs at 00:04.0 and
    00:05.0, as the H200 VM's `Duplicate GPU detected … CUDA device 60` shows)."""
    text = "vm:1:2 [0] NCCL INFO Channel 00 : 0[40] -> 1[50] via P2P/IPC\n"
    (pair,) = report(text=text).pairs
    assert (pair.from_device, pair.from_busid, pair.to_busid) == (
        None,
        "00000000:00:04.0",
        "00000000:00:05.0",
    )


# --- 5. pastes it could not read ---------------------------------------------------------


def test_records_joined_on_one_line_are_all_read() -> None:
    """NVIDIA/nccl#952's lines joined with padding (a paste that lost its newlines)."""
    lines = (
        (NCCL / "nccl952_ipc_read_socket_anonymised_host.log").read_text(encoding="utf-8").splitlines()[:16]
    )
    joined = "".join(line.ljust(120) for line in lines) + "\n"
    whole = report(text="\n".join(lines) + "\n")
    rep = report(text=joined)
    assert [(p.from_rank, p.to_rank, p.raw, len(p.channels)) for p in rep.pairs] == [
        (p.from_rank, p.to_rank, p.raw, len(p.channels)) for p in whole.pairs
    ]
    assert rep.unread == []


def test_ansi_docker_json_cr_bom_and_nul_blocks() -> None:
    """NVIDIA/nccl#1189's lines wrapped as terminals, docker and editors wrap them."""
    lines = (
        (NCCL / "nccl1189_h20_2hosts_ib_send_receive_cumem.log").read_text(encoding="utf-8").splitlines()[:14]
    )
    expected = {(p.from_rank, p.to_rank, p.transport) for p in report(text="\n".join(lines) + "\n").pairs}
    variants = {
        "ansi": "".join(f"\x1b[32m{line}\x1b[0m\n" for line in lines),
        "docker": "".join(
            json.dumps({"log": line + "\n", "stream": "stderr", "time": "t"}) + "\n" for line in lines
        ),
        "cr": "\r".join(lines) + "\r",
        "bom": "\ufeff" + "\n".join(lines) + "\n",
        "nul": "\n".join(lines[:7]) + "\n" + "\x00" * 4096 + "\n".join(lines[7:]) + "\n",
    }
    for name, text in variants.items():
        rep = report(text=text)
        assert {(p.from_rank, p.to_rank, p.transport) for p in rep.pairs} == expected, name
        assert not any("\x1b" in h or "\ufeff" in h for h in rep.log.hosts), name
    assert any("NUL" in note for note in report(text=variants["nul"]).log.notes)


def test_a_gzip_log_is_read_and_a_nul_block_is_skipped_with_a_note(tmp_path: Path) -> None:
    data = (NCCL / "nccl1189_h20_2hosts_ib_send_receive_cumem.log").read_bytes()
    packed = tmp_path / "log.gz"
    packed.write_bytes(gzip.compress(data))
    plain = CliRunner().invoke(
        cli,
        [
            "transport",
            "--from-log",
            str(NCCL / "nccl1189_h20_2hosts_ib_send_receive_cumem.log"),
            "--format",
            "json",
        ],
    )
    unpacked = CliRunner().invoke(cli, ["transport", "--from-log", str(packed), "--format", "json"])
    assert json.loads(unpacked.output)["pairs"] == json.loads(plain.output)["pairs"]
    crashed = tmp_path / "crashed.log"
    crashed.write_bytes(data[:400] + b"\x00" * 8192 + data[400:])
    result = CliRunner().invoke(cli, ["transport", "--from-log", str(crashed)])
    assert result.exit_code in (0, 1, 3) and "NUL byte(s)" in result.output
    utf16 = tmp_path / "utf16.log"
    utf16.write_bytes(data.decode().encode("utf-16-le"))  # (no byte-order mark)
    refused = CliRunner().invoke(cli, ["transport", "--from-log", str(utf16)])
    assert refused.exit_code == 2 and "not a text file" in refused.output


def test_control_characters_are_escaped_in_every_format() -> None:
    """Synthetic: a host name, a WARN line and an unread line carrying terminal escapes."""
    text = (
        "ev\x1b]0;x\x07il:1:2 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/IPC\n"
        "h:1:2 [0] NCCL WARN bad \x07\x1b[2J\x9b31m thing\n"
        "h:1:2 [0] NCCL INFO Channel 01/0 : 0[0] -> 1[1] via P2P/\x08\x07IPC\n"
    )
    for fmt in ("text", "json", "markdown"):
        result = CliRunner().invoke(cli, ["transport", "--from-log", "-", "--format", fmt], input=text)
        assert result.exit_code == 1, result.output
        raw = result.output
        assert not any(ch in raw for ch in "\x1b\x07\x08\x9b"), fmt
        if fmt == "json":
            assert "\\u001b" not in raw and "\\u0007" not in raw


def test_two_runs_in_one_file_get_a_note() -> None:
    """Synthetic: one job's lines logged twice by two runs (other pids, another NCCL version)."""
    first = "NCCL version 2.18.1+cuda12.1\nh:11:12 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/IPC\n"
    second = "NCCL version 2.21.5+cuda12.4\nh:21:22 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/IPC\n"
    rep = report(text=first + second)
    notes = " ".join(rep.host_notes)
    assert "more than one NCCL run (versions 2.18.1, 2.21.5)" in notes
    assert "rank(s) 0 printed the same connection from two processes" in notes
    assert report(text=first).host_notes == []


def test_two_h800s_of_one_host_over_shm_get_no_all_clear() -> None:
    """NVIDIA/nccl#1609: SHM between devices 6 and 7 of one host, no topology (exit 3)."""
    rep = report("nccl1609_h800_shm_one_host_cvd.log")
    assert [(p.from_rank, p.to_rank, p.transport) for p in rep.pairs] == [(2, 3, "SHM"), (3, 2, "SHM")]
    assert [f.code for f in rep.findings] == ["nccl-needs-topology"] and rep.exit_code() == 3


def test_nvls_lines_are_shown() -> None:
    """NVIDIA/nccl-tests#213: `NVLS comm … nHeads 8` beside P2P/direct pointer pairs."""
    rep = report("nccl_tests213_nvls_comm_direct_pointer.log")
    assert rep.log.collnet_nvls[0].startswith("NVLS comm 0x55a7be5601c0 headRank 0 nHeads 8")
    result = run("--from-log", str(NCCL / "nccl_tests213_nvls_comm_direct_pointer.log"))
    assert "NVLS/CollNet: NVLS comm" in result.output and result.exit_code == 0


def test_ib_devices_of_one_job_do_not_judge_another_jobs_socket_pair() -> None:
    """Synthetic two logs: job A's process lists IB devices; job B's pair over sockets."""
    a = "a:1:2 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB ; OOB ib0:10.0.0.1<0>\n"
    b = "b:3:4 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/Socket/0\n"
    apart = analyze(read_log([(a, "a.log"), (b, "b.log")]))
    assert "nccl-socket-with-ib" not in codes(apart)
    together = analyze(read_log([(a.replace("a:1:2", "b:3:4") + b, "b.log")]))
    assert "nccl-socket-with-ib" in codes(together)


def test_a_garbled_merged_prefix_or_a_bom_is_never_a_host_name() -> None:
    """Synthetic: two prefixes merged mid-line (`…:12:3node2:45:67 [0]`) and a BOM before one."""
    text = (
        "node1:12:3node2:45:67 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/IPC\n"
        "\ufeffnode3:5:6 [1] NCCL INFO Channel 00/0 : 1[1] -> 0[0] via P2P/IPC\n"
    )
    rep = report(text=text)
    assert rep.log.hosts == ["node3"]
    assert len(rep.pairs) == 2
