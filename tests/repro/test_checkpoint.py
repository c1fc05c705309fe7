"""gpudiag ckpt on checkpoints written by torch itself."""

from __future__ import annotations

import collections
import json
import os
import pickle
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from gpudiag.errors import InputError
from gpudiag.repro.checkpoint import convert, inspect
from gpudiag.repro.checkpoint.keys import KeyCollision
from gpudiag.repro.checkpoint.pickles import UnsafeCheckpoint
from tests.helpers import fuzz_examples, invoke

#: The wrapped models are built on the CPU here and on a GPU machine alike
#: (nn.DataParallel moves its module to cuda:0 where CUDA is available).
pytestmark = pytest.mark.usefixtures("no_gpu")


def small() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))


def train_step(model: nn.Module) -> torch.optim.Optimizer:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 3, 8, 8)).sum().backward()
    opt.step()
    return opt


def save_wrapped(path: Path, wrapped: nn.Module, legacy: bool = False) -> dict:
    opt = train_step(wrapped)
    ckpt = {"epoch": 7, "model_state_dict": wrapped.state_dict(), "optimizer_state_dict": opt.state_dict()}
    torch.save(ckpt, path, _use_new_zipfile_serialization=not legacy)
    return ckpt


def same_tensors(a: dict, b: dict, prefix: str) -> None:
    assert list(b) == [k[len(prefix) :] for k in a]
    for k, v in a.items():
        assert torch.equal(v, b[k[len(prefix) :]])


@pytest.mark.parametrize("legacy", [False, True])
def test_dataparallel_checkpoint_loads_strictly_after_convert(tmp_path: Path, legacy: bool) -> None:
    src, dst = tmp_path / "dp.pt", tmp_path / "plain.pt"
    original = save_wrapped(src, nn.DataParallel(small()), legacy)
    before = src.read_bytes()
    result = convert(src, dst)
    assert result.verified and result.mappings[0]["changed"] == len(original["model_state_dict"])
    out = torch.load(dst, weights_only=True)
    small().load_state_dict(out["model_state_dict"])  # strict
    same_tensors(original["model_state_dict"], out["model_state_dict"], "module.")
    assert out["epoch"] == 7
    assert out["optimizer_state_dict"]["param_groups"] == original["optimizer_state_dict"]["param_groups"]
    for i, state in original["optimizer_state_dict"]["state"].items():
        assert torch.equal(
            state["momentum_buffer"], out["optimizer_state_dict"]["state"][i]["momentum_buffer"]
        )
    meta = out["model_state_dict"]._metadata
    assert "module" not in meta and "1" in meta and meta["1"]["version"] == 2  # BatchNorm's version kept
    assert src.read_bytes() == before  # IN never modified


