"""The parts of ``gpudiag run``'s live side, alone: the dump folder written only through
real folders, a rank's descendants ended, written bytes read, the confirmation window and
the live sentences (docs/hang.md)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpudiag.errors import InputError
from gpudiag.hang import live, outdir, procs
from gpudiag.hang.live import Op, State
from gpudiag.hang.watchdog import confirm_window


def test_a_link_planted_in_the_folder_is_replaced_not_written_through(tmp_path: Path) -> None:
    out = tmp_path / "hang"
    out.mkdir()
    (out / "fr_rank0.pkl").symlink_to(tmp_path / "outside.pkl")
    with outdir.Folder(out) as folder:
        folder.write("fr_rank0.pkl", b"dump")
    assert not (tmp_path / "outside.pkl").exists()
    assert not (out / "fr_rank0.pkl").is_symlink() and (out / "fr_rank0.pkl").read_bytes() == b"dump"
    assert sorted(p.name for p in out.iterdir()) == ["fr_rank0.pkl"]  # (no temporary file left)


def test_a_stacks_folder_that_is_a_link_is_never_entered(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    out = tmp_path / "hang"
    out.mkdir()
    (out / "stacks").symlink_to(tmp_path / "elsewhere")
    with outdir.Folder(out) as folder, pytest.raises(OSError):
        folder.sub("stacks")
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_the_folder_is_made_when_the_dumps_are_written(tmp_path: Path) -> None:
    out = tmp_path / "a" / "b"
    assert outdir.check(out) == out and not (tmp_path / "a").exists()  # (checked, not made)
    with outdir.Folder(out) as folder, folder.sub("stacks") as stacks:
        stacks.write("rank0.json", b"{}")
    assert (out / "stacks" / "rank0.json").read_bytes() == b"{}"


def test_a_folder_under_a_file_is_refused_at_start(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(InputError, match="is not a folder"):
        outdir.check(tmp_path / "file" / "hang")
    assert list(tmp_path.iterdir()) == [tmp_path / "file"]


def test_a_link_to_a_folder_is_resolved_once(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert outdir.check(tmp_path / "link") == (tmp_path / "real").resolve()


def test_descendants_include_a_double_forked_orphan_of_the_session(tmp_path: Path) -> None:
    """A rank under torchrun leads its session: a grandchild whose parent ended is still found."""
    script = (
        "import os, subprocess, sys, time\n"
        "os.setsid()\n"
        "from gpudiag.hang import procs\n"
        "child = subprocess.Popen(['sleep', '60'])\n"
        "sh = subprocess.Popen(['sh', '-c', 'sleep 60 & echo $!'], stdout=subprocess.PIPE, text=True)\n"
        "orphan = int(sh.stdout.readline()); sh.wait()\n"
        "found = procs.descendants()\n"
        "print(child.pid in found, orphan in found)\n"
        "ended = procs.end_descendants(grace_s=5)\n"
        "child.wait(timeout=10)\n"
        "deadline = time.monotonic() + 10\n"
        "while procs.alive(orphan) and time.monotonic() < deadline: time.sleep(0.05)\n"
        "print(procs.alive(child.pid), procs.alive(orphan))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True", "False", "False"]


def test_written_bytes_grow_as_a_file_is_written(tmp_path: Path) -> None:
    before = procs.written_bytes([os.getpid()])
    if before is None:
        pytest.skip("no /proc/PID/io here")
    with open(tmp_path / "ckpt", "wb") as f:
        f.write(b"w" * (4 << 20))
        f.flush()
    after = procs.written_bytes([os.getpid()])
    assert after is not None and after - before >= 4 << 20
    assert procs.alive(os.getpid()) and not procs.alive(2**22 + 7)


@pytest.mark.parametrize(("stall", "window"), [(1, 10), (5, 10), (20, 10), (60, 30), (600, 300)])
def test_the_confirmation_window(stall: float, window: float) -> None:
    assert confirm_window(stall) == window


def test_the_sentences() -> None:
    barrier = Op("collective", "barrier", "default_pg", 2, time.time(), "job.py:30")
    assert live.slow(barrier, 12.2, {0: "job.py:26"}) == (
        "slow, not hung: rank 0 spent 12 s outside any collective at job.py:26 "
        "while the others waited in barrier #2 at job.py:30"
    )
    assert live.slow(barrier, 12.2, {}) == "slow, not hung: barrier #2 at job.py:30 completed after 12 s"
    seven = Op("collective", "all_reduce", "default_pg", 7, 0.0, "job.py:26")
    assert live.early_end([2], {0: seven, 1: seven}) == (
        "rank 2 reached the end of the script after collective #6; "
        "ranks 0 and 1 entered all_reduce #7 at job.py:26"
    )
    recv = State("p2p", Op("p2p", "recv", line="job.py:8"))
    assert live.blocked({0: recv, 1: recv, 2: State("outside")}, 5) == (
        "ranks 0 and 1 blocked for over 5 s in point-to-point transfers (gloo's flight recorder lists no "
        "send/recv; from their stacks): rank 0 in recv at job.py:8; rank 1 in recv at job.py:8"
    )
    assert live.blocked({0: State("outside")}, 5) is None
    assert "alive but not answering (pid 12)" in live.not_answering(1, 12, "h", "h", True)
    assert live.not_answering(1, 12, "h", "h", False) == "rank 1 is gone (pid 12 has ended)"


def test_a_state_survives_the_store() -> None:
    state = State(
        "collective", Op("collective", "all_reduce", "default_pg", 3, 1.5, "t.py:4"), "t.py:4", 10, 7, "h"
    )
    assert State.decode(state.encode()) == state
    assert State.decode(b"{not json") is None and State.decode(b'{"where": 1, "bogus": 2}') is None


def test_the_users_line_skips_the_standard_library_and_packages() -> None:
    import json as stdlib_json

    from gpudiag.hang.reader import Frame

    frames = (
        Frame(stdlib_json.__file__, 10, "dumps"),
        Frame(procs.__file__, 20, "written_bytes"),
        Frame("/home/me/job.py", 26, "save"),
        Frame("/home/me/job.py", 40, "<module>"),
    )
    assert live.user_line(frames) == "job.py:26"
