"""Issue 44: no planted secret reaches a bundle, whatever kind of secret and whatever kind of
input holds it. A property test plants each kind (a PEM private key, whole, one-lined or
cut; a number, boolean, list or object under a secret-named key; URL credentials with
``/`` and ``@``; token shapes; with --anonymize every IPv6 form) in each form the bundle
takes (a dump as JSON, a stacks file, a verdict, an NCCL log, a rank log, the env section,
the command line) and redacts it as the bundle does; an end-to-end test runs
``gpudiag report --hang DIR --nccl-log FILE`` on real dumps and a real NCCL log with all of
them planted at once and greps every file of the bundle."""

from __future__ import annotations

import json
import pickle
import shutil
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpudiag.redact import Redactor
from tests.helpers import FR, fuzz_examples, invoke
from tests.helpers.nccl_logs import LOG as NCCL_LOG

HOST, USER = "gpu-box-7.lab", "zqalice"
#: A random-looking word: what a planted secret is made of, so it is found nowhere else.
WORD = st.text("ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnpqrstuvwxyz23456789", min_size=12, max_size=20).map(
    lambda w: "Zq" + w
)

# --- secrets: each a function of a random word → (what to plant, what must not be found)


def pem(kind: str, shape: str) -> Callable[[str], tuple[str, list[str]]]:
    def plant(word: str) -> tuple[str, list[str]]:
        lines = [f"{word}{i}AAAAB3NzaC1yc2EAAAADAQABAAABAQ{word[::-1]}" for i in range(3)]
        header = ["Proc-Type: 4,ENCRYPTED", f"DEK-Info: AES-128-CBC,{word}"] if "ENCRYPTED" in kind else []
        block = [f"-----BEGIN {kind}-----", *header, "", *lines, f"-----END {kind}-----"]
        if shape == "one line":
            return " ".join(block), lines
        if shape == "cut":  # the log ends inside the key
            return "\n".join(block[:-2]), lines[:-1]
        if shape == "front cut":  # the log starts inside the key
            return "\n".join(block[2:]), lines[1:]
        return "\n".join(block), lines

    return plant


PEM_KINDS = [
    "OPENSSH PRIVATE KEY",
    "RSA PRIVATE KEY",
    "EC PRIVATE KEY",
    "ENCRYPTED PRIVATE KEY",
    "PRIVATE KEY",
]
TEXT_SECRETS: dict[str, Callable[[str], tuple[str, list[str]]]] = {
    **{f"pem {k} {s}": pem(k, s) for k in PEM_KINDS for s in ("whole", "one line", "cut", "front cut")},
    "url /": lambda w: (f"postgres://bob:{w[:6]}/{w[6:]}@db.internal/x", [w[:6] + "/" + w[6:], w[6:]]),
    "url @": lambda w: (f"see redis://:{w[:6]}@{w[6:]}@cache:6379/0", [w[6:]]),
    "url both": lambda w: (f"mongodb+srv://u:{w[:5]}@/{w[5:]}@h.example", [w[5:]]),
    "hf token": lambda w: (f"hf_{w}{w}", [w]),
    "github": lambda w: (f"ghp_{w}{w}", [w]),
    "bearer": lambda w: (f"Authorization: Bearer {w}", [w]),
    "env assignment": lambda w: (f"export DB_PASSWORD={w}", [w]),
    "option": lambda w: (f"--api-key {w} --model mlp", [w]),
}
#: Values under a secret-named key: (the key and its value as JSON data, what must vanish).
KEYED: dict[str, Callable[[str], tuple[dict[str, Any], list[str]]]] = {
    "number": lambda w: (
        {"api_key": 90000000000000000 + len(w) * 7919},
        [str(90000000000000000 + len(w) * 7919)],
    ),
    "float": lambda w: ({"client_secret": 31415926.5358979}, ["31415926.5358979"]),
    "list": lambda w: ({"password": [w, w[::-1]]}, [w, w[::-1]]),
    "object": lambda w: ({"HF_TOKEN": {"v": w, "n": [w[::-1]]}}, [w, w[::-1]]),
    "nested key": lambda w: ({"auth": {"token": {w: 1}}}, [w]),
}
#: With --anonymize: every IPv6 form, and the host and user.
IDENTITIES: dict[str, Callable[[str], tuple[str, list[str]]]] = {
    "ipv6 trailing ::": lambda w: ("peer 2001:db8:85a3:: up", ["2001:db8:85a3::"]),
    "ipv6 link-local": lambda w: ("on fe80:: now", ["fe80::"]),
    "ipv6 loopback": lambda w: ("bind [::1]:29500", ["::1"]),
    "ipv6 zone": lambda w: ("Using ib0:fe80::a1b2:c3d4%ib0<0>", ["fe80::a1b2", "c3d4"]),
    "ipv6 v4 tail": lambda w: ("from ::ffff:198.51.100.23.", ["198.51.100.23", "::ffff:"]),
    "ipv6 full": lambda w: ("2001:0db8:0000:0000:0000:ff00:0042:8329", ["0042:8329"]),
    "host and user": lambda w: (f"on {HOST} /home/{USER}/train.py", [HOST, f"/{USER}/"]),
}


