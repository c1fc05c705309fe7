"""gpudiag report, replay and doctor: bundles, secrets, repro.py, comparisons, exit codes."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpudiag.checks.suite import Here, command_line, plan, run_check
from gpudiag.repro.bundle import read_bundle
from gpudiag.repro.scripts import repro_script
from gpudiag.runtime.launch import launch, rank_logs
from tests.helpers import NVML, SEED_TOPO, TOPO, fuzz_examples, invoke, within

SEED_CAPTURE = str(SEED_TOPO)
FOUR_GPUS = str(TOPO / "v100_4gpu_nv1_nv2_numa.txt")  # NVLink between some pairs only
HF = "hf_" + "QwErTyUiOpAsDfGhJkLzXcVbNm123456"
PASSWORD = "tr0ub4dor-and-3-horses"
CONF_TOKEN = "ghp_" + "ZYXWVUTSRQponmlkjihgfedcba9876543210"
NO_GPU = Here(cuda_gpus=0, nvml="no NVML here (test)")


def bundle_bytes(path: Path) -> dict[str, bytes]:
    if path.is_dir():
        return {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()}
    with zipfile.ZipFile(path) as archive:
        return {name: archive.read(name) for name in archive.namelist()}


@pytest.fixture(scope="module")
def seed_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A report of a 4-GPU machine (virtual devices) with GPU 1 → 0 corrupting data."""
    out = tmp_path_factory.mktemp("bundles") / "seed"
    result = invoke(
        [
            "report",
            "--machine",
            FOUR_GPUS,
            "--inject",
            "1->0:nan@1",
            "--checks",
            "env,topology,peer,gradcheck,nancheck",
            "-o",
            str(out),
            "--format",
            "json",
        ],
    )
    assert result.exit_code == 1, result.output
    return out


def test_report_bundle_contents(seed_bundle: Path) -> None:
    files = bundle_bytes(seed_bundle)
    assert {"report.json", "REPORT.md", "repro.py", "machine.json"} <= set(files)
    assert {"traces/gradcheck.json", "traces/nancheck.json"} <= set(files)
    assert any(name.startswith("logs/gradcheck/launch1-rank1") for name in files)  # ddp ranks' own output
    doc = json.loads(files["report.json"])
    assert doc["schema"] == "gpudiag.report/1" and doc["gpudiag"] and doc["torch"]
    assert doc["env"]["schema"] == "gpudiag.env/1"
    status = {c["name"]: c["status"] for c in doc["checks"]}
    assert status == {
        "env": "pass",
        "topology": "pass",
        "peer": "fail",
        "gradcheck": "fail",
        "nancheck": "fail",
    }
    gradcheck = next(c for c in doc["checks"] if c["name"] == "gradcheck")
    assert gradcheck["config"]["inject"] == ["1->0:nan@1"] and gradcheck["config"]["seed"] == 0
    assert gradcheck["result"]["schema"] == "gpudiag.gradcheck/1"
    assert gradcheck["command"] == (
        "gpudiag gradcheck --model mlp --input-shape 3,32,32 --num-classes 10 --batch-size 8 --loss ce "
        "--strategies single,dp,ddp --world-size 2 --steps 1 --lr 0.01 --optimizer sgd --dtype fp32 "
        "--mode auto --seed 0 --inject '1->0:nan@1'"
    )
    nancheck = next(c for c in doc["checks"] if c["name"] == "nancheck")
    assert [f["code"] for f in nancheck["findings"]] == ["link-corruption"]
    md = files["REPORT.md"].decode()
    assert "| nancheck | ❌ fail (simulated) |" in md and "<details><summary>Environment</summary>" in md
    assert "python repro.py" in md and "## GPU topology" in md
    assert json.loads(files["traces/nancheck.json"])["traceEvents"]


