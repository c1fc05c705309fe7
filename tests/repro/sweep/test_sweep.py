"""gpudiag sweep's judging, results and summary on synthetic nodes (no processes)."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import pytest

from gpudiag.errors import InputError
from gpudiag.repro.sweep.hosts import expand_nodelist, expected_hosts
from gpudiag.repro.sweep.judge import HEALTHY, NO_RESULT, PROBLEM, judge
from gpudiag.repro.sweep.links import first_round, judge_round, next_round
from gpudiag.repro.sweep.problems import leave_one_out_medians, median
from gpudiag.repro.sweep.results import NODE_SCHEMA, RESULTS, RULES, RUN, RUN_SCHEMA, results_jsonl
from gpudiag.repro.sweep.rules import DEFAULT_RULES, check_baseline, check_rules, load_rules
from tests.helpers import SEED_MACHINE, codes, invoke, within
from tests.helpers.procfs import children


def node(i: int, **changes: Any) -> dict[str, Any]:
    """A healthy synthetic node record; ``changes`` replace fields (``figures`` merges)."""
    rec: dict[str, Any] = {
        "schema": NODE_SCHEMA,
        "host": f"node{i}",
        "node": i,
        "rank": i,
        "simulated": False,
        "machine_type": "8x H100",
        "gpus": 8,
        "topology_digest": "abc",
        "versions": {
            "nvidia_driver": "560.35",
            "cuda_runtime": "12.6",
            "nccl_runtime": "2.21",
            "torch": "2.5",
        },
        "checks": [{"name": "peer", "status": "pass", "codes": [], "headline": "ok"}],
        "figures": {"intra_busbw_gbps": 400.0 + (i % 7), "pair_busbw_gbps": 45.0 + (i % 3) * 0.5},
        "allreduce": {"ok": True, "wrong": 0, "expected": 1.0},
        "pairs": [],
        "problems": [],
    }
    figures = changes.pop("figures", {})
    rec.update(changes)
    rec["figures"] = {**rec["figures"], **figures}
    return rec


def by_host(verdict: Any) -> dict[str, Any]:
    return {v.host: v for v in verdict.nodes}


def host_codes(verdict: Any, host: str) -> list[str]:
    """The problem codes the sweep's verdict gives ``host``."""
    return codes(by_host(verdict)[host])


def test_leave_one_out_median_equals_the_median_of_the_others() -> None:
    rng = random.Random(0)
    for n in range(0, 14):
        for _ in range(30):
            values = [rng.choice([1.0, 2.0, 2.0, rng.random() * 3]) for _ in range(n)]
            got = leave_one_out_medians(values)
            for i in range(n):
                rest = values[:i] + values[i + 1 :]
                assert got[i] == median(rest)


def test_a_clean_fleet_names_nobody() -> None:
    verdict = judge([node(i) for i in range(16)], expected_hosts=[f"node{i}" for i in range(16)])
    assert verdict.exit_code == 0 and not verdict.named
    assert all(v.status == HEALTHY for v in verdict.nodes)


def test_each_kind_of_outlier_is_named_and_nobody_else() -> None:
    records = [node(i) for i in range(10)]
    records[2] = node(2, figures={"intra_busbw_gbps": 250.0})  # 37% below the others
    records[3] = node(3, versions={**records[3]["versions"], "nvidia_driver": "550.1"})
    records[4] = node(4, topology_digest="xyz")
    records[5] = node(5, gpus=7)
    records[6] = node(
        6, checks=[{"name": "nancheck", "status": "fail", "codes": ["link-corruption"], "headline": "x"}]
    )
    records[7] = node(7, allreduce={"ok": False, "wrong": 3, "expected": 55.0})
    verdict = judge(records, expected_hosts=[f"node{i}" for i in range(11)])
    assert host_codes(verdict, "node2") == ["node-figure-low"]
    assert host_codes(verdict, "node3") == ["node-version-differs"]
    assert host_codes(verdict, "node4") == ["node-topology-differs"]
    assert host_codes(verdict, "node5") == ["node-fewer-gpus"]
    assert host_codes(verdict, "node6") == ["node-check-failed"]
    assert host_codes(verdict, "node7") == ["node-allreduce-wrong"]
    assert by_host(verdict)["node10"].status == NO_RESULT and host_codes(verdict, "node10") == [
        "node-missing"
    ]
    assert {v.host for v in verdict.named} == {f"node{i}" for i in (2, 3, 4, 5, 6, 7, 10)}
    low = by_host(verdict)["node2"].problems[0]
    assert low.measured == 250.0 and "0.8" in low.expected  # expected vs measured
    assert verdict.exit_code == 1


