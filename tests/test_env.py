"""gpudiag env and the redaction every report passes through."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

from click.testing import CliRunner

from gpudiag.cli import cli
from gpudiag.hw.host import Output, Runner
from gpudiag.repro.env import collect_env, env_lines
from gpudiag.repro.redact import MARK, Redactor, is_secret_name

HERE = Path(__file__).parent

HF = "hf_" + "aBcDeFgHiJkLmNoPqRsTuVwXyZ012345"
GHP = "ghp_" + "0123456789abcdefghijABCDEFGHIJ012345"
JWT = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U"
AKIA = "AKIA" + "IOSFODNN7EXAMPLE"


def test_secret_names() -> None:
    for name in (
        "HF_TOKEN",
        "WANDB_API_KEY",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_REGION",
        "DATABASE_URL",
        "MY_PASSWORD",
        "GITHUB_TOKEN",
        "SSH_PRIVATE_FILE",
        "OPENAI_API_KEY",
        "SESSION_ID",
    ):
        assert is_secret_name(name), name
    for name in ("NCCL_DEBUG", "CUDA_VISIBLE_DEVICES", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "PATH", "HOME"):
        assert not is_secret_name(name), name


def test_redactor_scrubs_values_urls_and_token_shapes() -> None:
    environ = {"HF_TOKEN": HF, "MY_SERVICE_PASSWORD": "correct-horse-battery", "NCCL_DEBUG": "INFO"}
    r = Redactor(environ)
    text = (
        f"loaded {HF} and correct-horse-battery; clone https://bob:s3cr3t@github.com/x.git; "
        f"gh {GHP} jwt {JWT} aws {AKIA} slack xoxb-1234567890-abcdefghij "
        "openai sk-proj-abcdefghijklmnopqrstuv "
        "export API_KEY=plainvalue GPU-8c1f3a7e-1d2b-4c3d-9e8f-0a1b2c3d4e5f NCCL_DEBUG=INFO"
    )
    out = r.text(text)
    for secret in (
        HF,
        "correct-horse-battery",
        "s3cr3t",
        "bob:",
        GHP,
        JWT,
        AKIA,
        "xoxb-123",
        "sk-proj",
        "plainvalue",
        "8c1f3a7e",
    ):
        assert secret not in out, secret
    assert "https://<redacted>@github.com/x.git" in out
    assert f"API_KEY={MARK}" in out and "GPU-<uuid>" in out and "NCCL_DEBUG=INFO" in out
    assert r.env_value("HF_TOKEN", HF) == MARK and r.env_value("NCCL_DEBUG", "INFO") == "INFO"
    assert r.data({"WANDB_API_KEY": "x1234", "nested": [HF]}) == {"WANDB_API_KEY": MARK, "nested": [MARK]}


def test_redactor_leaves_ordinary_text_alone() -> None:
    r = Redactor({"HF_TOKEN": HF, "SHORT_SECRET": "1"})
    text = "gradcheck verdict: pass; rel_norm_err 1.3e-07 on 10.0.0.1 for step 1 of 1"
    assert r.text(text) == text  # a one-character secret is not scrubbed by value (it still shows as set)


def test_anonymize_masks_host_ips_user_and_master_addr() -> None:
    r = Redactor({"MASTER_ADDR": "node-17.cluster"}, anonymize=True, hostname="gpu-box-3.lab", user="alice")
    text = (
        "NCCL INFO NET/Socket : Using [0]eth0:172.17.0.2<0> on gpu-box-3 (gpu-box-3.lab) fe80::1:2:3 "
        "/home/alice/train.py by alice to node-17.cluster"
    )
    out = r.text(text)
    for identity in ("172.17.0.2", "gpu-box-3", "alice", "node-17", "fe80::1:2:3"):
        assert identity not in out, identity
    assert "/home/<user>/train.py" in out and "<master-addr>" in out and "<ip>" in out
    plain = Redactor({"MASTER_ADDR": "node-17.cluster"}, hostname="gpu-box-3.lab", user="alice").text(text)
    assert plain == text  # without --anonymize identities stay


class Commands(Runner):
    """A host whose commands answer from a table keyed by a word of the command line."""

    def __init__(self, answers: dict[str, str | None], files: dict[str, str] | None = None):
        super().__init__(timeout=1.0)
        self.answers, self.files = answers, files or {}

    def run(self, argv: list[str]) -> Output:
        line = " ".join(argv)
        for word, text in self.answers.items():
            if word in line:
                return Output(text, "" if text is not None else f"{word} is not installed")
        return Output(None, f"{argv[0]} is not installed")

    def read(self, path: str) -> Output:
        text = self.files.get(path)
        return Output(text, "" if text is not None else f"{path} does not exist")

    def listdir(self, path: str) -> Output:
        return Output(None, f"cannot list {path}")


def test_collect_env_with_canned_tools(tmp_path) -> None:
    runner = Commands(
        {
            "nvidia-smi -L": "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-8c1f3a7e-1d2b-4c3d-9e8f-0a1b2c3d4e5f)",
            "nvidia-smi": "Driver Version: 550.54.15",
            "dmesg": None,
            "lspci": None,
        },
        {
            "/proc/cmdline": "ro quiet intel_iommu=on iommu=pt",
            f"{tmp_path}/.nccl.conf": "NCCL_P2P_LEVEL=NVL\n",
        },
    )
    environ = {
        "NCCL_DEBUG": "INFO",
        "CUDA_VISIBLE_DEVICES": "1,0",
        "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1",
        "TORCH_HOME_TOKEN": "abcd-efgh-ijkl",
        "MASTER_ADDR": "10.1.2.3",
    }
    report = collect_env(runner, environ, home=str(tmp_path), live_topology=False)
    doc = report.to_json()
    sections = doc["sections"]
    assert doc["schema"] == "gpudiag.env/1"
    assert sections["versions"]["gpu_models"] == "GPU 0: NVIDIA H100 80GB HBM3"  # UUID removed
    assert sections["visibility"] == {"CUDA_VISIBLE_DEVICES": "1,0", "CUDA_DEVICE_ORDER": None}
    assert sections["variables"]["NCCL_DEBUG"] == "INFO" and sections["variables"]["TORCH_HOME_TOKEN"] == MARK
    assert sections["variables"]["MASTER_ADDR"] == "10.1.2.3"
    assert sections["nccl_config"][f"{tmp_path}/.nccl.conf"] == "NCCL_P2P_LEVEL=NVL\n"
    assert sections["iommu"]["mode"] == "passthrough"
    assert "warning" in sections["security"] and sections["flags"]["tf32_matmul"] is False
    assert "torch" in sections["packages"]
    assert doc["missing"]["host.dmesg"].startswith("could not collect")
    text = "\n".join(env_lines(doc))
    assert "abcd-efgh-ijkl" not in json.dumps(doc) and "NCCL_DEBUG: INFO" in text


def test_a_hanging_tool_is_cut_off_and_reported(tmp_path, monkeypatch) -> None:
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nsleep 30\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    start = time.monotonic()
    report = collect_env(Runner(timeout=0.3), dict(os.environ), home=str(tmp_path), live_topology=False)
    assert time.monotonic() - start < 10
    assert report.sections["versions"]["gpu_models"] is None
    assert "could not collect" in report.missing["versions.gpu_models"]


def test_a_broken_collector_never_fails_the_command(monkeypatch) -> None:
    import gpudiag.repro.env as env_module

    def broken() -> dict[str, str]:
        raise RuntimeError("boom")

    monkeypatch.setattr(env_module, "_flags", broken)
    report = collect_env(Commands({}), {}, live_topology=False)
    assert (
        "flags" not in report.sections and report.missing["flags"] == "could not collect: RuntimeError: boom"
    )


def test_env_command_formats(monkeypatch) -> None:
    monkeypatch.setenv("HF_TOKEN", HF)
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth0")
    runner = CliRunner()
    for fmt in ("text", "json", "markdown"):
        result = runner.invoke(cli, ["env", "--format", fmt])
        assert result.exit_code == 0, result.output
        assert HF not in result.output and "NCCL_SOCKET_IFNAME" in result.output
    doc = json.loads(runner.invoke(cli, ["env", "--format", "json"]).output)
    assert (
        doc["sections"]["versions"]["torch"] and doc["sections"]["variables"]["NCCL_SOCKET_IFNAME"] == "eth0"
    )


def test_gpus_section_from_nvml_maps_torch_indices_and_drops_uuids(monkeypatch) -> None:
    monkeypatch.setenv("GPUDIAG_NVML_SCENARIO", str(HERE / "data/nvml/h100_8gpu_nvswitch.json"))
    environ = {"CUDA_VISIBLE_DEVICES": "3,1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    report = collect_env(Commands({}), environ)
    gpus = report.sections["gpus"]
    assert gpus["source"] == "NVML" and gpus["count"] == 8
    torch_of = {d["nvidia_smi_index"]: d["torch_index"] for d in gpus["devices"]}
    assert torch_of[3] == 0 and torch_of[1] == 1 and torch_of[0] is None
    assert all(d["pci_bus_id"] for d in gpus["devices"])
    assert gpus["topology"]["schema"] == "gpudiag.machine/1"
    assert "GPU-" not in json.dumps(report.to_json()).replace("GPU-<uuid>", "")
    assert "GPU0" in "\n".join(env_lines(report.to_json()))  # the link matrix, laid out like topo -m


def test_report_anonymize_masks_the_host(tmp_path, monkeypatch) -> None:
    import socket

    host = socket.gethostname()
    monkeypatch.setenv("MASTER_ADDR", "10.20.30.40")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", f"eth0-{host}")
    out = tmp_path / "anon"
    result = CliRunner().invoke(cli, ["report", "--checks", "env", "--anonymize", "-o", str(out)])
    assert result.exit_code == 0, result.output
    for file in out.rglob("*"):
        if file.is_file():
            data = file.read_text()
            assert "10.20.30.40" not in data, file
            if len(host) >= 3:
                assert f"eth0-{host}" not in data, file
    assert json.loads((out / "report.json").read_text())["anonymized"] is True


def test_one_unreadable_version_field_leaves_the_others(monkeypatch) -> None:
    import torch

    def broken() -> bool:
        raise RuntimeError("CUDA driver initialization failed")

    monkeypatch.setattr(torch.cuda, "is_available", broken)
    report = collect_env(Commands({}), {}, live_topology=False)
    versions = report.sections["versions"]
    assert versions["cuda_available"] is None and versions["torch"] == torch.__version__
    assert (
        report.missing["versions.cuda_available"]
        == "could not collect: RuntimeError: CUDA driver initialization failed"
    )
