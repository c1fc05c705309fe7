"""gpudiag sweep under stress (issue 36): what it reads is bounded and checked, what it
writes replaces only its own earlier folder, what it says names the node that failed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from gpudiag.errors import InputError
from gpudiag.repro.sweep.run import SweepOptions, SweepRun, sweep
from tests.helpers import invoke, within
from tests.repro.sweep.test_sweep import _every_written_byte, _two_gpu_machine, _write_sweep, node

DEEP = "[" * 200_000 + "]" * 200_000


def _summary(folder: Path, *args: str) -> tuple[int, str]:
    result = invoke(["sweep", "--summary", str(folder), *args])
    return result.exit_code, result.stderr


# -- 4, 18: bounded, checked reads of --rules, --baseline and --summary ---------------------


@pytest.mark.parametrize("flag", ["--rules", "--baseline"])
def test_rules_and_baseline_over_64_mib_are_refused_unread(tmp_path: Path, flag: str) -> None:
    _write_sweep(tmp_path / "sweep", [node(0), node(1)], [])
    big = tmp_path / "big.json"
    with big.open("wb") as f:  # (sparse: no disk used)
        f.truncate((64 << 20) + 10)
    code, err = _summary(tmp_path / "sweep", flag, str(big))
    assert code == 2 and err.count("\n") == 1 and "larger than 64 MiB" in err, err


@pytest.mark.parametrize("flag", ["--rules", "--baseline"])
def test_rules_and_baseline_that_are_not_utf8_are_one_line_exit_2(tmp_path: Path, flag: str) -> None:
    _write_sweep(tmp_path / "sweep", [node(0), node(1)], [])
    bad = tmp_path / "latin1.json"
    bad.write_bytes('{"schema": "gpudiag.sweep-rules/1", "x": "caf\xe9"}'.encode("latin-1"))
    code, err = _summary(tmp_path / "sweep", flag, str(bad))
    assert code == 2 and err.count("\n") == 1 and "not UTF-8" in err, err


def test_rules_from_dev_zero_or_a_fifo_are_refused_at_once(tmp_path: Path) -> None:
    """(In a child with a deadline: the old reader grew without bound on /dev/zero and
    blocked forever on a FIFO.)"""
    _write_sweep(tmp_path / "sweep", [node(0), node(1)], [])
    fifo = tmp_path / "rules.fifo"
    os.mkfifo(fifo)
    for source in ("/dev/zero", str(fifo)):
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "gpudiag",
                "sweep",
                "--summary",
                str(tmp_path / "sweep"),
                "--rules",
                source,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
        assert "Traceback" not in run.stderr


@pytest.mark.parametrize("where", ["--rules", "results.jsonl", "sweep.json", "rules.json"])
def test_deeply_nested_json_is_one_line_exit_2_not_recursion_error(tmp_path: Path, where: str) -> None:
    folder = tmp_path / "sweep"
    _write_sweep(folder, [node(0), node(1)], [])
    args: list[str] = []
    if where == "--rules":
        (tmp_path / "deep.json").write_text(DEEP)
        args = ["--rules", str(tmp_path / "deep.json")]
    elif where == "results.jsonl":
        with (folder / where).open("a") as f:
            f.write(DEEP + "\n")
    else:
        (folder / where).write_text(DEEP)
    code, err = _summary(folder, *args)
    assert code == 2 and err.count("\n") == 1 and "nested too deep" in err, err
    assert "RecursionError" not in err


# -- 1, 2: --force replaces only a sweep gpudiag wrote; the target is checked again -------


def _solo(tmp_path: Path, output: Path, *, force: bool = False) -> SweepRun:
    """A real sweep of one node (CPU virtual devices, the env check only)."""
    options = SweepOptions(
        output=str(output),
        machine=str(_two_gpu_machine(tmp_path)),
        quick=True,
        checks=("env",),
        force=force,
    )
    return sweep(options)


def _invoke_force(output: Path) -> tuple[int, str]:
    result = invoke(
        ["sweep", "-o", str(output), "--force", "--quick", "--checks", "env", "--machine", "x.json"]
    )
    return result.exit_code, result.stderr


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("name", ["results.jsonl", "sweep.json"])
def test_force_refuses_a_user_folder_that_merely_holds_a_sweep_file_name(tmp_path: Path, name: str) -> None:
    mine = tmp_path / "experiments"
    mine.mkdir()
    (mine / name).write_text('{"mine": true}\n')
    (mine / "notes.txt").write_text("three weeks of notes")
    before = _tree(mine)
    code, err = _invoke_force(mine)
    assert code == 2 and err.count("\n") == 1 and "not a gpudiag sweep folder" in err, err
    assert _tree(mine) == before


@pytest.mark.usefixtures("no_gpu", "solo_env")
def test_force_replaces_an_earlier_sweep_but_never_a_file_the_user_added(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    first = _solo(tmp_path, out)
    assert first.folder == out and (out / "nodes").is_dir()
    listed = json.loads((out / "sweep.json").read_text())["files"]
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()) == listed
    for added in ("notes.txt", "nodes/extra.zip"):
        (out / added).write_text("the user's")
        before = _tree(out)
        code, err = _invoke_force(out)
        assert code == 2 and err.count("\n") == 1 and added in err and "a sweep does not write" in err, err
        assert _tree(out) == before
        (out / added).unlink()
    again = _solo(tmp_path, out, force=True)  # (only what the sweep wrote: replaced)
    assert again.folder == out and json.loads((out / "sweep.json").read_text())["files"] == listed


@pytest.fixture
def solo_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GPUDIAG_HOSTNAME", "n0")


@pytest.mark.usefixtures("no_gpu", "solo_env")
@pytest.mark.parametrize("appears", ["user", "sweep"])
def test_a_folder_that_appears_at_o_during_the_sweep_is_never_replaced_without_force(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, appears: str
) -> None:
    """What another sweep to the same -o (or the user) put there while this one ran
    survives: this one refuses when it comes to write (exit 2), names why, writes nothing."""
    import gpudiag.repro.sweep.run as run

    other = tmp_path / "other"
    if appears == "sweep":
        _solo(tmp_path, other)  # (the first sweep's results, finished while the second runs)
    else:
        other.mkdir()
        (other / "data.csv").write_text("the user's")
    out = tmp_path / "sweep"
    real = run.local_phase

    def local_phase_while_another_writes(*args: Any, **kwargs: Any) -> Any:
        result = real(*args, **kwargs)
        other.rename(out)
        return result

    monkeypatch.setattr(run, "local_phase", local_phase_while_another_writes)
    _two_gpu_machine(tmp_path)
    before = {p.name for p in tmp_path.iterdir()}
    with pytest.raises(InputError, match="exists; pass --force") as raised:
        _solo(tmp_path, out)
    assert "results were not written" in str(raised.value)
    after = _tree(out)
    assert after and ("data.csv" in after if appears == "user" else "results.jsonl" in after)
    assert {p.name for p in tmp_path.iterdir()} == before - {"other"} | {"sweep"}  # (no staging left)


# -- 8: --anonymize masks the machine's own name too, not only GPUDIAG_HOSTNAME ---------------


@pytest.mark.usefixtures("no_gpu", "solo_env")
def test_anonymize_masks_the_real_host_name_when_gpudiag_hostname_is_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The documented Kubernetes recipe sets GPUDIAG_HOSTNAME; the kernel's name (here
    given through socket.gethostname, the machine boundary) still shows in the paths of
    NCCL_* variables and must be masked everywhere a sweep writes or prints."""
    import socket

    real = "gpu-node-17.cluster.example"
    monkeypatch.setattr(socket, "gethostname", lambda: real)
    monkeypatch.setenv("NCCL_DEBUG_FILE", "/shared/logs/gpu-node-17/nccl.%p.log")
    monkeypatch.setenv("NCCL_TOPO_DUMP_FILE", f"/shared/topo/{real}.xml")
    out = tmp_path / "sweep"
    machine = str(_two_gpu_machine(tmp_path))
    args = ["-o", str(out), "--quick", "--checks", "env", "--anonymize", "--format", "markdown"]
    result = invoke(["sweep", *args, "--machine", machine])
    assert result.exit_code in (0, 1), result.output
    files = _every_written_byte(out)
    assert any(name.endswith("results.jsonl") for name in files) and any(":report.json" in n for n in files)
    for name, data in {**files, "stdout": result.stdout.encode()}.items():
        assert b"gpu-node-17" not in data, name
    record = json.loads((out / "results.jsonl").read_text())
    assert record["host"] == "n0"
    assert record["host_facts"]["nccl_env"]["NCCL_DEBUG_FILE"] == "/shared/logs/<host>/nccl.%p.log"