def test_rules_change_the_threshold_and_a_baseline_judges_a_lone_type() -> None:
    records = [node(i) for i in range(4)]
    records[1] = node(1, figures={"intra_busbw_gbps": 300.0})  # 25 % below
    assert host_codes(judge(records), "node1") == ["node-figure-low"]
    rules = check_rules({"figures": {"intra_busbw_gbps": {"min_fraction_of_median": 0.5}}})
    assert judge(records, rules=rules).exit_code == 0
    baseline = check_baseline(
        {"schema": "gpudiag.sweep-baseline/1", "machine_types": {"8x H100": {"intra_busbw_gbps": 450.0}}}
    )
    verdict = judge(records, rules=rules, baseline=baseline)
    assert host_codes(verdict, "node1") == ["node-below-baseline"]  # 300 < 0.8 × 450; 400+ is not


def test_bad_rules_and_baselines_are_input_errors(tmp_path: Path) -> None:
    for bad in (
        [],
        {"figures": {"nope": {"min_fraction_of_median": 0.5}}},
        {"figures": {"intra_busbw_gbps": {"min_fraction_of_median": 1.5}}},
        {"min_nodes": 1},
        {"versions": ["kernel"]},
        {"schema": "gpudiag.other/1"},
        {"surprise": 1},
    ):
        with pytest.raises(InputError):
            check_rules(bad)
    with pytest.raises(InputError):
        check_baseline({"machine_types": {"x": {"intra_busbw_gbps": -1}}})
    path = tmp_path / "rules.json"
    path.write_text("{not json")
    with pytest.raises(InputError, match="not JSON"):
        load_rules(path)
    assert load_rules(None) == DEFAULT_RULES


def test_slurm_node_lists_expand() -> None:
    assert expand_nodelist("node[01-03,07]") == ["node01", "node02", "node03", "node07"]
    assert expand_nodelist("a1,gpu-[8-10]x,b") == ["a1", "gpu-8x", "gpu-9x", "gpu-10x", "b"]
    assert expand_nodelist("n[08-10]") == ["n08", "n09", "n10"]
    assert expected_hosts(None, {"SLURM_JOB_NODELIST": "c[1-2]"}) == (["c1", "c2"], "SLURM_JOB_NODELIST")
    assert expected_hosts("x,y", {"SLURM_JOB_NODELIST": "c[1-2]"}) == (["x", "y"], "--expect-hosts")
    for bad in ("node[1-", "node[3-1]", "node[a-b]", "node]1["):
        with pytest.raises(InputError):
            expand_nodelist(bad)


def _pair_test(nodes: list[int], slow: set[int], corrupt: set[int]) -> list[dict[str, Any]]:
    """Play the pairwise link test: a pair is as fast as its slower node; values are
    wrong at a corrupting node. Returns records carrying the pair entries."""
    records = {n: node(n, figures={"pair_busbw_gbps": None}) for n in nodes}
    history: dict[int, Any] = {}
    pairs, rnd = first_round(nodes), 1
    while pairs:
        for a, b in pairs:
            bw = 5.0 if {a, b} & slow else 45.0
            for me, peer in ((a, b), (b, a)):
                entry = {"round": rnd, "peer": peer, "busbw_gbps": bw, "ok": me not in corrupt, "wrong": 0}
                records[me]["pairs"].append(entry)
        from gpudiag.repro.sweep.links import pair_rounds

        history[rnd] = judge_round(pair_rounds(list(records.values()))[rnd], 0.8, None if rnd == 1 else 45.0)
        pairs, rnd = next_round(nodes, history), rnd + 1
        assert rnd < 10
    return list(records.values())


def test_pairwise_link_test_names_the_slow_and_the_corrupting_node_and_clears_their_partners() -> None:
    records = _pair_test(list(range(8)), slow={3}, corrupt={6})
    assert max(e["round"] for r in records for e in r["pairs"]) == 2  # O(1) rounds here
    verdict = judge(records)
    assert host_codes(verdict, "node3") == ["node-link-slow"]
    assert host_codes(verdict, "node6") == ["node-link-corrupt"]
    assert {v.host for v in verdict.named} == {"node3", "node6"}
    assert any("cleared" in n for n in by_host(verdict)["node2"].notes)  # slow with node3 in round 1
    assert any("cleared" in n for n in by_host(verdict)["node7"].notes)
    partners = [n for v in verdict.nodes if v.host in ("node0", "node1", "node4", "node5") for n in v.notes]
    assert partners == []  # known-good partners in round 2: nothing to clear


def test_odd_fleet_pairs_the_last_node_in_round_two() -> None:
    assert first_round([0, 1, 2, 3, 4]) == [(0, 1), (2, 3)]
    records = _pair_test(list(range(5)), slow={4}, corrupt=set())
    assert host_codes(judge(records), "node4") == ["node-link-slow"]
    assert not judge(_pair_test(list(range(5)), slow=set(), corrupt=set())).named


def _write_sweep(folder: Path, records: list[dict[str, Any]], expected: list[str]) -> None:
    folder.mkdir()
    (folder / RESULTS).write_text(results_jsonl(records))
    (folder / RUN).write_text(json.dumps({"schema": RUN_SCHEMA, "expected_hosts": expected}))
    (folder / RULES).write_text(json.dumps(DEFAULT_RULES))


