"""``gpudiag.watch(model, hang_timeout=…)``: the hang watchdog of ``gpudiag run`` armed from
code, live under torchrun (gloo on the CPU) — a rank that skips one all_reduce ends the job
with the verdict; a healthy job leaves no file and no thread; a recorder that is off is
refused (docs/hang.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from torch import nn

import gpudiag
from gpudiag.cli import cli
from gpudiag.errors import InputError
from tests.core.hang.test_hang_run import _port
from tests.helpers import within

WATCHED = textwrap.dedent(
    """\
    import sys
    import threading
    import torch
    import torch.distributed as dist
    import gpudiag

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    watcher = gpudiag.watch(model, hang_timeout=2, hang_dir="hang")
    x = torch.ones(4)
    for step in range(3):
        model(torch.ones(1, 4)).sum().backward()
        if rank == 1 and step == 2:
            continue  # rank 1 skips one all_reduce
        dist.all_reduce(x)
    dist.barrier()
    watcher.close()
    # one write per line: the ranks share stdout, and print writes each piece on its own
    sys.stdout.write(f"rank {rank} threads {sorted(t.name for t in threading.enumerate())}\\n")
    sys.stdout.flush()
    """
)


def _torchrun(
    tmp_path: Path, script: str, ranks: int, **env: str
) -> tuple[subprocess.CompletedProcess[str], float]:
    (tmp_path / "train.py").write_text(script)
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks)]
    argv += ["--master-port", str(_port()), "train.py"]
    start = time.monotonic()
    done = subprocess.run(
        argv,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
    )
    return done, time.monotonic() - start


def test_a_skipped_all_reduce_under_watch_ends_the_job_and_names_the_rank(tmp_path: Path) -> None:
    done, took = _torchrun(tmp_path, WATCHED, 3)
    assert done.returncode != 0 and took < within(idle_s=15.0), done.stderr[
        -3000:
    ]  # (stall + confirm + gather)
    n = next(i + 1 for i, text in enumerate(WATCHED.splitlines()) if "dist.all_reduce(x)" in text)
    barrier = next(i + 1 for i, text in enumerate(WATCHED.splitlines()) if "dist.barrier()" in text)
    said = f"while ranks 0 and 2 are in all_reduce (train.py:{n})"
    assert said in done.stderr and "gpudiag.watch: a collective stalled for over 2 s" in done.stderr, (
        done.stderr[-3000:]
    )
    assert f"rank 1 called barrier (train.py:{barrier}) as default_pg collective #" in done.stderr
    verdict = json.loads((tmp_path / "hang" / "verdict.json").read_text())
    assert verdict["verdict"] == "stuck" and verdict["culprit_ranks"] == [1]
    assert verdict["collective"]["op"] == "all_reduce" and verdict["collective"]["ranks_in"] == [0, 2]
    assert verdict["missing_ranks"] == []
    dumps = sorted(p.name for p in (tmp_path / "hang").iterdir() if p.is_file())
    assert dumps == ["fr_rank0.pkl", "fr_rank1.pkl", "fr_rank2.pkl", "verdict.json"]
    assert sorted(p.name for p in (tmp_path / "hang" / "stacks").iterdir()) == [
        f"rank{r}.json" for r in range(3)
    ]
    assert "threads" not in done.stdout  # no rank went on past the hang
    # the folder as gpudiag report bundles it, and replay's verdict from the bundle alone
    bundle = tmp_path / "bundle"
    made = CliRunner().invoke(
        cli, ["report", "--checks", "hang", "--hang", str(tmp_path / "hang"), "-o", str(bundle)]
    )
    assert made.exit_code == 1, made.output
    assert sorted(
        p.relative_to(bundle / "hang").as_posix() for p in (bundle / "hang").rglob("*") if p.is_file()
    ) == [
        "fr_rank0.json",
        "fr_rank1.json",
        "fr_rank2.json",
        "stacks/rank0.json",
        "stacks/rank1.json",
        "stacks/rank2.json",
        "verdict.json",
    ]
    check = next(c for c in json.loads((bundle / "report.json").read_text())["checks"] if c["name"] == "hang")
    assert check["config"] == {"dumps": "hang", "world_size": 3}
    for key in ("verdict", "culprit_ranks", "collective", "lines"):
        assert check["result"][key] == verdict[key], key
    replayed = CliRunner().invoke(cli, ["replay", str(bundle), "--format", "json"])
    assert replayed.exit_code == 0 and json.loads(replayed.output)["match"], replayed.output


def test_a_healthy_watched_job_leaves_no_file_and_no_thread(tmp_path: Path) -> None:
    done, _ = _torchrun(tmp_path, WATCHED.replace("rank == 1 and step == 2", "False"), 2)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.py"]
    lines = [line for line in done.stdout.splitlines() if "threads" in line]
    assert len(lines) == 2 and all("gpudiag-hang-watchdog" not in line for line in lines), lines


OFF = textwrap.dedent(
    """\
    import torch
    import torch.distributed as dist
    import gpudiag
    from gpudiag.errors import InputError

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    try:
        gpudiag.watch(model, hang_timeout=2)
    except InputError as exc:
        print("refused:", exc)
    """
)


def test_a_recorder_turned_off_before_the_group_is_refused_by_name(tmp_path: Path) -> None:
    env = {**os.environ, "TORCH_FR_BUFFER_SIZE": "0", "TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}
    script = OFF.replace("{port}", str(_port()))
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "refused:" in done.stdout and "TORCH_FR_BUFFER_SIZE" in done.stdout, done.stdout
    assert "before init_process_group" in done.stdout
    assert list(tmp_path.iterdir()) == []


def _watchdogs() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == "gpudiag-hang-watchdog"]


def test_close_stops_the_watchdog_and_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        monkeypatch.setenv(name, "2000")  # (no group here: the watchdog would set them)
    before = _watchdogs()
    watcher = gpudiag.watch(nn.Linear(3, 1), hang_timeout=30, hang_dir=tmp_path / "hang")
    assert len(_watchdogs()) == len(before) + 1
    watcher.close()
    assert _watchdogs() == before and not (tmp_path / "hang").exists()


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), float("inf"), True, "5", 10**400])
def test_a_bad_hang_timeout_is_refused(timeout: object) -> None:
    with pytest.raises(InputError, match="hang_timeout"):
        gpudiag.watch(nn.Linear(3, 1), hang_timeout=timeout)  # type: ignore[arg-type]


def test_a_hang_dir_that_links_to_nothing_is_refused(tmp_path: Path) -> None:
    """Accepted, the watchdog's ``mkdir`` failed when the job hung (FileExistsError on the
    link): every rank ended with exit 1, no dump and no verdict."""
    (tmp_path / "hang").symlink_to(tmp_path / "gone")
    with pytest.raises(InputError, match="not a folder"):
        gpudiag.watch(nn.Linear(3, 1), hang_timeout=30, hang_dir=tmp_path / "hang")
    assert not (tmp_path / "gone").exists()


@pytest.mark.parametrize("earlier", ["fr_rank2.pkl", "verdict.json", "stacks"])
def test_a_hang_dir_holding_an_earlier_runs_files_is_refused_untouched(tmp_path: Path, earlier: str) -> None:
    """The verdict would read an earlier run's dump as this job's (live, a 2-rank job's
    verdict failed: "there is a dump of rank 2") and the new dumps overwrite the old."""
    old = tmp_path / "hang"
    old.mkdir()
    if earlier == "stacks":
        (old / "stacks").mkdir()
    else:
        (old / earlier).write_bytes(b"old")
    (old / "notes.txt").write_text("kept")  # (no rank in its name: never read as a dump)
    before = {p: p.read_bytes() for p in old.rglob("*") if p.is_file()}
    threads = _watchdogs()
    with pytest.raises(InputError, match=f"holds {earlier} of an earlier run"):
        gpudiag.watch(nn.Linear(3, 1), hang_timeout=30, hang_dir=old)
    assert _watchdogs() == threads
    assert {p: p.read_bytes() for p in old.rglob("*") if p.is_file()} == before


def test_a_restarted_job_dumps_into_its_own_folder_beside_the_first_attempts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torchrun --max-restarts restarts the ranks after a hang with the same -o: refused
    there, no restart could run; read with the first attempt's, the verdict would mix them."""
    from gpudiag.hang.arm import prepare

    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        monkeypatch.setenv(name, "2000")
    (tmp_path / "hang").mkdir()
    (tmp_path / "hang" / "fr_rank0.pkl").write_bytes(b"first attempt")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert prepare(30, tmp_path / "hang").out == tmp_path / "hang" / "restart1"
    (tmp_path / "hang" / "restart1").mkdir()
    (tmp_path / "hang" / "restart1" / "verdict.json").write_text("{}")
    with pytest.raises(InputError, match=r"holds verdict\.json of an earlier run"):
        prepare(30, tmp_path / "hang")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    with pytest.raises(InputError, match=r"holds fr_rank0\.pkl of an earlier run"):
        prepare(30, tmp_path / "hang")
    assert (tmp_path / "hang" / "fr_rank0.pkl").read_bytes() == b"first attempt"


