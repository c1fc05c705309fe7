"""gpudiag writes only regular files and folders it created: what every output option
refuses (FIFOs, sockets, device nodes, symbolic links, a user's folder, the current
folder), and the temporaries a killed run leaves, removed by the next run."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpudiag.fileio import atomic_write, remove_stale_temporaries, temporary_prefix
from tests.helpers import TOPO, invoke


def run(*args: str) -> tuple[int, str]:
    result = invoke(list(args))
    assert "Traceback" not in result.output and "internal error" not in result.output, result.output
    return result.exit_code, result.output


@pytest.fixture
def capture_file() -> str:
    return str(TOPO / "seed_8gpu_nv4_pairs_node_sys.txt")


@pytest.fixture(params=["fifo", "socket", "symlink", "dangling symlink", "device node"])
def special(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A path that is not a regular file, and the words the refusal uses for it."""
    path = tmp_path / "target"
    kind = request.param
    if kind == "fifo":
        os.mkfifo(path)
        yield path, "FIFO"
    elif kind == "socket":
        with socket.socket(socket.AF_UNIX) as sock:
            sock.bind(str(path))
            yield path, "socket"
    elif kind in ("symlink", "dangling symlink"):
        aim = tmp_path / "aim.json"
        if kind == "symlink":
            aim.write_text("precious")
        path.symlink_to(aim)
        yield path, "symbolic link"
        assert aim.read_text() == "precious" if kind == "symlink" else not aim.exists()
    else:
        try:
            os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 3))  # what /dev/null is
        except PermissionError:
            pytest.skip("creating a device node needs root")
        yield path, "device node"


def _same_kind(path: Path, before: os.stat_result) -> bool:
    after = os.lstat(path)
    return stat.S_IFMT(after.st_mode) == stat.S_IFMT(before.st_mode) and after.st_ino == before.st_ino


@pytest.mark.parametrize("force", [False, True])
def test_output_options_refuse_what_is_not_a_regular_file(
    special: tuple[Path, str], force: bool, capture_file: str, tmp_path: Path
) -> None:
    path, words = special
    before = os.lstat(path)
    extra = ["--force"] if force else []
    for args in (
        ["topology", "--from-file", capture_file, "--save-machine", str(path), *extra],
        ["gradcheck", "--model", "mlp", "--input-shape", "4", "--strategies", "single", "--trace", str(path)],
        ["report", "--checks", "env", "-o", f"{path}", *extra],
    ):
        code, output = run(*args)
        assert code == 2 and words in output, (args, output)
        assert _same_kind(path, before)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("aim")) == ["target"]


def test_checkpoint_convert_refuses_a_fifo_even_with_force(tmp_path: Path) -> None:
    import torch

    source = tmp_path / "in.pt"
    torch.save({"module.w": torch.ones(2)}, source)
    fifo = tmp_path / "out.pt"
    os.mkfifo(fifo)
    code, output = run("ckpt", "convert", str(source), str(fifo), "--force")
    assert code == 2 and "FIFO" in output
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.pt", "out.pt"]