def test_summary_rejudges_a_folder_from_the_command_line(tmp_path: Path) -> None:
    records = [node(i) for i in range(5)]
    records[1] = node(1, figures={"intra_busbw_gbps": 100.0})
    _write_sweep(tmp_path / "sweep", records, [f"node{i}" for i in range(6)])
    result = invoke(["sweep", "--summary", str(tmp_path / "sweep"), "--format", "json"])
    assert result.exit_code == 1, result.output
    doc = json.loads(result.stdout)
    assert doc["schema"] == "gpudiag.sweep/1" and doc["problem"] == 1 and doc["no_result"] == 1
    named = {n["host"]: n for n in doc["nodes"] if n["status"] != HEALTHY}
    assert named["node1"]["status"] == PROBLEM and named["node5"]["status"] == NO_RESULT
    text = invoke(["sweep", "--summary", str(tmp_path / "sweep")]).stdout
    assert "node1: problem: node-figure-low" in text and "node5: no result: node-missing" in text
    md = invoke(["sweep", "--summary", str(tmp_path / "sweep"), "--format", "markdown"]).stdout
    assert md.startswith("# gpudiag sweep: 6 node(s): 4 healthy, 1 problem, 1 no result")
    rules = tmp_path / "loose.json"
    rules.write_text(json.dumps({"figures": {"intra_busbw_gbps": {"min_fraction_of_median": 0.2}}}))
    again = invoke(
        ["sweep", "--summary", str(tmp_path / "sweep"), "--rules", str(rules), "--expect-hosts", "node[0-4]"],
    )
    assert again.exit_code == 0, again.output


def test_a_damaged_results_line_is_exit_2_naming_the_line(tmp_path: Path) -> None:
    _write_sweep(tmp_path / "sweep", [node(0), node(1)], [])
    path = tmp_path / "sweep" / RESULTS
    path.write_text(path.read_text() + '{"schema": "gpudiag.sweep-node/1", "host": 3}\n')
    result = invoke(["sweep", "--summary", str(tmp_path / "sweep")])
    assert result.exit_code == 2 and "results.jsonl:3" in result.stderr
    missing = invoke(["sweep", "--summary", str(tmp_path / "nothing")])
    assert missing.exit_code == 2 and "not a gpudiag sweep folder" in missing.stderr


def test_hostname_variable_overrides_the_host_name_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpudiag.identity import hostname
    from gpudiag.redact import Redactor

    monkeypatch.setenv("GPUDIAG_HOSTNAME", "rack7-node3")
    assert hostname() == "rack7-node3"
    assert Redactor(anonymize=True).text("ran on rack7-node3 today") == "ran on <host> today"
    monkeypatch.setenv("GPUDIAG_HOSTNAME", "  ")
    assert hostname() != "  "


def test_missing_nodes_are_named_by_host_or_by_number() -> None:
    records = [node(0, host="n0.cluster.local"), node(1)]
    verdict = judge(records, expected_hosts=["n0", "node1", "node2"], expected_nodes=3)
    assert [v.host for v in verdict.named] == ["node2"]  # n0 is n0.cluster.local; node #2 is node2
    verdict = judge(records, expected_nodes=3)
    assert [(v.host, v.status) for v in verdict.named] == [("node #2", NO_RESULT)]
    verdict.failed = True
    assert judge(records).exit_code == 0 and verdict.exit_code == 1


@pytest.mark.usefixtures("no_gpu")
def test_bad_usage_is_one_line_and_exit_2_before_anything_runs(tmp_path: Path) -> None:
    (tmp_path / "taken").mkdir()
    for args, message in (
        (["--expect-hosts", "node[1-"], "unbalanced"),
        (["-o", str(tmp_path / "taken")], "exists; pass --force"),
        (["--inject-stall", "nope"], "expected one of"),
        (["--rules", str(tmp_path / "none.json")], "cannot read it"),
        (["--inject", "0->1:melt"], "--inject"),
    ):
        result = invoke(["sweep", "-o", str(tmp_path / "out"), *args])
        assert result.exit_code == 2, (args, result.output)
        assert message in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()
    nccl = invoke(["sweep", "-o", str(tmp_path / "out"), "--backend", "nccl"])
    assert nccl.exit_code == 3 and "needs a CUDA GPU" in nccl.stderr


def test_host_facts_that_differ_from_the_majority_are_named() -> None:
    facts = {"iommu": "off", "acs_redirect": False, "nccl_env": {"NCCL_ALGO": "Ring"}}
    records = [node(i, host_facts=facts) for i in range(5)]
    records[1] = node(1, host_facts={**facts, "nccl_env": {"NCCL_ALGO": "Ring", "NCCL_P2P_DISABLE": "1"}})
    records[3] = node(3, host_facts={**facts, "iommu": "translated"})
    records[4] = node(4, host_facts=None)  # env did not run there: nothing to compare
    verdict = judge(records)
    assert {v.host: host_codes(verdict, v.host) for v in verdict.named} == {
        "node1": ["node-host-differs"],
        "node3": ["node-host-differs"],
    }
    assert verdict.majority["host.nccl_env"] == {"NCCL_ALGO": "Ring"}
    assert judge(records, rules=check_rules({"host": []})).exit_code == 0


