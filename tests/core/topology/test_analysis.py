"""Warnings and advice derived from real captures and machine descriptions."""

from __future__ import annotations

from gpudiag.hw.fake_nvml import FakeNvml
from gpudiag.hw.nvml import NvmlBackend
from gpudiag.topology import parse_capture
from gpudiag.topology.analysis import analyze, best_groups
from tests.helpers import NVML, capture, codes


def by_code(report, code: str):  # type: ignore[no-untyped-def]
    return [f for f in report.findings if f.code == code]


def test_seed_machine_best_pairs_are_the_nvlink_pairs() -> None:
    report = analyze(parse_capture(capture("seed_8gpu_nv4_pairs_node_sys.txt")))
    pairs, quads = by_code(report, "best-gpu-groups")
    assert pairs.evidence["groups"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert pairs.evidence["worst_links"] == ["NV4"] * 4
    assert pairs.evidence["env"][2] == "CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=4,5"
    assert quads.evidence["groups"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert quads.evidence["worst_links"] == ["NODE", "NODE"]
    (mixed,) = by_code(report, "mixed-links")
    assert mixed.evidence["nvlink_pairs"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mixed.evidence["pcie_paths"] == ["NODE", "SYS"]


def test_pairs_are_ranked_best_first() -> None:
    report = analyze(parse_capture(capture("seed_8gpu_nv4_pairs_node_sys.txt")))
    links = [p.link for p in report.pairs]
    assert links[:4] == ["NV4"] * 4
    assert links[4:12] == ["NODE"] * 8
    assert set(links[12:]) == {"SYS"}
    assert (report.pairs[0].a, report.pairs[0].b) == (0, 1)


def test_dgx1_prefers_double_links_and_counts_them() -> None:
    report = analyze(parse_capture(capture("dgx1_v100_nv1nv2_mlx5_spaces.txt")))
    top = report.pairs[0]
    assert (top.link, top.kind, top.nvlinks, top.path) == ("NV2", "nvlink", 2, "NVLINK")
    assert best_groups(report.topology, 2)[0] == (0, 3)


def test_all_sys_consumer_box_is_flagged_sys_ambiguous() -> None:
    report = analyze(parse_capture(capture("rtx4090_8gpu_all_sys_2nic_tabs.txt")))
    (warning,) = by_code(report, "sys-ambiguous")
    assert [0, 1] in warning.evidence["pairs"]
    assert [0, 4] not in warning.evidence["pairs"]  # NUMA 0 vs NUMA 1: a real SYS
    assert "mixed-links" not in codes(report)


def test_cross_socket_sys_is_not_ambiguous() -> None:
    report = analyze(parse_capture(capture("rtx6000ada_4gpu_node_sys_4nic.txt")))
    assert "sys-ambiguous" not in codes(report)


def test_legacy_soc_is_reported_as_sys_path() -> None:
    topo = parse_capture(capture("p40_8gpu_pix_pxb_soc_legacy_tabs.txt"))
    assert path_of_nic(topo) == "SYS"


def path_of_nic(topo) -> str | None:  # type: ignore[no-untyped-def]
    from gpudiag.topology.model import path_of

    return path_of(topo.cell("GPU0", "mlx5_0"))


def test_p2p_not_supported_from_a_p2p_capture() -> None:
    text = capture("rtx5090_2gpu_phb_tabs.txt") + "\n" + capture("p2p_rw_rtx5090_2gpu_gns.txt")
    (warning,) = by_code(analyze(parse_capture(text)), "p2p-not-supported")
    assert warning.evidence["pairs"][0]["p2p"] == "GNS"
    assert "GPU not supported" in (warning.cause or "")


def test_asymmetric_cell_is_a_warning_naming_it() -> None:
    text = capture("v100_4gpu_nv1_nv2_numa.txt").replace(
        "GPU2    NV2     NV1      X      NV1", "GPU2    NV2     NV1      X      NV2"
    )
    (warning,) = by_code(analyze(parse_capture(text)), "asymmetric-cell")
    assert warning.evidence == {"row": "GPU2", "column": "GPU3", "value": "NV2", "transposed": "NV1"}


def test_truncated_capture_is_a_warning() -> None:
    report = analyze(parse_capture(capture("gb200_4gpu_nv18_6nic_gpu_numa_id_fragment.txt")))
    (warning,) = by_code(report, "truncated-capture")
    assert warning.evidence["missing_rows"][0] == "GPU3"


def test_nvswitch_gpus_without_nvlink_are_flagged() -> None:
    nvml = FakeNvml.from_file(NVML / "a100_4gpu_fabric_down.json")
    with NvmlBackend(nvml, env={}) as backend:
        report = analyze(backend.topology())
    (warning,) = by_code(report, "nvswitch-without-nvlink")
    assert warning.evidence["gpus"] == [0, 1, 2, 3]
    assert "fabricmanager" in (warning.fix or "")


def test_nvswitch_box_with_nvlink_is_not_flagged() -> None:
    nvml = FakeNvml.from_file(NVML / "h100_8gpu_nvswitch.json")
    with NvmlBackend(nvml, env={}) as backend:
        report = analyze(backend.topology())
    assert "nvswitch-without-nvlink" not in codes(report)
    assert "mixed-links" not in codes(report)
    pairs = by_code(report, "best-gpu-groups")[0]
    assert pairs.evidence["groups"] == [[0, 1], [2, 3], [4, 5], [6, 7]]  # within NUMA nodes


def test_numa_affinity_advice_groups_gpus_by_node() -> None:
    report = analyze(parse_capture(capture("h100_8gpu_nv18_8nic_spaces.txt")))
    (advice,) = by_code(report, "numa-affinity")
    assert advice.evidence["places"] == [
        {"gpus": [0, 1, 2, 3], "numa_affinity": "0", "cpu_affinity": "0-47,96-143"},
        {"gpus": [4, 5, 6, 7], "numa_affinity": "1", "cpu_affinity": "48-95,144-191"},
    ]
    assert "numactl --cpunodebind=0" in (advice.fix or "")


def test_single_gpu_gets_no_grouping_advice() -> None:
    report = analyze(parse_capture(capture("tesla_p4_1gpu_numa_na.txt")))
    assert report.pairs == []
    assert "best-gpu-groups" not in codes(report)
