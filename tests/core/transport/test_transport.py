"""gpudiag transport: real pasted NCCL_DEBUG=INFO logs (tests/data/nccl/SOURCES.md) read
into the right pairs, transports and channel counts; damaged lines reported by number;
findings only where the log and topology show a slower path."""

from __future__ import annotations

import pytest

from gpudiag.hw.sources import read_machine_or_capture
from gpudiag.transport.analysis import TransportReport, analyze
from gpudiag.transport.reader import busid_from_nccl, read_log, transport_family
from tests.helpers import NCCL, TOPO


def report(*names: str, machine: str | None = None, text: str | None = None) -> TransportReport:
    texts = [((NCCL / n).read_text(encoding="utf-8"), n) for n in names]
    if text is not None:
        texts.append((text, "inline"))
    topo = read_machine_or_capture(str(TOPO / machine)) if machine else None
    return analyze(read_log(texts), topo)


def pair_table(rep: TransportReport) -> dict[tuple[int, int, str], int]:
    return {(p.from_rank, p.to_rank, p.transport): len(p.channels) for p in rep.pairs}


def codes(rep: TransportReport) -> list[str]:
    return [f.code for f in rep.findings]


@pytest.mark.parametrize(
    ("raw", "family"),
    [
        ("P2P/IPC", "P2P/IPC"),
        ("P2P/IPC/read", "P2P/IPC"),
        ("P2P/CUMEM/read", "P2P/CUMEM"),
        ("P2P/direct pointer", "P2P/direct"),
        ("SHM/direct/direct", "SHM"),
        ("NET/Socket/3", "NET/Socket"),
        ("NET/IB/1/GDRDMA", "NET/IB"),
        ("NET/IBext_v8/3", "NET/IBext"),
        ("NET/AWS Libfabric/1/GDRDMA", "NET/AWS Libfabric"),
        ("P2P/IP", None),
        ("NET/IB/", None),
        ("P2P/IPChost", None),
    ],
)
def test_transport_families(raw: str, family: str | None) -> None:
    assert transport_family(raw) == family


def test_busid_as_nvidia_smi_writes_it() -> None:
    assert busid_from_nccl("3e000") == "00000000:3E:00.0"
    assert busid_from_nccl("60") == "00000000:00:06.0"  # (the H200 VM's GPU, /sys/.../0000:00:06.0)
    assert busid_from_nccl("zz") is None


def test_channel_nn_mm_dev_form_with_anonymised_host_and_cut_last_line() -> None:
    rep = report("nccl952_ipc_read_socket_anonymised_host.log")
    assert pair_table(rep) == {
        (8, 15, "P2P/IPC"): 7,
        (10, 9, "P2P/IPC"): 2,
        (12, 11, "P2P/IPC"): 2,
        (13, 12, "P2P/IPC"): 1,
        (15, 6, "NET/Socket"): 2,
        (15, 14, "P2P/IPC"): 2,
    }
    first = next(p for p in rep.pairs if p.from_rank == 8)
    assert (first.from_device, first.to_device, first.from_busid, first.raw) == (0, 7, None, "P2P/IPC/read")
    assert [u.line for u in rep.unread] == [17]  # `<cluster_name>:921`
    # `<cluster_name>` is one placeholder for every node: no host is trusted, no finding
    assert all(p.from_host is None for p in rep.pairs)
    assert rep.findings == [] and rep.exit_code() == 0


def test_old_ring_form_with_line_numbers_and_bus_ids() -> None:
    rep = report("nccl385_ring_line_numbers_stripped_prefix.log")
    table = pair_table(rep)
    assert len(rep.log.connections) == 11 and len(table) == 11
    assert table[(1, 8, "NET/IB")] == 1 and table[(12, 11, "P2P/IPC")] == 1
    pair = next(p for p in rep.pairs if (p.from_rank, p.to_rank) == (12, 11))
    assert (pair.from_device, pair.from_busid, pair.to_busid) == (
        None,
        "00000000:41:00.0",
        "00000000:2D:00.0",
    )
    assert rep.unread == [] and rep.exit_code() == 0


