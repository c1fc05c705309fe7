"""``gpudiag run`` inside and around the user's job, live under torchrun (gloo on the CPU):
the script behaves as under plain torchrun (its signal handlers, ``KeyboardInterrupt``,
excepthook, open files), a slow rank is not a hung one, a send/recv deadlock and an early
return are named, a rank that holds the GIL is said to be alive, a hung script's children
end with it and ``-o`` is never written through a planted link (docs/hang.md)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.core.hang.test_hang_run import _port
from tests.helpers import within


def _job(
    tmp_path: Path, script: str, ranks: int, *options: str, gpudiag: bool = True
) -> tuple[subprocess.CompletedProcess[str], float]:
    """``torchrun --nproc-per-node RANKS [-m gpudiag run OPTIONS] train.py`` in ``tmp_path``."""
    (tmp_path / "train.py").write_text(script)
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks)]
    argv += ["--master-port", str(_port())]
    argv += ["-m", "gpudiag", "run", *options, "train.py"] if gpudiag else ["train.py"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=240, env=env)
    return done, time.monotonic() - start


def _line(script: str, text: str) -> int:
    return next(i + 1 for i, line in enumerate(script.splitlines()) if text in line)


SAVES = textwrap.dedent(
    """\
    import os, signal, sys, time
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    log = open(f"log{rank}.csv", "w")  # a logger's file, never closed: Python flushes it at exit
    for step in range(40):
        log.write(f"{step},{step * 0.5},train\\n")

    def preempted(signum, frame):  # a preemption checkpoint that takes longer than 5 s
        time.sleep(6)
        torch.save({"w": torch.arange(1000)}, f"term{rank}.pt")

    signal.signal(signal.SIGTERM, preempted)
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(30)
    except KeyboardInterrupt:
        torch.save({"w": torch.arange(1000)}, f"int{rank}.pt")
    os.kill(os.getpid(), signal.SIGTERM)
    dist.barrier()
    dist.destroy_process_group()
    """
)


def _files(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.name != "train.py"}


def test_the_scripts_signal_handlers_and_open_files_behave_as_under_plain_torchrun(tmp_path: Path) -> None:
    """Before: SIGINT arrived as gpudiag's own exception (no ``except KeyboardInterrupt``),
    SIGTERM's handler was killed 5 s in, and the CSV was left empty by ``os._exit``."""
    plain, watched = tmp_path / "plain", tmp_path / "watched"
    plain.mkdir(), watched.mkdir()
    base, _ = _job(plain, SAVES, 2, gpudiag=False)
    done, _ = _job(watched, SAVES, 2, "--stall", "60", "-o", "hang")
    assert base.returncode == 0, base.stderr[-3000:]
    assert done.returncode == 0, done.stderr[-3000:]
    expected = _files(plain)
    assert sorted(expected) == ["int0.pt", "int1.pt", "log0.csv", "log1.csv", "term0.pt", "term1.pt"]
    assert expected["log0.csv"] > 400
    assert _files(watched) == expected
    import torch

    for name in ("int0.pt", "term1.pt"):
        assert torch.load(watched / name)["w"].sum().item() == sum(range(1000))


RAISES = textwrap.dedent(
    """\
    import sys
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
    def check(value):
        raise ValueError(f"bad value {value}")
    check(3)
    """
)


@pytest.mark.parametrize("hook", ["", "sys.excepthook = lambda *a: print('own hook', a[0].__name__)\n"])
def test_an_unhandled_error_is_shown_as_python_and_torch_show_it(tmp_path: Path, hook: str) -> None:
    """torch's ``[rank0]:`` excepthook (or the script's own) gets the traceback, from the
    script's first frame: no gpudiag or runpy frame, the same bytes as ``python SCRIPT``."""
    script = RAISES.replace("{port}", str(_port())).replace("def check", hook + "def check")
    (tmp_path / "train.py").write_text(script)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = [[sys.executable, "train.py"], [sys.executable, "-m", "gpudiag", "run", "-o", "hang", "train.py"]]
    plain, watched = (
        subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
        for argv in runs
    )
    assert plain.returncode == watched.returncode == 1
    assert watched.stdout == plain.stdout and watched.stderr == plain.stderr, watched.stderr
    if not hook:
        assert '[rank0]:   File "' in watched.stderr and "gpudiag" not in watched.stderr
    assert not (tmp_path / "hang").exists()