@pytest.mark.usefixtures("no_gpu")
def test_alone_the_sweep_is_a_fleet_of_one_and_leaves_the_environment_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpudiag.repro.sweep.run import SweepOptions, sweep

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "NCCL_ALGO", "TORCH_NCCL_NAN_CHECK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GPUDIAG_HOSTNAME", "solo")
    before = dict(os.environ)
    seed = SEED_MACHINE
    doc = json.loads(seed.read_text())
    doc["labels"], doc["gpus"] = doc["labels"][:2], doc["gpus"][:2]
    doc["matrix"] = [["X", "NV4"], ["NV4", "X"]]
    (tmp_path / "m.json").write_text(json.dumps(doc))
    options = SweepOptions(
        output=str(tmp_path / "out"), machine=str(tmp_path / "m.json"), quick=True, checks=("env", "topology")
    )
    result = sweep(options)
    assert dict(os.environ) == before
    assert result.exit_code == 0 and [v.host for v in result.verdict.nodes] == ["solo"]  # type: ignore[union-attr]
    assert result.run["pinned"]["NCCL_ALGO"] == "Ring" and result.run["backend"] == "gloo"
    assert any("fleet of one" in n for n in result.run["notes"])
    record = json.loads((tmp_path / "out" / RESULTS).read_text())
    assert record["simulated"] and record["gpus"] == 2 and record["figures"]["intra_busbw_gbps"] > 0
    assert (tmp_path / "out" / "nodes" / "solo.zip").is_file() and (tmp_path / "out" / "SUMMARY.md").is_file()


def test_two_nodes_that_disagree_are_both_named_not_a_made_up_majority() -> None:
    versions = node(1)["versions"]
    verdict = judge([node(0), node(1, versions={**versions, "torch": "2.0"}, host_facts={"iommu": "on"})])
    for host in ("node0", "node1"):
        assert "node-version-differs" in host_codes(verdict, host)
    assert "no majority" in by_host(verdict)["node1"].problems[0].message
    assert verdict.exit_code == 1
    assert "node-fewer-gpus" in host_codes(judge([node(0), node(1, gpus=4)]), "node1")  # fewer than the most


def test_simulated_figures_are_not_judged_unless_the_rules_ask() -> None:
    records = [node(i, simulated=True) for i in range(4)]
    records[2] = node(2, simulated=True, figures={"intra_busbw_gbps": 1.0})
    assert judge(records).exit_code == 0
    asked = check_rules({"judge_simulated_figures": True})
    assert host_codes(judge(records, rules=asked), "node2") == ["node-figure-low"]
    pair = [node(0), node(1, figures={"pair_busbw_gbps": 1.0})]  # one link seen from both ends
    assert judge(pair).exit_code == 0


@pytest.mark.parametrize(
    "change",
    [
        {"gpus": "x"},
        {"gpus": 1e29},
        {"host_facts": "on"},
        {"topology_digest": ["a"]},
        {"versions": {"torch": ["2.5"]}},
        {"checks": [{"a": 1}]},
        {"figures": {"intra_busbw_gbps": float("nan")}},
        {"figures": {"intra_busbw_gbps": -1}},
        {"figures": {"intra_busbw_gbps": True}},
    ],
)
def test_wrongly_typed_records_are_exit_2_naming_the_field(tmp_path: Path, change: dict[str, Any]) -> None:
    rec = node(1)
    rec.update(change)
    path = tmp_path / RESULTS
    path.write_text(json.dumps(node(0)) + "\n" + json.dumps(rec) + "\n")
    result = invoke(["sweep", "--summary", str(path), "--format", "markdown"])
    assert result.exit_code == 2 and f"{RESULTS}:2" in result.stderr, result.output
    path.write_text("")
    empty = invoke(["sweep", "--summary", str(path)])
    assert empty.exit_code == 2 and "no node records" in empty.stderr


@pytest.mark.parametrize("hosts", ["", " ", ",", "node0 node1"])
def test_an_expect_hosts_list_that_names_no_host_is_exit_2(tmp_path: Path, hosts: str) -> None:
    _write_sweep(tmp_path / "sweep", [node(0), node(1)], [])
    result = invoke(["sweep", "--summary", str(tmp_path / "sweep"), "--expect-hosts", hosts])
    assert result.exit_code == 2 and "--expect-hosts" in result.stderr, result.output