def _inputs(planted: str, keyed: dict[str, Any]) -> dict[str, bytes]:
    """Every form the bundle takes, with ``planted`` (text) and ``keyed`` (data) in it."""
    dump = {
        "version": "2.10",
        "pg_config": {"0": {"name": planted, "desc": "default_pg", "ranks": "[0, 1]"}},
        "entries": [
            {"frames": [{"name": planted, "filename": f"/x/{planted}.py", "line": 3}], "thread_name": planted}
        ],
        **keyed,
    }
    stacks = {"pid": 1, "threads": [{"name": planted, "stack": [f'  File "{planted}", line 3'], **keyed}]}
    verdict = {"world_size": 2, "verdict": "hang", "lines": [planted], "detail": keyed}
    env = {
        "schema": "gpudiag.report/1",
        "env": {"sections": {"variables": {"NCCL_IB_HCA": planted, **keyed}}},
    }
    command = {"command": ["gpudiag", "report", "--note", planted, *_argv(keyed)]}
    text_keyed = json.dumps(keyed)
    python_keyed = repr(keyed)
    return {
        "hang/fr_rank0.json": json.dumps(dump).encode(),
        "hang/stacks/rank0.json": json.dumps(stacks, indent=1).encode(),
        "hang/verdict.json": (json.dumps(verdict, indent=2) + "\n").encode(),
        "report.json (env)": json.dumps(env, indent=2).encode(),
        "report.json (command)": json.dumps(command, indent=2).encode(),
        "nccl/0-rank0.log": f"a:1:2 [0] NCCL INFO {planted}\na:1:2 [0] NCCL INFO cfg {text_keyed}\n".encode(),
        "logs/gradcheck/launch0-rank1.log": f"[rank1] {planted}\n[rank1] cfg {python_keyed} done\n".encode(),
        "REPORT.md": f"# report\n\n```\n{planted}\n{text_keyed}\n```\n".encode(),
    }


def _argv(keyed: dict[str, Any]) -> list[str]:
    """A keyed secret as options on a command line (``--api-key VALUE``)."""
    out: list[str] = []
    for key, value in keyed.items():
        out += [f"--{key.lower().replace('_', '-')}", json.dumps(value)]
    return out


@settings(max_examples=fuzz_examples(200), deadline=None)
@given(
    word=WORD,
    kind=st.sampled_from(sorted(TEXT_SECRETS)),
    keyed=st.sampled_from(sorted(KEYED)),
    identity=st.sampled_from(sorted(IDENTITIES)),
    anonymize=st.booleans(),
)
def test_no_planted_secret_survives_in_any_bundle_input(
    word: str, kind: str, keyed: str, identity: str, anonymize: bool
) -> None:
    planted, hidden = TEXT_SECRETS[kind](word)
    data, hidden_keyed = KEYED[keyed](word)
    who, hidden_identity = IDENTITIES[identity](word)
    text = f"{planted} and {who}"
    r = Redactor({"NCCL_DEBUG": "INFO"}, anonymize=anonymize, hostname=HOST, user=USER)
    for name, raw in _inputs(text, data).items():
        out = r.bytes(raw).decode("utf-8", "replace")
        must_go = hidden + hidden_keyed + (hidden_identity if anonymize else [])
        for secret in must_go:
            assert secret not in out, (name, kind, keyed, identity, secret, out[:3000])
        if ".json" in name:
            json.loads(out)  # what was JSON stays JSON
        assert r.bytes(out.encode()) == out.encode(), name  # and redacting again changes nothing


