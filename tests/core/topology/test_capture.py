"""Every real capture parses to the labels, matrix and affinities it shows; damage is
repaired or refused with the line named."""

from __future__ import annotations

import pytest

from gpudiag.topology import CaptureError, parse_capture
from tests.helpers import TOPO, capture

NIC = [f"NIC{i}" for i in range(12)]


def gpus(n: int) -> list[str]:
    return [f"GPU{i}" for i in range(n)]


# file → (labels, {(row, col): cell}, {gpu: (cpu, numa, gpu numa id)}, NIC legend size, legend)
EXPECTED = {
    "dgx1_v100_nv1nv2_mlx5_spaces.txt": (
        [*gpus(8), "mlx5_0"],
        {
            ("GPU0", "GPU3"): "NV2",
            ("GPU0", "GPU5"): "SYS",
            ("GPU2", "mlx5_0"): "PIX",
            ("mlx5_0", "GPU0"): "NODE",
            ("GPU7", "GPU6"): "NV2",
        },
        {"GPU0": ("0-11,24-35", None, None), "GPU7": ("12-23,36-47", None, None)},
        0,
        "modern",
    ),
    "dgx1_v100_nv1nv2_mlx5_crlf.txt": (
        [*gpus(8), "mlx5_0"],
        {("GPU4", "GPU7"): "NV2", ("GPU3", "GPU7"): "NV1", ("mlx5_0", "GPU3"): "PIX"},
        {"GPU4": ("12-23,36-47", None, None)},
        0,
        "modern",
    ),
    "dgx_a100_8gpu_nv12_10nic_spaces.txt": (
        [*gpus(8), *NIC[:10]],
        {
            ("GPU0", "GPU7"): "NV12",
            ("GPU0", "NIC0"): "PXB",
            ("GPU0", "NIC2"): "SYS",
            ("NIC8", "NIC9"): "PIX",
            ("NIC9", "NIC8"): "PIX",
        },
        {
            "GPU0": ("48-63,176-191", "3", None),
            "GPU4": ("112-127,240-255", "7", None),
            "GPU7": ("80-95,208-223", "5", None),
        },
        10,
        "modern",
    ),
    "gb200_4gpu_nv18_numa_na.txt": (
        gpus(4),
        {("GPU0", "GPU3"): "NV18"},
        {"GPU0": ("0-71", "0", None), "GPU3": ("72-143", "1", None)},
        0,
        "modern",
    ),
    "gb200_4gpu_nv18_6nic_gpu_numa_id_fragment.txt": (
        [*gpus(4), *NIC[:6]],
        {
            ("GPU0", "GPU1"): "NV18",
            ("GPU3", "GPU0"): "NV18",
            ("GPU2", "NIC5"): "SYS",
            ("NIC0", "GPU2"): "SYS",
            ("NIC0", "NIC1"): None,
            ("GPU3", "NIC0"): None,
        },
        {
            "GPU0": ("0-71", "0,3-9,11-17", "2"),
            "GPU2": ("72-143", "1,19-25,27-33", "18"),
            "GPU3": (None, None, None),
        },
        0,
        None,
    ),
    "h100_8gpu_nv18_8nic_spaces.txt": (
        [*gpus(8), *NIC[:8]],
        {("GPU1", "NIC1"): "PIX", ("GPU1", "NIC4"): "SYS", ("NIC7", "NIC6"): "NODE"},
        {"GPU0": ("0-47,96-143", "0", None), "GPU7": ("48-95,144-191", "1", None)},
        8,
        "modern",
    ),
    "h100pcie_1gpu_1nic_kvm.txt": (
        ["GPU0", "NIC0"],
        {("GPU0", "NIC0"): "PHB", ("NIC0", "GPU0"): "PHB"},
        {"GPU0": ("0-251", "0", None)},
        1,
        "modern",
    ),
    "h200_8gpu_nv18_12nic_tabs.txt": (
        [*gpus(8), *NIC],
        {("GPU1", "NIC3"): "PXB", ("GPU5", "NIC9"): "PXB", ("NIC1", "NIC2"): "PIX", ("NIC11", "GPU7"): "PXB"},
        {"GPU0": ("0-55,112-167", "0", None), "GPU7": ("56-111,168-223", "1", None)},
        12,
        "modern",
    ),
    "h200_8gpu_reformatted_annotated_blog.txt": (
        [*gpus(8), *NIC[:9]],
        {("GPU0", "NIC0"): "PIX", ("GPU0", "NIC8"): "NODE", ("NIC8", "GPU4"): "SYS"},
        {"GPU0": ("0,2-47,96-143", "0", None), "GPU4": ("48-95,144-191", "1", None)},
        9,
        "modern",
    ),
    "k80_4gpu_mlx4_oldest_legend.txt": (
        [*gpus(4), "mlx4_0"],
        {("GPU0", "GPU1"): "PIX", ("GPU1", "GPU2"): "PHB", ("mlx4_0", "GPU3"): "PHB"},
        {"GPU0": ("0-11", None, None)},
        0,
        "oldest",
    ),
    "p40_8gpu_pix_pxb_soc_legacy_tabs.txt": (
        [*gpus(8), "mlx5_0"],
        {("GPU0", "GPU3"): "PIX", ("GPU3", "GPU4"): "PXB", ("GPU0", "mlx5_0"): "SOC"},
        {"GPU0": ("0-13", None, None)},
        0,
        "soc",
    ),
    "rtx4090_8gpu_all_sys_2nic_tabs.txt": (
        [*gpus(8), "NIC0", "NIC1"],
        {("GPU0", "GPU1"): "SYS", ("GPU6", "NIC0"): "PHB", ("NIC0", "NIC1"): "PIX"},
        {"GPU0": ("0-55,112-167", "0", None), "GPU7": ("56-111,168-223", "1", None)},
        0,
        None,
    ),
    "rtx5090_2gpu_phb_tabs.txt": (
        gpus(2),
        {("GPU0", "GPU1"): "PHB"},
        {"GPU1": ("0-63", "0", None)},
        0,
        "modern",
    ),
    "rtx6000ada_2gpu_phb_2nic_workstation.txt": (
        [*gpus(2), "NIC0", "NIC1"],
        {("GPU0", "GPU1"): "PHB", ("GPU1", "NIC0"): "NODE", ("NIC1", "NIC0"): "PIX"},
        {"GPU0": ("0-23", "0", None)},
        2,
        "modern",
    ),
    "rtx6000ada_4gpu_node_sys_4nic.txt": (
        [*gpus(4), *NIC[:4]],
        {("GPU0", "GPU1"): "NODE", ("GPU1", "GPU2"): "SYS", ("GPU3", "NIC3"): "NODE"},
        {"GPU0": ("0-31", "0", None), "GPU3": ("32-63", "1", None)},
        4,
        "modern",
    ),
    "seed_8gpu_nv4_pairs_node_sys.txt": (
        gpus(8),
        {("GPU0", "GPU1"): "NV4", ("GPU5", "GPU6"): "NODE", ("GPU5", "GPU2"): "SYS", ("GPU0", "GPU0"): "X"},
        {"GPU0": ("0-31", None, None), "GPU4": ("32-6", None, None)},
        0,
        "modern",
    ),
    "tesla_p4_1gpu_numa_na.txt": (
        gpus(1),
        {("GPU0", "GPU0"): "X"},
        {"GPU0": ("0-7", None, None)},
        0,
        "modern",
    ),
    "v100_4gpu_nv1_nv2_numa.txt": (
        gpus(4),
        {("GPU0", "GPU3"): "NV1", ("GPU1", "GPU3"): "NV2"},
        {"GPU2": ("20-39,60-79", "1", None)},
        0,
        "modern",
    ),
}