@pytest.mark.usefixtures("no_gpu")
def test_a_node_with_no_gpu_and_no_machine_file_is_never_healthy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpudiag.repro.sweep.node import Identity, SweepOptions, local_phase

    monkeypatch.setenv("GPUDIAG_HOSTNAME", "bare")
    alone = invoke(["sweep", "-o", str(tmp_path / "out"), "--quick"])
    assert alone.exit_code == 3, alone.output
    assert alone.stderr.count("\n") == 1 and "no CUDA GPU here" in alone.stderr
    assert not (tmp_path / "out").exists()
    # in a fleet (under torchrun) the node is judged with the others and named
    ident = Identity(1, 2, 0, 1, "bare", True, 2)
    record = local_phase(SweepOptions(quick=True, checks=("topology",)), ident, "gloo").record
    assert record["gpus"] == 0 and record["simulated"] is False
    verdict = judge([node(0, gpus=0, simulated=False), record])
    assert by_host(verdict)["bare"].status == PROBLEM
    assert "node-no-gpus" in host_codes(verdict, "bare") and "node-no-gpus" in host_codes(verdict, "node0")
    assert verdict.exit_code == 1 and verdict.simulated is False


@pytest.mark.usefixtures("no_gpu")
def test_flight_recorder_dumps_land_in_the_node_bundle_and_the_scratch_folder_goes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import zipfile

    import gpudiag.repro.sweep.node as node_module
    from gpudiag.repro.sweep.run import (
        FLIGHT_RECORDER,
        FLIGHT_RECORDER_NCCL,
        SweepOptions,
        dump_flight_recorder,
        flight_settings,
        sweep,
    )

    for name in (*FLIGHT_RECORDER, *FLIGHT_RECORDER_NCCL, "RANK", "WORLD_SIZE", "MASTER_ADDR", "NCCL_ALGO"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GPUDIAG_HOSTNAME", "solo")
    seen: dict[str, str] = {}
    real = node_module.intra_busbw

    def collectives_that_dump(*args: Any) -> Any:  # where torch's watchdog would write its dump
        seen.update({k: os.environ[k] for k in (*FLIGHT_RECORDER, *FLIGHT_RECORDER_NCCL) if k in os.environ})
        Path(os.environ["TORCH_FR_DUMP_TEMP_FILE"] + "0").write_bytes(b"fake flight record")
        return real(*args)

    monkeypatch.setattr(node_module, "intra_busbw", collectives_that_dump)
    seed = SEED_MACHINE
    doc = json.loads(seed.read_text())
    doc["labels"], doc["gpus"], doc["matrix"] = (
        doc["labels"][:2],
        doc["gpus"][:2],
        [["X", "NV4"], ["NV4", "X"]],
    )
    (tmp_path / "m.json").write_text(json.dumps(doc))
    options = SweepOptions(
        output=str(tmp_path / "out"), machine=str(tmp_path / "m.json"), quick=True, checks=("env",)
    )
    result = sweep(options)
    prefix = seen["TORCH_FR_DUMP_TEMP_FILE"]
    assert Path(prefix).name == "nccl_trace_rank_" and seen["TORCH_FR_BUFFER_SIZE"] == "2000"
    assert seen["TORCH_FR_DUMP_ON_TIMEOUT"] == seen["TORCH_NCCL_NAN_CHECK"] == "1"
    assert not any(name in seen for name in FLIGHT_RECORDER_NCCL)  # gloo: no deprecation warnings
    assert not any(name in os.environ for name in FLIGHT_RECORDER)  # (restored after)
    nccl = flight_settings("nccl", Path("/s"))  # NCCL's watchdog reads only the older names
    assert nccl["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == nccl["TORCH_FR_DUMP_TEMP_FILE"] == "/s/nccl_trace_rank_"
    assert nccl["TORCH_NCCL_DUMP_ON_TIMEOUT"] == nccl["TORCH_FR_DUMP_ON_TIMEOUT"] == "1"
    assert nccl["TORCH_NCCL_TRACE_BUFFER_SIZE"] == nccl["TORCH_FR_BUFFER_SIZE"] == "2000"
    assert not Path(prefix).parent.exists()  # the sweep's scratch folder is removed
    with zipfile.ZipFile(tmp_path / "out" / "nodes" / "solo.zip") as bundle:
        assert bundle.read("flight/nccl_trace_rank_0") == b"fake flight record"
    assert result.exit_code == 0
    # a hung collective: each rank dumps its own record (real torch, gloo's recorder)
    written = dump_flight_recorder(tmp_path, 3, "gloo")
    assert written == tmp_path / "nccl_trace_rank_3" and written.stat().st_size > 0
    written.write_bytes(b"the watchdog's")
    assert dump_flight_recorder(tmp_path, 3, "gloo") == written and written.read_bytes() == b"the watchdog's"


def _two_gpu_machine(folder: Path) -> Path:
    seed = SEED_MACHINE
    doc = json.loads(seed.read_text())
    doc["labels"], doc["gpus"], doc["matrix"] = (
        doc["labels"][:2],
        doc["gpus"][:2],
        [["X", "NV4"], ["NV4", "X"]],
    )
    path = folder / "m2.json"
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.usefixtures("no_gpu")
def test_quick_budget_is_a_deadline_phases_that_do_not_fit_are_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import time

    from gpudiag.repro.sweep.budget import Budget
    from gpudiag.repro.sweep.run import SweepOptions, sweep

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GPUDIAG_HOSTNAME", "prolog")
    monkeypatch.setenv("GPUDIAG_SWEEP_BUDGET", "2.6")  # (tests only: --quick's budget is 50 s)
    import torch._dynamo  # noqa: F401  (a stop waits for an import in progress: not this one's ~1.5 s)

    machine = _two_gpu_machine(tmp_path)
    options = SweepOptions(output=str(tmp_path / "out"), machine=str(machine), quick=True)
    before = set(children())  # (a process another test left behind is not this sweep's)
    began = time.monotonic()
    result = sweep(options)
    took = time.monotonic() - began
    record = result.records[0]
    statuses = {c["name"]: c["status"] for c in record["checks"]}
    assert list(statuses) == ["env", "topology", "peer", "nancheck"]
    assert "skipped" in statuses.values() and "fail" not in statuses.values(), statuses
    assert any("skipped: --quick budget" in n for n in record["notes"]), record["notes"]
    assert took < within(idle_s=4.1), took  # (against a hang; the budget is the notes above)
    assert result.exit_code == 0 and set(children()) - before == set()
    summary = (tmp_path / "out" / "SUMMARY.md").read_text()
    assert "prolog: " in summary and "skipped: --quick budget" in summary
    assert Budget.for_quick(False).seconds is None and Budget.for_quick(True, {}).seconds == 50.0
    for bad in ("0", "-1", "nan", "soon"):
        with pytest.raises(InputError, match="GPUDIAG_SWEEP_BUDGET"):
            Budget.for_quick(True, {"GPUDIAG_SWEEP_BUDGET": bad})


@pytest.mark.usefixtures("no_gpu")
def test_a_check_still_running_when_the_budget_is_spent_is_stopped_not_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dataclasses
    import time

    from gpudiag.checks import registry
    from gpudiag.checks.suite import Here
    from gpudiag.repro.sweep.budget import WRITE_RESERVE_S, Budget
    from gpudiag.repro.sweep.node import SweepOptions, _run_checks

    real_peer = registry.get("peer")

    def slow_peer(config: Any, here: Any) -> Any:  # a check that outlasts the budget
        result = real_peer.run(config, here)  # (ranks started, compared, reaped)
        time.sleep(60)  # (stopped here; had it not been, the check would pass after a minute)
        return result

    monkeypatch.setitem(registry._REGISTRY, "peer", dataclasses.replace(real_peer, run=slow_peer))
    here = Here.detect(str(_two_gpu_machine(tmp_path)))
    notes: list[str] = []
    budget = Budget(WRITE_RESERVE_S + 1.5)  # alone: 1.5 s for the node's own checks
    before = set(children())  # (a process another test left behind is not this check's)
    began = time.monotonic()
    report = _run_checks(here, SweepOptions(quick=True, checks=("peer", "env")), budget, True, notes)
    took = time.monotonic() - began
    assert [(c.name, c.status) for c in report.checks] == [("peer", "skipped"), ("env", "skipped")]
    assert took < within(idle_s=1.7), took  # (against a hang: a check not stopped takes a minute)
    assert notes[0].startswith("check peer stopped after") and "skipped: --quick budget" in notes[0]
    assert "check env skipped: --quick budget" in notes[1]
    assert set(children()) - before == set()


def _every_written_byte(folder: Path) -> dict[str, bytes]:
    """Each file under ``folder`` by name, a zip's members read out."""
    import zipfile

    out = {}
    for path in folder.rglob("*"):
        if path.is_file():
            out[str(path)] = path.read_bytes()
            if path.suffix == ".zip":
                with zipfile.ZipFile(path) as bundle:
                    out.update({f"{path}:{name}": bundle.read(name) for name in bundle.namelist()})
    return out


@pytest.mark.usefixtures("no_gpu")
def test_anonymize_masks_user_and_host_in_path_valued_variables_in_every_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpudiag.redact import _user
    from gpudiag.repro.sweep.run import SweepOptions, sweep

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    user = _user()
    monkeypatch.setenv("GPUDIAG_HOSTNAME", "rack7-n3")
    path = f"/home/{user}/runs/rack7-n3/nccl.%h.%p.log"
    monkeypatch.setenv("NCCL_DEBUG_FILE", path)
    monkeypatch.setenv("NCCL_TOPO_DUMP_FILE", f"/scratch/{user}/topo.xml")
    monkeypatch.setenv("TORCH_COMPILE_DEBUG_DIR", f"/scratch/{user}/compile")
    options = SweepOptions(
        output=str(tmp_path / "out"),
        machine=str(_two_gpu_machine(tmp_path)),
        quick=True,
        checks=("env",),
        anonymize=True,
    )
    result = sweep(options)
    files = _every_written_byte(tmp_path / "out")
    assert any(name.endswith("results.jsonl") for name in files) and any(":report.json" in n for n in files)
    for name, data in files.items():
        for leak in (path, f"/home/{user}", f"/scratch/{user}", "runs/rack7-n3"):
            assert leak.encode() not in data, (name, leak)
    record = result.records[0]
    assert record["host"] == "rack7-n3"  # (the verdict still names the node)
    assert record["host_facts"]["nccl_env"]["NCCL_DEBUG_FILE"] == "/home/<user>/runs/<host>/nccl.%h.%p.log"


@pytest.mark.parametrize(
    ("text", "named"),
    [
        (
            '{"schema": "gpudiag.sweep-baseline/1", "machine_types": {"8x H100": {"intra_busbw_gbps": NaN}}}',
            "got nan",
        ),
        (
            '{"schema": "gpudiag.sweep-baseline/1", "machine_types": {"8x": {"pair_busbw_gbps": Infinity}}}',
            "inf",
        ),
        ('{"schema": "gpudiag.sweep-baseline/1", "machine_types": {}, "machine_typos": {}}', "machine_typos"),
        (
            '{"schema": "gpudiag.sweep-baseline/1", "machine_types": {"8x H100": {"intra_busbw": 1}}}',
            "intra_busbw",
        ),
        (
            '{"schema": "gpudiag.sweep-baseline/1", "machine_types": {"8x": {"intra_busbw_gbps": "360"}}}',
            "'360'",
        ),
        ('{"schema": "gpudiag.sweep-baseline/1", "machine_types": {"8x H100": [360]}}', "list"),
        ('{"schema": "gpudiag.sweep-baseline/1", "machine_types": [1]}', "machine_types"),
        ('{"machine_types": {"8x H100": {"intra_busbw_gbps": 360}}}', "no schema"),
        ('{"schema": "gpudiag.sweep-rules/1", "machine_types": {}}', "gpudiag.sweep-rules/1"),
        ("[]", "expected a JSON object"),
    ],
)
def test_a_bad_baseline_file_is_one_line_exit_2_naming_what_is_wrong(
    tmp_path: Path, text: str, named: str
) -> None:
    _write_sweep(tmp_path / "sweep", [node(0), node(1)], [])
    (tmp_path / "baseline.json").write_text(text)
    result = invoke(
        ["sweep", "--summary", str(tmp_path / "sweep"), "--baseline", str(tmp_path / "baseline.json")]
    )
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1 and "baseline file" in result.stderr and named in result.stderr, (
        result.stderr
    )


@pytest.mark.parametrize(
    ("rules", "named"),
    [
        (
            {"figures": {"intra_busbw_gbps": {"min_fraction": 0.5}}},
            "figures.intra_busbw_gbps: unknown key(s) min_fraction",
        ),
        ({"figures": {"intra_bw": {"min_fraction_of_median": 0.5}}}, "figures: unknown key(s) intra_bw"),
        ({"figures": {"intra_busbw_gbps": 0.5}}, "figures.intra_busbw_gbps: expected an object"),
        ({"min_nodes": 10**9}, "min_nodes: an integer from 2 to 100000"),
        ({"min_nodes": 2.5}, "min_nodes"),
    ],
)
def test_rules_name_the_bad_sub_key_with_its_section(rules: dict[str, Any], named: str) -> None:
    with pytest.raises(InputError) as caught:
        check_rules(rules)
    assert named in str(caught.value)


def test_a_fleet_smaller_than_min_nodes_says_the_figure_was_not_judged() -> None:
    records = [node(i) for i in range(4)]
    records[1] = node(1, figures={"intra_busbw_gbps": 10.0})
    assert host_codes(judge(records), "node1") == ["node-figure-low"]
    verdict = judge(records, rules=check_rules({"min_nodes": 5}))
    assert verdict.exit_code == 0
    assert (
        "intra_busbw_gbps: not judged against the fleet: 4 node(s) have it, fewer than the rules' min_nodes 5"
        in (verdict.notes)
    )
    from gpudiag.repro.sweep.results import summary_markdown

    assert "not judged against the fleet" in summary_markdown(verdict, records, {})
    two = judge([node(0), node(1)])  # a pair's figure with two nodes: one link, both ends
    assert any(n.startswith("pair_busbw_gbps: not judged") and "3 (two ends" in n for n in two.notes)


@pytest.mark.usefixtures("no_gpu")
def test_the_sweep_s_own_settings_are_kept_apart_from_the_user_s(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpudiag.repro.sweep.run import SweepOptions, sweep

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "TORCH_NCCL_NAN_CHECK", "TORCH_FR_BUFFER_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GPUDIAG_HOSTNAME", "solo")
    monkeypatch.setenv("NCCL_ALGO", "Tree")  # the user's: the sweep leaves it
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth0")
    options = SweepOptions(
        output=str(tmp_path / "out"), machine=str(_two_gpu_machine(tmp_path)), quick=True, checks=("env",)
    )
    result = sweep(options)
    assert result.run["user_settings"] == {"NCCL_ALGO": "Tree"} and "NCCL_ALGO" not in result.run["pinned"]
    assert result.run["pinned"]["TORCH_NCCL_NAN_CHECK"] == "1"
    assert result.records[0]["host_facts"]["nccl_env"] == {"NCCL_ALGO": "Tree", "NCCL_SOCKET_IFNAME": "eth0"}
    monkeypatch.delenv("NCCL_ALGO")
    again = sweep(SweepOptions(**{**options.__dict__, "output": str(tmp_path / "again")}))
    assert again.run["pinned"]["NCCL_ALGO"] == "Ring" and again.run["user_settings"] == {}
    assert again.records[0]["host_facts"]["nccl_env"] == {
        "NCCL_SOCKET_IFNAME": "eth0"
    }  # not the sweep's Ring
    summary = (tmp_path / "again" / "SUMMARY.md").read_text()
    assert (
        "set by the sweep for its run (not the nodes' own settings): " in summary
        and "`NCCL_ALGO=Ring`" in summary
    )
    assert "majority host.nccl_env: NCCL_SOCKET_IFNAME=eth0" in summary and "{'" not in summary


def test_summary_shows_mappings_as_key_value_items_not_a_dict_repr() -> None:
    from gpudiag.repro.sweep.results import summary_markdown, summary_text

    facts = {
        "iommu": "off",
        "acs_redirect": False,
        "nccl_env": {"NCCL_IB_HCA": "mlx5_0", "NCCL_P2P_LEVEL": "NVL"},
    }
    records = [node(i, host_facts=facts) for i in range(3)]
    records[2] = node(2, host_facts={**facts, "nccl_env": {}})
    verdict = judge(records)
    markdown, text = summary_markdown(verdict, records, {}), summary_text(verdict)
    assert "| NCCL_IB_HCA=mlx5_0, NCCL_P2P_LEVEL=NVL | none |" in markdown
    assert "majority host.nccl_env: NCCL_IB_HCA=mlx5_0, NCCL_P2P_LEVEL=NVL" in markdown
    assert "(expected NCCL_IB_HCA=mlx5_0, NCCL_P2P_LEVEL=NVL, measured none)" in text
    assert "{'" not in markdown + text


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--quick"], "--quick"),
        (["--machine", "m.json"], "--machine"),
        (["-o", "elsewhere"], "--output"),
        (["--force"], "--force"),
        (["--checks", "env"], "--checks"),
        (["--backend", "gloo"], "--backend"),
        (["--timeout", "5"], "--timeout"),
        (["--anonymize"], "--anonymize"),
        (["--inject", "0->1:nan"], "--inject"),
        (["--inject-delay", "0"], "--inject-delay"),
    ],
)
def test_summary_refuses_the_options_only_a_run_uses(tmp_path: Path, args: list[str], flag: str) -> None:
    _write_sweep(tmp_path / "sweep", [node(0), node(1)], [])
    result = invoke(["sweep", "--summary", str(tmp_path / "sweep"), *args])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith(f"gpudiag: error: {flag} does not apply to --summary")
    assert result.stderr.count("\n") == 1


