"""gpudiag report bundles NCCL's transports: the log given with --nccl-log (bounded, redacted,
host names masked with --anonymize) and the transport result in report.json; gpudiag replay
re-reads the bundled log and gets the same pairs and findings. Real logs from public threads
(tests/data/nccl/SOURCES.md); the live run's NCCL is faked with one of them (its ranks' lines)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from gpudiag.checks.suite import Here
from gpudiag.cli import cli
from gpudiag.redact import Redactor
from gpudiag.repro.bundle import read_bundle
from gpudiag.repro.replay import replay
from gpudiag.repro.report import run_report, write_bundle
from gpudiag.transport.bundled import bundled_logs
from tests.helpers import DATA, NCCL

SHM_ON_NVLINK = str(NCCL / "nccl1817_shm_and_p2p_direct_one_process.log")
NV18 = str(DATA / "topo" / "h100_8gpu_nv18_8nic_spaces.txt")
TWO_HOSTS = str(NCCL / "nccl1189_h20_2hosts_ib_send_receive_cumem.log")
WITH_IPS = str(NCCL / "nv_peer_memory56_ib_devices_env_socket.log")
HOST = "sh9-machine-20250813085604-64df4c99dc-m27xf"  # (the host of the #1817 log)


def report_cli(tmp_path: Path, *args: str) -> tuple[Any, Path]:
    tmp_path.mkdir(exist_ok=True)
    out = tmp_path / "bundle"
    result = CliRunner().invoke(cli, ["report", "--checks", "transport", "-o", str(out), *args])
    return result, out


def transport_doc(bundle: Path) -> dict[str, Any]:
    (check,) = json.loads((bundle / "report.json").read_text())["checks"]
    assert check["name"] == "transport"
    return check  # type: ignore[no-any-return]


def pairs_of(result: dict[str, Any]) -> list[tuple[Any, ...]]:
    return sorted(
        (p["from_rank"], p["to_rank"], p["from_host"], p["to_host"], p["transport"], tuple(p["channels"]))
        for p in result["pairs"]
    )


def test_report_bundles_the_log_and_replay_rereads_it(tmp_path: Path) -> None:
    result, bundle = report_cli(tmp_path, "--nccl-log", SHM_ON_NVLINK, "--machine", NV18)
    assert result.exit_code == 1, result.output  # (SHM where NVLink is: a slower path)
    check = transport_doc(bundle)
    assert check["status"] == "fail" and [f["code"] for f in check["findings"]] == ["nccl-slow-path"]
    name = "nccl/1-nccl1817_shm_and_p2p_direct_one_process.log"
    assert check["config"] == {"from_log": [name], "machine": "machine.json"}
    assert check["command"] == f"gpudiag transport --from-log {name} --machine machine.json"
    assert (bundle / name).read_bytes() == Path(SHM_ON_NVLINK).read_bytes()  # (nothing to redact in it)
    assert {p["offers"] for p in check["result"]["pairs"]} == {"NV18"}
    assert not (bundle / "repro.py").exists()  # (torch alone cannot reproduce a log)
    assert "NCCL transports" in (bundle / "REPORT.md").read_text()
    read = read_bundle(bundle)
    again = replay(read, Here(cuda_gpus=0, nvml="no NVML (test)", machine=read.machine()))
    (item,) = again.checks
    assert item.match and item.here is not None and item.here.status == "fail"
    assert pairs_of(item.here.result or {}) == pairs_of(check["result"])
    assert [f.code for f in item.here.findings] == ["nccl-slow-path"]
    got = CliRunner().invoke(cli, ["replay", str(bundle)])
    assert got.exit_code == 0 and "match" in got.output


def test_anonymize_masks_every_host_and_address_and_replay_still_agrees(tmp_path: Path) -> None:
    plain, _ = report_cli(tmp_path / "a", "--nccl-log", TWO_HOSTS, "--format", "json")
    result, bundle = report_cli(
        tmp_path / "b", "--nccl-log", TWO_HOSTS, "--nccl-log", WITH_IPS, "--anonymize"
    )
    assert plain.exit_code == 0 and result.exit_code == 0, result.output
    every_byte = b"".join(p.read_bytes() for p in bundle.rglob("*") if p.is_file())
    for identity in (b"H20-GPU-05", b"H20-GPU-06", b"master_node", b"secondary_node", b"192.168.11.1"):
        assert identity not in every_byte
    check = transport_doc(bundle)
    hosts = {h for p in check["result"]["pairs"] for h in (p["from_host"], p["to_host"])} - {None}
    assert hosts == {"anon-host-1", "anon-host-2"}  # (the H20 log's two hosts: still two)
    (first,) = json.loads(plain.stdout)["checks"]
    anonymous = [p for p in pairs_of(check["result"]) if p[0] < 4]  # (the H20 log's ranks)
    assert [p[:2] + p[4:] for p in pairs_of(first["result"])] == [p[:2] + p[4:] for p in anonymous]
    again = replay(read_bundle(bundle), Here(cuda_gpus=0, nvml="no NVML (test)"))
    (item,) = again.checks
    assert item.match and pairs_of(item.here.result or {}) == pairs_of(check["result"])  # type: ignore[union-attr]


def test_anonymize_masks_a_host_in_another_case_and_with_its_domain() -> None:
    """torchrun's failure summary writes the host with its domain (``host : H20-GPU-06.hpc.
    acme.internal``), a launcher may capitalise it: the bundle kept the domain after
    ``anon-host-1`` and the other spelling whole."""
    log = Path(TWO_HOSTS).read_text(encoding="utf-8")
    extra = "\n  host      : H20-GPU-06.hpc.acme-corp.internal\n[rank1]: connection to h20-gpu-05 refused\n"
    ((text, _),), _ = bundled_logs([(log + extra, "h20.log")], anonymize=True)
    for identity in ("H20-GPU", "h20-gpu", "acme-corp", "hpc."):
        assert identity not in text, identity
    assert "  host      : anon-host-1\n[rank1]: connection to anon-host-2 refused" in text
    assert sorted(set(re.findall(r"anon-host-\d+", text))) == ["anon-host-1", "anon-host-2"]


def test_a_log_in_utf32_is_refused_and_never_bundled(tmp_path: Path) -> None:
    """UTF-32's byte-order mark starts as UTF-16's: decoded as UTF-16, each character came
    with a NUL the redactor's patterns do not expect, and an hf_ token reached the bundle."""
    token = "hf_" + "abcdefghijklmnopqrstuvwx1234"
    line = f"gpu-node-18:202:302 [0] NCCL INFO HF_TOKEN={token}\n"
    (tmp_path / "u32.log").write_bytes(line.encode("utf-32"))
    (tmp_path / "u16.log").write_bytes(Path(TWO_HOSTS).read_text(encoding="utf-8").encode("utf-16"))
    result, bundle = report_cli(
        tmp_path / "a", "--nccl-log", TWO_HOSTS, "--nccl-log", str(tmp_path / "u32.log")
    )
    assert result.exit_code == 2 and "u32.log: not a text file" in result.output
    assert not bundle.exists()
    result, bundle = report_cli(
        tmp_path / "b", "--nccl-log", str(tmp_path / "u16.log")
    )  # (Windows' UTF-16: read)
    assert result.exit_code == 0, result.output
    assert len(transport_doc(bundle)["result"]["pairs"]) > 0


