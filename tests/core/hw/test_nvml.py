"""The NVML backend through data-driven fake NVML scenarios."""

from __future__ import annotations

import pytest

from gpudiag.hw.fake_nvml import FakeNvml
from gpudiag.hw.nvml import NvmlBackend, NvmlUnavailable, cpu_list
from tests.helpers import NVML


def backend(name: str, env: dict[str, str] | None = None) -> NvmlBackend:
    return NvmlBackend(FakeNvml.from_file(NVML / f"{name}.json"), env={} if env is None else env)


def test_nothing_is_read_before_the_first_query() -> None:
    nvml = FakeNvml.from_file(NVML / "h100_8gpu_nvswitch.json")
    NvmlBackend(nvml, env={})
    assert nvml.calls == []


def test_nvswitch_box_gives_every_pair_the_fabric_link_count() -> None:
    with backend("h100_8gpu_nvswitch") as b:
        topo = b.topology()
    assert topo.source == "nvml"
    assert topo.labels == [f"GPU{i}" for i in range(8)]
    assert {p.link for p in topo.pairs()} == {"NV18"}
    assert {p.p2p for p in topo.pairs()} == {"OK"}
    gpu = topo.gpus["GPU5"]
    assert gpu.name == "NVIDIA H100 80GB HBM3"
    assert gpu.pci_bus_id == "00000000:AB:00.0"
    assert gpu.memory_total_mib == 81559
    assert (gpu.cpu_affinity, gpu.numa_affinity, gpu.gpu_numa_id) == ("48-95,144-191", "1", None)
    assert topo.notes == []  # GPU NUMA ID NotSupported on x86 is normal, not a note


def test_pcie_box_reads_levels_and_p2p_per_capability() -> None:
    with backend("rtx5090_2gpu_pcie_gns") as b:
        topo = b.topology()
    (pair,) = topo.pairs()
    assert (pair.link, pair.kind, pair.path, pair.p2p) == ("PHB", "pcie", "PHB", "GNS")
    assert pair.p2p_caps == {"read": "GNS", "write": "GNS", "nvlink": "NS", "atomics": "GNS"}


def test_p2p_capability_indices_are_plain_ints() -> None:
    # nvidia-ml-py 13.615 defines NVML_P2P_CAPS_INDEX_READ as the tuple (0,); the fake,
    # like ctypes, rejects anything but an int, so this test fails if the constant is used.
    with backend("rtx5090_2gpu_pcie_gns") as b:
        assert b.topology().pairs()[0].p2p_caps["read"] == "GNS"


def test_direct_nvlink_bridges_are_counted_by_remote_bus_id() -> None:
    with backend("a100_4gpu_one_lost") as b:
        topo = b.topology()
    assert topo.cell("GPU0", "GPU1") == "NV12"
    assert topo.cell("GPU0", "GPU3") == "NODE"


def test_lost_gpu_becomes_na_and_the_rest_still_reads() -> None:
    with backend("a100_4gpu_one_lost") as b:
        topo = b.topology()
    lost = topo.gpus["GPU2"]
    assert (lost.name, lost.pci_bus_id, lost.torch_index) == (None, None, None)
    assert topo.cell("GPU0", "GPU2") is None and topo.cell("GPU2", "GPU3") is None
    assert topo.gpus["GPU3"].name == "NVIDIA A100 80GB PCIe"
    codes = {n.code: n for n in topo.notes}
    assert codes["gpu-lost"].evidence == {"gpus": [2]}
    assert codes["nvml-field-unavailable"].evidence == {
        "field": "cpu_affinity",
        "error": "NotSupported",
        "gpus": [3],
    }
    assert topo.gpus["GPU3"].cpu_affinity is None
    assert topo.gpus["GPU3"].numa_affinity == "0"


@pytest.mark.parametrize(
    ("name", "words"),
    [("no_driver", "libnvidia-ml.so"), ("driver_mismatch", "versions differ")],
)
def test_fatal_errors_raise_one_typed_error_with_a_hint(name: str, words: str) -> None:
    with pytest.raises(NvmlUnavailable) as info:
        backend(name).topology()
    assert words in str(info.value)
    assert "--from-file" in str(info.value)
    assert info.value.exit_code == 3


def test_torch_numbering_follows_cuda_visible_devices() -> None:
    env = {"CUDA_VISIBLE_DEVICES": "6,2", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    with backend("h100_8gpu_nvswitch", env) as b:
        gpus = b.gpus()
    assert {g.index: g.torch_index for g in gpus if g.torch_index is not None} == {6: 0, 2: 1}


def test_cpu_list_formats_masks_like_nvidia_smi() -> None:
    assert cpu_list([0xFF]) == "0-7"
    assert cpu_list([(1 << 64) - 1, 0xFFFF]) == "0-79"
    assert cpu_list([0b1011]) == "0-1,3"
    assert cpu_list([0, 0]) is None


def test_real_pynvml_without_a_driver_is_exit_3() -> None:
    pytest.importorskip("pynvml")
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("an NVIDIA driver is present")
    with pytest.raises(NvmlUnavailable):
        NvmlBackend(env={}).topology()


@pytest.mark.gpu
def test_real_nvml_reads_this_machine() -> None:
    with NvmlBackend() as b:
        topo = b.topology()
    assert topo.gpus
    for info in topo.gpus.values():
        assert info.name and info.pci_bus_id and info.uuid


def test_nvlinks_past_gaps_and_down_links_are_counted() -> None:
    nvml = FakeNvml.from_file(NVML / "a100_4gpu_one_lost.json")
    nvml.gpus[0]["nvlinks"] = [
        {"remote": "unsupported", "links": 2},
        {"remote": "down", "links": 1},
        {"remote": "00000000:65:00.0", "links": 3},
    ]
    with NvmlBackend(nvml, env={}) as b:
        topo = b.topology()
    assert topo.cell("GPU0", "GPU1") == "NV3"
    assert topo.cell("GPU1", "GPU0") == "NV12"  # GPU1 still reports its own 12 links
