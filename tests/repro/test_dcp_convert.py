"""gpudiag ckpt convert DIR: the result bitwise equal to torch's own dcp_to_torch_save, on
checkpoints written by torch (one process, FSDP2 over 2 and 3 ranks, DDP, column-sharded
DTensors); wrappers peeled; damaged folders refused without a partial output."""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpudiag.repro.checkpoint import dcp_read
from gpudiag.repro.checkpoint.dcp_convert import convert
from gpudiag.repro.checkpoint.dcp_metadata import read_metadata
from tests.helpers import fuzz_examples, invoke
from tests.repro.test_dcp_helpers import copy_of, healthy, snapshot, tiny

pytestmark = pytest.mark.usefixtures("no_gpu")


@pytest.fixture(scope="session")
def made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dcp")


def torch_converted(folder: Path, out: Path) -> Any:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(folder, out)
    return torch.load(out, weights_only=False)


def assert_bitwise_equal(a: Any, b: Any, where: str = "") -> None:
    """Same containers, keys in the same order, tensors of the same dtype, shape, strides
    and bytes, other values equal and of the same type."""
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.stride()) == (b.dtype, b.shape, b.stride()), where
        assert a.reshape(-1).view(torch.uint8).tolist() == b.reshape(-1).view(torch.uint8).tolist(), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            assert_bitwise_equal(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_bitwise_equal(x, y, f"{where}/{i}")
    else:
        assert a == b, where


@pytest.mark.parametrize("kind", ["single", "fsdp2-2", "fsdp2-3", "ddp", "colwise", "edge"])
def test_convert_is_bitwise_equal_to_torch_dcp_to_torch_save(made: Path, tmp_path: Path, kind: str) -> None:
    folder = healthy(kind, made)
    before = snapshot(folder)
    theirs = torch_converted(folder, tmp_path / "theirs.pt")
    result = invoke(["ckpt", "convert", str(folder), str(tmp_path / "ours.pt"), "--keys", "keep"])
    assert result.exit_code == 0, result.output
    assert "verified: read back as torch.load(weights_only=True) reads it" in result.stdout
    ours = torch.load(tmp_path / "ours.pt", weights_only=True)  # and loads by weights-only rules
    assert_bitwise_equal(theirs, ours)
    assert snapshot(folder) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ours.pt", "theirs.pt"]  # no temporary left


def test_colwise_chunks_are_not_one_run_of_the_tensor(made: Path) -> None:
    """The column-sharded checkpoint above exercises assembly run by run: its chunks of
    ``w`` split every row."""
    meta = read_metadata(healthy("colwise", made))
    w = next(e for e in meta.entries if e.key == "model.w")
    assert [c.offsets for c in w.chunks] == [(0, 0), (0, 4)] and w.chunks[0].sizes == (6, 4)


def test_only_model_to_safetensors_holds_the_model_tensors(made: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    folder = healthy("fsdp2-3", made)
    theirs = torch_converted(folder, tmp_path / "theirs.pt")
    out = tmp_path / "model.safetensors"
    result = convert(folder, out, only="model")
    assert result.verified and result.sidecar is None  # the model group has no objects
    back = load_file(out)
    assert list(back) == list(theirs["model"])
    for key, tensor in theirs["model"].items():
        assert torch.equal(back[key], tensor), key
    model = tiny()
    model.load_state_dict(back, strict=True)


def test_keys_auto_removes_inner_orig_mod_from_keys_and_optimizer_params(made: Path, tmp_path: Path) -> None:
    folder = healthy("ac_compiled", made)
    out = tmp_path / "plain.pt"
    result = invoke(["ckpt", "convert", str(folder), str(out)])
    assert result.exit_code == 0, result.output
    assert "--keys auto: removed wrapper segments _orig_mod." in result.stdout
    state = torch.load(out, weights_only=True)
    tiny().load_state_dict(state["model"], strict=True)
    assert "layers.0.attn.weight" in state["optim"]["state"]
    names = state["optim"]["param_groups"][0]["params"]
    assert "layers.0.attn.weight" in names and not any("_orig_mod" in n for n in names)
    kept = tmp_path / "kept.pt"
    assert invoke(["ckpt", "convert", str(folder), str(kept), "--keys", "keep"]).exit_code == 0
    assert "layers.0._orig_mod.attn.weight" in torch.load(kept, weights_only=True)["model"]


def test_a_missing_rank_file_refuses_conversion_and_writes_nothing(made: Path, tmp_path: Path) -> None:
    folder = copy_of(healthy("fsdp2-2", made), tmp_path / "ck")
    os.remove(folder / "__1_0.distcp")
    out = tmp_path / "out.pt"
    result = invoke(["ckpt", "convert", str(folder), str(out)])
    assert result.exit_code == 2 and result.stdout == ""
    assert "dcp-file-missing: __1_0.distcp is missing (saved by rank 1" in result.stderr
    assert result.stderr.count("\n") == 1
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_damaged_values_stop_the_conversion_with_no_partial_output(made: Path, tmp_path: Path) -> None:
    folder = copy_of(healthy("single", made), tmp_path / "ck")
    meta = read_metadata(folder)
    entry = next(e for e in meta.entries if e.key == "model.embed.weight")
    chunk = entry.chunks[0]
    with open(folder / str(chunk.file), "r+b") as handle:
        piece = dcp_read.open_piece(handle, entry, chunk)
        handle.seek(piece.begin + 5)
        handle.write(b"\xff")
    before = snapshot(folder)
    out = tmp_path / "out.pt"
    result = invoke(["ckpt", "convert", str(folder), str(out)])
    assert result.exit_code == 2
    assert f"__0_0.distcp bytes {piece.begin}-{piece.begin + piece.nbytes}" in result.stderr
    assert "model.embed.weight" in result.stderr and "CRC-32" in result.stderr
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    assert snapshot(folder) == before


def test_output_rules(made: Path, tmp_path: Path) -> None:
    folder = copy_of(healthy("single", made), tmp_path / "ck")
    inside = invoke(["ckpt", "convert", str(folder), str(folder / "x.pt")])
    assert inside.exit_code == 2 and "inside the checkpoint folder" in inside.stderr
    out = tmp_path / "out.pt"
    out.write_bytes(b"keep me")
    again = invoke(["ckpt", "convert", str(folder), str(out)])
    assert again.exit_code == 2 and "exists; pass --force" in again.stderr
    assert out.read_bytes() == b"keep me"
    assert invoke(["ckpt", "convert", str(folder), str(out), "--force"]).exit_code == 0
    bad = invoke(["ckpt", "convert", str(folder), str(tmp_path / "o.pt"), "--only", "nope"])
    assert bad.exit_code == 2 and "no such top-level group (the checkpoint has model, optim)" in bad.stderr
    usage = invoke(["ckpt", "convert", str(folder), str(tmp_path / "o.pt"), "--strip", "module."])
    assert usage.exit_code == 2 and "not for a DCP folder" in usage.stderr


def test_an_object_of_the_jobs_own_class_is_named_and_never_run(tmp_path: Path) -> None:
    from gpudiag.repro.checkpoint import dcp
    from tests.repro.test_dcp_helpers import save_with_object

    marker = tmp_path / "ran"
    folder = save_with_object(tmp_path / "ck", marker)
    report = dcp.verify(folder)
    (found,) = report.findings
    assert found.code == "dcp-object-unsafe" and found.evidence["key"] == "job.cfg"
    assert "system" in found.message and "__0_0.distcp bytes" in found.message
    refused = invoke(["ckpt", "convert", str(folder), str(tmp_path / "all.pt")])
    assert refused.exit_code == 2 and "job.cfg" in refused.stderr and "--only GROUP" in refused.stderr
    assert not (tmp_path / "all.pt").exists()
    model_only = invoke(["ckpt", "convert", str(folder), str(tmp_path / "model.pt"), "--only", "model"])
    assert model_only.exit_code == 0, model_only.output
    tiny().load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True), strict=True)
    assert not marker.exists()