def test_send_and_receive_of_one_connection_count_once() -> None:
    rep = report("nccl429_channel_busid_ib_gdrdma_2hosts.log")
    net = [p for p in rep.pairs if p.transport == "NET/IB"]
    # 7 -> 14 on channel 3 is logged by both ends: one connection, one channel
    assert {(p.from_rank, p.to_rank): p.channels for p in net} == {(7, 14): [3], (15, 6): [1]}
    seven = next(p for p in net if p.from_rank == 7)
    assert (seven.from_host, seven.to_host) == ("machine-2", "machine-1")
    assert seven.raw == "NET/IB/0/GDRDMA"
    assert pair_table(rep)[(5, 7, "P2P/direct")] == 3  # (channel 4's line is cut before `via`)
    assert [(u.line, "before `via" in u.why) for u in rep.unread] == [(15, True)]
    assert rep.findings == []


def test_graphs_and_connected_all_rings_are_never_pairs() -> None:
    graphs = report("easydistill4_ring_graph_only.log")
    assert graphs.pairs == [] and graphs.unread == []
    assert codes(graphs) == ["nccl-no-transport-lines"]
    old = report("nccl229_old_ring_libfabric_channel_graph.log")
    assert pair_table(old) == {
        (0, 1, "P2P/IPC"): 1,
        (7, 8, "NET/AWS Libfabric"): 1,
        (8, 9, "P2P/IPC"): 1,
        (15, 0, "NET/AWS Libfabric"): 1,
    }
    seven = next(p for p in old.pairs if p.from_rank == 7)
    assert (seven.from_device, seven.to_device) == (None, None)  # (`7 -> 8`: no brackets)
    rings = report("awsofi715_cumem_read_timestamp_lines.log")
    assert pair_table(rings)[(3, 4, "P2P/CUMEM")] == 3
    assert sum(len(p.channels) for p in rings.pairs) == 12


def test_logging_framework_prefix_and_split_lines() -> None:
    rep = report("easydistill4_logging_prefix_split_lines.log")
    assert pair_table(rep) == {(2, 0, "P2P/IPC"): 5, (5, 0, "P2P/IPC"): 1, (7, 0, "P2P/IPC"): 3}
    assert {p.from_host for p in rep.pairs} == {"g340-cd51-4900-b72a-d104-a9bf-df48"}
    # the `- INFO - P2P/IPC` fragments carry no pair; the last line is cut before `via`
    assert [u.line for u in rep.unread] == [12]


def test_plugin_networks_and_a_shared_host_name() -> None:
    ofi = report("nccl1597_aws_libfabric_plugin.log")
    assert pair_table(ofi) == {(0, 1, "NET/AWS Libfabric"): 3, (1, 0, "NET/AWS Libfabric"): 8}
    assert ofi.log.warnings[0].startswith("NET/OFI Operation with NULL context")
    ibext = report("nccl1814_ibext_v8_plugin.log")
    assert pair_table(ibext)[(36, 20, "NET/IBext")] == 5
    # every node is `hostname-test` (not one host: no same-host finding); `NET/IBext_v8/N`
    # without /GDRDMA between nodes is data staged through host memory
    assert codes(ibext) == ["nccl-no-gdrdma"] and ibext.exit_code() == 1


def test_two_hosts_ib_and_cumem() -> None:
    rep = report("nccl1189_h20_2hosts_ib_send_receive_cumem.log")
    table = pair_table(rep)
    assert table[(1, 3, "NET/IB")] == 4 and table[(3, 1, "NET/IB")] == 4 and table[(1, 0, "P2P/CUMEM")] == 4
    assert [u.line for u in rep.unread] == [15]  # `… -> 0[0] [se`
    assert rep.findings == []


def test_old_ring_rank_only_form_and_a_rank_claimed_by_two_hosts() -> None:
    rep = report("nccl226_old_ring_ranks_only_socket.log")
    assert len(rep.pairs) == 14  # 15 lines, 45 -> 46 printed twice
    twice = next(p for p in rep.pairs if (p.from_rank, p.to_rank) == (45, 46))
    assert twice.to_host is None  # (two hosts printed it: no host is claimed)
    assert rep.findings == []