def test_four_part_versions_are_not_masked_as_addresses() -> None:
    from gpudiag.redact import Redactor

    r = Redactor({}, anonymize=True, hostname="gpu-box-3.lab", user="alice")
    for kept in (
        "nvidia-cublas 13.1.1.3",
        "nvidia-cublas==13.1.1.3",
        "| nvidia-cudnn-cu13 | 9.24.0.43 |",
        '"nvidia-cufft": "12.0.0.61"',
        "driver v10.4.0.35",
    ):
        assert r.text(kept) == kept
    for address in (
        "MASTER_ADDR=10.0.0.1",
        "NCCL_COMM_ID=10.1.2.3:1234",
        "inet 10.1.1.3/24",
        "nvidia-smi 10.0.0.9",
    ):
        assert "<ip>" in r.text(address), address
    assert r.data({"nvidia-cublas": "13.1.1.3", "addr": "10.0.0.1"}) == {
        "nvidia-cublas": "13.1.1.3",
        "addr": "<ip>",
    }
    packages = json.dumps({"packages": {"nvidia-curand": "10.4.0.35"}}, indent=1).encode()
    assert b"10.4.0.35" in r.bytes(packages)


# -- 9: a node's own name in its NCCL_* paths is not a difference --------------------------


def test_nccl_paths_holding_each_node_s_own_name_are_not_node_host_differs() -> None:
    from gpudiag.repro.sweep.judge import judge

    def with_log(i: int, folder: str, **more: Any) -> dict[str, Any]:
        env = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_FILE": f"/shared/logs/{folder}/nccl.%p.log"}
        return node(i, host_facts={"iommu": "off", "acs_redirect": False, "nccl_env": env}, **more)

    records = [with_log(i, f"node{i}") for i in range(4)]
    # under GPUDIAG_HOSTNAME, $(hostname) is the kernel's name: an alias of the node
    records.append(with_log(4, "gpu-17.cluster", aliases=["gpu-17.cluster"]))
    verdict = judge(records)
    assert verdict.exit_code == 0 and not verdict.named, [(v.host, v.problems) for v in verdict.named]
    records.append(with_log(5, "node0"))  # (node5 writes into node0's folder: a real difference)
    named = {v.host: [p.code for p in v.problems] for v in judge(records).named}
    assert named == {"node5": ["node-host-differs"]}


