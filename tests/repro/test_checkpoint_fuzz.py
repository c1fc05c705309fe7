"""gpudiag ckpt on hostile and random files: bounded work, one-line errors, input untouched."""

from __future__ import annotations

import hashlib
import io
import json
import re
import signal
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import fuzz_examples, invoke

pytestmark = pytest.mark.usefixtures("no_gpu")


def dag(levels: int = 60) -> list:
    """A list of 2**levels leaves when walked as a tree; a few hundred bytes pickled."""
    node: list = []
    for _ in range(levels):
        node = [node, node]
    return node


def hashed_dag_pickle(levels: int = 60) -> bytes:
    """``{0: [T0 … T60], T60: 1}`` with ``T(i+1) = (Ti, Ti)``: hashing the key T60 walks
    2**60 tuples. Only opcodes torch's weights-only unpickler accepts."""
    out = bytearray(b"\x80\x02}K\x00])q\x00a")  # {} 0 [] () memo[0] append
    for i in range(levels):
        out += b"h%ch%c\x86q%ca" % (i, i, i + 1)  # memo[i+1] = (memo[i], memo[i]); append
    return bytes(out + b"sh%cK\x01s." % levels)  # d[0] = list; d[T60] = 1


def zipped(data_pkl: bytes, records: dict[str, bytes] | None = None) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        zf.writestr("archive/data.pkl", data_pkl)
        for name, data in (records or {}).items():
            zf.writestr(name, data)
    return buffer.getvalue()


def _hostile_files(folder: Path) -> dict[str, Path]:
    files = {}
    tree = {"model": {"w": torch.ones(2)}, "graph": dag()}
    torch.save(tree, folder / "dag-zip.pt")
    torch.save(tree, folder / "dag-legacy.pt", _use_new_zipfile_serialization=False)
    (folder / "hash-plain.pkl").write_bytes(hashed_dag_pickle())
    (folder / "hash-zip.pt").write_bytes(zipped(hashed_dag_pickle()))
    for name in ("dag-zip.pt", "dag-legacy.pt", "hash-plain.pkl", "hash-zip.pt"):
        files[name] = folder / name
    return files