def test_real_logs_without_transport_lines_say_why() -> None:
    one = report("nccl2.28.9_ws1_h200_info.log")
    assert one.pairs == [] and one.log.versions == ["2.28.9"] and one.log.ib_not_found
    (finding,) = one.findings
    assert finding.code == "nccl-no-transport-lines" and "one rank" in finding.message
    dup = report("nccl2.28.9_2ranks_1gpu_duplicate.log")
    none = next(f for f in dup.findings if f.code == "nccl-no-transport-lines")
    assert "NCCL_DEBUG_SUBSYS=INIT,P2P,NET" in none.message
    assert any("Duplicate GPU detected" in w for w in dup.log.warnings)
    # the failure NCCL wrote is a finding of its own, explained
    warn = next(f for f in dup.findings if f.code == "nccl-warn")
    assert "Duplicate GPU detected" in warn.message and "same GPU" in (warn.cause or "")
    assert one.exit_code() == 0 and dup.exit_code() == 1


def test_settings_versions_and_ib_devices() -> None:
    ib = report("nv_peer_memory56_ib_devices_env_socket.log")
    assert ib.log.versions == ["2.4.7"] and ib.log.ib_devices == ["mlx5_0:1/IB"]
    assert ib.log.hosts == ["master_node", "secondary_node"]
    env = report("nccl1053_ib_disable_env_socket_lo.log")
    assert env.log.env["NCCL_IB_DISABLE"] == ["1"] and env.log.networks == ["Socket"]
    setting = next(f for f in env.findings if f.code == "nccl-transport-setting")
    assert setting.severity == "info" and "NCCL_IB_DISABLE=1" in setting.message
    assert env.exit_code() == 0


def test_shm_on_sys_pairs_is_normal() -> None:
    """The #1817 machine's log on an all-SYS capture: SHM is NCCL's own choice there."""
    rep = report("nccl1817_shm_and_p2p_direct_one_process.log", machine="rtx4090_8gpu_all_sys_2nic_tabs.txt")
    assert {p.offers for p in rep.pairs} == {"SYS"}
    assert rep.findings == [] and rep.exit_code() == 0


def test_shm_on_nvlink_pairs_is_a_slow_path() -> None:
    """The same log placed on an NV18 capture (a test construction: two real texts of two
    machines): SHM where NVLink exists is flagged; the send/receive connections
    (``Channel NN/1 … P2P/direct``) are not compared with the rings' as "mixed"."""
    rep = report("nccl1817_shm_and_p2p_direct_one_process.log", machine="h100_8gpu_nv18_8nic_spaces.txt")
    assert codes(rep) == ["nccl-slow-path"]
    slow = rep.findings[0]
    assert len(slow.evidence["pairs"]) == 4 and {p["transport"] for p in slow.evidence["pairs"]} == {"SHM"}
    assert "nvidia-smi topo -p2p r" in (slow.fix or "")
    assert rep.exit_code() == 1


# Situations no collected thread shows, built inline (synthetic, in NCCL 2.19+'s line form).
SYNTHETIC_SAME_HOST_NET = """\
nodeA:101:201 [0] NCCL INFO comm 0x1 rank 0 nRanks 2 nNodes 1 localRanks 2 localRank 0 MNNVL 0
nodeA:101:201 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] [send] via NET/Socket/0
nodeA:102:202 [1] NCCL INFO Channel 00/0 : 0[0] -> 1[1] [receive] via NET/Socket/0
nodeA:102:202 [1] NCCL INFO Channel 00/0 : 1[1] -> 0[0] [send] via NET/Socket/0
"""
SYNTHETIC_SOCKET_WITH_IB = """\
n1:11:21 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB ; OOB ib0:10.0.0.1<0>
n2:12:22 [0] NCCL INFO Channel 00/0 : 1[0] -> 0[0] [send] via NET/Socket/0
n1:11:21 [0] NCCL INFO Channel 00/0 : 1[0] -> 0[0] [receive] via NET/Socket/0
"""


def test_two_gpus_of_one_host_over_the_network() -> None:
    rep = analyze(read_log([(SYNTHETIC_SAME_HOST_NET, "synthetic")]))
    assert pair_table(rep) == {(0, 1, "NET/Socket"): 1, (1, 0, "NET/Socket"): 1}
    assert codes(rep) == ["nccl-same-host-net"] and rep.exit_code() == 1
    # the same lines from two hosts that both own a GPU 0: normal, quiet
    two_hosts = SYNTHETIC_SAME_HOST_NET.replace("nodeA:102", "nodeB:102").replace("nNodes 1", "nNodes 2")
    assert analyze(read_log([(two_hosts, "synthetic")])).findings == []