@pytest.mark.usefixtures("no_gpu", "solo_env")
def test_a_node_record_names_the_kernel_s_host_name_as_an_alias(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket

    from gpudiag.repro.sweep.node import Identity, local_phase

    monkeypatch.setattr(socket, "gethostname", lambda: "gpu-17.cluster")
    options = SweepOptions(
        output="unused", quick=True, checks=("env",), machine=str(_two_gpu_machine(tmp_path))
    )
    local = local_phase(options, Identity.detect(os.environ), "gloo")
    assert local.record["host"] == "n0" and local.record["aliases"] == ["gpu-17.cluster"]


# -- 3: a node killed mid-sweep is named, and the sweep says it did not finish -------------


@pytest.mark.parametrize(
    "where",
    [
        "gather-records",
        pytest.param("pair-round1", marks=pytest.mark.slow),
        pytest.param("allreduce-all", marks=pytest.mark.slow),
    ],
)
def test_a_node_killed_mid_sweep_is_named_and_the_sweep_did_not_finish(tmp_path: Path, where: str) -> None:
    import tempfile

    from gpudiag.repro.sweep.rehearse import Node
    from tests.repro.sweep.test_sweep_nodes import machine, run_nodes

    def scratch() -> set[str]:
        return {p.name for p in Path(tempfile.gettempdir()).glob("gpudiag-sweep-*")}

    before = scratch()
    m = machine(tmp_path)
    nodes = [Node("node0", m), Node("node1", m, ["--inject-stall", f"{where}:kill"]), Node("node2", m)]
    out = run_nodes(tmp_path, nodes, "--checks", "env", "--timeout", "20", deadline=120)
    assert scratch() <= before  # (the killed node's scratch folder goes with the rehearsal's)
    assert out["rank0"].returncode == 1, out["rank0"].output[-2000:]
    assert out["named"] == {"node1": ["node-hung"]}, out["summary"]
    first = out["summary"].splitlines()[0]
    assert "the sweep did not finish" in first and "named: node1" in first, first
    assert "nobody named" not in out["summary"] and not out["run"]["finished"]
    assert f"rank 1 stopped answering in {where}" in out["summary"]
    assert "the sweep did not finish" in out["rank0"].output


# -- 16: rank 0's refusal of -o reaches every node before any group forms ------------------


def test_when_rank_0_refuses_the_output_every_node_refuses_at_once(tmp_path: Path) -> None:
    import time

    from gpudiag.repro.sweep.rehearse import Node, rehearse
    from tests.repro.sweep.test_sweep_nodes import machine

    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "data.csv").write_text("the user's")
    m = machine(tmp_path)
    start = time.monotonic()
    finished = rehearse(
        [Node("node0", m), Node("node1", m)],
        taken,
        ["--quick", "--checks", "env", "--timeout", "120"],
        deadline=60,
    )
    # (torchrun exits 1 when a worker fails; the worker's own code is in its report)
    assert [f.returncode for f in finished] == [1, 1], [f.output[-1500:] for f in finished]
    assert all(re.search(r"exitcode\s*:\s*2\b", f.output) for f in finished), [
        f.output[-1500:] for f in finished
    ]
    assert "rank 0 refused the output folder" in finished[1].output and "exists" in finished[1].output
    assert time.monotonic() - start < within(idle_s=9.6)  # (against a hang; rehearse stops at 60 s)
    assert (taken / "data.csv").read_text() == "the user's" and len(list(taken.iterdir())) == 1