@pytest.mark.parametrize("name", ["dag-zip.pt", "dag-legacy.pt", "hash-plain.pkl", "hash-zip.pt"])
@pytest.mark.parametrize("command", ["inspect", "convert"])
def test_shared_reference_bombs_end_quickly_with_exit_2(tmp_path: Path, name: str, command: str) -> None:
    path = _hostile_files(tmp_path)[name]
    assert path.stat().st_size < 4096
    args = [str(path)] + ([str(tmp_path / "out.pt")] if command == "convert" else [])
    done = subprocess.run(
        [sys.executable, "-m", "gpudiag", "ckpt", command, *args], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 2, done.stderr
    assert "too complex" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out.pt").exists()


def _colliding_int_keys(n: int) -> bytes:
    """A dict of n int keys that all hash alike (k * (2**61 - 1)): quadratic to build."""
    out = bytearray(b"\x80\x02}(")
    for k in range(1, n):
        out += b"\x8a\x0c" + (k * (2**61 - 1)).to_bytes(12, "little", signed=True) + b"N"
    return bytes(out + b"u.")


BOMBS = {
    "colliding keys": (_colliding_int_keys(5000), "same hash"),
    "list(range(1e9))": (
        b"\x80\x02c__builtin__\nlist\nc__builtin__\nrange\nJ\x00\xca\x9a\x3b\x85R\x85R.",
        "items",
    ),
    "bytearray(1e10)": (b"\x80\x02c__builtin__\nbytearray\n\x8a\x05\x00\xe4\x0bT\x02\x85R.", "items"),
    "str(list)": (b"\x80\x02c__builtin__\nstr\n]\x85R.", "str() of a container"),
    "nested lists": (b"\x80\x02" + b"]" * 20000 + b"a" * 19999 + b".", "nested more than"),
    "nested tuple key": (b"\x80\x02})" + b"\x85" * 20000 + b"Ns.", "a tuple of more than"),
    "cycle": (b"\x80\x02]q\x00h\x00a.", "holds itself"),
}


@pytest.mark.parametrize("name", list(BOMBS))
def test_pickle_bombs_are_refused_at_once(name: str) -> None:
    from gpudiag.errors import InputError
    from gpudiag.repro.checkpoint import pickles

    data, message = BOMBS[name]
    with deadline(5), pytest.raises(InputError, match=re.escape(message)):
        pickles.loads(data, name)


class Hang(BaseException):
    """Raised by the alarm: a BaseException, so no ``except Exception`` swallows it."""


@contextmanager
def deadline(seconds: float) -> Iterator[None]:
    def fire(signum: int, frame: object) -> None:
        raise Hang(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """A small real checkpoint, zip and legacy, and the pieces of the zip."""
    folder = tmp_path_factory.mktemp("real")
    base = torch.arange(6.0)
    tree = {"model": {"module.a": base, "module.b": base[2:], "module.c": torch.ones(2, 2)}, "epoch": 3}
    torch.save(tree, folder / "z.pt")
    torch.save(tree, folder / "l.pt", _use_new_zipfile_serialization=False)
    with zipfile.ZipFile(folder / "z.pt") as zf:
        parts = {i.filename: zf.read(i.filename) for i in zf.infolist()}
    return {"zip": (folder / "z.pt").read_bytes(), "legacy": (folder / "l.pt").read_bytes(), **parts}


def mutated(data: bytes, edits: list[tuple[float, int]]) -> bytes:
    out = bytearray(data)
    for where, value in edits:
        out[int(where * (len(out) - 1))] = value
    return bytes(out)


edits = st.lists(st.tuples(st.floats(0, 1), st.integers(0, 255)), min_size=1, max_size=4)
#: Pickle opcodes (with arguments) that torch checkpoints use, and a few they do not.
OPCODES = [
    *(b"]", b"}", b")", b"(", b"t", b"a", b"e", b"s", b"u", b"R", b"b", b"\x85", b"\x86", b"\x87"),
    *(b"N", b"\x88", b"K\x01", b"K\x00", b"J\xff\xff\xff\xff", b"h\x00", b"h\x01", b"q\x00", b"q\x01"),
    *(b"Q", b"X\x01\x00\x00\x00a", b"X\x07\x00\x00\x00storage", b"X\x03\x00\x00\x00cpu", b"0", b"2"),
    *(b"ctorch._utils\n_rebuild_tensor_v2\n", b"ctorch._utils\n_rebuild_parameter\n"),
    *(b"ctorch\nFloatStorage\n", b"ccollections\nOrderedDict\n", b"ctorch\nSize\n"),
    *(b"c__builtin__\nset\n", b"c__builtin__\nfrozenset\n"),
    *(b"c__builtin__\nlist\n", b"c__builtin__\nrange\n", b"c__builtin__\nstr\n", b"\x8f", b"\x90", b"\x91"),
]


@st.composite
def hostile_bytes(draw: st.DrawFn, real: dict[str, bytes]) -> bytes:
    """Random bytes, pickle-looking bytes, small zips with random or damaged pickles, real
    checkpoints (zip, legacy) with a few bytes changed, random safetensors headers."""
    kind = draw(st.sampled_from(["random", "pickle", "zip", "zip-pickle", "opcodes", "real", "safetensors"]))
    if kind == "random":
        return draw(st.binary(min_size=1, max_size=200))
    if kind == "pickle":
        return b"\x80" + draw(st.binary(max_size=200))
    pkl_name = next(n for n in real if n.endswith("data.pkl"))
    if kind == "zip":
        return zipped(b"\x80\x02" + draw(st.binary(max_size=100)))
    if kind == "opcodes":
        ops = draw(st.lists(st.sampled_from(OPCODES), max_size=40))
        return zipped(b"\x80\x02" + b"".join(ops) + b".", {"archive/data/0": b"\0" * 8})
    if kind == "zip-pickle":
        records = {n: d for n, d in real.items() if "/" in n and n != pkl_name}
        return zipped(mutated(real[pkl_name], draw(edits)), records)
    if kind == "real":
        return mutated(real[draw(st.sampled_from(["zip", "legacy"]))], draw(edits))
    header = draw(
        st.recursive(
            st.none() | st.integers(-5, 40) | st.text(max_size=5),
            lambda inner: (
                st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
            ),
            max_leaves=8,
        )
    )
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + draw(st.binary(max_size=64))


@settings(
    max_examples=fuzz_examples(150),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_random_files_never_crash_hang_or_change(
    tmp_path: Path, real: dict[str, bytes], data: st.DataObject
) -> None:
    content = data.draw(hostile_bytes(real))
    path = tmp_path / "in.pt"
    path.write_bytes(content)
    digest = hashlib.sha256(content).hexdigest()
    commands = [
        ["ckpt", "inspect", str(path)],
        ["ckpt", "convert", str(path), str(tmp_path / "o.pt"), "--force"],
        ["ckpt", "convert", str(path), str(tmp_path / "o.safetensors"), "--to", "safetensors", "--force"],
    ]
    for args in commands:
        with deadline(10):
            result = invoke(args)
        assert result.exit_code in (0, 1, 2), (args, result.output, result.exception)
        assert "internal error" not in result.output, (args, result.output)
        if result.exit_code == 2:
            assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert hashlib.sha256(path.read_bytes()).hexdigest() == digest
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert not leftovers  # no temporary file left behind


def test_pickle_limits_do_not_refuse_a_large_real_state_dict(tmp_path: Path) -> None:
    """Far below the limits: 1000 tensors, nested optimizer-like state, tied entries."""
    shared = torch.zeros(1)
    state = {f"module.block{i}.weight": shared if i % 7 == 0 else torch.zeros(1) for i in range(1000)}
    torch.save({"model": state, "opt": {"state": {i: {"m": shared} for i in range(50)}}}, tmp_path / "big.pt")
    result = invoke(["ckpt", "convert", str(tmp_path / "big.pt"), str(tmp_path / "o.pt")])
    assert result.exit_code == 0, result.output
    back = torch.load(tmp_path / "o.pt", weights_only=True)
    assert back["model"]["block7.weight"] is back["opt"]["state"][3]["m"]
    assert len(back["model"]) == 1000
