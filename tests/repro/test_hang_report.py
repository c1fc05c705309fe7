"""``gpudiag report --hang DIR``: a hang folder in the bundle (dumps as JSON, stacks,
verdict; every byte redacted) and ``gpudiag replay`` judging it again to the same verdict.
The dumps are the real gloo ones tests/data/fr/make_gloo_dumps.py made; the live folder
with stacks and a verdict, the one ``gpudiag.watch(hang_timeout=)`` writes, is bundled
in tests/test_hang_watch.py."""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpudiag.cli import cli
from gpudiag.hang import bundled
from tests.helpers import FR

GLOO = FR / "gloo"
#: The verdict's fields replay compares (checks/builtin.py _compare_hang).
VERDICT = ("verdict", "culprit_ranks", "stuck_ranks", "missing_ranks", "collective", "lines")


def report(folder: Path, out: Path, *more: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    args = ["report", "--checks", "hang", "--hang", str(folder), "-o", str(out), "--format", "json", *more]
    done = CliRunner().invoke(cli, args, env=env)
    return done.exit_code, done.output


def hang_json(folder: Path) -> dict:
    done = CliRunner().invoke(cli, ["hang", str(folder), "--format", "json"])
    return json.loads(done.output)


def replay(bundle: Path) -> tuple[int, dict]:
    done = CliRunner().invoke(cli, ["replay", str(bundle), "--format", "json"])
    return done.exit_code, json.loads(done.output) if done.output.startswith("{") else {"output": done.output}


def files_of(bundle: Path) -> dict[str, bytes]:
    if bundle.is_dir():
        return {p.relative_to(bundle).as_posix(): p.read_bytes() for p in bundle.rglob("*") if p.is_file()}
    with zipfile.ZipFile(bundle) as archive:
        return {name: archive.read(name) for name in archive.namelist()}


def hang_check(bundle: Path) -> dict:
    document = json.loads(files_of(bundle)["report.json"])
    return next(c for c in document["checks"] if c["name"] == "hang")


@pytest.mark.parametrize("scenario", ["skip", "dead", "subgroup"])
def test_a_bundled_hang_folder_replays_to_the_same_verdict(scenario: str, tmp_path: Path) -> None:
    folder = GLOO / scenario / "pickle"
    code, _ = report(folder, tmp_path / "bundle")
    assert code == 1  # the hang check fails
    files = files_of(tmp_path / "bundle")
    dumps = sorted(n for n in files if n.startswith("hang/"))
    assert dumps == [f"hang/fr_rank{r}.json" for r in sorted(int(p.name[-1]) for p in folder.iterdir())]
    for name in dumps:  # JSON, never the pickle: the redactor can scrub text without breaking it
        assert json.loads(files[name])["entries"] and not files[name].startswith(b"\x80")
    check = hang_check(tmp_path / "bundle")
    direct = hang_json(folder)  # gpudiag hang on the original pickles
    assert check["config"] == {"dumps": "hang"}
    assert {k: check["result"][k] for k in VERDICT} == {k: direct[k] for k in VERDICT}
    code, out = replay(tmp_path / "bundle")
    assert code == 0 and out["match"], out
    (hang,) = [c for c in out["checks"] if c["name"] == "hang"]
    assert hang["compared"] and hang["match"] and hang["recorded"]["status"] == "fail"


def test_a_secret_in_the_dumps_is_redacted_and_the_zip_still_replays(tmp_path: Path) -> None:
    # the generator's file name stands in for a secret: the frames of every dump hold it
    secret = "make_gloo_dumps.py"
    code, _ = report(GLOO / "skip" / "pickle", tmp_path / "b.zip", env={"HF_TOKEN": secret})
    assert code == 1
    files = files_of(tmp_path / "b.zip")
    assert all(secret.encode() not in data for data in files.values())
    assert b"<redacted: set>" in files["hang/fr_rank0.json"]
    assert hang_check(tmp_path / "b.zip")["result"]["culprit_ranks"] == [2]
    code, out = replay(tmp_path / "b.zip")
    assert code == 0 and out["match"], out


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-be", "utf-32"])
def test_a_stacks_file_or_verdict_in_another_encoding_never_carries_a_secret_into_the_bundle(
    tmp_path: Path, encoding: str
) -> None:
    """json.loads reads UTF-16/32 bytes, which the redactor scrubbed as text: a token in a
    UTF-16 stacks file reached the bundle (its UTF-16 bytes) unredacted."""
    token = "hf_" + "A1b2C3d4E5f6G7h8I9j0KLMN"
    folder = tmp_path / "hang"
    shutil.copytree(GLOO / "skip" / "pickle", folder)
    (folder / "stacks").mkdir()
    frames = [{"filename": f"/srv/{token}/train.py", "line": 3, "name": "main"}]
    for rank in (0, 1):
        (folder / "stacks" / f"rank{rank}.json").write_bytes(
            json.dumps({"MainThread": frames, "_finished": False}).encode(encoding if rank == 0 else "utf-8")
        )
    (folder / "verdict.json").write_bytes(json.dumps({"world_size": 3, "summary": token}).encode(encoding))
    code, _ = report(folder, tmp_path / "bundle")
    assert code == 1
    files = files_of(tmp_path / "bundle")
    assert "hang/stacks/rank1.json" in files and "hang/stacks/rank0.json" not in files
    assert "hang/verdict.json" not in files
    for data in files.values():
        assert all(token.encode(e) not in data for e in ("utf-8", "utf-16-le", "utf-16-be", "utf-32-le"))


def test_a_rank_past_the_largest_job_or_a_huge_stated_world_never_reaches_the_bundle(tmp_path: Path) -> None:
    """A verdict.json stating 1,000,000 ranks made a 95 MB report.json that replay refused
    (64 MiB a file); a dump named rank 9999999 made ten million ranks."""
    folder = tmp_path / "hang"
    shutil.copytree(GLOO / "skip" / "pickle", folder)
    (folder / "verdict.json").write_text('{"world_size": 1000000}')
    code, _ = report(folder, tmp_path / "bundle")
    assert code == 1
    assert hang_check(tmp_path / "bundle")["result"]["world_size"] == 3  # (the stated size ignored)
    (folder / "nccl_trace_rank_2").rename(folder / "nccl_trace_rank_9999999")
    code, out = report(folder, tmp_path / "other")
    assert code == 2 and "rank 9999999" in out and not (tmp_path / "other").exists()


def test_a_damaged_dump_is_one_line_exit_2_and_no_bundle(tmp_path: Path) -> None:
    folder = tmp_path / "hang"
    shutil.copytree(GLOO / "skip" / "pickle", folder)
    dump = folder / "nccl_trace_rank_1"
    dump.write_bytes(dump.read_bytes()[:200])
    code, output = report(folder, tmp_path / "bundle")
    assert code == 2 and len(output.strip().splitlines()) == 1 and "nccl_trace_rank_1" in output
    assert not (tmp_path / "bundle").exists()


def test_a_folder_without_dumps_or_too_large_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "empty").mkdir()
    code, output = report(tmp_path / "empty", tmp_path / "bundle")
    assert code == 2 and "no dump files" in output
    code, output = report(tmp_path / "nope", tmp_path / "bundle")
    assert code == 2 and "not a folder" in output
    monkeypatch.setattr(bundled, "MAX_DUMP_BYTES", 1000)
    code, output = report(GLOO / "skip" / "pickle", tmp_path / "bundle")
    assert code == 2 and "too large for a report bundle" in output
    assert not (tmp_path / "bundle").exists()