SYNTHETIC_MIXED = """\
h:1:2 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/IPC
h:3:4 [2] NCCL INFO Channel 00/0 : 2[2] -> 3[3] via SHM/direct/direct
"""


def test_mixed_transports_on_equal_pairs() -> None:
    """GPU0-GPU1 and GPU2-GPU3 are both NODE on this capture: P2P on one, SHM on the other."""
    rep = analyze(
        read_log([(SYNTHETIC_MIXED, "synthetic")]),
        read_machine_or_capture(str(TOPO / "rtx6000ada_4gpu_node_sys_4nic.txt")),
    )
    assert codes(rep) == ["nccl-mixed-transports"] and "NODE" in rep.findings[0].message
    # no topology: no claim either way, and no all-clear: the SHM pair needs the topology
    bare = analyze(read_log([(SYNTHETIC_MIXED, "synthetic")]))
    assert (
        codes(bare) == ["nccl-needs-topology"]
        and bare.exit_code() == 3
        and "2->3" in bare.findings[0].message
    )


def test_socket_where_ib_devices_are_logged() -> None:
    rep = analyze(read_log([(SYNTHETIC_SOCKET_WITH_IB, "synthetic")]))
    assert codes(rep) == ["nccl-socket-with-ib"] and "mlx5_0:1/IB" in rep.findings[0].message
    without_ib = SYNTHETIC_SOCKET_WITH_IB.split("\n", 1)[1]
    assert analyze(read_log([(without_ib, "synthetic")])).findings == []


@pytest.mark.parametrize(
    ("damage", "expect_pairs", "unread_lines"),
    [
        # two processes' lines merged into one: the first is glued to the second's prefix
        (
            "h:1:2 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/IPCh:3:4 [1] NCCL INFO "
            "Channel 00/0 : 1[1] -> 0[0] via P2P/IPC\n",
            {(1, 0, "P2P/IPC"): 1},
            [1],
        ),
        # a terminal border on both sides and a line number
        (
            "│ 12  h:1:2 [0] NCCL INFO Channel 03/0 : 0[0] -> 1[1] via SHM/direct/direct │\n",
            {(0, 1, "SHM"): 1},
            [],
        ),
        # a cut last line without a line end: `P2P/IPC` may have been `P2P/IPC/read`
        ("h:1:2 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/IPC", {}, [1]),
        ("h:1:2 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/IPC/read", {(0, 1, "P2P/IPC"): 1}, []),
        # a transport the reader does not know
        ("h:1:2 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via MAGIC/1\n", {}, [1]),
    ],
)
def test_damaged_lines(
    damage: str, expect_pairs: dict[tuple[int, int, str], int], unread_lines: list[int]
) -> None:
    rep = analyze(read_log([(damage, "paste")]))
    assert pair_table(rep) == expect_pairs
    assert [u.line for u in rep.unread] == unread_lines


def test_json_document() -> None:
    doc = report("nccl429_channel_busid_ib_gdrdma_2hosts.log").to_json()
    assert doc["schema"] == "gpudiag.transport/1" and doc["nccl_version"] is None
    pair = next(p for p in doc["pairs"] if (p["from_rank"], p["to_rank"]) == (7, 14))
    assert {
        k: pair[k] for k in ("from_device", "from_busid", "to_busid", "transport", "raw", "channels")
    } == {
        "from_device": None,
        "from_busid": "00000000:B2:00.0",
        "to_busid": "00000000:B1:00.0",
        "transport": "NET/IB",
        "raw": "NET/IB/0/GDRDMA",
        "channels": [3],
    }
    assert doc["unread"] == [
        {"line": 15, "source": None, "why": "cut off before `via …`", "text": "Channel 04 : 5[89000] ->"}
    ]


def test_terminal_borders_and_padding() -> None:
    rep = report("nccl733_terminal_borders_ib.log")
    assert pair_table(rep) == {
        (2, 6, "NET/IB"): 1,
        (4, 6, "NET/IB"): 1,
        (6, 2, "NET/IB"): 1,
        (6, 4, "NET/IB"): 1,
    }
    six = next(p for p in rep.pairs if p.from_rank == 6 and p.to_rank == 2)
    assert (six.from_busid, six.raw, six.from_host) == (
        "00000000:0E:00.0",
        "NET/IB/0/GDRDMA",
        "task-7703-j5hpd",
    )
    assert rep.unread == [] and rep.findings == []