def test_every_topology_capture_has_expectations() -> None:
    not_topo = {
        "amd_rocm_smi_showtopo_4gpu_pcie.txt",
        "p2pBandwidthLatencyTest_rtx6000ada_2gpu.txt",
        "p2pBandwidthLatencyTest_rtx6000ada_4gpu.txt",
        "p2p_rw_rtx5090_2gpu_gns.txt",
    }
    assert {p.name for p in TOPO.glob("*.txt")} == set(EXPECTED) | not_topo


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_capture_parses_to_what_it_shows(name: str) -> None:
    labels, cells, affinity, nic_legend, legend = EXPECTED[name]
    topo = parse_capture(capture(name), name)
    assert topo.source == "nvidia-smi"
    assert topo.labels == labels
    assert set(topo.matrix) == set(labels)
    for (row, col), value in cells.items():
        assert topo.cell(row, col) == value, (row, col)
    for gpu, (cpu, numa, gpu_numa) in affinity.items():
        info = topo.gpus[gpu]
        assert (info.cpu_affinity, info.numa_affinity, info.gpu_numa_id) == (cpu, numa, gpu_numa)
    assert len(topo.nic_legend) == nic_legend
    assert topo.legend == legend


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_capture_matrix_is_square_with_self_on_the_diagonal_and_symmetric(name: str) -> None:
    topo = parse_capture(capture(name), name)
    for row in topo.labels:
        assert list(topo.matrix[row]) == topo.labels
        for col in topo.labels:
            assert (topo.cell(row, col) == "X") == (row == col)
            assert topo.cell(row, col) == topo.cell(col, row)


