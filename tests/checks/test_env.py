"""gpudiag env and the redaction every report passes through."""

from __future__ import annotations

import json
import os
import stat
import time
from dataclasses import replace

from hypothesis import example, given, settings
from hypothesis import strategies as st

from gpudiag.checks.env import collect_env
from gpudiag.hw.host import Output, Runner
from gpudiag.redact import MARK, Redactor, is_secret_name
from gpudiag.render.env_lines import env_lines
from tests.helpers import NVML, fuzz_examples, invoke, within

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


def test_anonymize_masks_an_ipv6_address_after_its_interface_as_nccl_prints_it() -> None:
    """NCCL writes ``[1]ib0:fe80::…%ib0<0>``: the colon after the interface name kept the
    address out of the IPv6 pattern, and --anonymize bundled it."""
    r = Redactor({}, anonymize=True, hostname="gpu-box-3.lab", user="alice")
    lines = {
        "NET/Socket : Using [0]eth0:10.2.3.4<0> [1]ib0:fe80::1234:5678:9abc:def0%ib0<0>": "fe80::1234",
        "Bootstrap : Using ib0:2001:db8:0:0:0:0:0:5<0>": "2001:db8",
        "NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [RO]; OOB bond0.12:fd00::7%bond0.12<0>": "fd00::7",
    }
    for line, address in lines.items():
        out = r.text(line)
        assert address not in out and "<ip>" in out, out
    assert r.text("[1]ib0:fe80::1%ib0<0>") == "[1]ib0:<ip>%ib0<0>"  # (the interface name stays)
    assert r.text("[0]mlx5_0:1/IB at 12:34:56") == "[0]mlx5_0:1/IB at 12:34:56"


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
    assert time.monotonic() - start < within(idle_s=1.5)  # (1.4 s at load 7; nvidia-smi sleeps 30 s)
    assert report.sections["versions"]["gpu_models"] is None
    assert "could not collect" in report.missing["versions.gpu_models"]


def test_a_broken_collector_never_fails_the_command(monkeypatch) -> None:
    import gpudiag.checks.env as env_module

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
    for fmt in ("text", "json", "markdown"):
        result = invoke(["env", "--format", fmt])
        assert result.exit_code == 0, result.output
        assert HF not in result.output and "NCCL_SOCKET_IFNAME" in result.output
    doc = json.loads(invoke(["env", "--format", "json"]).output)
    assert (
        doc["sections"]["versions"]["torch"] and doc["sections"]["variables"]["NCCL_SOCKET_IFNAME"] == "eth0"
    )


def test_gpus_section_from_nvml_maps_torch_indices_and_drops_uuids(monkeypatch) -> None:
    monkeypatch.setenv("GPUDIAG_NVML_SCENARIO", str(NVML / "h100_8gpu_nvswitch.json"))
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
    result = invoke(["report", "--checks", "env", "--anonymize", "-o", str(out)])
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


def test_secret_names_are_judged_by_their_words() -> None:
    """Issue 16: DB_PWD and MY_SERVICE_CREDS leaked; max_tokens=512 was redacted."""
    for name in ("DB_PWD", "MY_SERVICE_CREDS", "X_SECRET", "Y_TOKEN", "Z_KEY", "PASSWD", "DB_PASS"):
        assert is_secret_name(name), name
    for name in ("apiKey", "accessToken", "--api-key", "HTTP_AUTHORIZATION", "BASIC_AUTH", "SENTRY_DSN"):
        assert is_secret_name(name), name
    for name in ("max_tokens", "session_length", "auth_mode", "passthrough", "bypass", "PWD", "OLDPWD"):
        assert not is_secret_name(name), name
    assert not is_secret_name("TOKENIZERS_PARALLELISM") and not is_secret_name("KEY_PATH")
    r = Redactor({"DB_PWD": "pwd-value-1", "max_tokens": "512"})
    ordinary = "max_tokens=512 session_length=30 auth_mode=none passthrough=1 bypass=0 PWD=/work"
    assert r.text(ordinary) == ordinary
    config = {"max_tokens": 512, "session_length": 30, "auth_mode": "none", "passthrough": 1, "bypass": 0}
    assert r.data(config) == config


#: Each a secret planted in a different form; the second item is what must not survive.
PLANTED = {
    "DB_PWD": "db-pwd-0123456789",
    "MY_SERVICE_CREDS": "svc-creds-0123456789",
    "X_SECRET": "x-secret-0123456789",
    "Y_TOKEN": "y-token-0123456789",
    "Z_KEY": "z-key-0123456789",
    "PASSWD": "passwd-0123456789",
}