def test_force_replaces_an_earlier_bundle_but_not_a_users_folder(tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text("mine")
    code, output = run("report", "--checks", "env", "-o", str(project), "--force")
    assert code == 2 and "not a gpudiag bundle" in output
    assert sorted(p.name for p in project.iterdir()) == ["train.py"]
    # a folder with a report.json that is not gpudiag's is not a bundle either
    (project / "report.json").write_text('{"schema": "someone-else/1"}')
    code, output = run("report", "--checks", "env", "-o", str(project), "--force")
    assert code == 2 and "not a gpudiag bundle" in output

    bundle = tmp_path / "bundle"
    assert run("report", "--checks", "env", "-o", str(bundle))[0] == 0
    (bundle / "stale.txt").write_text("from the earlier bundle")
    assert run("report", "--checks", "env", "-o", str(bundle), "--force")[0] == 0
    assert (bundle / "report.json").exists() and not (bundle / "stale.txt").exists()
    zipped = tmp_path / "b.zip"
    assert run("report", "--checks", "env", "-o", str(zipped))[0] == 0
    assert run("report", "--checks", "env", "-o", str(zipped), "--force")[0] == 0
    (tmp_path / "other.zip").write_bytes(b"PK\x05\x06" + bytes(18))  # an empty zip, not a bundle
    code, output = run("report", "--checks", "env", "-o", str(tmp_path / "other.zip"), "--force")
    assert code == 2 and "not a gpudiag bundle" in output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.zip", "bundle", "other.zip", "project"]


@pytest.mark.parametrize("where", [".", "..", "parent"])
def test_force_never_replaces_the_current_folder_or_a_parent(
    where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "report.json").write_text('{"schema": "gpudiag.report/1", "checks": []}')  # looks like a bundle
    monkeypatch.chdir(work)
    target = {".": ".", "..": "..", "parent": str(tmp_path)}[where]
    code, output = run("report", "--checks", "env", "-o", target, "--force")
    assert code == 2, output
    assert sorted(p.name for p in work.iterdir()) == ["report.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"]  # no ..XXXX.old/ left


def test_a_stale_temporary_of_a_killed_run_is_removed_by_the_next(tmp_path: Path) -> None:
    target = tmp_path / "machine.json"
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(dead.stdout)
    stale_file = tmp_path / f".machine.json.gpudiag-{dead_pid}-abc123.tmp"
    stale_file.write_bytes(b"half a file")
    stale_folder = tmp_path / f".machine.json.gpudiag-{dead_pid}-def456.tmp"
    stale_folder.mkdir()
    (stale_folder / "x").write_text("staged")
    live = tmp_path / f".machine.json.gpudiag-{os.getppid()}-ghi789.tmp"  # a running process's
    live.write_bytes(b"in progress")
    mine = tmp_path / f"{temporary_prefix(target)}jkl.tmp"
    mine.write_bytes(b"mine")
    other = tmp_path / ".machine.json.notgpudiag.tmp"
    other.write_bytes(b"someone else's")
    atomic_write(target, "{}")
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted(["machine.json", live.name, mine.name, other.name])
    assert remove_stale_temporaries(target) == []


def test_a_failed_write_leaves_no_temporary(tmp_path: Path) -> None:
    from gpudiag.fileio import atomic_output

    target = tmp_path / "out.bin"
    with pytest.raises(KeyboardInterrupt), atomic_output(target) as out:
        out.write(b"partial")
        raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []


def test_doctor_writes_a_bundle_only_when_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 47: every doctor run left a report folder in the current directory."""
    monkeypatch.chdir(tmp_path)
    for args in ([], ["--no-bundle"]):  # (--no-bundle, the old way to ask for nothing, still taken)
        code, output = run("doctor", *args, "--checks", "env")
        assert code == 0 and "env" in output and "Bundle:" not in output
        assert list(tmp_path.iterdir()) == []
    code, output = run("doctor", "--checks", "env", "-o", "asked")
    assert code == 0 and "Bundle: asked" in output and (tmp_path / "asked" / "report.json").is_file()
    code, output = run("report", "--checks", "env")  # (report's whole job is the bundle)
    assert code == 0 and [p.name for p in tmp_path.iterdir() if p.name.startswith("gpudiag-report-")]
    code, output = run("doctor", "--no-bundle", "-o", "x")
    assert code == 2 and "contradict" in output


@pytest.mark.usefixtures("no_gpu")
def test_doctor_on_this_torch_finds_nothing_wrong_with_a_healthy_model() -> None:
    """Issue 52: on torch 2.6 doctor warned ``numerics-changed`` from its own settings
    reader; ``make test-floor`` runs this on the floor torch, ``make test`` on the newest."""
    result = invoke(["doctor", "--checks", "env,gradcheck", "--format", "json"])
    assert result.exit_code == 0, result.output
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert checks["gradcheck"]["status"] == "pass", checks["gradcheck"]
    assert "numerics-changed" not in result.stdout


@pytest.fixture(params=[0o022, 0o027], ids=["umask-022", "umask-027"])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    """An explicit umask for the test, the old one restored after."""
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_outputs_follow_the_umask_as_torch_save_does(umask: int, capture_file: str, tmp_path: Path) -> None:
    """A converted checkpoint, a machine file, a bundle's zip and a bundle folder get
    0666 (a folder 0777) less the umask — torch.save's 0644 under 0022, not
    mkstemp's 0600; a file replaced with --force too."""
    import torch

    torch.save({"module.w": torch.ones(2)}, tmp_path / "in.pt")
    file_mode, folder_mode = 0o666 & ~umask, 0o777 & ~umask
    assert _mode(tmp_path / "in.pt") == file_mode  # what torch.save gives
    (tmp_path / "out.pt").write_bytes(b"old")
    (tmp_path / "out.pt").chmod(0o600)  # --force: the umask, not the old file's mode
    assert run("ckpt", "convert", str(tmp_path / "in.pt"), str(tmp_path / "out.pt"), "--force")[0] == 0
    machine = tmp_path / "machine.json"
    assert run("topology", "--from-file", capture_file, "--save-machine", str(machine))[0] == 0
    assert run("report", "--checks", "env", "-o", str(tmp_path / "b.zip"))[0] == 0
    assert run("report", "--checks", "env", "-o", str(tmp_path / "bundle"))[0] == 0
    for path in ("out.pt", "machine.json", "b.zip", "bundle/report.json"):
        assert _mode(tmp_path / path) == file_mode, (path, oct(_mode(tmp_path / path)))
    assert _mode(tmp_path / "bundle") == folder_mode