SLOW = textwrap.dedent(
    """\
    import os, time
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    x = torch.ones(4)
    dist.all_reduce(x)
    if rank == 0:
        time.sleep(6)  # evaluates: nothing written, back before the stall is confirmed
    dist.barrier()
    if rank == 0:
        with open("ckpt.bin", "wb") as f:  # a checkpoint written for longer than stall + confirm
            for _ in range(60):
                f.write(b"w" * (1 << 20))
                f.flush()
                time.sleep(0.25)
    dist.barrier()
    os.write(1, f"rank {rank} finished\\n".encode())  # (one write: the ranks share stdout)
    """
)


def test_a_slow_rank_is_not_ended_and_the_slowness_is_said(tmp_path: Path) -> None:
    """Before: a rank writing a checkpoint for 20 s at --stall 5 was ended (exit 1, the
    checkpoint truncated); so was a rank evaluating for 12 s."""
    done, _ = _job(tmp_path, SLOW, 3, "--stall", "2", "--confirm", "8", "-o", "hang")
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "ckpt.bin").stat().st_size == 60 << 20
    assert sorted(line for line in done.stdout.splitlines() if "finished" in line) == [
        f"rank {r} finished" for r in range(3)
    ]
    sleep = _line(SLOW, "time.sleep(6)")
    writing = [_line(SLOW, text) for text in ("f.write(", "f.flush()", "time.sleep(0.25)")]
    said = [line for line in done.stderr.splitlines() if "slow, not hung" in line]
    assert any(
        "rank 0 spent" in line
        and f"outside any collective at train.py:{sleep} while the others waited in barrier #2" in line
        for line in said
    ), done.stderr[-3000:]
    assert any(
        f"at train.py:{n} while the others waited in barrier #3" in line for line in said for n in writing
    ), said
    assert not (tmp_path / "hang").exists()


DEADLOCK = textwrap.dedent(
    """\
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    x = torch.ones(4)
    dist.all_reduce(x)
    dist.recv(x, 1 - rank)  # both ranks receive first: neither ever sends
    dist.send(x, 1 - rank)
    """
)


def test_a_send_recv_deadlock_is_ended_naming_the_ranks_and_lines(tmp_path: Path) -> None:
    """Before: gloo records no p2p, nothing looked pending, and the job waited for the
    backend's 30-minute timeout."""
    done, took = _job(tmp_path, DEADLOCK, 2, "--stall", "2", "--confirm", "1", "-o", "hang")
    assert done.returncode != 0 and took < within(idle_s=15.0), done.stderr[-3000:]
    recv = _line(DEADLOCK, "dist.recv(")
    assert "a send/recv stalled for over 2 s" in done.stderr, done.stderr[-3000:]
    assert (
        "ranks 0 and 1 blocked for over 2 s in point-to-point transfers" in done.stderr
        and f"rank 0 in recv at train.py:{recv}; rank 1 in recv at train.py:{recv}" in done.stderr
    ), done.stderr[-3000:]
    verdict = json.loads((tmp_path / "hang" / "verdict.json").read_text())
    assert any("point-to-point" in said for said in verdict["live"])


EARLY = textwrap.dedent(
    """\
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    x = torch.ones(4)
    for step in range(4):
        if rank == 2 and step == 3:
            break  # rank 2 ends its loop early
        dist.all_reduce(x)
    dist.destroy_process_group()
    """
)


def test_a_rank_that_returns_after_destroy_process_group_is_named(tmp_path: Path) -> None:
    """Before: no dump, no verdict, only gloo's "Connection closed by peer"."""
    done, _ = _job(tmp_path, EARLY, 3, "--stall", "5", "-o", "hang")
    assert done.returncode != 0, done.stderr[-3000:]
    line = _line(EARLY, "dist.all_reduce(x)")
    said = (
        "rank 2 reached the end of the script after collective #3; "
        f"ranks 0 and 1 entered all_reduce #4 at train.py:{line}"
    )
    assert said in done.stderr, done.stderr[-3000:]
    assert done.stderr.count("reached the end of the script") == 1


