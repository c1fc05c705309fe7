"""The public Python API: listed in ``__all__`` and ``dir(gpudiag)``, imported on first
use, and results whose repr is one short line."""

from __future__ import annotations

import gpudiag
from tests.helpers import models


def test_the_api_is_listed_and_every_name_resolves() -> None:
    assert set(gpudiag.__all__) == {
        "__version__",
        "topology_report",
        "gradcheck",
        "gradcheck_spec",
        "nancheck",
        "peer",
        "inspect_checkpoint",
        "convert_checkpoint",
        "doctor",
        "bench",
        "watch",
        "NonFiniteError",
    }
    assert dir(gpudiag) == sorted(gpudiag.__all__)
    for name in gpudiag.__all__:
        assert getattr(gpudiag, name) is not None


def test_results_have_short_reprs() -> None:
    topology = gpudiag.topology_report(machine="seed_8gpu_machine.json")
    nancheck = gpudiag.nancheck(
        models.mlp, *models.batch(8), machine=topology.topology, pairs="0-1", steps=2, inject=["0->1:nan"]
    )
    x, y = models.batch(8)
    check = gpudiag.gradcheck(models.mlp, x, y, strategies=("single", "dp"))
    peer = gpudiag.peer(machine=topology.topology, pairs="0-1", sizes=(4096,))
    for result, start in (
        (topology, "<TopologyReport machine-file · gpus 8"),
        (nancheck, "<NancheckReport fail · singles 2 · pairs 1 · link-corruption"),
        (check, "<GradcheckReport pass · comparisons 1>"),
        (peer, "<PeerReport pass · directions 2"),
    ):
        assert repr(result).startswith(start) and len(repr(result)) < 200, repr(result)


def test_bundle_checkpoint_and_env_results_have_short_reprs(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import torch

    report = gpudiag.doctor(checks=["env"])
    assert repr(report) == "<Report env pass>" and repr(report.checks) == "[<CheckRun env pass>]"
    assert repr(report.checks[0].report).startswith("<EnvReport sections ")
    source = tmp_path / "dp.pt"
    torch.save({"module.w": torch.ones(2)}, source)
    inspected = gpudiag.inspect_checkpoint(str(source))
    assert repr(inspected) == "<InspectResult torch-zip · state dicts 1 · keys 1>"
    converted = gpudiag.convert_checkpoint(str(source), str(tmp_path / "plain.pt"))
    assert repr(converted) == "<ConvertResult torch-zip -> pt · verified · mappings 1>"