def test_the_bundled_log_is_bounded_at_a_line_end_and_says_so() -> None:
    text = Path(TWO_HOSTS).read_text(encoding="utf-8")
    lines = text.splitlines(keepends=True)
    limit = len("".join(lines[:3]).encode()) + 5
    (kept, name), *_ = bundled_logs([(text, "h20.log")], anonymize=False, limit=limit)[0]
    notes = bundled_logs([(text, "h20.log")], anonymize=False, limit=limit)[1]
    assert kept == "".join(lines[:3]) and name == "nccl/1-h20.log"
    assert len(notes) == 1 and "h20.log: only its first" in notes[0]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nccl-log", "/nonexistent/nccl.log"], "nccl.log"),
        (["--nccl-log", str(DATA / "topo" / "rtx5090_2gpu_phb_tabs.txt")], "no NCCL line"),
    ],
)
def test_a_bad_log_is_refused_before_anything_runs(tmp_path: Path, args: list[str], message: str) -> None:
    result, bundle = report_cli(tmp_path, *args)
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output
    assert not bundle.exists()


def test_a_log_without_the_transport_check_is_bad_usage(tmp_path: Path) -> None:
    got = CliRunner().invoke(
        cli, ["report", "--checks", "env", "--nccl-log", SHM_ON_NVLINK, "-o", str(tmp_path / "b")]
    )
    assert got.exit_code == 2 and "add transport to --checks" in got.output