def test_host_names_are_compared_without_case() -> None:
    assert expand_nodelist("node1,NODE1,Node[1-2]") == ["node1", "Node2"]
    assert expected_hosts("gpu-a,GPU-A", {}) == (["gpu-a"], "--expect-hosts")
    assert expected_hosts(None, {"SLURM_JOB_NODELIST": "n[1-2],N1"}) == (["n1", "n2"], "SLURM_JOB_NODELIST")
    records = [node(0, host="Node0.Cluster.Local"), node(1, host="NODE1")]
    verdict = judge(records, expected_hosts=["node0", "node1", "node2"])
    assert [(v.host, v.status) for v in verdict.named] == [("node2", NO_RESULT)]  # node0, node1 joined
    twins = judge([node(0, host="node7"), node(1, host="NODE7"), node(2)])
    assert host_codes(twins, "node7") == ["node-host-duplicate"] and host_codes(twins, "NODE7") == [
        "node-host-duplicate"
    ]


def test_a_budget_stop_waits_until_an_import_or_a_cleanup_is_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib
    import sys
    import time

    from gpudiag.repro.sweep.budget import BudgetSpent, hard_stop

    done: list[str] = []

    def close() -> None:  # (Ranks.close, a with block's __exit__: reaping, removing)
        time.sleep(0.3)
        done.append("closed")

    with pytest.raises(BudgetSpent), hard_stop(0.05):
        close()
        time.sleep(5)
    assert done == ["closed"]
    (tmp_path / "slow_to_import.py").write_text("import time\ntime.sleep(0.3)\nREADY = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    began = time.monotonic()
    with pytest.raises(BudgetSpent), hard_stop(0.05):
        importlib.import_module("slow_to_import")
        time.sleep(5)
    assert sys.modules["slow_to_import"].READY  # (the import finished, then the stop: not inside it)
    assert time.monotonic() - began < within(idle_s=0.35)  # (against a stop never raised: 5 s)
    monkeypatch.delitem(sys.modules, "slow_to_import")
