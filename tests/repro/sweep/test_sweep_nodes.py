"""gpudiag sweep across "nodes" that are separate torchrun processes on 127.0.0.1 (gloo, CPU
virtual devices laid out by a machine file per node, a host name per node through
GPUDIAG_HOSTNAME). Each scenario's culprit is named, and nobody else; results are simulated."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

import pytest

from gpudiag.repro.sweep.rehearse import LOOSE_RULES, Node, rehearse
from tests.helpers import SEED_MACHINE

SECRET = "wandb-0123456789abcdef0123456789abcdef"
SEED = SEED_MACHINE


def machine(folder: Path, gpus: int = 2, link: str = "NV4") -> str:
    """A machine file of ``gpus`` GPUs, every pair joined by ``link``."""
    doc = json.loads(SEED.read_text())
    doc["labels"], doc["gpus"] = doc["labels"][:gpus], doc["gpus"][:gpus]
    doc["matrix"] = [["X" if i == j else link for j in range(gpus)] for i in range(gpus)]
    path = folder / f"m{gpus}-{link}.json"
    path.write_text(json.dumps(doc))
    return str(path)


def run_nodes(tmp_path: Path, nodes: list[Node], *common: str, deadline: float = 90) -> dict[str, Any]:
    rules = tmp_path / "loose.json"
    rules.write_text(json.dumps(LOOSE_RULES))
    finished = rehearse(
        nodes, tmp_path / "sweep", ["--quick", "--rules", str(rules), *common], deadline=deadline
    )
    assert all(f.returncode is not None for f in finished), [f.output[-3000:] for f in finished]
    summary = (tmp_path / "sweep" / "SUMMARY.md").read_text()
    records = [json.loads(line) for line in (tmp_path / "sweep" / "results.jsonl").read_text().splitlines()]
    run = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    from gpudiag.repro.sweep.run import rejudge

    verdict, _ = rejudge(str(tmp_path / "sweep"))
    return {
        "rank0": finished[0],
        "summary": summary,
        "records": records,
        "run": run,
        "named": {v.host: [p.code for p in v.problems] for v in verdict.named},
        "verdict": verdict,
    }


def test_two_nodes_name_the_corrupting_node_and_the_host_that_never_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_HUB_TOKEN", SECRET)  # the nodes' bundles must not carry it
    m = machine(tmp_path)
    out = run_nodes(
        tmp_path,
        [Node("node0", m), Node("node1", m, ["--inject", "*->*:bitflip"])],
        "--checks",
        "env,topology",
        "--expect-hosts",
        "node[0-2]",
    )
    assert out["rank0"].returncode == 1, out["rank0"].output[-3000:]
    named = out["named"]
    assert set(named) == {"node1", "node2"}, out["summary"]
    assert set(named["node1"]) == {"node-allreduce-wrong", "node-link-corrupt"}
    assert named["node2"] == ["node-missing"]
    assert [r["host"] for r in out["records"]] == ["node0", "node1"]
    assert all(r["simulated"] for r in out["records"]) and "simulated" in out["summary"]
    assert out["run"]["backend"] == "gloo" and out["run"]["pinned"]["NCCL_ALGO"] == "Ring"
    assert out["run"]["injected"] == ["node1: *->*:bitflip"]  # the rehearsal, said by host
    assert "rehearsal" in (tmp_path / "sweep" / "SUMMARY.md").read_text()
    with zipfile.ZipFile(tmp_path / "sweep" / "nodes" / "node1.zip") as bundle:
        names = bundle.namelist()
        assert "report.json" in names and "sweep/node.json" in names
        assert json.loads(bundle.read("sweep/node.json"))["host"] == "node1"
        assert "TORCH_HUB_TOKEN" in bundle.read("report.json").decode()  # (named, value redacted)
    for path in (tmp_path / "sweep").rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            if path.suffix == ".zip":
                with zipfile.ZipFile(path) as bundle:
                    data = b"".join(bundle.read(name) for name in bundle.namelist())
            assert SECRET.encode() not in data, path


@pytest.mark.slow
def test_the_node_s_own_checks_see_its_injected_link_fault(tmp_path: Path) -> None:
    m = machine(tmp_path)
    out = run_nodes(tmp_path, [Node("node0", m), Node("node1", m, ["--inject", "0->1:nan"])])
    assert set(out["named"]) == {"node1"}, out["summary"]
    failed = [p for p in out["verdict"].named[0].problems if p.code == "node-check-failed"]
    assert {p.message.split()[0] for p in failed} == {"peer", "nancheck"}
    assert "link-corruption" in " ".join(str(p.measured) for p in failed)


@pytest.mark.slow
def test_a_clean_run_names_nobody(tmp_path: Path) -> None:
    m = machine(tmp_path)
    out = run_nodes(tmp_path, [Node("node0", m), Node("node1", m)], "--expect-hosts", "node0,node1")
    assert out["rank0"].returncode == 0, out["summary"]
    assert out["named"] == {} and "Nobody: every node is healthy." in out["summary"]
    checks = {c["name"]: c["status"] for c in out["records"][1]["checks"]}
    assert checks == {"env": "pass", "topology": "pass", "peer": "pass", "nancheck": "pass"}


@pytest.mark.slow
def test_slow_node_and_different_machine_file_are_named(tmp_path: Path) -> None:
    m, other = machine(tmp_path), machine(tmp_path, 2, "SYS")
    nodes = [
        Node("node0", m),
        Node("node1", m, ["--inject-delay", "0.5"]),
        Node("node2", other),
        Node("node3", m),
    ]
    out = run_nodes(tmp_path, nodes, "--checks", "env,topology", deadline=150)
    assert set(out["named"]) == {"node1", "node2"}, out["summary"]
    assert "node-figure-low" in out["named"]["node1"]
    assert out["named"]["node2"] == ["node-topology-differs"]


@pytest.mark.slow
def test_a_rank_that_never_enters_a_collective_is_named(tmp_path: Path) -> None:
    m = machine(tmp_path)
    nodes = [Node("node0", m), Node("node1", m, ["--inject-stall", "allreduce-all"]), Node("node2", m)]
    out = run_nodes(tmp_path, nodes, "--checks", "env", "--timeout", "8", deadline=150)
    assert out["rank0"].returncode == 1
    assert out["named"] == {"node1": ["node-hung"]}, out["summary"]
    assert "never entered allreduce-all" in out["summary"] and not out["run"]["finished"]
    with zipfile.ZipFile(tmp_path / "sweep" / "nodes" / "node0.zip") as bundle:  # rank 0's own record
        assert bundle.getinfo("flight/nccl_trace_rank_0").file_size > 0
