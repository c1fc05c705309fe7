"""gpudiag ckpt inspect|verify DIR on DCP folders written by torch itself (one process, FSDP2
and DDP jobs on gloo), healthy and with the faults made the way they happen."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpudiag.errors import InputError
from gpudiag.repro.checkpoint import dcp, dcp_read
from gpudiag.repro.checkpoint.dcp_check import _coverage_problem, strip_wrappers
from gpudiag.repro.checkpoint.dcp_metadata import Chunk, Entry, read_metadata
from gpudiag.repro.checkpoint.dcp_read import crc32_combine
from tests.helpers import fuzz_examples, invoke, json_of
from tests.repro.test_dcp_helpers import copy_of, healthy, rewrite_metadata, snapshot

HERE = Path(__file__).parent
TINY = f"{HERE / 'test_dcp_helpers.py'}:tiny"

pytestmark = pytest.mark.usefixtures("no_gpu")


@pytest.fixture(scope="session")
def made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dcp")


def codes(report: dcp.DcpReport) -> list[str]:
    return [f.code for f in report.findings]


@pytest.mark.parametrize("kind", ["single", "fsdp2-2", "fsdp2-3", "ddp"])
def test_healthy_checkpoints_verify_clean_and_load_into_the_model(made: Path, kind: str) -> None:
    folder = healthy(kind, made)
    before = snapshot(folder)
    result = invoke(["ckpt", "verify", str(folder), "--model", TINY, "--format", "json"])
    assert result.exit_code == 0, result.output
    doc = json_of(result)
    assert doc["schema"] == "gpudiag.ckpt/1" and doc["format"] == "dcp" and doc["findings"] == []
    world = int(kind.split("-")[1]) if kind.startswith("fsdp2") else 2 if kind == "ddp" else 1
    assert doc["world_size"] == world
    assert [f["rank"] for f in doc["files"]] == list(range(world)) or kind == "ddp"
    assert {g["name"] for g in doc["groups"]} >= {"model", "optim"}
    embed = next(t for t in doc["tensors"] if t["key"] == "model.embed.weight")
    assert embed["shape"] == [13, 10] and embed["dtype"] == "float32"
    assert len(embed["chunks"]) == (world if kind.startswith("fsdp2") else 1)
    assert doc["model"]["loads_strictly"] and doc["model"]["group"] == "model"
    assert doc["verified_bytes"] > 0
    assert snapshot(folder) == before  # the input is never modified


def test_missing_rank_file_is_named_with_its_rank_and_tensors(made: Path, tmp_path: Path) -> None:
    folder = copy_of(healthy("fsdp2-2", made), tmp_path / "ck")
    os.remove(folder / "__1_0.distcp")  # left on the other node's local disk
    for command in ("inspect", "verify"):
        result = invoke(["ckpt", command, str(folder)])
        assert result.exit_code == 1, result.output
        assert "error dcp-file-missing: __1_0.distcp is missing (saved by rank 1" in result.stdout
        assert "model.embed.weight" in result.stdout
    report = dcp.verify(folder)
    missing = [f for f in report.findings if f.code == "dcp-file-missing"]
    assert len(missing) == 1 and missing[0].evidence["rank"] == 1
    assert "model.layers.1.mlp.bias" in missing[0].evidence["keys"]


def test_truncated_file_names_the_file_the_size_needed_and_the_first_range_cut(
    made: Path, tmp_path: Path
) -> None:
    folder = copy_of(healthy("fsdp2-3", made), tmp_path / "ck")
    target = folder / "__2_0.distcp"
    size = target.stat().st_size
    with open(target, "r+b") as handle:
        handle.truncate(size // 2)  # a copy cut short
    report = dcp.verify(folder)
    cut = [f for f in report.findings if f.code == "dcp-file-truncated"]
    assert len(cut) == 1
    assert cut[0].evidence == {**cut[0].evidence, "file": "__2_0.distcp", "rank": 2, "bytes": size // 2}
    assert cut[0].evidence["needed"] == size
    assert f"__2_0.distcp is truncated: {size // 2} bytes, its byte ranges need {size}" in cut[0].message
    assert "first range cut: bytes " in cut[0].message
    # what is still there was read: the other ranks' files and the head of rank 2's
    assert report.verified_bytes > 0 and "dcp-chunk-damaged" not in codes(report)


def test_flipped_byte_in_values_is_found_by_verify_not_by_inspect(made: Path, tmp_path: Path) -> None:
    folder = copy_of(healthy("single", made), tmp_path / "ck")
    meta = read_metadata(folder)
    entry = next(e for e in meta.entries if e.key == "model.head.weight")
    chunk = entry.chunks[0]
    with open(folder / str(chunk.file), "r+b") as handle:
        piece = dcp_read.open_piece(handle, entry, chunk)  # where the values are
        handle.seek(piece.begin + piece.nbytes // 2)
        byte = handle.read(1)
        handle.seek(-1, 1)
        handle.write(bytes([byte[0] ^ 0x40]))
    assert dcp.inspect(folder).findings == []
    report = dcp.verify(folder)
    damaged = [f for f in report.findings if f.code == "dcp-chunk-damaged"]
    assert len(damaged) == 1, report.findings
    assert "__0_0.distcp bytes" in damaged[0].message and "CRC-32" in damaged[0].message
    assert damaged[0].evidence["key"] == "model.head.weight"


def test_crafted_metadata_is_refused_and_never_run(made: Path, tmp_path: Path) -> None:
    folder = copy_of(healthy("single", made), tmp_path / "ck")
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return (os.system, (f"touch {marker}",))

    (folder / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": Payload()}))
    for command in ("inspect", "verify"):
        result = invoke(["ckpt", command, str(folder)])
        assert result.exit_code == 2
        assert result.stdout == ""
        line = result.stderr.strip()
        assert "\n" not in line and "dcp-metadata-unsafe" in line and "system" in line
        assert "Traceback" not in result.output
    assert not marker.exists()


def test_coverage_gap_overlap_and_a_chunk_past_the_tensor_are_each_named(made: Path, tmp_path: Path) -> None:
    folder = copy_of(healthy("fsdp2-2", made), tmp_path / "ck")

    def damage(meta: object) -> None:
        md = meta.state_dict_metadata  # type: ignore[attr-defined]
        md["model.embed.weight"].chunks.pop()  # rank 1's rows gone: a gap
        attn = md["model.layers.0.attn.weight"].chunks
        attn.append(attn[0])  # rank 0's chunk listed twice: an overlap
        head = md["model.head.weight"].chunks[-1]
        head.sizes = type(head.sizes)([head.sizes[0] + 1, head.sizes[1]])  # past the end

    rewrite_metadata(folder, damage)
    report = dcp.inspect(folder)
    gaps = {f.evidence["key"]: f.message for f in report.findings if f.code == "dcp-coverage-gap"}
    assert set(gaps) == {"model.embed.weight", "model.layers.0.attn.weight", "model.head.weight"}
    assert "cover 70 of its 130 elements" in gaps["model.embed.weight"]
    assert "overlap" in gaps["model.layers.0.attn.weight"]
    assert "reaches past the tensor" in gaps["model.head.weight"]
    assert report.exit_code() == 1


def test_nonfinite_values_are_counted_per_tensor(made: Path, tmp_path: Path) -> None:
    import torch

    from tests.repro.test_dcp_helpers import save_single, tiny

    model = tiny()
    with torch.no_grad():
        model.norm.weight[3] = float("nan")
        model.layers[1].mlp.bias[0] = float("inf")
    folder = save_single(tmp_path / "ck", model, optimizer=False, step=False)
    report = dcp.verify(folder)
    (found,) = [f for f in report.findings if f.code == "nonfinite-in-checkpoint"]
    assert found.evidence["tensors"] == {"model.layers.1.mlp.bias": 1, "model.norm.weight": 1}
    assert dcp.inspect(folder).findings == []  # values are read by verify only


def test_optimizer_state_missing_for_a_parameter(made: Path, tmp_path: Path) -> None:
    folder = copy_of(healthy("fsdp2-2", made), tmp_path / "ck")

    def drop(meta: object) -> None:
        del meta.state_dict_metadata["optim.state.head.weight.exp_avg_sq"]  # type: ignore[attr-defined]

    rewrite_metadata(folder, drop)
    report = dcp.inspect(folder)
    (found,) = [f for f in report.findings if f.code == "optimizer-state-partial"]
    assert found.evidence["partial"] == {"head.weight": ["exp_avg_sq"]}
    assert "head.weight lacks exp_avg_sq" in found.message


def test_every_key_difference_against_the_model_is_listed(made: Path) -> None:
    folder = healthy("ac_compiled", made)  # AC around a compiled block: inner _orig_mod.
    report = dcp.inspect(folder, model=TINY)
    by_code = {f.code: f for f in report.findings}
    assert set(by_code) == {"key-path-wrapper", "keys-missing", "keys-unexpected"}
    assert by_code["keys-missing"].evidence["keys"] == [
        "layers.0.attn.weight",
        "layers.0.attn.bias",
        "layers.0.mlp.weight",
        "layers.0.mlp.bias",
    ]
    assert len(by_code["keys-unexpected"].evidence["keys"]) == 4
    wrapper = by_code["key-path-wrapper"]
    assert wrapper.evidence["segments"] == {"_orig_mod": 4}
    assert wrapper.evidence["examples"]["layers.0.attn.weight"] == "layers.0._orig_mod.attn.weight"
    # 4 model keys and their 12 optimizer entries (get_state_dict initialises AdamW state)
    assert report.to_json()["wrappers"] == {"_orig_mod": 16}


def test_dtype_and_shape_differences_against_the_model(made: Path) -> None:
    folder = healthy("fsdp2-2", made)
    bf16 = dcp.inspect(folder, model=f"{HERE / 'test_dcp_helpers.py'}:tiny_bf16")
    (cast,) = [f for f in bf16.findings if f.code == "dtype-cast-silent"]
    assert "float32->bfloat16" in cast.message and len(cast.evidence["tensors"]) == 12
    assert bf16.exit_code() == 1
    wide = dcp.inspect(folder, model=f"{HERE / 'test_dcp_helpers.py'}:tiny_wide_vocab")
    (shape,) = [f for f in wide.findings if f.code == "shape-mismatch"]
    assert {t["key"] for t in shape.evidence["tensors"]} == {"model.embed.weight", "model.head.weight"}
    assert {"key": "model.embed.weight", "checkpoint": [13, 10], "model": [14, 10]} in shape.evidence[
        "tensors"
    ]


@pytest.mark.parametrize(
    "setup, expected",
    [
        ("nothing", "does not exist"),
        ("file", "is not a folder"),
        ("empty", "no .metadata file"),
        ("garbage", "damaged or truncated DCP metadata"),
        ("other", "not DCP metadata as torch writes it"),
    ],
)
def test_unreadable_input_is_one_line_exit_2(tmp_path: Path, setup: str, expected: str) -> None:
    target = tmp_path / "ck"
    if setup == "file":
        target.write_bytes(b"x")
    elif setup != "nothing":
        target.mkdir()
    if setup == "garbage":
        (target / ".metadata").write_bytes(b"\x80\x04\x95garbage")
    if setup == "other":
        (target / ".metadata").write_bytes(pickle.dumps({"a": [1, 2]}))
    result = invoke(["ckpt", "verify", str(target)])
    assert result.exit_code == 2 and result.stdout == ""
    assert expected in result.stderr and result.stderr.count("\n") == 1


@settings(max_examples=fuzz_examples(60), deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_damaged_metadata_never_escapes_as_anything_but_input_error(made: Path, tmp_path: Path, data) -> None:  # type: ignore[no-untyped-def]
    source = healthy("fsdp2-2", made) / ".metadata"
    raw = bytearray(source.read_bytes())
    if data.draw(st.booleans()):
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    else:
        for _ in range(data.draw(st.integers(1, 8))):
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    folder = tmp_path / f"f{data.draw(st.integers(0, 10**9))}"
    folder.mkdir()
    (folder / ".metadata").write_bytes(bytes(raw))
    try:
        dcp.inspect(folder)
    except InputError as exc:
        assert "\n" not in str(exc)
    finally:
        shutil.rmtree(folder)


def test_report_bundles_the_inspection_never_the_tensors(made: Path, tmp_path: Path) -> None:
    folder = copy_of(healthy("fsdp2-2", made), tmp_path / "ck")
    os.remove(folder / "__1_0.distcp")
    bundle = tmp_path / "bundle"
    result = invoke(["report", "--checks", "env", "--checkpoint", str(folder), "-o", str(bundle)])
    assert result.exit_code == 0, result.output
    files = sorted(p.relative_to(bundle).as_posix() for p in bundle.rglob("*") if p.is_file())
    assert [f for f in files if f.startswith("checkpoint/")] == [
        "checkpoint/inspect.json",
        "checkpoint/inspect.txt",
    ]
    doc = json.loads((bundle / "checkpoint" / "inspect.json").read_text())
    assert doc["schema"] == "gpudiag.ckpt/1" and [f["code"] for f in doc["findings"]] == ["dcp-file-missing"]
    assert "dcp-file-missing" in (bundle / "checkpoint" / "inspect.txt").read_text()
    assert all(set(t) == {"key", "shape", "dtype", "chunks"} for t in doc["tensors"])  # no values
    assert sum((bundle / f).stat().st_size for f in files if f.startswith("checkpoint/")) < 64_000


def _grid(shape: tuple[int, ...], cuts: list[list[int]]) -> list[Chunk]:
    """The chunks of ``shape`` cut at ``cuts`` along each dimension (a DTensor placement)."""
    import itertools

    edges = [sorted({0, n, *(c for c in cs if 0 < c < n)}) for n, cs in zip(shape, cuts, strict=True)]
    spans = [list(itertools.pairwise(e)) or [(0, 0)] for e in edges]
    return [
        Chunk(tuple(a for a, _ in box), tuple(b - a for a, b in box), "__0_0.distcp")
        for box in itertools.product(*spans)
    ]


@settings(max_examples=fuzz_examples(200), deadline=None)
@given(
    shape=st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple),
    data=st.data(),
)
def test_coverage_accepts_every_tiling_and_names_a_dropped_or_repeated_chunk(shape, data) -> None:  # type: ignore[no-untyped-def]
    cuts = [data.draw(st.lists(st.integers(0, n), max_size=3)) for n in shape]
    chunks = _grid(shape, cuts)
    entry = Entry("w", ("w",), "float32", shape, chunks)
    assert _coverage_problem(entry) is None
    i = data.draw(st.integers(0, len(chunks) - 1))
    dropped = Entry("w", ("w",), "float32", shape, chunks[:i] + chunks[i + 1 :])
    problem = _coverage_problem(dropped) or ""
    assert "a gap" in problem or (len(chunks) == 1 and problem == "no chunk stores it")
    repeated = Entry("w", ("w",), "float32", shape, [*chunks, chunks[i]])
    assert "overlap" in (_coverage_problem(repeated) or "")


@settings(max_examples=fuzz_examples(200), deadline=None)
@given(a=st.binary(max_size=300), b=st.binary(max_size=3000))
def test_crc32_combine_is_the_crc_of_the_concatenation(a: bytes, b: bytes) -> None:
    import zlib

    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


@pytest.mark.parametrize(
    "key, plain",
    [
        ("layers.0._checkpoint_wrapped_module._orig_mod.attn.weight", "layers.0.attn.weight"),
        ("_orig_mod.module.fc.weight", "fc.weight"),
        ("module.encoder.module.weight", "encoder.module.weight"),  # an inner module. is a name
        ("_fsdp_wrapped_module.layers.0._fsdp_wrapped_module.w", "layers.0.w"),
        ("fc.weight", "fc.weight"),
    ],
)
def test_strip_wrappers(key: str, plain: str) -> None:
    assert strip_wrappers(key) == plain
    assert strip_wrappers(plain) == plain


def test_a_data_file_that_cannot_be_read_is_one_line_exit_2(made: Path, tmp_path: Path) -> None:
    folder = copy_of(healthy("fsdp2-2", made), tmp_path / "ck")
    os.remove(folder / "__1_0.distcp")
    (folder / "__1_0.distcp").mkdir()  # not a file: open() fails
    for args in (["ckpt", "verify", str(folder)], ["ckpt", "convert", str(folder), str(tmp_path / "o.pt")]):
        result = invoke(args)
        assert result.exit_code == 2 and result.stdout == "", result.output
        assert "cannot read" in result.stderr and "__1_0.distcp" in result.stderr
        assert result.stderr.count("\n") == 1
    assert not (tmp_path / "o.pt").exists()