def test_ddp_over_gloo_checkpoint(tmp_path: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        original = save_wrapped(tmp_path / "ddp.pt", nn.parallel.DistributedDataParallel(small()))
    finally:
        dist.destroy_process_group()
    convert(tmp_path / "ddp.pt", tmp_path / "out.pt")
    same_tensors(original["model_state_dict"], torch.load(tmp_path / "out.pt")["model_state_dict"], "module.")


def test_real_torchvision_model_with_model_check(tmp_path: Path) -> None:
    torchvision = pytest.importorskip("torchvision")
    src = tmp_path / "r.pt"
    torch.save({"state_dict": nn.DataParallel(torchvision.models.resnet18(num_classes=10)).state_dict()}, src)
    report = inspect(src, model="torchvision:resnet18?num_classes=10")
    assert report.model["transformation"] == "--strip module."
    assert not report.model["loads_strictly"]
    convert(src, tmp_path / "o.pt", model="torchvision:resnet18?num_classes=10")
    torchvision.models.resnet18(num_classes=10).load_state_dict(torch.load(tmp_path / "o.pt")["state_dict"])


def test_inspect_model_verdict_first_keys_summarised_exit_1_when_it_does_not_load(tmp_path: Path) -> None:
    """A root-level DataParallel state dict of 122 keys: the verdict is on the first lines,
    the keys are summarised (JSON keeps them all), and not loading into --model is exit 1."""
    torchvision = pytest.importorskip("torchvision")
    src, fixed = tmp_path / "dp.pt", tmp_path / "fixed.pt"
    torch.save(nn.DataParallel(torchvision.models.resnet18(num_classes=10)).state_dict(), src)
    spec = "torchvision:resnet18?num_classes=10"
    text = invoke(["ckpt", "inspect", str(src), "--model", spec])
    assert text.exit_code == 1, text.output
    lines = text.output.splitlines()
    assert lines[0] == f"{src}: torch-zip"
    assert lines[1] == "  does NOT load strictly into --model as it is; fix: --strip module."
    assert len(lines) < 15 and "module.layer2.0.conv1.weight" not in text.output
    assert "keys (122): 'module.conv1.weight', 'module.bn1.weight', 'module.bn1.bias', …" in text.output
    markdown = invoke(["ckpt", "inspect", str(src), "--model", spec, "--format", "markdown"])
    assert markdown.exit_code == 1 and "does NOT load strictly" in markdown.output.splitlines()[4]
    doc = invoke(["ckpt", "inspect", str(src), "--model", spec, "--format", "json"])
    assert doc.exit_code == 1
    keys = json.loads(doc.output)["state_dicts"][0]["keys"]
    assert len(keys) == 122 and "module.layer2.0.conv1.weight" in keys
    bare = invoke(["ckpt", "inspect", str(src)])
    assert bare.exit_code == 0
    assert bare.output.splitlines()[1] == (
        "  (root): wrapper prefix module. on every key; `gpudiag ckpt convert` strips it"
    )
    assert invoke(["ckpt", "convert", str(src), str(fixed)]).exit_code == 0
    loads = invoke(["ckpt", "inspect", str(fixed), "--model", spec])
    assert loads.exit_code == 0 and loads.output.splitlines()[1] == "  loads strictly into --model as it is"
    assert inspect(src, model=spec).exit_code() == 1 and inspect(fixed, model=spec).exit_code() == 0


def test_inspect_says_what_each_renaming_fixes_and_what_remains(tmp_path: Path) -> None:
    """Issue 47: a 10-class DataParallel resnet18 against the 1000-class model read "no
    renaming of prefixes makes it load"; stripping module. fixes 120 of its 122 keys and
    only the head's shape differs."""
    torchvision = pytest.importorskip("torchvision")
    src = tmp_path / "dp.pt"
    torch.save(nn.DataParallel(torchvision.models.resnet18(num_classes=10)).state_dict(), src)
    report = inspect(src, model="torchvision:resnet18")
    assert report.model is not None and report.model["transformation"] is None
    best, *others = report.model["renames"]
    assert (best["rename"], best["fits"], best["keys"]) == ("--strip module.", 120, 122)
    assert best["missing"] == best["unexpected"] == []
    assert [m["key"] for m in best["shape_mismatches"]] == ["fc.weight", "fc.bias"]
    assert {r["rename"]: r["fits"] for r in others}["as it is"] == 0
    text = invoke(["ckpt", "inspect", str(src), "--model", "torchvision:resnet18"])
    assert text.exit_code == 1
    lines = text.output.splitlines()
    assert lines[1].startswith(
        "  does NOT load strictly into --model: --strip module. fixes 120 of 122 keys;"
    )
    assert "2 shape(s) differ" in lines[1] and "no renaming" in lines[1]
    assert lines[2] == "    shape fc.weight: checkpoint [10, 512], model [1000, 512]"
    assert "missing" not in text.output  # (what remains after the best renaming, not before it)
    unrelated = invoke(["ckpt", "inspect", str(src), "--model", "mlp"])
    assert unrelated.exit_code == 1 and "makes any of its 4 keys fit" in unrelated.output.splitlines()[1]


def test_compile_and_nested_wrappers_are_peeled(tmp_path: Path) -> None:
    compiled = torch.compile(nn.DataParallel(small()))
    sd = compiled.state_dict()
    assert next(iter(sd)).startswith("_orig_mod.module.")
    torch.save(sd, tmp_path / "c.pt")
    result = convert(tmp_path / "c.pt", tmp_path / "o.pt")
    assert result.mappings[0]["strip"] == ["_orig_mod.", "module."]
    small().load_state_dict(torch.load(tmp_path / "o.pt"))


def test_add_prefix_for_a_wrapped_target(tmp_path: Path) -> None:
    torch.save(small().state_dict(), tmp_path / "p.pt")
    convert(tmp_path / "p.pt", tmp_path / "w.pt", add="module.")
    nn.DataParallel(small()).load_state_dict(torch.load(tmp_path / "w.pt"))


class Inner(nn.Module):
    """Like WeightDrop: a wrapper whose child is literally called ``module``."""

    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Linear(3, 3)


def test_inner_module_segment_stays(tmp_path: Path) -> None:
    model = nn.Sequential(collections.OrderedDict(encoder=Inner(), head=nn.Linear(3, 2)))
    torch.save(nn.DataParallel(model).state_dict(), tmp_path / "i.pt")
    convert(tmp_path / "i.pt", tmp_path / "o.pt")
    keys = list(torch.load(tmp_path / "o.pt"))
    assert keys == ["encoder.module.weight", "encoder.module.bias", "head.weight", "head.bias"]


def test_collisions_are_refused_naming_the_keys(tmp_path: Path) -> None:
    sd = collections.OrderedDict(
        [
            ("module.fc.weight", torch.ones(2)),
            ("fc.weight", torch.zeros(2)),
            ("module.fc.bias", torch.ones(1)),
        ]
    )
    torch.save(sd, tmp_path / "ema.pt")
    with pytest.raises(KeyCollision, match=r"would collide .*'fc\.weight'"):
        convert(tmp_path / "ema.pt", tmp_path / "o.pt")
    with pytest.raises(KeyCollision):
        convert(tmp_path / "ema.pt", tmp_path / "o.pt", strip=["module."])
    assert not (tmp_path / "o.pt").exists()


def test_lightning_style_strip(tmp_path: Path) -> None:
    inner = small()
    sd = collections.OrderedDict((f"model.{k}", v) for k, v in inner.state_dict().items())
    torch.save(
        {"state_dict": sd, "pytorch-lightning_version": "2.4.0", "global_step": 12}, tmp_path / "l.ckpt"
    )
    report = inspect(tmp_path / "l.ckpt")
    assert report.format == "lightning (torch-zip)"
    assert report.state_dicts[0]["path"] == "['state_dict']" and report.state_dicts[0]["prefixes"] == []
    convert(tmp_path / "l.ckpt", tmp_path / "o.pt", strip=["model."])
    out = torch.load(tmp_path / "o.pt")
    small().load_state_dict(out["state_dict"])
    assert out["global_step"] == 12


def test_safetensors_both_ways(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    original = save_wrapped(tmp_path / "dp.pt", nn.DataParallel(small()))
    result = convert(tmp_path / "dp.pt", tmp_path / "m.safetensors", to="safetensors")
    tensors = load_file(tmp_path / "m.safetensors")
    same_tensors(original["model_state_dict"], tensors, "module.")
    sidecar = json.loads(Path(result.sidecar).read_text())
    assert sidecar["epoch"] == 7 and "optimizer_state_dict" in sidecar
    save_file({f"module.{k}": v for k, v in tensors.items()}, tmp_path / "w.safetensors")
    convert(tmp_path / "w.safetensors", tmp_path / "u.safetensors")
    back = load_file(tmp_path / "u.safetensors")
    assert sorted(back) == sorted(tensors) and all(torch.equal(back[k], tensors[k]) for k in back)
    convert(tmp_path / "w.safetensors", tmp_path / "p.pt", to="pt")
    small().load_state_dict(torch.load(tmp_path / "p.pt"))


def test_shared_storage_to_safetensors(tmp_path: Path) -> None:
    base = torch.arange(12.0)
    torch.save(
        {"a.weight": base[:6].view(2, 3), "b.weight": base[6:].view(3, 2), "c.weight": base},
        tmp_path / "s.pt",
    )
    convert(tmp_path / "s.pt", tmp_path / "s.safetensors", to="safetensors")
    from safetensors.torch import load_file

    out = load_file(tmp_path / "s.safetensors")
    assert out["b.weight"].tolist() == [[6.0, 7.0], [8.0, 9.0], [10.0, 11.0]]


class Evil:
    def __reduce__(self) -> tuple:
        return (os.system, ("touch pwned",))


def test_malicious_pickle_never_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    torch.save({"state_dict": {"w": torch.ones(1)}, "payload": Evil()}, tmp_path / "evil.pt")
    torch.save(
        {"w": torch.ones(1), "payload": Evil()},
        tmp_path / "evil_legacy.pt",
        _use_new_zipfile_serialization=False,
    )
    for name in ("evil.pt", "evil_legacy.pt"):
        with pytest.raises(UnsafeCheckpoint, match="--trust-checkpoint"):
            convert(tmp_path / name, tmp_path / "o.pt")
        with pytest.raises(UnsafeCheckpoint):
            inspect(tmp_path / name)
    assert not (tmp_path / "pwned").exists()
    assert not (tmp_path / "o.pt").exists()


def test_output_rules(tmp_path: Path) -> None:
    torch.save(nn.DataParallel(small()).state_dict(), tmp_path / "in.pt")
    (tmp_path / "out.pt").write_text("keep")
    with pytest.raises(InputError, match="--force"):
        convert(tmp_path / "in.pt", tmp_path / "out.pt")
    assert (tmp_path / "out.pt").read_text() == "keep"
    with pytest.raises(InputError, match="OUT is IN"):
        convert(tmp_path / "in.pt", tmp_path / "in.pt", force=True)
    convert(tmp_path / "in.pt", tmp_path / "out.pt", force=True)
    assert torch.load(tmp_path / "out.pt")


def test_full_disk_leaves_no_partial_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpudiag.repro.checkpoint import torchzip

    torch.save(nn.DataParallel(small()).state_dict(), tmp_path / "in.pt")
    real = torchzip._copy_range
    calls = []

    def fills_up(src, dst, offset, size, *copier):  # type: ignore[no-untyped-def]
        calls.append(size)
        if len(calls) == 3:  # a few records in, the disk is full
            dst.write(b"\0" * 10)
            raise OSError(28, "No space left on device")
        return real(src, dst, offset, size, *copier)

    monkeypatch.setattr(torchzip, "_copy_range", fills_up)
    with pytest.raises(OSError, match="No space left"):
        convert(tmp_path / "in.pt", tmp_path / "out.pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.pt"]


def test_convert_checks_each_records_crc_as_it_copies_and_reads_nothing_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every record's bytes are read once from IN and summed as they are written (records
    larger than the copy's buffer included); nothing of OUT's data is read back; a record
    whose bytes do not match IN's CRC-32 stops the copy and leaves nothing."""
    from gpudiag.repro.checkpoint import torchzip

    g = torch.Generator().manual_seed(0)
    sd = {f"module.{i}.weight": torch.randn(700, 700, generator=g) for i in range(3)}  # 1.9 MiB each
    torch.save(sd, tmp_path / "in.pt")
    reads: collections.Counter[str] = collections.Counter()
    real = os.preadv

    def counted(fd: int, buffers: list, offset: int) -> int:  # type: ignore[type-arg]
        n = real(fd, buffers, offset)
        reads[os.readlink(f"/proc/self/fd/{fd}")] += n
        return n

    monkeypatch.setattr(os, "preadv", counted)
    assert convert(tmp_path / "in.pt", tmp_path / "out.pt").verified
    monkeypatch.setattr(os, "preadv", real)
    back = torch.load(tmp_path / "out.pt", weights_only=True)
    assert all(torch.equal(back[k.removeprefix("module.")], v) for k, v in sd.items())
    archive = torchzip.open_archive(tmp_path / "in.pt", "in.pt")
    stored = sum(r.size for r in archive.records if r.name != archive.pickle_name)
    assert reads.pop(str(tmp_path / "in.pt")) == stored  # each record read once, through the CRC
    assert not reads, reads  # and no byte of OUT (its temporary) read back

    record = next(r for r in archive.records if r.name.endswith("data/1"))
    damaged = bytearray((tmp_path / "in.pt").read_bytes())
    damaged[record.data_offset + record.size // 2] ^= 0x10  # the data, not the CRC the directory holds
    (tmp_path / "bad.pt").write_bytes(damaged)
    with pytest.raises(InputError, match=r"bad.pt: record in/data/1 does not match its CRC-32"):
        convert(tmp_path / "bad.pt", tmp_path / "bad-out.pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.pt", "in.pt", "out.pt"]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "is empty"),
        (b"hello world, not a checkpoint", "not a checkpoint"),
        (b"PK\x03\x04garbage", "damaged"),
    ],
)
def test_bad_inputs(tmp_path: Path, content: bytes, message: str) -> None:
    (tmp_path / "bad.pt").write_bytes(content)
    with pytest.raises(InputError, match=message):
        convert(tmp_path / "bad.pt", tmp_path / "o.pt")
    assert not (tmp_path / "o.pt").exists()