def test_nic_legend_keeps_non_contiguous_names_and_bonds() -> None:
    topo = parse_capture(capture("h200_8gpu_reformatted_annotated_blog.txt"))
    assert topo.nic_legend["NIC1"] == "mlx5_3"
    assert topo.nic_legend["NIC8"] == "mlx5_bond_0"


def test_nic_columns_named_by_device_keep_printed_order() -> None:
    text = (
        "\tGPU0\tGPU1\tmlx5_2\tmlx5_0\tCPU Affinity\n"
        "GPU0\t X \tNV1\tPIX\tSYS\t0-11\n"
        "GPU1\tNV1\t X \tSYS\tPIX\t12-23\n"
        "mlx5_2\tPIX\tSYS\t X \tSYS\n"
        "mlx5_0\tSYS\tPIX\tSYS\t X\n"
    )
    topo = parse_capture(text)
    assert topo.labels == ["GPU0", "GPU1", "mlx5_2", "mlx5_0"]
    assert topo.nic_labels == ["mlx5_2", "mlx5_0"]
    assert topo.cell("GPU1", "mlx5_0") == "PIX"


def test_merged_header_and_cells_are_split() -> None:
    text = capture("seed_8gpu_nv4_pairs_node_sys.txt")
    text = text.replace("\tGPU0\tGPU1\tGPU2", "\tGPU0GPU1GPU2")
    text = text.replace("GPU3\tNODE\tNODE\tNV4\tΧ\tSYS\tSYS", "GPU3\tNODENODE\tNV4 Χ SYS\tSYS")
    topo = parse_capture(text)
    assert topo.labels == gpus(8)
    assert [topo.cell("GPU3", c) for c in gpus(5)] == ["NODE", "NODE", "NV4", "X", "SYS"]


def test_merged_nic_headings_are_split() -> None:
    text = capture("dgx_a100_8gpu_nv12_10nic_spaces.txt").replace("NIC7    NIC8", "NIC7NIC8")
    assert parse_capture(text).labels == parse_capture(capture("dgx_a100_8gpu_nv12_10nic_spaces.txt")).labels


def test_ansi_escapes_single_spaces_and_surrounding_text() -> None:
    base = capture("v100_4gpu_nv1_nv2_numa.txt")
    lines = base.split("\n")
    lines[0] = "\x1b[4m" + lines[0] + "\x1b[0m"
    squeezed = "\n".join(" ".join(line.split()) for line in lines)
    text = "NVIDIA Topology:\n" + squeezed + "\n\nHypervisor vendor: KVM\nulimit soft: 1048576\n"
    topo = parse_capture(text)
    assert topo.labels == gpus(4)
    assert topo.cell("GPU1", "GPU3") == "NV2"
    assert topo.gpus["GPU0"].cpu_affinity == "20-39,60-79"
    assert topo.gpus["GPU0"].numa_affinity == "1"