def test_a_bundle_naming_a_log_outside_its_nccl_folder_is_refused(tmp_path: Path) -> None:
    result, bundle = report_cli(tmp_path, "--nccl-log", SHM_ON_NVLINK)
    assert result.exit_code == 0, result.output  # (no topology: SHM is not judged)
    document = json.loads((bundle / "report.json").read_text())
    document["checks"][0]["config"]["from_log"] = ["../../etc/passwd"]
    (bundle / "report.json").write_text(json.dumps(document))
    got = CliRunner().invoke(cli, ["replay", str(bundle)])
    assert got.exit_code == 2 and "from_log" in got.output and "Traceback" not in got.output


def test_the_live_transport_check_bundles_its_ranks_log_and_topology_and_replay_rereads_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The suite's live check on "two GPUs": the NCCL run is faked by the ranks' logs it
    would write (a real log's lines, split by the device that printed them); NVML is the
    project's fake NVSwitch H100. The logs and the topology the pairs were placed on go into
    the bundle, and the recorded configuration reads them: replay on a machine without GPUs
    re-reads them and gets the same pairs and findings."""
    from tests.helpers.nccl_logs import rank_lines

    texts = [("\n".join(rank_lines(r, 2)) + "\n", f"launch1-rank{r}.log") for r in range(2)]
    monkeypatch.setattr("gpudiag.transport.live.live_texts", lambda gpus, timeout=120.0: texts)
    monkeypatch.setenv("GPUDIAG_NVML_SCENARIO", str(DATA / "nvml" / "h100_8gpu_nvswitch.json"))
    monkeypatch.setenv("GPUDIAG_WATCH_DIR", str(tmp_path / "no-watch"))  # (none of the user's)
    report = run_report(Here(cuda_gpus=2, nvml=None), ["transport"], anonymize=True)
    (run,) = report.checks
    names = ["nccl/1-launch1-rank0.log", "nccl/2-launch1-rank1.log"]
    assert run.config == {"from_log": names, "machine": "nccl/machine.json"}
    assert [f.code for f in run.findings] == ["nccl-slow-path"]
    assert sorted(report.files) == [
        "nccl/1-launch1-rank0.log",
        "nccl/2-launch1-rank1.log",
        "nccl/machine.json",
    ]
    path = write_bundle(report, tmp_path / "b", redactor=Redactor(anonymize=True, hostname=HOST))
    every_byte = b"".join(p.read_bytes() for p in path.rglob("*") if p.is_file())
    assert HOST.encode() not in every_byte and b"anon-host-1:3884652" in (path / names[0]).read_bytes()
    again = replay(read_bundle(path), Here(cuda_gpus=0, nvml="no NVML (test)"))
    (item,) = again.checks
    assert item.match and item.here is not None and item.here.status == run.status == "fail"
    assert [f.code for f in item.here.findings] == ["nccl-slow-path"]
    assert [p[:2] + p[4:] for p in pairs_of(item.here.result or {})] == [
        p[:2] + p[4:] for p in pairs_of(run.result or {})
    ]
    assert {p["offers"] for p in (item.here.result or {})["pairs"]} == {"NV18"}


@pytest.mark.multi_gpu
def test_report_on_two_gpus_bundles_the_live_runs_log_and_replay_rereads_it(tmp_path: Path) -> None:
    """The real thing: the suite's transport check runs NCCL on this machine's GPUs; the
    bundle holds its ranks' logs, and replay re-reads them to the same pairs."""
    result, bundle = report_cli(tmp_path, "--format", "json")
    assert result.exit_code in (0, 1), result.output
    check = transport_doc(bundle)
    assert check["config"]["from_log"] and check["result"]["pairs"]
    assert all((bundle / name).is_file() for name in check["config"]["from_log"])
    got = CliRunner().invoke(cli, ["replay", str(bundle), "--format", "json"])
    (item,) = json.loads(got.stdout)["checks"]
    assert got.exit_code == 0 and item["match"], got.output