@settings(max_examples=fuzz_examples(40), deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_damaged_data_files_give_findings_or_one_line_never_a_traceback(
    made: Path, tmp_path: Path, data
) -> None:  # type: ignore[no-untyped-def]
    """Bytes of a rank's file overwritten or the file cut anywhere: verify reports findings
    (exit 1) and convert refuses with one line (exit 2) or, when the damage missed every
    byte range it reads, converts (exit 0); never an exception of another kind."""
    source = healthy("fsdp2-2", made)
    folder = tmp_path / f"f{data.draw(st.integers(0, 10**9))}"
    shutil.copytree(source, folder)
    target = folder / data.draw(st.sampled_from(["__0_0.distcp", "__1_0.distcp"]))
    raw = bytearray(target.read_bytes())
    if data.draw(st.booleans()):
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    else:
        for _ in range(data.draw(st.integers(1, 6))):
            raw[data.draw(st.integers(0, len(raw) - 1))] ^= data.draw(st.integers(1, 255))
    target.write_bytes(bytes(raw))
    try:
        from gpudiag.repro.checkpoint import dcp

        dcp.verify(folder)
        out = tmp_path / "out.pt"
        result = invoke(["ckpt", "convert", str(folder), str(out)], catch_exceptions=False)
        assert result.exit_code in (0, 2)
        if result.exit_code == 2:
            assert result.stderr.count("\n") == 1 and not out.exists()
        out.unlink(missing_ok=True)
    finally:
        shutil.rmtree(folder)