def test_every_form_of_secret_is_caught() -> None:
    r = Redactor({**PLANTED, "NCCL_DEBUG": "INFO"})
    echoed = " ".join(f"value {v}," for v in PLANTED.values())  # a rank log echoing the values
    lines = [
        f"[rank1] {echoed}",
        "GET /v1 with Authorization: Bearer abcdef0123456789ghij",
        "curl -H 'Authorization: Basic dXNlcjpwYXNzd29yZA=='",
        "clone https://deploy:hunter2hunter2@git.example.com/x.git and postgres://:pgpass99@db/x",
        "python train.py --api-key=cmdline-key-1 --token cmdline-token-2 --max-tokens 512",
        "connected to 10.0.0.1hf_GluedTokenAfterADigit0123 and shf_notatokenbutaword0123456789",
        "PASSWORD= --token flag-after-empty-1",
    ]
    out = r.text("\n".join(lines))
    for secret in [*PLANTED.values(), "abcdef0123456789ghij", "dXNlcjpwYXNzd29yZA", "hunter2hunter2"]:
        assert secret not in out, secret
    glued_and_empty = ("GluedTokenAfterADigit", "flag-after-empty-1")
    for secret in ("pgpass99", "cmdline-key-1", "cmdline-token-2", *glued_and_empty):
        assert secret not in out, secret
    assert "shf_notatokenbutaword0123456789" in out  # a letter before: part of a word
    assert "--max-tokens 512" in out and "https://<redacted>@git.example.com" in out
    assert out.count("\n") == len(lines) - 1  # nothing joined or dropped
    # The same in JSON: a command line as an argv list, secrets under secret-looking keys.
    doc = {
        "command": ["gpudiag", "--api-key", "argv-key-3", "--model", "mlp"],
        "db": {"password": "p4ssw0rd!"},
    }
    back = json.loads(r.bytes(json.dumps(doc).encode()))
    assert back == {"command": ["gpudiag", "--api-key", MARK, "--model", "mlp"], "db": {"password": MARK}}


def test_binary_logs_are_scrubbed_around_undecodable_bytes() -> None:
    r = Redactor(PLANTED)
    data = b"\xff\xfe rank0 " + PLANTED["DB_PWD"].encode() + b" Bearer abcdef0123456789ghij \x80\n"
    out = r.bytes(data)
    assert PLANTED["DB_PWD"].encode() not in out and b"abcdef0123456789" not in out
    assert out.startswith(b"\xff\xfe rank0 ") and out.endswith(b" \x80\n")


_FRAGMENTS = st.sampled_from(
    [
        "/home/alice",
        "/home/alice/x.py",
        "/Users/bob",
        '"',
        "\\",
        "\n",
        " ",
        ",",
        "HF_TOKEN=",
        "PASSWORD: ",
        "--api-key=k3y-value",
        "--token ",
        "https://u:pw1234@h/x",
        "10.0.0.1",
        "fe80::1",
        "gpu-box-3",
        "alice",
        "Bearer abcdefghijkl",
        "max_tokens=512",
        "<redacted: set>",
        "x",
    ]
)
_TEXT = st.lists(_FRAGMENTS, max_size=6).map(" ".join)
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | _TEXT,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(_TEXT | st.sampled_from(["DB_PWD", "auth"]), inner, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=fuzz_examples(150), deadline=None)
@given(document=_JSON, indent=st.sampled_from([None, 1, 2]))
@example(document='HF_TOKEN= "', indent=None)  # a JSON file that is one string
def test_redacted_json_is_still_json(document: object, indent: int | None) -> None:
    """Issue 16: with --anonymize a home path ate the closing `",` of a JSON string."""
    r = Redactor({"DB_PWD": "pw-0123456789"}, anonymize=True, hostname="gpu-box-3.lab", user="alice")
    data = (json.dumps(document, indent=indent) + "\n").encode()
    out = r.bytes(data)
    back = json.loads(out)
    if isinstance(document, (dict, list)):
        assert type(back) is type(document) and len(back) <= len(document)
        for secret in ("pw1234", "alice", "10.0.0.1", "k3y-value", "abcdefghijkl"):
            assert secret not in out.decode(), secret


#: This machine's ``lscpu`` vulnerability lines (issue 17: "bypass: Vulnerable" was redacted).
LSCPU_VULNERABILITIES = """\
Vulnerability Itlb multihit:             Not affected
Vulnerability Spec rstack overflow:      Vulnerable: Safe RET, no microcode
Vulnerability Spec store bypass:         Vulnerable
Vulnerability Spec store bypass: Mitigation; Speculative Store Bypass disabled via prctl
Vulnerability Spectre v1:                Mitigation; usercopy/swapgs barriers and __user pointer sanitization
Vulnerability Spectre v2:                Mitigation; Retpolines; IBPB: conditional; RSB filling
Vulnerability Tsx async abort:           Not affected"""
INNOCENT = [
    *LSCPU_VULNERABILITIES.splitlines(),
    "loading tokenizer from /models/bert (tokenizer.json)",
    "TOKENIZERS_PARALLELISM=false max_tokens=512 max_new_tokens: 64",
    "nsswitch: using the passwd file /etc/passwd; compass=north bypass=0 keyboard: us",
    "PWD=/work session_length=30 auth_mode: none passthrough: 1",
]