def test_a_setting_names_the_pairs_on_the_path_it_leaves() -> None:
    """Synthetic: NCCL's own `set by environment` line with P2P disabled, and SHM used."""
    text = (
        "h:1:2 [0] NCCL INFO NCCL_P2P_DISABLE set by environment to 1.\n"
        "h:1:2 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via SHM/direct/direct\n"
    )
    rep = analyze(read_log([(text, "synthetic")]))
    judged, note = rep.findings
    assert note.code == "nccl-transport-setting" and note.severity == "info"
    assert "NCCL_P2P_DISABLE=1" in note.message and "0->1" in note.message
    # no topology: not an all-clear; the setting is named as why the pair took SHM
    assert judged.code == "nccl-needs-topology" and "NCCL_P2P_DISABLE=1" in (judged.cause or "")
    assert rep.exit_code() == 3 and rep.verdict == "needs-topology"


def test_a_setting_in_the_log_is_the_first_cause_of_a_slow_path() -> None:
    """Synthetic two-line log on a real NV18 capture: P2P disabled by the environment."""
    text = (
        "h:1:2 [0] NCCL INFO NCCL_P2P_DISABLE set by environment to 1.\n"
        "h:1:2 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via SHM/direct/direct\n"
    )
    topo = read_machine_or_capture(str(TOPO / "h100_8gpu_nv18_8nic_spaces.txt"))
    rep = analyze(read_log([(text, "synthetic")]), topo)
    slow = next(f for f in rep.findings if f.code == "nccl-slow-path")
    assert (slow.cause or "").startswith("1. set in the log: NCCL_P2P_DISABLE=1")
    assert rep.exit_code() == 1


def test_bus_ids_are_placed_on_the_machine_by_bus_id() -> None:
    """Synthetic bus-id log (NCCL 2.5-2.11 form) on the seed machine, its first two GPUs
    given bus ids: the pair is found by bus id, not by the rank or the order."""
    topo = read_machine_or_capture("seed_8gpu_machine.json")
    topo.gpus["GPU3"].pci_bus_id = "00000000:1B:00.0"
    topo.gpus["GPU2"].pci_bus_id = "00000000:1C:00.0"
    text = "h:1:2 [0] NCCL INFO Channel 00 : 0[1b000] -> 1[1c000] via SHM/direct/direct\n"
    rep = analyze(read_log([(text, "synthetic")]), topo)
    (pair,) = rep.pairs
    assert (pair.from_busid, pair.offers) == ("00000000:1B:00.0", "NV4")
    assert codes(rep) == ["nccl-slow-path"]
    unknown = analyze(read_log([(text.replace("1c000", "9c000"), "synthetic")]), topo)
    assert unknown.pairs[0].offers is None and codes(unknown) == ["nccl-needs-topology"]
    assert "not found" in (unknown.findings[0].cause or "")


def test_one_process_connecting_its_own_gpus_over_ib() -> None:
    """NVIDIA/nccl#707: one host, one process, four GPUs joined over NET/IB."""
    rep = report("nccl707_one_host_one_process_ib_between_own_gpus.log")
    assert pair_table(rep) == {
        (0, 1, "NET/IB"): 1,
        (0, 2, "NET/IB"): 1,
        (2, 0, "NET/IB"): 1,
        (2, 1, "NET/IB"): 1,
        (2, 3, "NET/IB"): 1,
        (3, 0, "NET/IB"): 1,
        (3, 2, "NET/IB"): 1,
    }
    assert codes(rep) == ["nccl-same-host-net"] and rep.exit_code() == 1
    cause = rep.findings[0].cause or ""
    assert "one process drives these GPUs" in cause and "containers or pods" not in cause
    assert [u.line for u in rep.unread] == [13]


def test_direct_pointer_read_and_ib_without_gdr_across_hosts() -> None:
    rep = report("nccl629_direct_pointer_read_ib_no_gdr_2hosts.log")
    table = pair_table(rep)
    assert table[(3, 2, "P2P/direct")] == 4 and table[(9, 0, "NET/IB")] == 1
    assert next(p.raw for p in rep.pairs if p.from_rank == 9) == "NET/IB/1"
    assert [u.line for u in rep.unread] == [14]
    # `[receive] via NET/IB/1` between two hosts: no GPUDirect RDMA
    assert codes(rep) == ["nccl-no-gdrdma"] and "9->0" in rep.findings[0].message