def test_gpudiag_run_refuses_a_folder_of_earlier_dumps_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("raise SystemExit(5)\n")
    (tmp_path / "hang").mkdir()
    (tmp_path / "hang" / "fr_rank0.pkl").write_bytes(b"old")
    done = CliRunner().invoke(cli, ["run", "-o", str(tmp_path / "hang"), str(tmp_path / "train.py")])
    assert done.exit_code == 2 and len(done.output.strip().splitlines()) == 1, done.output
    assert "holds fr_rank0.pkl of an earlier run" in done.output
    assert (tmp_path / "hang" / "fr_rank0.pkl").read_bytes() == b"old"


def test_hang_dir_without_hang_timeout_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="hang_dir without hang_timeout"):
        gpudiag.watch(nn.Linear(3, 1), hang_dir=tmp_path)


EXITS = textwrap.dedent(
    """\
    import torch
    import torch.distributed as dist
    import gpudiag

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    watcher = gpudiag.watch(model, hang_timeout=30)
    model(torch.ones(1, 4)).sum().backward()
    from gpudiag.hang import arm
    print("armed", len(arm._ARMED), flush=True)
    """
)


def test_a_script_that_never_closes_its_watcher_exits_cleanly(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", EXITS.replace("{port}", str(_port()))],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0 and done.stdout == "armed 1\n", done.stderr[-3000:]
    assert "Traceback" not in done.stderr and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("hang_dir", [123, b"hang", ["hang"]])
def test_a_hang_dir_that_is_no_path_is_an_input_error(hang_dir: object) -> None:
    """(Was a TypeError out of pathlib.)"""
    with pytest.raises(InputError, match=r"hang_dir=.*expected a folder's path"):
        gpudiag.watch(nn.Linear(3, 1), hang_timeout=30, hang_dir=hang_dir)  # type: ignore[arg-type]