GIL = textwrap.dedent(
    """\
    import ctypes
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    x = torch.ones(4)
    dist.all_reduce(x)
    if rank == 1:
        ctypes.PyDLL(None).sleep(120)  # native code holding the GIL: no Python thread runs
    dist.all_reduce(x)
    """
)


def test_a_rank_holding_the_gil_is_said_alive_not_dead(tmp_path: Path) -> None:
    done, took = _job(tmp_path, GIL, 2, "--stall", "2", "--confirm", "1", "-o", "hang")
    assert done.returncode != 0 and took < within(idle_s=15.0), done.stderr[-3000:]
    assert "rank 1 is alive but not answering (pid " in done.stderr, done.stderr[-3000:]
    assert "rank 1 is gone" not in done.stderr


CHILDREN = textwrap.dedent(
    """\
    import os, subprocess
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    child = subprocess.Popen(["sleep", "300"])
    orphan = subprocess.Popen(["sh", "-c", "sleep 300 & echo $!"], stdout=subprocess.PIPE, text=True)
    grandchild = int(orphan.stdout.readline())
    open(f"pids{rank}", "w").write(f"{child.pid} {grandchild}")
    x = torch.ones(4)
    for step in range(2):
        if rank == 1 and step == 1:
            continue  # rank 1 skips one all_reduce and waits in the barrier
        dist.all_reduce(x)
    dist.barrier()
    """
)


def test_a_hung_jobs_children_end_with_it_and_a_planted_link_is_not_written_through(tmp_path: Path) -> None:
    """Before: 11 children of a hung script kept running, and a dangling link planted in
    -o was written through to a file outside the folder."""
    (tmp_path / "hang").mkdir()
    (tmp_path / "hang" / "fr_rank0.pkl").symlink_to(tmp_path / "elsewhere.pkl")
    done, _ = _job(tmp_path, CHILDREN, 3, "--stall", "2", "--confirm", "1", "-o", "hang")
    assert done.returncode != 0 and "rank 1 called barrier" in done.stderr, done.stderr[-3000:]
    pids = [int(p) for r in range(3) for p in (tmp_path / f"pids{r}").read_text().split()]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    assert [p for p in pids if _alive(p)] == []
    assert not (tmp_path / "elsewhere.pkl").exists()
    link = tmp_path / "hang" / "fr_rank0.pkl"
    assert not link.is_symlink() and link.stat().st_size > 0
    assert not [p.name for p in (tmp_path / "hang").iterdir() if p.name.startswith(".")]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state not in "ZX"


def test_a_folder_it_cannot_write_is_said_before_the_script_runs(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("open('ran', 'w').write('yes')\n")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    immutable = os.geteuid() == 0
    if immutable and subprocess.run(["chattr", "+i", str(locked)], capture_output=True).returncode != 0:
        pytest.skip("root here, and no chattr to make a folder it cannot write")
    try:
        argv = [sys.executable, "-m", "gpudiag", "run", "-o", "locked/hang", "train.py"]
        done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(locked)], check=True)
        locked.chmod(0o755)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("gpudiag: error: locked/hang: cannot write in locked")
    assert len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "ran").exists() and list(locked.iterdir()) == []


def test_sigterm_to_a_rank_is_the_scripts_to_handle(tmp_path: Path) -> None:
    """No gpudiag handler: a SIGTERM from outside (torchrun, a scheduler) ends a script
    without a handler as it ends under python, by the signal."""
    (tmp_path / "train.py").write_text("import time\nopen('started', 'w').close()\ntime.sleep(60)\n")
    argv = [sys.executable, "-m", "gpudiag", "run", "-o", "hang", "train.py"]
    proc = subprocess.Popen(argv, cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 100
    while not (tmp_path / "started").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM and "gpudiag" not in err, err
