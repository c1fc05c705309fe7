"""SIGINT (Ctrl-C, sent to the whole process group as a terminal does) and SIGTERM (sent
to gpudiag alone, as ``kill`` or a job scheduler does) stop every process gpudiag
started within seconds, remove its temporary files, folders and shared memory, print one
line and exit 130 / 143 — at several points of a run.

Each case runs ``gpudiag`` in a fresh interpreter (its own session and ``$TMPDIR``) with
one function wrapped to write a marker file and wait, so the signal arrives exactly at
that point: the test arranges the timing, the product code is unchanged."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers import within
from tests.helpers.procfs import session_processes

#: Runs the CLI with one pause point installed (argv: point, marker path, CLI args...).
WRAPPER = textwrap.dedent(
    """
    import os, sys, time
    point, marker = sys.argv[1], sys.argv[2]

    def pause():
        open(marker, "w").close()
        time.sleep(120)

    if point == "ranks-starting":
        import gpudiag.runtime.launch
        launch = sys.modules["gpudiag.runtime.launch"]  # (gpudiag.runtime.launch is also a function)
        real_start = launch._FreshRank.start.__func__
        def start(cls, spec):
            rank = real_start(cls, spec)
            if spec.rank == 0:
                pause()  # rank 0 is importing torch, rank 1 not started yet
            return rank
        launch._FreshRank.start = classmethod(start)
    elif point == "bundle-writing":
        import pathlib
        real_write = pathlib.Path.write_bytes
        def write_bytes(self, data):
            written = real_write(self, data)
            if ".gpudiag-" in str(self):
                pause()  # inside the staging folder, some files written
            return written
        pathlib.Path.write_bytes = write_bytes
    elif point == "convert-writing":
        real_fsync = os.fsync
        import threading
        def fsync(fd):
            if threading.current_thread() is threading.main_thread():  # (not a helper thread's)
                pause()  # the temporary output is written, not yet renamed
            return real_fsync(fd)
        os.fsync = fsync
    sys.argv = ["gpudiag", *sys.argv[3:]]
    from gpudiag.cli import main
    main()
    """
)

#: A model whose forward marks a file and sleeps: in this process or in a rank.
SLOW_MODEL = textwrap.dedent(
    """
    import os, time
    import torch
    from torch import nn

    class Slow(nn.Module):
        def __init__(self, where):
            super().__init__()
            self.where = where
            self.fc = nn.Linear(4, 3)

        def forward(self, x):
            in_rank = torch.distributed.is_available() and torch.distributed.is_initialized()
            if (self.where == "rank") == in_rank:
                open(os.environ["PAUSE_MARKER"], "w").close()
                time.sleep(120)
            return self.fc(x)

    def make(where):
        return Slow(where)
    """
)


def _shm() -> set[str]:
    shm = Path("/dev/shm")
    return {p.name for p in shm.iterdir()} if shm.is_dir() else set()


CASES = {
    # point: (how to pause, the signal, to whom, gpudiag's arguments)
    "ranks starting": ("ranks-starting", signal.SIGINT, "group", ["gradcheck", "--model", "mlp"]),
    "a step running in ranks": (
        "model",
        signal.SIGTERM,
        "gpudiag",
        ["gradcheck", "--model", "SLOW:make?where='rank'"],
    ),
    "a step running here": (
        "model",
        signal.SIGINT,
        "group",
        ["gradcheck", "--model", "SLOW:make?where='here'"],
    ),
    "a bundle being written": (
        "bundle-writing",
        signal.SIGTERM,
        "gpudiag",
        ["report", "--checks", "env", "-o", "OUT"],
    ),
    "a convert writing": ("convert-writing", signal.SIGINT, "group", ["ckpt", "convert", "IN", "OUT"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_signal_stops_everything_and_leaves_nothing_behind(case: str, tmp_path: Path) -> None:
    point, signum, target, args = CASES[case]
    work, scratch = tmp_path / "work", tmp_path / "tmp"
    work.mkdir()
    scratch.mkdir()
    model = work / "slow.py"
    model.write_text(SLOW_MODEL)
    if "IN" in args:
        import torch

        torch.save({"module.w": torch.ones(1000)}, work / "in.pt")
    args = [
        {
            "SLOW:make?where='rank'": f"{model}:make?where='rank'",
            "SLOW:make?where='here'": f"{model}:make?where='here'",
        }.get(a, a)
        for a in args
    ]
    args = [str(work / "in.pt") if a == "IN" else str(work / "out") if a == "OUT" else a for a in args]
    if args[0] == "gradcheck":
        args += ["--input-shape", "4", "--num-classes", "3", "--strategies", "single,ddp"]
    marker = tmp_path / "paused"
    env = {
        **os.environ,
        "TMPDIR": str(scratch),
        "PAUSE_MARKER": str(marker),
        "GPUDIAG_RANK_START": "subprocess" if point == "ranks-starting" else "auto",
    }
    shm_before = _shm()
    proc = subprocess.Popen(
        [sys.executable, "-c", WRAPPER, "model" if point == "model" else point, str(marker), *args],
        cwd=work,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the pause point was never reached"
            time.sleep(0.02)
        time.sleep(0.2)
        sent = time.monotonic()
        if target == "group":
            os.killpg(proc.pid, signum)
        else:
            proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 128 + signum, (proc.returncode, err)
    lines = err.strip().splitlines()  # (report prints its progress on stderr before)
    assert lines[-1] == f"gpudiag: interrupted by {signal.Signals(signum).name}; stopped", err
    assert "Traceback" not in err and sum("gpudiag:" in line for line in lines) == 1, err
    assert took < within(idle_s=2.0)  # (measured 1.5 s at load 7)
    time.sleep(0.3)  # (a process that was told to go may take a moment to disappear)
    assert session_processes(proc.pid) == [], "processes left behind"
    # (torch itself makes an empty torchinductor_<user> cache folder when an optimizer is
    # created, in any program: torch's, kept across runs by design)
    left_tmp = [p.name for p in scratch.iterdir() if not p.name.startswith("torchinductor_")]
    assert left_tmp == [], "temporary files left in $TMPDIR"
    left = sorted(p.name for p in work.iterdir())
    assert left == sorted(["slow.py", *(["in.pt"] if "in.pt" in left else [])]), left
    assert _shm() <= shm_before, "shared memory left behind"