@pytest.mark.parametrize(
    "text",
    ['{"api_key": 123456789012}', "{'password': True, 'n': 2}", '{"HF_TOKEN": {"v": "x1y2z3w4"}} tail'],
)
def test_a_keyed_value_in_text_keeps_the_closing_brace(text: str) -> None:
    out = Redactor({}).text(text)
    for secret in ("123456789012", "True", "x1y2z3w4"):
        assert secret not in out
    assert out.count("}") == text.count("}") - (1 if "HF_TOKEN" in text else 0), out
    if text.startswith('{"api'):
        assert json.loads(out) == {"api_key": "<redacted: set>"}


def _plant_dumps(folder: Path, text: str, keyed: dict[str, Any]) -> None:
    """The real gloo dumps (tests/data/fr/gloo/skip), with ``text`` in every frame name,
    thread name and group description, and ``keyed`` at the top of each dump."""
    for source in sorted((FR / "gloo" / "skip" / "pickle").iterdir()):
        tree = pickle.loads(source.read_bytes())  # (our own test data)
        for entry in tree["entries"]:
            entry["thread_name"] = text
            for frame in entry["frames"]:
                frame["name"] = f"{frame['name']} {text}"
        tree.update(keyed)
        (folder / source.name).write_bytes(pickle.dumps(tree, protocol=2))
    (folder / "stacks").mkdir()
    stacks = {"threads": [{"name": text, "stack": [text], **keyed}]}
    (folder / "stacks" / "rank0.json").write_text(json.dumps(stacks, indent=1))
    (folder / "verdict.json").write_text(json.dumps({"world_size": 3, "verdict": text, **keyed}))


@pytest.mark.parametrize("anonymize", [False, True])
def test_report_bundles_none_of_the_secrets_planted_in_its_inputs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, anonymize: bool
) -> None:
    plants = [TEXT_SECRETS[k]("Zq" + "k7Wm" * 4 + str(i)) for i, k in enumerate(sorted(TEXT_SECRETS))]
    keyed_plants = [KEYED[k]("Zq" + "p3Xv" * 4 + str(i)) for i, k in enumerate(sorted(KEYED))]
    identities = [IDENTITIES[k]("") for k in sorted(IDENTITIES)]
    text = " | ".join(p for p, _ in plants + identities)
    keyed: dict[str, Any] = {k: v for data, _ in keyed_plants for k, v in data.items()}
    hang = tmp_path / "hang"
    hang.mkdir()
    _plant_dumps(hang, text, keyed)
    log = tmp_path / "nccl.log"
    lines = NCCL_LOG.read_text(encoding="utf-8").splitlines()
    half = len(lines) // 2
    log.write_text(
        "\n".join([*lines[:half], f"{lines[half]} {text}", json.dumps(keyed), *lines[half:]]) + "\n"
    )
    # the environment and the command line the report records
    monkeypatch.setenv("NCCL_IB_HCA", plants[0][0].replace("\n", " "))
    monkeypatch.setenv("GPUDIAG_HOSTNAME", HOST)
    monkeypatch.setenv("USER", USER)
    monkeypatch.setenv("LOGNAME", USER)
    args = ["report", "--checks", "hang,transport", "--hang", str(hang), "--nccl-log", str(log)]
    args += ["-o", str(tmp_path / "b.zip"), "--format", "json", *(["--anonymize"] if anonymize else [])]
    monkeypatch.setattr(sys, "argv", ["gpudiag", *args, "--", text, *_argv(keyed)])
    done = invoke(args)
    assert done.exit_code in (0, 1), done.output
    with zipfile.ZipFile(tmp_path / "b.zip") as archive:
        files = {name: archive.read(name).decode("utf-8", "replace") for name in archive.namelist()}
    assert any(n.startswith("hang/fr_rank") for n in files) and any(n.startswith("nccl/") for n in files)
    hidden = [s for _, found in plants + keyed_plants for s in found]
    hidden += [s for _, found in identities for s in found] if anonymize else []
    for name, data in {**files, "(printed)": done.stdout}.items():
        for secret in hidden:
            assert secret not in data, (name, secret)
    shutil.rmtree(hang)