# CUDA_VISIBLE_DEVICES: NCCL's connection lines name CUDA device numbers, which are the
# process's own; its Init lines (2.16+) also give the NVML index, nvidia-smi's GPU number.
# Synthetic, in NCCL 2.19+'s line form; the machine is the real DGX-1 capture, where GPU0-GPU1
# and GPU4-GPU5 are NVLink and GPU0-GPU5 is SYS.
SYNTHETIC_VISIBLE_0_5 = """\
dgx:201:301 [0] NCCL INFO comm 0x1 rank 0 nranks 2 cudaDev 0 nvmlDev 0 busId 6000 - Init START
dgx:202:302 [1] NCCL INFO comm 0x2 rank 1 nranks 2 cudaDev 1 nvmlDev 5 busId 8a000 - Init START
dgx:201:301 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via SHM/direct/direct
dgx:202:302 [1] NCCL INFO Channel 00/0 : 1[1] -> 0[0] via SHM/direct/direct
"""
SYNTHETIC_ONE_GPU_EACH = """\
dgx:201:301 [0] NCCL INFO comm 0x1 rank 0 nranks 2 cudaDev 0 nvmlDev 4 busId 85000 - Init START
dgx:202:302 [0] NCCL INFO comm 0x2 rank 1 nranks 2 cudaDev 0 nvmlDev 5 busId 8a000 - Init START
dgx:201:301 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] via SHM/direct/direct
dgx:202:302 [0] NCCL INFO Channel 00/0 : 1[0] -> 0[0] via SHM/direct/direct
"""


def test_pairs_are_placed_by_nvidia_smi_number_under_cuda_visible_devices() -> None:
    """CUDA_VISIBLE_DEVICES=0,5: the pair is GPU0-GPU5 (SYS, where SHM is NCCL's normal
    choice), not GPU0-GPU1 (NVLink): placing it by CUDA device number called a healthy
    machine slow."""
    rep = report(text=SYNTHETIC_VISIBLE_0_5, machine="dgx1_v100_nv1nv2_mlx5_spaces.txt")
    assert {p.offers for p in rep.pairs} == {"SYS"}
    assert codes(rep) == [] and rep.exit_code() == 0
    assert [(p.from_device, p.to_device) for p in rep.pairs] == [(0, 1), (1, 0)]  # (the log's own numbers)


def test_each_process_seeing_its_own_gpu_is_named_from_the_log() -> None:
    """Every rank sees one GPU as cudaDev 0 (CUDA_VISIBLE_DEVICES per process): the pair is
    GPU4-GPU5 (NVLink), over SHM, and the first cause is what the log itself shows."""
    rep = report(text=SYNTHETIC_ONE_GPU_EACH, machine="dgx1_v100_nv1nv2_mlx5_spaces.txt")
    assert codes(rep) == ["nccl-slow-path"]
    assert {p.offers for p in rep.pairs} == {"NV1"}
    cause = rep.findings[0].cause or ""
    assert cause.startswith(
        "1. the log shows each process seeing its own GPU: cudaDev 0 is rank 0 GPU 4, rank 1 GPU 5"
    )
    assert cause.count("CUDA_VISIBLE_DEVICES set per process") == 1


# One GPU per process (GPUs 4, 5, 6 as cudaDev 0) and a second communicator of ranks 1 and
# 2, which numbers them 0 and 1: rank 0 cudaDev 0 is GPU 4 in one Init line and GPU 5 in
# the other, rank 1 GPU 5 and GPU 6.
SYNTHETIC_TWO_COMMS_DISAGREE = """\
dgx:201:301 [0] NCCL INFO comm 0x1 rank 0 nranks 3 cudaDev 0 nvmlDev 4 busId 85000 - Init START
dgx:202:302 [0] NCCL INFO comm 0x2 rank 1 nranks 3 cudaDev 0 nvmlDev 5 busId 8a000 - Init START
dgx:203:303 [0] NCCL INFO comm 0x3 rank 2 nranks 3 cudaDev 0 nvmlDev 6 busId 8b000 - Init START
dgx:202:302 [0] NCCL INFO comm 0x4 rank 0 nranks 2 cudaDev 0 nvmlDev 5 busId 8a000 - Init START
dgx:203:303 [0] NCCL INFO comm 0x5 rank 1 nranks 2 cudaDev 0 nvmlDev 6 busId 8b000 - Init START
dgx:202:302 [0] NCCL INFO Channel 00/0 : 1[0] -> 2[0] via SHM/direct/direct
dgx:203:303 [0] NCCL INFO Channel 00/0 : 2[0] -> 0[0] via SHM/direct/direct
"""


