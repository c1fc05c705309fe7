"""``sweep --inject-stall``: a rehearsed hang is recorded as a rehearsal, and one that
cannot fire is refused before anything runs (issue 36 #13), as ``--inject`` specs are."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpudiag.repro.sweep.node import Identity, SweepOptions, local_phase
from gpudiag.repro.sweep.run import stall_cannot_fire
from tests.helpers import SEED_MACHINE, invoke


@pytest.mark.usefixtures("no_gpu")
def test_a_stall_outside_torchrun_is_refused_before_anything_runs(tmp_path: Path) -> None:
    machine = SEED_MACHINE
    args = ["sweep", "-o", str(tmp_path / "out"), "--machine", str(machine), "--quick"]
    out = invoke([*args, "--inject-stall", "allreduce-all"])  # (it ran, exit 0)
    assert out.exit_code == 2, out.output
    assert "cannot fire here" in out.stderr and out.stderr.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_which_stalls_can_fire() -> None:
    one_node = Identity(0, 2, 0, 0, "n0", True, 1)
    two_nodes = Identity(0, 2, 0, 0, "n0", True, 2)
    assert stall_cannot_fire("pair-round1", one_node) == "one node: there is no pairwise link test"
    assert stall_cannot_fire("gather-round1", one_node) is not None
    assert stall_cannot_fire("allreduce-all", one_node) is None
    assert stall_cannot_fire("pair-round1", two_nodes) is None
    assert stall_cannot_fire("gather-records", Identity(0, 1, 0, 0, "n0", False)) is not None


@pytest.mark.usefixtures("no_gpu")
def test_a_stall_is_recorded_as_a_rehearsal() -> None:
    ident = Identity(1, 2, 0, 1, "n1", True, 2)
    options = SweepOptions(quick=True, checks=("topology",), stall="allreduce-all", inject=("0->1:bitflip",))
    record = local_phase(options, ident, "gloo").record
    assert record["injected"] == ["0->1:bitflip", "stall allreduce-all"]


#: A node's worker that kills its whole node (its torchrun and itself: the process group
#: rehearse gives each node) half a second after it starts: before its own checks end, so
#: before any record of it can be gathered (issue 44: a live, healthy node was named instead).
KILLER = """\
import os, signal, threading
if os.environ.get("RANK") is not None and os.environ.get("GPUDIAG_REHEARSE_KILL") == "1":
    threading.Timer(0.5, lambda: os.killpg(0, signal.SIGKILL)).start()
"""


@pytest.mark.slow
def test_a_node_killed_before_the_records_are_gathered_is_named_missing_and_nobody_else(
    tmp_path: Path,
) -> None:
    import json

    from gpudiag.repro.sweep.rehearse import LOOSE_RULES, Node, rehearse
    from gpudiag.repro.sweep.run import rejudge
    from tests.helpers import SEED_MACHINE

    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(KILLER)
    rules = tmp_path / "loose.json"
    rules.write_text(json.dumps(LOOSE_RULES))
    killed = {"PYTHONPATH": str(hook), "GPUDIAG_REHEARSE_KILL": "1"}
    m = str(SEED_MACHINE)
    nodes = [Node("node0", m), Node("node1", m), Node("node2", m, env=killed)]
    common = [
        "--quick",
        "--rules",
        str(rules),
        "--checks",
        "env",
        "--timeout",
        "8",
        "--expect-hosts",
        "node[0-2]",
    ]
    finished = rehearse(nodes, tmp_path / "sweep", common, deadline=150)
    assert finished[0].returncode == 1, finished[0].output[-3000:]
    verdict, _ = rejudge(str(tmp_path / "sweep"))
    named = {v.host: [p.code for p in v.problems] for v in verdict.named}
    assert named == {"node2": ["node-missing"]}, (tmp_path / "sweep" / "SUMMARY.md").read_text()
    records = [json.loads(line) for line in (tmp_path / "sweep" / "results.jsonl").read_text().splitlines()]
    assert sorted(r["host"] for r in records) == ["node0", "node1"]