def test_a_bundle_that_lost_its_dumps_is_refused_by_replay(tmp_path: Path) -> None:
    report(GLOO / "skip" / "json", tmp_path / "bundle")
    shutil.rmtree(tmp_path / "bundle" / "hang")
    code, out = replay(tmp_path / "bundle")
    assert code == 2 and "names hang/, which the bundle lacks" in out["output"]


def test_without_hang_the_check_says_what_it_needs(tmp_path: Path) -> None:
    done = CliRunner().invoke(cli, ["report", "--checks", "env,hang", "-o", str(tmp_path / "b")])
    assert done.exit_code == 0, done.output
    assert "gpudiag report --hang DIR" in hang_check(tmp_path / "b")["headline"]
    assert not any(n.startswith("hang/") for n in files_of(tmp_path / "b"))


def test_replay_given_a_machine_still_reads_the_bundles_dumps(tmp_path: Path) -> None:
    from gpudiag.checks.suite import Here
    from gpudiag.repro.bundle import read_bundle
    from gpudiag.repro.replay import replay as run_replay

    report(GLOO / "p2p" / "pickle", tmp_path / "bundle")
    here = Here(cuda_gpus=0, nvml="no NVML here (test)")
    result = run_replay(read_bundle(tmp_path / "bundle"), here)
    (hang,) = [c for c in result.checks if c.name == "hang"]
    assert result.match and hang.compared and hang.here is not None and hang.here.status == "fail"
    assert here.files == {}  # (the caller's Here is not changed)