def test_a_rank_whose_init_lines_disagree_is_not_placed_on_its_cuda_device_number() -> None:
    """The lines say rank 0's cudaDev 0 is GPU 4 or GPU 5, never GPU 0: the pairs were placed
    on GPU0-GPU6 and GPU6-GPU0 (SYS), a path the log does not show (the truth, GPU5-GPU6 or
    GPU4-GPU6, is NVLink)."""
    rep = report(text=SYNTHETIC_TWO_COMMS_DISAGREE, machine="dgx1_v100_nv1nv2_mlx5_spaces.txt")
    assert [(p.from_rank, p.to_rank, p.offers) for p in rep.pairs] == [(1, 2, None), (2, 0, None)]
    assert codes(rep) == ["nccl-needs-topology"]
    agreeing = "\n".join(
        SYNTHETIC_TWO_COMMS_DISAGREE.splitlines()[:3] + SYNTHETIC_TWO_COMMS_DISAGREE.splitlines()[5:]
    )
    rep = report(text=agreeing + "\n", machine="dgx1_v100_nv1nv2_mlx5_spaces.txt")
    assert [(p.from_rank, p.to_rank, p.offers) for p in rep.pairs] == [(1, 2, "NV2"), (2, 0, "NV1")]


# Two hosts, each with CUDA_VISIBLE_DEVICES alike for its ranks (a: GPUs 0,1; b: GPUs 4,5):
# cudaDev 0 is GPU 0 on a and GPU 4 on b, which proves nothing about either host.
SYNTHETIC_TWO_HOSTS_ALIKE = """\
a:201:301 [0] NCCL INFO comm 0x1 rank 0 nranks 4 cudaDev 0 nvmlDev 0 busId 6000 - Init START
a:202:302 [1] NCCL INFO comm 0x2 rank 1 nranks 4 cudaDev 1 nvmlDev 1 busId 7000 - Init START
b:201:301 [0] NCCL INFO comm 0x3 rank 2 nranks 4 cudaDev 0 nvmlDev 4 busId 85000 - Init START
b:202:302 [1] NCCL INFO comm 0x4 rank 3 nranks 4 cudaDev 1 nvmlDev 5 busId 8a000 - Init START
a:201:301 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via SHM/direct/direct
a:202:302 [1] NCCL INFO Channel 00/0 : 1[1] -> 0[0] via SHM/direct/direct
b:201:301 [0] NCCL INFO Channel 00/0 : 2[0] -> 3[1] via SHM/direct/direct
b:202:302 [1] NCCL INFO Channel 00/0 : 3[1] -> 2[0] via SHM/direct/direct
"""


def test_one_cuda_device_number_on_two_hosts_is_no_evidence_of_per_process_visibility() -> None:
    """cudaDev 0 is GPU 0 on host a and GPU 4 on host b: each host set CUDA_VISIBLE_DEVICES
    alike for its ranks. The cause used to say "each process seeing its own GPU: cudaDev 0
    is rank 0 GPU 0, rank 2 GPU 4" — two ranks of two hosts."""
    rep = report(text=SYNTHETIC_TWO_HOSTS_ALIKE, machine="dgx1_v100_nv1nv2_mlx5_spaces.txt")
    assert codes(rep) == ["nccl-slow-path"]  # (SHM on NVLink pairs: still slow)
    assert "the log shows each process" not in (rep.findings[0].cause or "")
    one_host = SYNTHETIC_TWO_HOSTS_ALIKE.replace("b:2", "a:3")  # (the same lines on one host: evidence)
    rep = report(text=one_host, machine="dgx1_v100_nv1nv2_mlx5_spaces.txt")
    assert "cudaDev 0 is rank 0 GPU 0, rank 2 GPU 4" in (rep.findings[0].cause or "")
