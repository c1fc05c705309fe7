"""``gpudiag run`` live under torchrun (gloo on the CPU): a rank that skips one all_reduce
ends the job with a verdict; a healthy script leaves nothing behind."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from gpudiag.cli import cli
from tests.helpers import within

SKIPS = textwrap.dedent(
    """\
    import sys
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    x = torch.ones(4)
    for step in range(3):
        if rank == 1 and step == 2:
            continue  # rank 1 skips one all_reduce
        dist.all_reduce(x)
    print("rank", rank, "argv", sys.argv[1:], flush=True)
    """
)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _torchrun(
    tmp_path: Path, script: str, ranks: int, *options: str
) -> tuple[subprocess.CompletedProcess[str], float]:
    (tmp_path / "train.py").write_text(script)
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks)]
    argv += ["--master-port", str(_port()), "-m", "gpudiag", "run", *options, "train.py", "--lr", "3"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=180, env=env)
    return done, time.monotonic() - start


def test_a_skipped_all_reduce_ends_the_job_naming_the_rank_the_collective_and_the_line(
    tmp_path: Path,
) -> None:
    done, took = _torchrun(tmp_path, SKIPS, 3, "--stall", "5", "-o", "hang")
    assert done.returncode != 0 and took < within(idle_s=15.0), done.stderr[
        -3000:
    ]  # (stall + confirm + gather)
    n = next(i + 1 for i, text in enumerate(SKIPS.splitlines()) if "dist.all_reduce(x)" in text)
    said = (
        f"rank 1 never entered default_pg collective #3 while ranks 0 and 2 are in all_reduce (train.py:{n})"
    )
    assert said in done.stderr, [
        line for line in done.stderr.splitlines() if "gpudiag" in line or "rank" in line
    ]
    assert "rank 1 argv ['--lr', '3']" in done.stdout  # sys.argv as python SCRIPT ARGS sets it
    # Nothing else said: no traceback of the collectives that failed as the job was ended
    # (the verdict names the cause; torchrun's own ChildFailedError report stays), no
    # warning about a recorder variable gpudiag set.
    assert "run_path" not in done.stderr and "Connection closed" not in done.stderr, done.stderr[-3000:]
    assert "deprecated" not in done.stderr, done.stderr[-3000:]
    verdict = json.loads((tmp_path / "hang" / "verdict.json").read_text())
    assert verdict["culprit_ranks"] == [1] and verdict["collective"]["seq"] == 3
    assert (
        verdict["missing_ranks"] == []
    )  # every rank dumped once (a rank counted twice made it analyse early)
    assert sorted(p.name for p in (tmp_path / "hang" / "stacks").iterdir()) == [
        f"rank{r}.json" for r in range(3)
    ]


RECV = textwrap.dedent(
    """\
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    x = torch.ones(4)
    for step in range(3):
        if rank == 0 and step < 2:
            dist.send(x, 1)  # rank 0 skips its third send
        elif rank == 1:
            dist.recv(x, 0)
        dist.all_reduce(x)
    """
)


def test_a_rank_waiting_in_a_recv_is_named_with_its_line(tmp_path: Path) -> None:
    # gloo records no recv: the stacks name its line, and pg_status is read by op_id (by
    # sequence number, rank 0's two sends made its pending all_reduce look completed)
    done, _ = _torchrun(tmp_path, RECV, 3, "--stall", "3", "-o", "hang")
    assert done.returncode != 0, done.stderr[-3000:]
    recv = next(i + 1 for i, text in enumerate(RECV.splitlines()) if "dist.recv(x, 0)" in text)
    assert "rank 1 never entered default_pg collective #3" in done.stderr, done.stderr[-3000:]
    assert f"its Python stack is at train.py:{recv}" in done.stderr
    verdict = json.loads((tmp_path / "hang" / "verdict.json").read_text())
    assert verdict["verdict"] == "stuck" and verdict["culprit_ranks"] == [1]
    assert [f["code"] for f in verdict["findings"]] == ["hang-never-entered", "hang-p2p-unrecorded"]


def test_a_healthy_script_exits_with_its_code_and_leaves_nothing(tmp_path: Path) -> None:
    healthy = SKIPS.replace("rank == 1 and step == 2", "False")
    done, _ = _torchrun(tmp_path, healthy, 2, "--stall", "5", "-o", "hang")
    assert done.returncode == 0, done.stderr[-3000:]
    assert not (tmp_path / "hang").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.py"]


ENDS_LATER = textwrap.dedent(
    """\
    import atexit, sys, threading, time
    atexit.register(lambda: open("atexit.done", "w").write("ran"))
    def later():
        time.sleep(0.5)
        open("thread.done", "w").write("ran")
    threading.Thread(target=later).start()
    """
)


@pytest.mark.parametrize(("last", "code"), [("", 0), ("sys.exit(3)", 3), ("raise ValueError('own')", 1)])
def test_the_scripts_threads_and_atexit_handlers_run_as_under_python(
    tmp_path: Path, last: str, code: int
) -> None:
    """``python train.py`` waits for its non-daemon threads and runs its atexit handlers;
    under ``gpudiag run`` the command line's ``os._exit`` skipped both (a background upload,
    a logger's final flush lost)."""
    (tmp_path / "train.py").write_text(ENDS_LATER + last + "\n")
    argv = [sys.executable, "-m", "gpudiag", "run", "--stall", "5", "-o", "hang", "train.py"]
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == code, done.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["atexit.done", "thread.done", "train.py"]


def test_run_options_are_no_prefix_of_torchruns_own() -> None:
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    theirs = [o for action in parser._actions for o in action.option_strings]
    ours = [o for p in cli.commands["run"].params for o in getattr(p, "opts", []) if o.startswith("-")]
    assert ours == ["--stall", "--confirm", "-o"]
    for option in ours:
        assert not [o for o in theirs if o.startswith(option)], option
    args = parser.parse_args(
        [
            "--nproc-per-node",
            "3",
            "-m",
            "gpudiag",
            "run",
            "--stall",
            "5",
            "--confirm",
            "1",
            "-o",
            "d",
            "t.py",
            "-x",
        ]
    )
    assert args.module and args.training_script == "gpudiag"
    assert args.training_script_args == ["run", "--stall", "5", "--confirm", "1", "-o", "d", "t.py", "-x"]


def test_a_missing_script_is_one_line_and_exit_2(tmp_path: Path) -> None:
    from click.testing import CliRunner

    done = CliRunner().invoke(cli, ["run", "-o", str(tmp_path / "out"), str(tmp_path / "nope.py")])
    assert (
        done.exit_code == 2 and len(done.output.strip().splitlines()) == 1 and "no such script" in done.output
    )
    assert not (tmp_path / "out").exists()