def test_dcp_folder_goes_to_the_dcp_reader(tmp_path: Path) -> None:
    """(DCP folders: tests/repro/test_dcp*.py.) The single-file options refuse one, naming
    the commands that read it; inspect reads it as DCP."""
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / ".metadata").write_bytes(b"x")
    with pytest.raises(InputError, match=r"gpudiag ckpt convert DIR OUT\.pt"):
        convert(tmp_path / "dcp", tmp_path / "o.pt", strip=["module."])
    with pytest.raises(InputError, match="damaged or truncated DCP metadata"):
        inspect(tmp_path / "dcp")


@pytest.fixture(scope="module")
def wrapped_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("t") / "dp.pt"
    save_wrapped(path, nn.DataParallel(small()))
    return path.read_bytes()


@settings(
    max_examples=fuzz_examples(40), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(cut=st.floats(0.0, 0.999))
def test_truncation_anywhere_is_one_clear_error(tmp_path: Path, wrapped_bytes: bytes, cut: float) -> None:
    bad = tmp_path / f"t{cut}.pt"
    bad.write_bytes(wrapped_bytes[: int(len(wrapped_bytes) * cut)])
    out = tmp_path / f"o{cut}.pt"
    with pytest.raises(InputError) as info:
        convert(bad, out)
    assert "\n" not in str(info.value)
    assert not out.exists()


@settings(
    max_examples=fuzz_examples(25), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(prefix=st.sampled_from(["module.", "_orig_mod.", "model.", "net.encoder."]))
def test_add_then_strip_is_the_identity_on_keys_and_bytes(tmp_path: Path, prefix: str) -> None:
    sd = small().state_dict()
    torch.save(sd, tmp_path / "a.pt")
    convert(tmp_path / "a.pt", tmp_path / "b.pt", add=prefix, force=True)
    convert(tmp_path / "b.pt", tmp_path / "c.pt", strip=[prefix], force=True)
    back = torch.load(tmp_path / "c.pt")
    assert list(back) == list(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
    assert back._metadata == sd._metadata


def test_cli_inspect_convert_and_dry_run(tmp_path: Path) -> None:
    torch.save({"model": nn.DataParallel(small()).state_dict()}, tmp_path / "in.pt")
    result = invoke(["ckpt", "inspect", str(tmp_path / "in.pt"), "--format", "json"])
    doc = json.loads(result.output)
    assert doc["schema"] == "gpudiag.ckpt-inspect/1" and doc["state_dicts"][0]["prefixes"] == ["module."]
    dry = invoke(["ckpt", "convert", str(tmp_path / "in.pt"), str(tmp_path / "o.pt"), "--dry-run"])
    assert dry.exit_code == 0 and "'module.0.weight' -> '0.weight'" in dry.output
    assert not (tmp_path / "o.pt").exists()
    done = invoke(["ckpt", "convert", str(tmp_path / "in.pt"), str(tmp_path / "o.pt"), "--format", "json"])
    assert done.exit_code == 0 and json.loads(done.output)["verified"] is True
    again = invoke(["ckpt", "convert", str(tmp_path / "in.pt"), str(tmp_path / "o.pt")])
    assert again.exit_code == 2 and "--force" in again.stderr
    missing = invoke(["ckpt", "inspect", str(tmp_path / "nope.pt")])
    assert missing.exit_code == 2 and "does not exist" in missing.stderr


def test_pickle_placeholders_round_trip_through_torch(tmp_path: Path) -> None:
    from gpudiag.repro.checkpoint import pickles, torchzip

    torch.save(
        {
            "p": nn.Parameter(torch.ones(2)),
            "h": torch.ones(3, dtype=torch.bfloat16),
            "s": {1, 2},
            "size": torch.Size([2]),
            "dt": torch.float16,
            "dev": torch.device("cpu"),
            "b": b"x",
        },
        tmp_path / "x.pt",
    )
    archive = torchzip.open_archive(tmp_path / "x.pt", "x")
    tree = pickles.loads(archive.pickle, "x")
    with open(tmp_path / "y.pt", "wb") as out:
        torchzip.rewrite(archive, pickles.dumps(tree), out)
    back = torch.load(tmp_path / "y.pt", weights_only=True)
    assert isinstance(back["p"], nn.Parameter) and back["h"].dtype == torch.bfloat16
    assert back["s"] == {1, 2} and back["dt"] == torch.float16 and back["b"] == b"x"
    assert pickle.loads(pickle.dumps(back["size"])) == torch.Size([2])


# -- shared and tied tensors (issue 16) ----------------------------------------------------------


def sharing(tree: object) -> list[tuple[int, int]]:
    """For each tensor in order: the first that is the same object, the first on the same storage."""
    tensors: list[torch.Tensor] = []

    def walk(value: object) -> None:
        if isinstance(value, torch.Tensor):
            tensors.append(value)
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)

    walk(tree)
    same: dict[int, int] = {}
    storage: dict[int, int] = {}
    return [
        (same.setdefault(id(t), i), storage.setdefault(t.untyped_storage().data_ptr(), i))
        for i, t in enumerate(tensors)
    ]


def equal_trees(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(equal_trees(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(equal_trees, a, b))
    return bool(a == b)


@st.composite
def aliased_checkpoints(draw: st.DrawFn) -> tuple[dict, str]:
    """A checkpoint whose tensors share: one tensor under several keys, views and slices of
    one storage, tensors again in nested dicts and lists; every state dict key wrapped."""
    dtype = draw(st.sampled_from([torch.float32, torch.int64, torch.float16]))
    bases = [torch.arange(draw(st.integers(2, 12))).to(dtype) for _ in range(draw(st.integers(1, 3)))]
    pool: list[torch.Tensor] = list(bases)
    for _ in range(draw(st.integers(0, 4))):
        base = draw(st.sampled_from(bases))
        start = draw(st.integers(0, base.numel() - 1))
        stop = draw(st.integers(start + 1, base.numel()))
        view = base[start:stop]
        pool.append(view.view(1, -1) if draw(st.booleans()) else view)
    n = draw(st.integers(1, 8))
    values = [draw(st.sampled_from(pool)) for _ in range(n)]
    prefix = draw(st.sampled_from(["", "module.", "_orig_mod.", "_orig_mod.module."]))
    state = collections.OrderedDict((f"{prefix}layer{i}.weight", v) for i, v in enumerate(values))
    ckpt = {"model": state, "step": draw(st.integers(0, 9))}
    if draw(st.booleans()):
        ckpt["extra"] = [draw(st.sampled_from(pool)), {"again": draw(st.sampled_from(values)), "n": 1}]
    if draw(st.booleans()):
        ckpt["ema"] = {f"{prefix}layer{i}.weight": draw(st.sampled_from(pool)) for i in range(n)}
    return ckpt, prefix


@settings(
    max_examples=fuzz_examples(30), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(case=aliased_checkpoints(), legacy=st.booleans(), add=st.sampled_from([None, "net."]))
def test_shared_tensors_convert_and_load_weights_only(
    tmp_path: Path, case: tuple[dict, str], legacy: bool, add: str | None
) -> None:
    ckpt, prefix = case
    src, dst = tmp_path / "in.pt", tmp_path / "out.pt"
    torch.save(ckpt, src, _use_new_zipfile_serialization=not legacy)
    before = torch.load(src, weights_only=True)
    result = convert(src, dst, force=True, **({"strip": [prefix], "add": add} if add and prefix else {}))
    assert result.verified
    after = torch.load(dst, weights_only=True)  # torch itself, not gpudiag's reading of it
    assert sharing(after) == sharing(before)
    want = add if add and prefix else ""
    assert list(after["model"]) == [want + k[len(prefix) :] for k in before["model"]]
    before["model"] = collections.OrderedDict(zip(after["model"], before["model"].values(), strict=True))
    if "ema" in before:
        assert list(after["ema"]) == [want + k[len(prefix) :] for k in before["ema"]]
        before["ema"] = dict(zip(after["ema"], before["ema"].values(), strict=True))
    assert equal_trees(after, before)


def test_tied_weights_saved_with_keep_vars(tmp_path: Path) -> None:
    """state_dict(keep_vars=True) of a tied model holds one Parameter under two keys."""

    class TinyLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(11, 4)
            self.head = nn.Linear(4, 11, bias=False)
            self.head.weight = self.embed.weight  # tied

    model = nn.DataParallel(TinyLM())
    opt = torch.optim.Adam(model.parameters())
    state = model.state_dict(keep_vars=True)
    assert state["module.embed.weight"] is state["module.head.weight"]
    torch.save({"model": state, "opt": opt.state_dict()}, tmp_path / "t.pt")
    result = convert(tmp_path / "t.pt", tmp_path / "o.pt")
    out = torch.load(tmp_path / "o.pt", weights_only=True)
    assert result.verified and list(out["model"]) == ["embed.weight", "head.weight"]
    assert out["model"]["embed.weight"] is out["model"]["head.weight"]
    assert isinstance(out["model"]["head.weight"], nn.Parameter)
    TinyLM().load_state_dict(out["model"])


def test_verified_only_when_torch_weights_only_loads_it(tmp_path: Path) -> None:
    """numpy values load with gpudiag's reader but not with torch.load(weights_only=True):
    the output is written (it is as loadable as the input) but not called verified."""
    import numpy as np

    torch.save({"model": {"module.w": torch.ones(2)}, "best": np.float64(0.5)}, tmp_path / "n.pt")
    with pytest.raises(pickle.UnpicklingError):
        torch.load(tmp_path / "n.pt", weights_only=True)
    result = convert(tmp_path / "n.pt", tmp_path / "o.pt")
    assert not result.verified
    assert any("not verified for torch.load(weights_only=True)" in n and "numpy" in n for n in result.notes)
    assert torch.load(tmp_path / "o.pt", weights_only=False)["best"] == 0.5


def test_empty_add_and_unmatched_strip_are_refused(tmp_path: Path) -> None:
    src, out = tmp_path / "in.pt", tmp_path / "out.pt"
    torch.save({"model": nn.DataParallel(small()).state_dict(), "ema": small().state_dict()}, src)
    run = invoke
    empty = run(["ckpt", "convert", str(src), str(out), "--add", ""])
    assert empty.exit_code == 2 and "--add needs a prefix" in empty.stderr and not out.exists()
    typo = run(["ckpt", "convert", str(src), str(out), "--strip", "model."])
    assert typo.exit_code == 2 and "no key starts with it" in typo.stderr and not out.exists()
    partial = run(["ckpt", "convert", str(src), str(out), "--strip", "module.", "--format", "json"])
    assert partial.exit_code == 0
    notes = json.loads(partial.output)["notes"]
    assert any("--strip module.: 0 of" in n and "['ema']" in n and "unchanged" in n for n in notes)


def test_to_safetensors_says_what_it_drops(tmp_path: Path) -> None:
    model = nn.DataParallel(small())
    opt = train_step(model)
    ema = {k: v.clone() for k, v in model.state_dict().items()}
    src, out = tmp_path / "in.pt", tmp_path / "m.safetensors"
    torch.save({"model": model.state_dict(), "ema": ema, "optimizer": opt.state_dict(), "epoch": 3}, src)
    run = invoke(["ckpt", "convert", str(src), str(out), "--to", "safetensors", "--format", "json"])
    doc = json.loads(run.output)
    assert [m["state_dict"] for m in doc["mappings"]] == ["['model']"]  # ['ema'] is not in OUT
    notes = "\n".join(doc["notes"])
    n, params = len(ema), len(list(model.parameters()))
    assert f"OUT has the {n} tensors of ['model']" in notes
    assert f"'ema' ({n} tensors), 'optimizer' ({params} tensors)" in notes and "without values" in notes
    assert "dropped from ['model']: its _metadata" in notes
    assert doc["verified"] and json.loads(Path(doc["sidecar"]).read_text())["epoch"] == 3


def test_weights_only_rules_are_within_torchs() -> None:
    """The globals and opcodes gpudiag's weights-only read accepts are ones torch accepts
    (torch's private allowlist: this test notices when a torch release narrows it)."""
    from torch import _weights_only_unpickler as wo

    from gpudiag.repro.checkpoint.pickles import WEIGHTS_ONLY_GLOBALS
    from gpudiag.unpickle import WEIGHTS_ONLY_OPCODES

    allowed = set(wo._get_allowed_globals())
    assert {g.replace("__builtin__.", "builtins.") for g in WEIGHTS_ONLY_GLOBALS} <= allowed
    source = Path(wo.__file__).read_text()
    for code in WEIGHTS_ONLY_OPCODES:
        name = next(n for n in dir(pickle) if n.isupper() and getattr(pickle, n) == bytes([code]))
        assert f"key[0] == {name}[0]" in source or f"{name}[0]" in source, name