def test_innocent_lines_stay_and_secrets_in_every_spelling_go() -> None:
    """Issue 17: secrets, not substrings of words; a name that is not secret (``cfg:``,
    ``x=``) must not hide the secret assignment after it."""
    r = Redactor({"NCCL_DEBUG": "INFO"})
    for line in INNOCENT:
        assert r.text(line) == line, line
    planted = {
        "cfg: HF_TOKEN=planted-1a2b3c": "cfg: HF_TOKEN=<redacted: set>",
        "x=MY_TOKEN=planted-2b3c4d": "x=MY_TOKEN=<redacted: set>",
        'args="DB_PASSWORD=planted-3c4d5e" next': 'args="DB_PASSWORD=<redacted: set>" next',
        'log {"password": "planted 4d5e6f", "n": 1}': 'log {"password": "<redacted: set>", "n": 1}',
        "secret: token: planted-5e6f7a": "secret: token: <redacted: set>",
        "export API_KEY='planted 6f7a8b'": f"export API_KEY='{MARK}'",
        'PASSWD="planted-7a8b9c': f'PASSWD="{MARK}',
        "opts:--api-key=planted-8b9c0d": f"opts:--api-key={MARK}",
    }
    for line, expected in planted.items():
        assert r.text(line) == expected, line
    text = "\n".join([*INNOCENT, *planted])
    out = r.text(text)
    assert "planted" not in out and out.splitlines()[: len(INNOCENT)] == INNOCENT


_SECRET_FRAGMENTS = st.sampled_from(
    [
        "MY_TOKEN",
        "HF_TOKEN",
        "--api-key",
        "password",
        "max_tokens",
        "bypass",
        "x",
        "=",
        ": ",
        ":",
        " ",
        "\n",
        "'",
        '"',
        "{",
        "<redacted: set>",
        " set>",
        "<redacted>",
        "tok-0123456789",
        "Bearer abcdefghijkl",
        "https://u:pw1234@h/x",
        "10.0.0.1",
        "gpu-box-3",
        "alice",
        "/home/alice",
        "GPU-8c1f3a7e-1d2b-4c3d-9e8f-0a1b2c3d4e5f",
    ]
)
_SECRET_TEXT = st.lists(_SECRET_FRAGMENTS, max_size=10).map("".join)


@settings(max_examples=fuzz_examples(300), deadline=None)
@given(text=_SECRET_TEXT, anonymize=st.booleans())
@example(text="MY_TOKEN=<redacted: set>", anonymize=False)
@example(text="MY_TOKEN=tok-0123456789 MY_TOKEN: <redacted: set> set>", anonymize=False)
@example(text="10.0.0.1gpu-box-3", anonymize=True)  # the address went first, then the host
@example(text="alice::--api-key=x", anonymize=True)
def test_redaction_is_idempotent(text: str, anonymize: bool) -> None:
    """Issue 17: redacting redacted text changes nothing — text, bytes and JSON."""
    r = Redactor({"MY_TOKEN": "tok-0123456789"}, anonymize=anonymize, hostname="gpu-box-3.lab", user="alice")
    once = r.text(text)
    assert r.text(once) == once
    assert "tok-0123456789" not in once and "pw1234" not in once
    data = text.encode()
    assert r.bytes(r.bytes(data)) == r.bytes(data)
    for document in ({"env": text, text: [text, "--api-key", text]}, [text], text):
        encoded = json.dumps(document, indent=2).encode()
        redacted = r.bytes(encoded)
        assert r.bytes(redacted) == redacted
        assert r.data(r.data(document)) == r.data(document)


def test_collecting_never_initialises_cuda(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A CUDA context in the process that collects (gpudiag doctor, report) would make every
    later rank launch a fresh interpreter and hold memory on GPU 0: torch's own
    get_cuda_module_loading_config calls torch.cuda.init() (found reviewing for issue 14)."""
    import torch

    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "init", lambda: calls.append("torch.cuda.init"))
    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: calls.append("torch.cuda._lazy_init"))
    monkeypatch.delenv("CUDA_MODULE_LOADING", raising=False)
    report = collect_env(Commands({}), {}, home=str(tmp_path), live_topology=False)
    assert calls == []
    assert report.sections["versions"]["cuda_module_loading"] == "LAZY (not set; torch's default)"


def test_flags_report_a_mixed_tf32_state_instead_of_losing_the_section() -> None:
    """cuDNN conv in TF32 beside an RNN in full fp32: torch's legacy getter raises; the
    flags section keeps its other fields and says what it found (issue 35)."""
    import torch

    from gpudiag.runtime.numerics import Numerics

    mixed = replace(Numerics.observe(), cudnn_conv="tf32", cudnn_rnn="ieee")
    with mixed.applied():
        report = collect_env(Commands({}), {}, live_topology=False)
        assert torch.backends.cudnn.conv.fp32_precision == "tf32"
    flags = report.sections["flags"]
    assert flags["tf32_cudnn"].startswith("mixed") and flags["cudnn_benchmark"] is False
    assert "flags" not in report.missing