def test_repro_script_needs_only_torch_and_shows_the_problem(seed_bundle: Path, tmp_path: Path) -> None:
    script = (seed_bundle / "repro.py").read_text()
    assert "import gpudiag" not in script and "from gpudiag" not in script
    assert os.access(seed_bundle / "repro.py", os.X_OK)
    shutil.copy(seed_bundle / "repro.py", tmp_path / "repro.py")
    # gpudiag cannot be imported: the script must not need it.
    blocker = "import sys, runpy; sys.modules['gpudiag'] = None; sys.argv = sys.argv[1:]; "
    blocker += "runpy.run_path(sys.argv[0], run_name='__main__')"
    done = subprocess.run(
        [sys.executable, "-c", blocker, "repro.py", "nancheck", "peer"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "goes non-finite at step 1 on the pair (0, 1)" in done.stdout
    assert "1->0 (cpu -> cpu): 12 copies, 12 wrong" in done.stdout
    assert "problem shows: nancheck, peer" in done.stdout
    # The script trains exactly what gpudiag trained: the same losses, step by step.
    nancheck = next(
        c for c in json.loads((seed_bundle / "report.json").read_text())["checks"] if c["name"] == "nancheck"
    )
    pair = next(p for p in nancheck["result"]["pairs"] if (p["a"], p["b"]) == (0, 1))
    alone = next(s for s in nancheck["result"]["singles"] if s["device"] == 0)

    def printed(run: dict) -> str:  # (JSON: null where a loss was not finite, its value apart)
        losses = list(run["losses"])
        for bad in run["nonfinite"]:
            losses[bad["step"] - 1] = bad["value"]
        return "[" + ", ".join(f"{float(x):.4g}" for x in losses) + "]"

    assert f"GPU 0 alone (cpu): losses {printed(alone)}" in done.stdout
    assert f"(dp): losses {printed(pair)}" in done.stdout
    # The same script with the fault made harmless (× 1.0) finds nothing: the check can fail.
    assert script.count("'kind': 'nan'") >= 2
    (tmp_path / "healthy.py").write_text(script.replace("'kind': 'nan'", "'kind': 'scale'"))
    done = subprocess.run(
        [sys.executable, "healthy.py", "nancheck", "peer"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "the problem did not show" in done.stdout
    done = subprocess.run([sys.executable, "repro.py", "nope"], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 2 and "no check nope" in done.stderr


def test_repro_script_gradcheck_with_ddp(tmp_path: Path) -> None:
    """single vs written-out DataParallel vs spawned DDP over gloo, from a failing gradcheck."""
    config = {**plan(NO_GPU, ["gradcheck"], inject=("1->0:scale=3@1",))[0][1]}
    run = run_check("gradcheck", config, NO_GPU)
    assert run.status == "fail"
    (tmp_path / "repro.py").write_text(repro_script([run]))
    done = subprocess.run(
        [sys.executable, "repro.py"], cwd=tmp_path, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 1, done.stdout + done.stderr
    # The script and gpudiag agree strategy by strategy.
    for comparison in run.result["comparisons"]:
        verdict = "agrees" if comparison["ok"] else "DIFFERS"
        assert f"  {comparison['strategy']}: {verdict} with single" in done.stdout, done.stdout
    assert "ddp: DIFFERS with single" in done.stdout


def test_repro_script_carries_a_model_file(tmp_path: Path) -> None:
    model = tmp_path / "my_model.py"
    model.write_text(
        "from torch import nn\n\ndef build():\n    return nn.Sequential(nn.Flatten(), nn.Linear(12, 3))\n"
    )
    config = {**plan(NO_GPU, ["gradcheck"], model=f"{model}:build")[0][1]}
    config.update(
        {"input_shape": [3, 2, 2], "num_classes": 3, "strategies": ["single", "dp"], "inject": ["1->0:inf"]}
    )
    run = run_check("gradcheck", config, NO_GPU)
    assert run.status == "fail"
    text = repro_script([run])
    assert "nn.Linear(12, 3)" in text and str(tmp_path) not in text
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "repro.py").write_text(text)
    done = subprocess.run(
        [sys.executable, "repro.py"], cwd=tmp_path / "elsewhere", capture_output=True, text=True
    )
    assert done.returncode == 1 and "dp: DIFFERS with single: non-finite gradient" in done.stdout


def test_secrets_never_reach_the_bundle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted in the environment, in ~/.nccl.conf and in a rank's log; none of it may leave."""
    home = tmp_path / "home"
    home.mkdir()
    (home / ".nccl.conf").write_text(f"NCCL_IB_HCA=mlx5_0\n# token for the mirror: {CONF_TOKEN}\n")
    model = tmp_path / "leaky.py"
    model.write_text(
        "import os\nfrom torch import nn\n\n"
        "class Leaky(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.net = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 10))\n\n"
        "    def forward(self, x):\n"
        "        print('auth with', os.environ['HF_TOKEN'], os.environ['MY_SERVICE_PASSWORD'], flush=True)\n"
        "        print('db', os.environ['DB_PWD'], 'svc', os.environ['MY_SERVICE_CREDS'], flush=True)\n"
        "        print('Authorization: Bearer', os.environ['BEARER'], flush=True)\n"
        "        print('argv: train.py --api-key=' + os.environ['CLI_ARG'], flush=True)\n"
        "        print('max_tokens=512 session_length=30', 'auth_mode=none', end=' ')\n"
        "        print('passthrough=1 bypass=0', flush=True)\n"
        "        return self.net(x)\n"
    )
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("HF_TOKEN", HF)
    monkeypatch.setenv("MY_SERVICE_PASSWORD", PASSWORD)
    monkeypatch.setenv("WANDB_API_KEY", "0123456789abcdef0123456789abcdef")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth0")
    monkeypatch.setenv("TORCH_HUB_URL", "https://deploy:hunter2hunter2@hub.example.com/models")
    # Issue 16: values of *_PWD / *_CREDS variables reached the rank logs verbatim.
    monkeypatch.setenv("DB_PWD", "db-pwd-5551234")
    monkeypatch.setenv("MY_SERVICE_CREDS", "svc-creds-5551234")
    monkeypatch.setenv("BEARER", "bearer0123456789abcdef")  # (a name that is no secret: found by shape)
    monkeypatch.setenv("CLI_ARG", "cli-key-5551234")  # likewise: found as --api-key=…
    secrets = [HF, PASSWORD, CONF_TOKEN, "0123456789abcdef0123456789abcdef", "hunter2hunter2"]
    secrets += ["db-pwd-5551234", "svc-creds-5551234", "bearer0123456789abcdef", "cli-key-5551234"]
    for suffix in ("folder", "bundle.zip"):
        out = tmp_path / suffix
        result = invoke(
            [
                "report",
                "--checks",
                "env,gradcheck",
                "--model",
                f"{model}:Leaky",
                "-o",
                str(out),
                "--inject",
                "1->0:nan",
            ],
        )
        assert result.exit_code == 1, result.output
        files = bundle_bytes(out)
        logs = [name for name in files if name.startswith("logs/")]
        assert logs and any(b"auth with <redacted: set>" in files[name] for name in logs)
        ordinary = b"max_tokens=512 session_length=30 auth_mode=none passthrough=1 bypass=0"  # (print joins)
        assert any(ordinary in files[name] for name in logs)  # not over-redacted
        for name, data in files.items():
            for secret in secrets:
                assert secret.encode() not in data, f"{secret} leaked into {name}"
        if out.suffix == ".zip":
            raw = out.read_bytes()
            assert all(s.encode() not in raw for s in secrets)
        env = json.loads(files["report.json"])["env"]["sections"]
        assert env["variables"]["NCCL_SOCKET_IFNAME"] == "eth0"
        assert env["variables"]["TORCH_HUB_URL"] == "https://<redacted>@hub.example.com/models"
        assert "NCCL_IB_HCA=mlx5_0" in env["nccl_config"][f"{home}/.nccl.conf"]


def test_report_refuses_an_existing_bundle_and_bad_input(tmp_path: Path) -> None:
    existing = tmp_path / "old"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    result = invoke(["report", "--checks", "env", "-o", str(existing)])
    assert result.exit_code == 2 and "exists; pass --force" in result.output
    assert (existing / "keep.txt").read_text() == "mine"
    for args, message in (
        (["--checks", "env,bogus"], "expected a list of env"),
        (["--model", "nope-model"], "bad --model"),
        (["--machine", str(tmp_path / "missing.txt")], "does not exist"),
        (["-o", str(tmp_path / "no" / "such" / "dir")], "does not exist"),
        (["--inject", "1=>0:nan"], "Invalid value for '--inject'"),
    ):
        output = [] if "-o" in args else ["-o", str(tmp_path / "x")]
        result = invoke(["report", "--checks", "env", *output, *args])
        assert result.exit_code == 2, (args, result.output)
        assert message in result.output and "Traceback" not in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old"]  # nothing half-written
    # --force replaces an earlier bundle only (tests/cli/test_outputs.py), not a user's folder
    result = invoke(["report", "--checks", "env", "-o", str(existing), "--force"])
    assert result.exit_code == 2 and "not a gpudiag bundle" in result.output
    assert sorted(p.name for p in existing.iterdir()) == ["keep.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old"]


def test_replay_matches_its_own_bundle(seed_bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpudiag import progress

    seen: list[str] = []  # what a terminal would show (issue 17: replay was silent until the end)
    monkeypatch.setattr(progress, "shown", lambda stream=None: progress.listening(seen.append))
    result = invoke(["replay", str(seed_bundle), "--format", "json"])
    assert result.exit_code == 0, result.output
    names = ["env", "topology", "peer", "gradcheck", "nancheck"]
    assert [s for s in seen if s.startswith("replay: ")] == [f"replay: {name}" for name in names]
    assert any(s.startswith("nancheck: ") for s in seen)  # the checks' own notes go on showing
    doc = json.loads(result.output)
    assert doc["rehearsal"] and [c["recorded"]["simulated"] for c in doc["checks"]] == [0, 0, 1, 1, 1]
    assert doc["schema"] == "gpudiag.replay/1" and doc["match"] is True
    assert {c["name"]: c["compared"] for c in doc["checks"]} == {
        "env": False,
        "topology": True,
        "peer": True,
        "gradcheck": True,
        "nancheck": True,
    }


def test_replay_says_what_differs(seed_bundle: Path, tmp_path: Path) -> None:
    """The reporter's failures were the fault; here the same configuration without it passes."""
    copy = tmp_path / "copy"
    shutil.copytree(seed_bundle, copy)
    doc = json.loads((copy / "report.json").read_text())
    for check in doc["checks"]:
        if check["config"] and "inject" in check["config"]:
            check["config"]["inject"] = []
    doc["env"]["sections"]["versions"]["torch"] = "1.13.0"
    (copy / "report.json").write_text(json.dumps(doc))
    result = invoke(["replay", str(copy)])
    assert result.exit_code == 1, result.output
    assert "replay of" in result.output and "DIFFERS" in result.output
    assert "fails on the reporter's machine, passes here: hardware-specific" in result.output
    assert "pair (0,1): diverged (step 1) there, ok here" in result.output
    assert "versions.torch: 1.13.0 there" in result.output


def test_replay_rejects_damaged_and_newer_bundles(seed_bundle: Path, tmp_path: Path) -> None:
    cases = {}
    newer = tmp_path / "newer"
    shutil.copytree(seed_bundle, newer)
    doc = json.loads((newer / "report.json").read_text())
    (newer / "report.json").write_text(json.dumps({**doc, "schema": "gpudiag.report/2"}))
    cases[newer] = "written by a newer gpudiag"
    damaged = tmp_path / "damaged"
    shutil.copytree(seed_bundle, damaged)
    (damaged / "report.json").write_text('{"schema": "gpudiag.report/1", "checks": [')
    cases[damaged] = "report.json is damaged"
    truncated = tmp_path / "bundle.zip"
    truncated.write_bytes(b"PK\x03\x04 not really a zip")
    cases[truncated] = "damaged zip"
    cases[tmp_path / "nothing"] = "does not exist"
    empty = tmp_path / "empty"
    empty.mkdir()
    cases[empty] = "no report.json"
    for path, message in cases.items():
        result = invoke(["replay", str(path)])
        assert result.exit_code == 2 and message in result.output, (path, result.output)


def test_zip_bundle_replays(tmp_path: Path) -> None:
    out = tmp_path / "r.zip"
    result = invoke(["report", "--checks", "env,gradcheck", "-o", str(out)])
    assert result.exit_code == 0, result.output
    with zipfile.ZipFile(out) as archive:
        assert {"report.json", "REPORT.md"} <= set(
            archive.namelist()
        ) and "repro.py" not in archive.namelist()
    assert read_bundle(out).document["schema"] == "gpudiag.report/1"
    result = invoke(["replay", str(out)])
    assert result.exit_code == 0, result.output


@pytest.mark.usefixtures("no_gpu")
def test_doctor_without_gpus(tmp_path: Path) -> None:
    result = invoke(["doctor", "-o", str(tmp_path / "b"), "--format", "json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["schema"] == "gpudiag.doctor/1" and doc["bundle"] == str(tmp_path / "b")
    status = {c["name"]: c["status"] for c in doc["checks"]}
    assert status == {
        "env": "pass",
        "topology": "skipped",
        "peer": "skipped",  # issue 17: it said pass with no GPU to test
        "gradcheck": "pass",
        "nancheck": "skipped",
        "transport": "skipped",
    }
    assert all(set(c) >= {"name", "status", "findings"} for c in doc["checks"])
    peer = next(c for c in doc["checks"] if c["name"] == "peer")
    assert "not enough GPUs (fewer than 2 CUDA GPUs" in peer["headline"]
    simulated = {c["name"] for c in doc["checks"] if c["simulated"]}
    assert simulated == {"gradcheck"} and "gradcheck ran on CPU virtual devices" in doc["simulation"]
    text = invoke(["doctor", "-o", str(tmp_path / "c")])
    assert text.exit_code == 0
    assert "gpudiag doctor --machine topo.txt" in text.stdout and "Skipped" in text.stdout
    assert "[4/6] gradcheck: pass" in text.stderr
    rows = {line.split()[0]: line for line in text.stdout.splitlines() if line.startswith(" ")}
    assert "pass (simulated)" in rows["gradcheck"] and "skipped" in rows["peer"]
    assert "Simulated: gradcheck ran on CPU virtual devices, not on GPUs" in text.stdout


def test_doctor_on_a_capture_finds_the_broken_link(tmp_path: Path) -> None:
    result = invoke(
        [
            "doctor",
            "--machine",
            SEED_CAPTURE,
            "--inject",
            "5->6:nan@3",
            "-o",
            str(tmp_path / "b"),
            "--checks",
            "topology,nancheck",
            "--format",
            "json",
        ],
    )
    assert result.exit_code == 1, result.output
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert checks["topology"]["status"] == "warning"
    assert checks["nancheck"]["status"] == "fail"
    assert checks["nancheck"]["headline"].startswith(
        "link-corruption: training breaks only on pair(s) (5,6) over NODE"
    )


def test_doctor_on_a_capture_says_simulated_and_rehearsal(tmp_path: Path) -> None:
    """Issue 17: `doctor --machine topo.txt` printed `peer pass …` and `nancheck pass …` as if
    the captured machine had been tested, and an --inject run did not say it was a rehearsal."""
    args = ["doctor", "--machine", SEED_CAPTURE, "--checks", "topology,peer,nancheck", "--pairs", "0-1"]
    text = invoke([*args, "--inject", "0->1:nan@2", "--no-bundle"])
    assert text.exit_code == 1, text.output
    lines = text.stdout.splitlines()
    assert lines[0].startswith("Rehearsal with injected faults (--inject '0->1:nan@2')")
    assert f"Simulated: peer and nancheck ran on CPU virtual devices laid out like {SEED_CAPTURE}" in lines[2]
    rows = {line.split()[0]: line for line in lines if line.startswith(" ")}
    assert " warning " in rows["topology"] and "simulated" not in rows["topology"]  # the capture's own data
    assert "fail (simulated)" in rows["nancheck"]
    assert "fail (simulated)" in rows["peer"] and "step 2" in rows["peer"]  # @2 honoured (issue 47)
    doc = json.loads(invoke([*args, "--format", "json", "--no-bundle"]).stdout)
    checks = {c["name"]: c for c in doc["checks"]}
    assert (checks["peer"]["status"], checks["peer"]["simulated"]) == ("pass", True)
    assert checks["nancheck"]["simulated"] is True and checks["topology"]["simulated"] is False
    assert "not on the machine's GPUs" in checks["nancheck"]["simulation"]
    assert doc["injected_faults"] == [] and doc["rehearsal"] is None
    assert "CPU virtual devices, not the GPUs" in checks["peer"]["headline"]


def test_a_rehearsal_bundle_says_so_first(seed_bundle: Path) -> None:
    """Issue 17: that faults were injected appeared only inside the command line."""
    files = bundle_bytes(seed_bundle)
    md = files["REPORT.md"].decode()
    assert md.startswith("> **Rehearsal with injected faults:** `--inject '1->0:nan@1'`.")
    assert md.index("Rehearsal") < md.index("# gpudiag report")
    doc = json.loads(files["report.json"])
    assert doc["injected_faults"] == ["1->0:nan@1"] and "planted by gpudiag" in doc["rehearsal"]
    assert {c["name"] for c in doc["checks"] if c["simulated"]} == {"peer", "gradcheck", "nancheck"}
    assert "**Simulated: peer, gradcheck and nancheck ran on CPU virtual devices" in md
    assert "| peer | ❌ fail (simulated) |" in md and "## nancheck — fail (simulated)" in md


def test_rank_logs_capture_each_rank(tmp_path: Path) -> None:
    with rank_logs(tmp_path / "logs") as folder:
        launch(_print_rank, 2)
    logs = sorted(p.name for p in folder.iterdir())
    assert logs == ["launch1-rank0.log", "launch1-rank1.log"]
    assert "hello from rank 1 of 2" in (folder / "launch1-rank1.log").read_text()
    assert "backend gloo" in (folder / "launch1-rank0.log").read_text()


def _print_rank(rank: int, world: int) -> bytes:
    print(f"hello from rank {rank} of {world}", flush=True)
    return b""


def test_command_lines_and_plan() -> None:
    assert command_line("topology", {"machine": "machine.json"}) == "gpudiag topology --machine machine.json"
    assert command_line("peer", {"machine": None, "pairs": "all", "inject": []}) == "gpudiag peer --pairs all"
    planned = {name: (config, why) for name, config, why in plan(NO_GPU)}
    assert planned["topology"][0] is None and "--machine" in planned["topology"][1]
    assert planned["nancheck"][0] is None and planned["gradcheck"][0]["model"] == "mlp"


@pytest.mark.gpu
def test_doctor_on_a_gpu_machine(tmp_path: Path) -> None:
    result = invoke(
        ["doctor", "--checks", "env,gradcheck,nancheck", "-o", str(tmp_path / "b"), "--format", "json"]
    )
    assert result.exit_code == 0, result.output
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert checks["nancheck"]["status"] == "pass" and checks["gradcheck"]["status"] == "pass"
    env = json.loads((tmp_path / "b" / "report.json").read_text())["env"]["sections"]
    assert env["versions"]["cuda_available"] is True and env["versions"]["nccl_runtime"]


def test_pairs_limit_peer_and_nancheck(tmp_path: Path) -> None:
    args = ["doctor", "--machine", SEED_CAPTURE, "--checks", "peer,nancheck", "--format", "json"]
    result = invoke([*args, "--pairs", "5-6", "-o", str(tmp_path / "b")])
    assert result.exit_code == 0, result.output
    doc = json.loads((tmp_path / "b" / "report.json").read_text())
    checks = {c["name"]: c for c in doc["checks"]}
    assert [(p["src"], p["dst"]) for p in checks["peer"]["result"]["pairs"]] == [(5, 6), (6, 5)]
    assert [(p["a"], p["b"]) for p in checks["nancheck"]["result"]["pairs"]] == [(5, 6)]
    assert "--pairs 5-6" in checks["nancheck"]["command"]
    result = invoke([*args, "--pairs", "5-9", "-o", str(tmp_path / "c")])
    assert result.exit_code == 2 and "no GPU 9 here" in result.output and not (tmp_path / "c").exists()


@pytest.mark.usefixtures("no_gpu")
def test_doctor_reads_the_topology_from_nvml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUDIAG_NVML_SCENARIO", str(NVML / "a100_4gpu_fabric_down.json"))
    result = invoke(
        ["doctor", "--checks", "topology,nancheck", "-o", str(tmp_path / "b"), "--format", "json"]
    )
    assert result.exit_code == 0, result.output
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert checks["topology"]["status"] == "warning"
    assert "nvswitch-without-nvlink" in {f["code"] for f in checks["topology"]["findings"]}
    assert checks["nancheck"]["status"] == "skipped"  # NVML sees GPUs, torch has no CUDA here
    assert json.loads((tmp_path / "b" / "report.json").read_text())["here"]["nvml"] == "ok"


def write_doc(folder: Path, checks: list[dict], **files: bytes) -> Path:
    """A folder bundle whose report.json holds ``checks`` (and any other files given)."""
    folder.mkdir(parents=True, exist_ok=True)
    doc = {"schema": "gpudiag.report/1", "checks": checks, "env": None}
    (folder / "report.json").write_text(json.dumps(doc))
    for name, data in files.items():
        (folder / name.replace("__", "/")).write_bytes(data)
    return folder


def gradcheck_entry(**config: object) -> dict:
    return {
        "name": "gradcheck",
        "status": "pass",
        "headline": "",
        "config": {**plan(NO_GPU, ["gradcheck"])[0][1], **config},
        "findings": [],
        "result": None,
    }


def test_anonymized_bundles_are_json_and_replay(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 16: a home path at the end of a JSON string ate its closing `",`."""
    monkeypatch.setenv("NCCL_DEBUG_FILE", "/home/alice")
    monkeypatch.setenv("NCCL_TOPO_FILE", "/home/alice/topo.xml")
    for name in ("anon", "anon.zip"):
        out = tmp_path / name
        args = ["report", "--anonymize", "--machine", FOUR_GPUS, "--checks", "env,topology", "-o", str(out)]
        result = invoke(args)
        assert result.exit_code == 0, result.output
        files = bundle_bytes(out)
        for file, data in files.items():
            if file.endswith(".json"):
                json.loads(data)
        variables = json.loads(files["report.json"])["env"]["sections"]["variables"]
        assert variables["NCCL_DEBUG_FILE"] == "/home/<user>"
        assert variables["NCCL_TOPO_FILE"] == "/home/<user>/topo.xml"
        result = invoke(["replay", str(out)])
        assert result.exit_code == 0, result.output


def test_replay_runs_no_code_the_bundle_names(tmp_path: Path) -> None:
    """Issue 16: replay imported and called the bundle's --model without a word."""
    marker = tmp_path / "ran"
    evil = tmp_path / "evil.py"
    evil.write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('x')\nbuild = None\n")
    bundle = write_doc(
        tmp_path / "b", [gradcheck_entry(model=f"{evil}:build"), {**gradcheck_entry(model="this:x")}]
    )
    result = invoke(["replay", str(bundle), "--format", "json"])
    assert result.exit_code == 3, result.output  # nothing compared (issue 47: it said MATCH, exit 0)
    assert not marker.exists() and "Zen of Python" not in result.output
    doc = json.loads(result.output)
    assert doc["trusted"] is False
    notes = [c["note"] for c in doc["checks"]]
    assert [c["here"]["status"] for c in doc["checks"]] == ["skipped", "skipped"]
    assert f"--model '{evil}:build' would run the Python file {evil}" in notes[0]
    assert "--model 'this:x' would import the module this" in notes[1]
    assert all("--trust-bundle" in note for note in notes)
    result = invoke(["replay", str(bundle), "--trust-bundle"])
    assert marker.exists()  # with the flag it runs (and this file has no factory: a difference)
    assert result.exit_code == 1, result.output


def test_replay_reads_bundles_within_limits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 16: a zip bomb was read into memory whole. Sizes are checked before reading."""
    import gpudiag.repro.bundle as bundle_module

    report = json.dumps({"schema": "gpudiag.report/1", "checks": []}).encode()
    bomb = tmp_path / "bomb.zip"
    with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("report.json", report)
        with archive.open("logs/x.log", "w") as stream:
            for _ in range(80):
                stream.write(bytes(1 << 20))
    assert bomb.stat().st_size < 1 << 20
    ratio = tmp_path / "ratio.zip"
    with zipfile.ZipFile(ratio, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("report.json", report)
        archive.writestr("logs/x.log", bytes(4 << 20))
    many = tmp_path / "many.zip"
    with zipfile.ZipFile(many, "w") as archive:
        archive.writestr("report.json", report)
        for i in range(2000):
            archive.writestr(f"logs/{i}.log", b"")
    cases = {
        bomb: "logs/x.log unpacks to 83886080 bytes",
        ratio: "a zip bomb?",
        many: "it holds 2001 files",
    }
    for path, message in cases.items():
        result = invoke(["replay", str(path)])
        assert result.exit_code == 2, (path, result.output)
        assert message in result.output and result.output.count("\n") == 1, result.output
    # Folders: limits lowered here to keep the test small.
    big = write_doc(tmp_path / "big", [])
    (big / "trace.json").write_bytes(bytes(1 << 20))
    crowded = write_doc(tmp_path / "crowded", [])
    for i in range(5):
        (crowded / f"{i}.log").write_text("x")
    monkeypatch.setattr(bundle_module, "MAX_FILE_BYTES", (1 << 20) - 1)
    monkeypatch.setattr(bundle_module, "MAX_FILES", 4)
    for path, message in {big: "trace.json holds 1048576 bytes", crowded: "more than 4 files"}.items():
        result = invoke(["replay", str(path)])
        assert result.exit_code == 2 and message in result.output, (path, result.output)
    # Only regular files are read: no FIFO (a read would block), no link out of the folder.
    odd = tmp_path / "odd"
    odd.mkdir()
    os.mkfifo(odd / "report.json")
    outside = write_doc(tmp_path / "outside", [])
    (odd / "logs").symlink_to(outside)
    result = invoke(["replay", str(odd)])
    assert result.exit_code == 2 and "no report.json" in result.output


@pytest.mark.usefixtures("no_gpu")
def test_replay_skips_what_cannot_run_here(tmp_path: Path) -> None:
    """Issue 16: a check this machine cannot run was reported as DIFFERS, without the reason."""
    copies = [{"wrong": False}] * 2
    peer = {
        "name": "peer",
        "status": "pass",
        "headline": "",
        "config": {"machine": None, "pairs": "all", "inject": []},
        "findings": [],
        "result": {"pairs": [{"src": 0, "dst": 1, "copies": copies}, {"src": 1, "dst": 0, "copies": copies}]},
    }
    topology = {
        "name": "topology",
        "status": "pass",
        "headline": "",
        "config": {"source": "nvml"},
        "findings": [],
        "result": {"pairs": [{"a": 0, "b": 1, "link": "NV2"}]},
    }
    gradcheck = gradcheck_entry()
    gradcheck["result"] = {"config": {"devices": {"kind": "cuda", "ids": [0, 1]}}, "comparisons": []}
    bundle = write_doc(tmp_path / "b", [peer, topology, gradcheck])
    result = invoke(["replay", str(bundle), "--format", "json"])
    assert result.exit_code == 3, result.output  # nothing compared: not a match (issue 47)
    doc = json.loads(result.output)
    assert [c["here"]["status"] for c in doc["checks"]] == ["skipped"] * 3
    notes = [c["note"] for c in doc["checks"]]
    assert notes[0] == "cannot run here: the reporter ran peer on CUDA GPU(s) 0, 1; here 0 CUDA GPU(s)"
    assert notes[1].startswith("cannot run here: the reporter read the topology from NVML")
    assert notes[2].startswith("cannot run here: the reporter ran gradcheck on 2 CUDA GPU(s); here 0")


def test_replay_rejects_fields_of_the_wrong_type(tmp_path: Path) -> None:
    """Issue 16: world_size "2" (a string) hung for 305 s. Now exit 2 naming the field, at once."""
    nancheck = {"name": "nancheck", "status": "pass", "headline": "", "findings": [], "result": None}
    cases = {
        "checks[0].config.world_size: '2' is not an integer": [gradcheck_entry(world_size="2")],
        "checks[0].config.input_shape": [gradcheck_entry(input_shape=[3, "32", 32])],
        "checks[0].config.strategies": [gradcheck_entry(strategies="single,dp")],
        "checks[0].config.inject": [gradcheck_entry(inject="1->0:nan")],
        "checks[0].config.timeout: unknown field of gradcheck": [gradcheck_entry(timeout=1e9)],
        "checks[0].config.world_size: 100000 is out of range": [gradcheck_entry(world_size=100_000)],
        "checks[0].config.model: missing": [{**gradcheck_entry(), "config": {"world_size": 2}}],
        "asks for trained weights": [gradcheck_entry(model="torchvision:resnet18?weights=DEFAULT")],
        "checks[0].config.machine_file: unknown field": [
            {**nancheck, "config": {"machine_file": "/etc/passwd"}}
        ],
        "checks[0].config.machine names machine.json, which the bundle lacks": [
            {**nancheck, "config": {"machine": "machine.json"}}
        ],
        "checks[0].config.pairs": [{**nancheck, "config": {"pairs": [0, 1]}}],
        "checks[0].name: unknown check 'rm'": [{**nancheck, "name": "rm", "config": {}}],
        "checks[0].result.singles[0]: a GPU number that is not an integer": [
            {
                **nancheck,
                "config": {},
                "result": {"singles": [{"device": [0], "status": "ok", "first_bad_step": None}]},
            }
        ],
        "checks[0].findings[0] is not a finding": [{**nancheck, "config": None, "findings": [3]}],
    }
    for i, (message, checks) in enumerate(cases.items()):
        bundle = write_doc(tmp_path / str(i), checks)
        result = invoke(["replay", str(bundle)])
        assert result.exit_code == 2 and message in result.output, (message, result.output)
        assert result.output.count("\n") == 1


def _zip_of(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return buffer.getvalue()


_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
#: Values a real configuration or result holds, and near misses, besides random ones.
_PLAUSIBLE = _VALUES | st.sampled_from(
    (
        0,
        1,
        2,
        "2",
        1000000000.0,
        -1,
        "mlp",
        "cnn-bn",
        "this:x",
        "/tmp/x.py:build",
        "torchvision:resnet18",
        "all",
        "0-1",
        "machine.json",
        "nvml",
        (3, 8, 8),
        (3, "8"),
        ("single", "dp"),
        ("1->0:nan",),
        "4K,1M",
        "ok",
    )
).map(lambda v: list(v) if isinstance(v, tuple) else v)
_KEYS = st.sampled_from(
    (
        "model",
        "world_size",
        "input_shape",
        "strategies",
        "inject",
        "pairs",
        "machine",
        "source",
        "sizes",
        "steps",
        "seed",
        "loss",
        "mode",
        "dtype",
        "strategy",
        "timeout",
    )
)
_ITEM_KEYS = st.sampled_from(
    (
        "src",
        "dst",
        "a",
        "b",
        "device",
        "status",
        "first_bad_step",
        "link",
        "strategy",
        "mode",
        "ok",
        "rel_norm_err",
        "norm_ratio",
        "options",
        "copies",
    )
)
_ITEMS = st.lists(st.dictionaries(_ITEM_KEYS, _PLAUSIBLE, max_size=6), max_size=2) | _VALUES
_CHECK = st.fixed_dictionaries(
    {
        "name": st.sampled_from(["env", "topology", "peer", "gradcheck", "nancheck"] * 3 + ["bogus"]),
        "status": st.sampled_from(["pass", "fail", "warning", "error", "skipped"] * 3 + ["odd"]),
    },
    optional={
        "config": st.dictionaries(_KEYS, _PLAUSIBLE, max_size=3) | st.just({}) | _VALUES,
        "result": st.dictionaries(st.sampled_from(["pairs", "singles", "comparisons", "config"]), _ITEMS)
        | _VALUES,
        "findings": st.just([]) | st.lists(st.dictionaries(st.sampled_from(["code", "message"]), _PLAUSIBLE)),
        "seconds": st.floats(0, 10) | st.floats(0, 10) | _VALUES,
        "headline": st.text(max_size=10) | st.text(max_size=10) | _VALUES,
    },
)
_ENV = st.none() | st.fixed_dictionaries(
    {"sections": st.dictionaries(st.sampled_from(["versions", "gpus", "flags"]), _VALUES) | _VALUES}
)
_REPORT = st.one_of(
    st.fixed_dictionaries(
        {
            "schema": st.sampled_from(["gpudiag.report/1"] * 6 + ["gpudiag.report/x", "other"]),
            "checks": st.lists(_CHECK, min_size=1, max_size=3),
        },
        optional={"env": _ENV},
    ),
    _VALUES,
)
#: Checks whose every field is valid but the configuration and the result (deeper paths).
_DEEP = st.lists(
    st.fixed_dictionaries(
        {
            "name": st.sampled_from(["env", "topology", "peer", "gradcheck", "nancheck"]),
            "status": st.sampled_from(["pass", "fail", "warning"]),
            "config": st.dictionaries(_KEYS, _PLAUSIBLE, max_size=3),
            "result": st.none()
            | st.dictionaries(st.sampled_from(["pairs", "singles", "comparisons"]), _ITEMS),
        }
    ),
    min_size=1,
    max_size=3,
).map(lambda checks: {"schema": "gpudiag.report/1", "checks": checks})
_BUNDLE = st.one_of(
    st.tuples(st.just("bytes"), st.binary(max_size=200)),
    st.tuples(
        st.just("zip"),
        st.dictionaries(
            st.sampled_from(["report.json", "machine.json", "logs/a.log", "x/"]), st.binary(max_size=50)
        ),
    ),
    st.tuples(st.just("folder"), _REPORT.map(lambda doc: json.dumps(doc).encode())),
    st.tuples(st.just("zipped"), _REPORT.map(lambda doc: json.dumps(doc).encode())),
    st.tuples(st.just("folder"), _DEEP.map(lambda doc: json.dumps(doc).encode())),
)


@settings(
    max_examples=fuzz_examples(120),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(bundle=_BUNDLE)
def test_replay_fuzz(
    bundle: tuple[str, bytes | dict[str, bytes]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Random bytes, zips and report.json documents: exit 0, 1, 2 (or 3), never an internal
    error, never a hang. Checks that pass validation run as a stub echoing the recorded
    result (the real runs are tested above); validation and comparison run for real."""
    import time

    import gpudiag.repro.replay as replay_module
    from gpudiag.checks.suite import CheckRun, Here

    def stub(name: str, config: dict, here: Here, *, why: str = "") -> CheckRun:
        return CheckRun(name, "pass", "stub", config)

    monkeypatch.setattr(replay_module, "run_check", stub)
    monkeypatch.setattr(Here, "detect", classmethod(lambda cls, machine=None: NO_GPU))
    kind, content = bundle
    target = tmp_path / f"fuzz-{time.monotonic_ns()}"
    if kind == "bytes":
        target.write_bytes(content)  # type: ignore[arg-type]
    elif kind == "zip":
        target.write_bytes(_zip_of(content))  # type: ignore[arg-type]
    elif kind == "zipped":
        target.write_bytes(_zip_of({"report.json": content}))  # type: ignore[dict-item]
    else:
        target.mkdir()
        (target / "report.json").write_bytes(content)  # type: ignore[arg-type]
    start = time.monotonic()
    result = invoke(["replay", str(target), "--format", "json"])
    assert time.monotonic() - start < within(idle_s=1.0)  # (0.04 s at most at load 7)
    assert result.exit_code in (0, 1, 2, 3), result.output
    assert "internal error" not in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    if result.exit_code == 3:  # nothing compared: each check says why, or there was none
        doc = json.loads(result.output)
        assert doc["verdict"] == "nothing-compared"
        assert all(
            c["here"] is None or c["here"]["status"] == "skipped" for c in doc["checks"] if c["name"] != "env"
        )
        assert all(c["note"] for c in doc["checks"] if c["name"] != "env")


def test_each_check_gets_only_the_injections_it_can_fire() -> None:
    from gpudiag.checks.suite import Here, plan

    here = Here.detect(str(SEED_TOPO))
    configs = {name: config for name, config, _ in plan(here, inject=("5->6:nan@3", "0->1:zero"))}
    assert configs["gradcheck"]["inject"] == ["0->1:zero"]  # world size 2: ranks 0 and 1
    assert configs["nancheck"]["inject"] == ["5->6:nan@3", "0->1:zero"]
