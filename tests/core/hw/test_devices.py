"""torch ``cuda:N`` against nvidia-smi numbering, joined on the PCI bus id."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpudiag.hw.devices import bus_id_from_torch, map_torch_indices, normalize_bus_id
from gpudiag.topology.model import GpuInfo


def gpus(names: list[str]) -> list[GpuInfo]:
    return [
        GpuInfo(f"GPU{i}", i, name=n, pci_bus_id=f"00000000:{0x10 * (i + 1):02X}:00.0", uuid=f"GPU-{i}abc")
        for i, n in enumerate(names)
    ]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("00000000:07:00.0", "00000000:07:00.0"),
        ("0000:af:00.0", "00000000:AF:00.0"),
        (b"00000000:18:00.0", "00000000:18:00.0"),
        ("af:00.1", "00000000:AF:00.1"),
        ("garbage", None),
    ],
)
def test_normalize_bus_id(text: str | bytes, expected: str | None) -> None:
    assert normalize_bus_id(text) == expected


def test_torch_bus_id_matches_nvml_form() -> None:
    assert bus_id_from_torch(0, 0xAF, 0) == normalize_bus_id("0000:af:00.0")


def test_unset_environment_maps_identity_for_identical_gpus() -> None:
    mapping = map_torch_indices(gpus(["A100"] * 4), {})
    assert mapping.torch_of == {0: 0, 1: 1, 2: 2, 3: 3}
    assert mapping.certain


def test_visible_devices_reorder_and_hide() -> None:
    mapping = map_torch_indices(gpus(["A100"] * 4), {"CUDA_VISIBLE_DEVICES": "3,1"})
    assert mapping.torch_of == {0: None, 1: 1, 2: None, 3: 0}


def test_visible_devices_by_uuid_prefix() -> None:
    mapping = map_torch_indices(gpus(["A100"] * 3), {"CUDA_VISIBLE_DEVICES": "GPU-2,GPU-0"})
    assert mapping.torch_of == {0: 1, 1: None, 2: 0}


def test_invalid_entry_hides_everything_after_it() -> None:
    mapping = map_torch_indices(gpus(["A100"] * 4), {"CUDA_VISIBLE_DEVICES": "2,7,0"})
    assert mapping.torch_of == {0: None, 1: None, 2: 0, 3: None}
    assert "'7'" in mapping.notes[0]


def test_empty_visible_devices_hides_all() -> None:
    assert set(map_torch_indices(gpus(["A100"] * 2), {"CUDA_VISIBLE_DEVICES": ""}).torch_of.values()) == {
        None
    }


def test_mixed_models_under_fastest_first_are_uncertain() -> None:
    mapping = map_torch_indices(gpus(["RTX 4090", "RTX 3060"]), {})
    assert not mapping.certain
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in mapping.notes[0]
    assert map_torch_indices(gpus(["RTX 4090", "RTX 3060"]), {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}).certain


def test_nvml_order_differs_from_bus_order_and_is_joined_by_bus_id() -> None:
    # NVML index 0 on a higher bus than index 1: CUDA (PCI order) counts bus order.
    devices = [
        GpuInfo("GPU0", 0, name="A100", pci_bus_id="00000000:B0:00.0"),
        GpuInfo("GPU1", 1, name="A100", pci_bus_id="00000000:20:00.0"),
    ]
    assert map_torch_indices(devices, {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}).torch_of == {0: 1, 1: 0}


def test_exact_mapping_from_torch_bus_ids() -> None:
    devices = gpus(["A100"] * 3)
    mapping = map_torch_indices(devices, {}, torch_bus_ids=["0000:30:00.0", "0000:10:00.0"])
    assert mapping.torch_of == {0: 1, 1: None, 2: 0}


@given(st.permutations(range(6)), st.integers(0, 6))
def test_visible_devices_give_a_bijection_onto_torch_indices(order: list[int], count: int) -> None:
    chosen = order[:count]
    mapping = map_torch_indices(gpus(["A100"] * 6), {"CUDA_VISIBLE_DEVICES": ",".join(map(str, chosen))})
    assert [mapping.torch_of[i] for i in chosen] == list(range(count))
    assert sum(v is not None for v in mapping.torch_of.values()) == count
