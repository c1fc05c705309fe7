"""Issue 44: ``gpudiag report --hang DIR`` and ``gpudiag replay`` answer every value a dump
or a bundle can hold with exit 0, 1 or 2 — never an internal error, never a partial bundle.
A dump is a real gloo dump (tests/data/fr/gloo) with values hypothesis chooses put into it:
keys that are tuples, bytes, frozensets, numbers, None; lone surrogates; integers far past
what Python prints; sets, bytes, deep lists — as a pickle and as JSON. A bundle's
report.json is fuzzed the same way for replay."""

from __future__ import annotations

import json
import pickle
import zipfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpudiag.render.jsonout import TooLarge, dumps_bounded
from tests.helpers import FR, fuzz_examples, invoke

DUMPS = FR / "gloo" / "skip" / "pickle"

TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=12) | st.sampled_from(
    ["\udc80", "a\ud800b", "\x1b[2J", "", "default_pg", "0"]
)
#: Integers past what Python prints (4,300 digits): chosen by index (hypothesis cannot repr them).
HUGE = st.integers(0, 3).map(lambda i: [10**5000, -(10**5000), 2**64, 1 << 100000][i])
SCALAR = st.none() | st.booleans() | st.integers() | HUGE | st.floats() | TEXT | st.binary(max_size=8)
KEY = (
    TEXT
    | st.integers()
    | HUGE
    | st.tuples(TEXT, st.integers())
    | st.binary(max_size=6)
    | st.frozensets(st.integers(), max_size=3)
    | st.none()
    | st.floats(allow_nan=False)
)
VALUE = st.recursive(
    SCALAR,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(KEY, inner, max_size=3)
        | st.frozensets(st.integers(), max_size=3)
        | st.tuples(inner, inner)
    ),
    max_leaves=10,
)
#: Where a value goes in a real dump: a new top-level key, an entry's field, a frame's field.
WHERE = st.sampled_from(["top", "entry", "frame", "pg_config", "replace entries", "replace frames"])


def _planted(tree: dict[str, Any], where: str, key: Any, value: Any) -> dict[str, Any]:
    if where == "top":
        tree[key] = value
    elif where == "entry":
        tree["entries"][0][key] = value
    elif where == "frame":
        tree["entries"][0]["frames"][0][key] = value
    elif where == "pg_config":
        tree["pg_config"][key] = value
    elif where == "replace entries":
        tree["entries"][-1] = value
    else:
        tree["entries"][0]["frames"] = value
    return tree


def _one_line_or_bundle(done: Any, bundle: Path) -> None:
    assert "internal error" not in done.output and "Traceback" not in done.output, done.output[-2000:]
    assert done.exit_code in (0, 1, 2), (done.exit_code, done.output[-2000:])
    if done.exit_code == 2:
        assert not bundle.exists(), "refused, and no bundle"
        assert done.stderr.count("\n") == 1, done.stderr
    else:
        with zipfile.ZipFile(bundle) as archive:
            for name in archive.namelist():
                if name.endswith(".json"):
                    json.loads(archive.read(name))


@settings(
    max_examples=fuzz_examples(12),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(key=KEY, value=VALUE, where=WHERE, as_json=st.booleans())
@pytest.mark.usefixtures("no_gpu")
def test_report_hang_answers_any_dump_value(
    tmp_path_factory: Any, key: Any, value: Any, where: str, as_json: bool
) -> None:
    folder = tmp_path_factory.mktemp("hang")
    for source in sorted(DUMPS.iterdir()):
        tree = _planted(pickle.loads(source.read_bytes()), where, key, value)  # (our own test data)
        if as_json:
            try:
                data = dumps_bounded(tree, 1 << 20)
            except (TooLarge, ValueError):
                return
            (folder / source.name).write_bytes(data)
        else:
            (folder / source.name).write_bytes(pickle.dumps(tree, protocol=2))
    bundle = folder.parent / f"{folder.name}.zip"
    done = invoke(
        ["report", "--checks", "hang", "--hang", str(folder), "-o", str(bundle), "--format", "json"]
    )
    _one_line_or_bundle(done, bundle)
    if done.exit_code != 2:
        json.loads(done.stdout)
        replayed = invoke(["replay", str(bundle), "--format", "json"])
        assert replayed.exit_code in (0, 1, 2) and "internal error" not in replayed.output, replayed.output[
            -2000:
        ]


JSON_VALUE = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=8,
)
REPORT_PATH = st.sampled_from(
    [
        ("env",),
        ("checks", 0),
        ("checks", 0, "config"),
        ("checks", 0, "config", "dumps"),
        ("checks", 0, "config", "world_size"),
        ("checks", 0, "result"),
        ("checks", 0, "findings"),
        ("checks", 0, "status"),
        ("checks", 0, "name"),
        ("here",),
        ("schema",),
        ("files",),
    ]
)


@settings(
    max_examples=fuzz_examples(12),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(path=REPORT_PATH, value=JSON_VALUE)
@pytest.mark.usefixtures("no_gpu")
def test_replay_answers_any_json_in_a_bundle(
    tmp_path_factory: Any, path: tuple[Any, ...], value: Any
) -> None:
    folder = tmp_path_factory.mktemp("bundle")
    made = invoke(
        ["report", "--checks", "hang", "--hang", str(DUMPS), "-o", str(folder / "b"), "--format", "json"]
    )
    assert made.exit_code == 1, made.output
    report = folder / "b" / "report.json"
    document = json.loads(report.read_text())
    target = document
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value
    report.write_text(json.dumps(document))
    for fmt in ("json", "text", "markdown"):
        done = invoke(["replay", str(folder / "b"), "--format", fmt])
        assert done.exit_code in (0, 1, 2, 3), (done.exit_code, done.output[-2000:])
        assert "internal error" not in done.output and "Traceback" not in done.output, done.output[-2000:]


@pytest.mark.usefixtures("no_gpu")
@pytest.mark.parametrize("fmt", ["text", "json"])
def test_a_log_whose_name_cannot_be_encoded_still_makes_a_whole_bundle(tmp_path: Path, fmt: str) -> None:
    from tests.helpers.nccl_logs import LOG

    log = tmp_path / "rank\udcff\x1b.log"  # (a file name with a byte that is not UTF-8)
    log.write_bytes(LOG.read_bytes())
    for out in (tmp_path / "b.zip", tmp_path / "b"):
        done = invoke(
            ["report", "--checks", "transport", "--nccl-log", str(log), "-o", str(out), "--format", fmt]
        )
        assert done.exit_code in (0, 1), done.output[-2000:]
        assert "internal error" not in done.output
        names = zipfile.ZipFile(out).namelist() if out.suffix else [p.name for p in out.rglob("*")]
        assert any("rank" in n for n in names) and "report.json" in names, names


@pytest.mark.usefixtures("no_gpu")
def test_report_refuses_a_device_or_a_fifo_given_as_a_log_unread(tmp_path: Path) -> None:
    """Issue 44: ``--nccl-log /dev/zero`` was read up to its bound (256 MiB) before it was
    refused; docs/security.md promises devices and FIFOs refused unread."""
    import os

    fifo = tmp_path / "log.fifo"
    os.mkfifo(fifo)  # (opened without blocking: a reader that waited would hang here)
    for source, kind in (("/dev/zero", "a device"), (str(fifo), "a FIFO")):
        done = invoke(
            ["report", "--checks", "transport", "--nccl-log", source, "-o", str(tmp_path / "b.zip")]
        )
        assert done.exit_code == 2 and f"{kind}, not a file; refused unread" in done.stderr, done.output
        assert not (tmp_path / "b.zip").exists()