# -- 15: a signal leaves no gpudiag-ranks-* folder, and is honoured inside a C++ wait --------

#: A gpudiag process with ranks started (their folder in $TMPDIR) whose main thread then
#: blocks in a C++ call Python's handler cannot interrupt: a gloo all-reduce whose peer
#: never comes (what a sweep worker waits in when another node is gone). Its Interrupted is
#: handled as the CLI's main() does.
STUCK = textwrap.dedent(
    """
    import datetime, os, sys, threading, time
    import torch, torch.distributed as dist
    from gpudiag.cli import stop_on_signals
    from gpudiag.cleanup import clean_up
    from gpudiag.errors import Interrupted
    from gpudiag.runtime.launch import start

    def rank(r, w):
        time.sleep(120)
        return b""

    stop_on_signals()
    try:
        ranks = start(rank, 2, timeout=120)
        store, timeout = dist.HashStore(), datetime.timedelta(seconds=120)
        kept = []  # (the peer's group lives on, and never enters the all-reduce)
        peer = threading.Thread(target=lambda: kept.append(dist.ProcessGroupGloo(store, 1, 2, timeout)))
        peer.start()
        group = dist.ProcessGroupGloo(store, 0, 2, timeout)
        peer.join()
        print("ready", flush=True)
        group.allreduce([torch.ones(4)]).wait()
    except Interrupted as exc:
        print(f"gpudiag: interrupted by SIG{'TERM' if exc.signum == 15 else 'INT'}; stopped", file=sys.stderr)
        clean_up()
        os._exit(exc.exit_code)
    """
)


@pytest.mark.parametrize("sig", ["TERM", "INT"])
def test_a_signal_is_honoured_within_seconds_even_inside_a_cpp_wait(tmp_path: Path, sig: str) -> None:
    import signal
    import time

    from tests.helpers.procfs import session_processes

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {**os.environ, "TMPDIR": str(scratch), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", STUCK],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        assert [p.name for p in scratch.iterdir() if p.name.startswith("gpudiag-ranks-")]
        sent = time.monotonic()
        proc.send_signal(getattr(signal, "SIG" + sig))
        _, err = proc.communicate(timeout=120)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 128 + getattr(signal, "SIG" + sig), err
    assert took < within(idle_s=1.5), took  # (measured 0.44 s at load 7; the wait is 120 s)
    assert err.strip().splitlines()[-1] == f"gpudiag: interrupted by SIG{sig}; stopped", err
    assert [p.name for p in scratch.iterdir()] == []
    assert session_processes(proc.pid) == [], "rank processes left behind"


def test_the_sweep_summary_escapes_what_a_node_said_about_itself() -> None:
    """Issue 44: a node's host name and check headlines are whatever it reported; a
    terminal escape in them is written escaped in SUMMARY.md and the terminal's summary."""
    from gpudiag.repro.sweep.judge import judge
    from gpudiag.repro.sweep.results import summary_markdown, summary_text

    hostile = "\x1b[2J\x1b]52;c;ZXZpbA==\x07\u202e"
    bad = node(1, host=f"node1{hostile}", topology_digest="other")
    records = [node(0), bad, node(2)]
    verdict = judge(records)
    for text in (
        summary_markdown(verdict, records, {"command": ["gpudiag", "sweep", hostile]}),
        summary_text(verdict),
    ):
        assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text, repr(text)
        assert "node1\\x1b[2J" in text


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_results_jsonl_that_is_a_fifo_or_a_device_is_refused_unread(tmp_path: Path, kind: str) -> None:
    """Issue 44: read_results opened results.jsonl as it was (the folder's check came
    before, so a file swapped in meanwhile, or a path given directly, was read): a FIFO
    blocked for ever, /dev/zero (no newline) was one line growing without bound. In a
    child with a deadline."""
    source = "/dev/zero"
    if kind == "fifo":
        source = str(tmp_path / "results.jsonl")
        os.mkfifo(source)
    code = (
        "import sys\n"
        "from gpudiag.errors import InputError\n"
        "from gpudiag.repro.sweep.results import read_results\n"
        "try:\n"
        f"    read_results({source!r})\n"
        "except InputError as exc:\n"
        "    print(exc)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and "not a file; refused unread" in run.stdout, (run.stdout, run.stderr)
