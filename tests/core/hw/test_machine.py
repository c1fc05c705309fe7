"""Machine files: every capture round-trips; bad files are one clear error; writes are safe."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpudiag.errors import InputError
from gpudiag.hw.fake_nvml import FakeNvml
from gpudiag.hw.machine import MachineBackend, MachineFileError, load_machine, save_machine, to_json
from gpudiag.hw.nvml import NvmlBackend
from gpudiag.topology import parse_capture
from gpudiag.topology.analysis import analyze
from tests.helpers import NVML, SEED_MACHINE, TOPO, capture

TOPO_CAPTURES = [
    p.name for p in sorted(TOPO.glob("*.txt")) if "rocm" not in p.name and "Latency" not in p.name
]


def same_report(a, b) -> None:  # type: ignore[no-untyped-def]
    left, right = analyze(a).to_json(), analyze(b).to_json()
    left.pop("source"), right.pop("source")
    assert left == right


@pytest.mark.parametrize("name", TOPO_CAPTURES)
def test_capture_round_trips_through_a_machine_file(name: str, tmp_path: Path) -> None:
    topo = parse_capture(capture(name), name)
    path = save_machine(topo, tmp_path / "m.json")
    back = load_machine(path)
    assert back.source == "machine-file"
    same_report(topo, back)


@pytest.mark.parametrize("scenario", ["h100_8gpu_nvswitch", "rtx5090_2gpu_pcie_gns", "a100_4gpu_one_lost"])
def test_nvml_reading_round_trips_through_a_machine_file(scenario: str, tmp_path: Path) -> None:
    with NvmlBackend(FakeNvml.from_file(NVML / f"{scenario}.json"), env={}) as b:
        topo = b.topology()
    back = MachineBackend(save_machine(topo, tmp_path / "m.json")).topology()
    # torch numbering belongs to the live machine's environment, not to the file.
    for info in topo.gpus.values():
        info.torch_index = None
    same_report(topo, back)
    assert back.gpus["GPU0"].name == topo.gpus["GPU0"].name


def test_machine_backend_lists_gpus() -> None:
    backend = MachineBackend(SEED_MACHINE)
    gpus = backend.gpus()
    assert [g.index for g in gpus] == list(range(8))
    assert backend.topology().cell("GPU5", "GPU6") == "NODE"


def test_existing_file_needs_force_and_is_left_untouched(tmp_path: Path) -> None:
    topo = parse_capture(capture("rtx5090_2gpu_phb_tabs.txt"))
    target = tmp_path / "m.json"
    target.write_text("keep me")
    with pytest.raises(InputError, match="--force"):
        save_machine(topo, target)
    assert target.read_text() == "keep me"
    save_machine(topo, target, force=True)
    assert json.loads(target.read_text())["schema"] == "gpudiag.machine/1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.json"]  # no temporary left


def test_failed_write_leaves_no_partial_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    topo = parse_capture(capture("rtx5090_2gpu_phb_tabs.txt"))

    def broken_fsync(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("os.fsync", broken_fsync)
    with pytest.raises(OSError):
        save_machine(topo, tmp_path / "m.json")
    assert list(tmp_path.iterdir()) == []


def good() -> dict:  # type: ignore[type-arg]
    return to_json(parse_capture(capture("rtx5090_2gpu_phb_tabs.txt")))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.update(schema="other"), "not a machine file"),
        (lambda d: d.update(labels=["GPU0", "GPU0"]), "distinct"),
        (lambda d: d.update(matrix=[["X"]]), "2 rows of 2 cells"),
        (lambda d: d["matrix"][0].__setitem__(1, "NVLINK"), "unknown code 'NVLINK'"),
        (lambda d: d["matrix"][1].__setitem__(1, "SYS"), "diagonal"),
        (lambda d: d.update(p2p={"read": [["X", "YES"], ["OK", "X"]]}), "unknown code 'YES'"),
        (lambda d: d.update(p2p={"teleport": [["X", "OK"], ["OK", "X"]]}), "unknown P2P capability"),
        (lambda d: d.update(labels=["NIC0", "NIC1"]), "GPU"),
    ],
)
def test_bad_machine_files_are_one_clear_error(change, message: str, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    data = good()
    change(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(MachineFileError, match=message):
        load_machine(path)


def test_missing_and_non_json_machine_files(tmp_path: Path) -> None:
    with pytest.raises(MachineFileError, match="does not exist"):
        load_machine(tmp_path / "nope.json")
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(MachineFileError, match="not valid JSON"):
        load_machine(tmp_path / "x.json")
