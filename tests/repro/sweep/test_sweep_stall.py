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