def test_truncated_heading_cpu_is_cpu_affinity() -> None:
    topo = parse_capture(capture("seed_8gpu_nv4_pairs_node_sys.txt"))
    assert topo.gpus["GPU7"].cpu_affinity == "32-6"  # kept as printed, even when cut


def test_p2p_status_capture_alone() -> None:
    topo = parse_capture(capture("p2p_rw_rtx5090_2gpu_gns.txt"))
    assert topo.labels == gpus(2)
    assert topo.cell("GPU0", "GPU1") is None
    assert topo.p2p["reported"]["GPU0"]["GPU1"] == "GNS"
    (pair,) = topo.pairs()
    assert (pair.a, pair.b, pair.link, pair.p2p) == (0, 1, None, "GNS")


def test_topology_followed_by_p2p_status_capture() -> None:
    text = (
        capture("rtx5090_2gpu_phb_tabs.txt")
        + "\n$ nvidia-smi topo -p2p rw\n"
        + capture("p2p_rw_rtx5090_2gpu_gns.txt")
    )
    (pair,) = parse_capture(text).pairs()
    assert (pair.link, pair.kind, pair.path, pair.p2p) == ("PHB", "pcie", "PHB", "GNS")


def test_asymmetric_cell_is_kept_and_readable() -> None:
    text = capture("v100_4gpu_nv1_nv2_numa.txt").replace(
        "GPU2    NV2     NV1      X      NV1", "GPU2    NV2     NV1      X      NV2"
    )
    topo = parse_capture(text)
    assert topo.cell("GPU2", "GPU3") == "NV2"
    assert topo.cell("GPU3", "GPU2") == "NV1"


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("amd", capture("amd_rocm_smi_showtopo_4gpu_pcie.txt"), "rocm-smi"),
        ("p2p test", capture("p2pBandwidthLatencyTest_rtx6000ada_2gpu.txt"), "p2pBandwidthLatencyTest"),
        ("empty", "", "no `nvidia-smi topo -m` matrix"),
        ("prose", "my GPUs are broken, please help\n", "no `nvidia-smi topo -m` matrix"),
        ("short row", "\tGPU0\tGPU1\tGPU2\nGPU0\t X \tNV4\nGPU1\tNV4\t X \tSYS\n", "line 2"),
        ("self off diagonal", "\tGPU0\tGPU1\nGPU0\t X \t X\nGPU1\tNV4\t X\n", "X off the diagonal"),
        ("no self", "\tGPU0\tGPU1\nGPU0\tSYS\tNV4\nGPU1\tNV4\t X\n", "where X (self) belongs"),
        ("unknown row", "\tGPU0\tGPU1\nGPU0\t X \tNV4\nGPU2\tNV4\t X\n", "GPU2 is not a column"),
        ("extra cell", "\tGPU0\tGPU1\nGPU0\t X \tNV4\tSYS\nGPU1\tNV4\t X\n", "more cells"),
        ("bad code", "\tGPU0\tGPU1\nGPU0\t X \tNVL\nGPU1\tNV4\t X\n", "'NVL'"),
        ("duplicate row", "\tGPU0\tGPU1\nGPU0\t X \tNV4\nGPU0\t X \tNV4\n", "appears twice"),
        ("merged number", "\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tNV120-7\nGPU1\tNV12\t X\t0-7\n", "line 2"),
    ],
)
def test_what_cannot_be_read_is_one_clear_error(name: str, text: str, message: str) -> None:
    with pytest.raises(CaptureError) as info:
        parse_capture(text, "topo.txt")
    assert message in str(info.value)
    assert str(info.value).startswith("topo.txt")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("name", ["seed_8gpu_nv4_pairs_node_sys.txt", "h200_8gpu_nv18_12nic_tabs.txt"])
def test_markdown_table_paste_reads_back_the_same_matrix(name: str) -> None:
    import io

    from gpudiag.render.markdown import topology as markdown
    from gpudiag.topology.analysis import analyze

    original = parse_capture(capture(name))
    out = io.StringIO()
    markdown(analyze(original), out)
    again = parse_capture(out.getvalue())
    assert again.labels == original.labels
    assert again.matrix == original.matrix
    assert again.gpus == original.gpus
