"""gradcheck's cheaper paths (issue 35.11) change nothing the check reports: what they skip
is a copy (the probe's own) or a broadcast of bytes every rank already holds."""

from __future__ import annotations

import torch
from torch import nn

from gpudiag.checks.gradcheck.factories import Controlled, Prebuilt
from gpudiag.checks.gradcheck.trainmode import probe
from gpudiag.runtime.ddp import _init_sync


def bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))


def test_ddp_skips_the_start_up_broadcast_only_for_copies_of_one_built_template(monkeypatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    prebuilt = Prebuilt(bn_model)
    assert _init_sync(prebuilt) == {}  # not built yet: each rank would build its own
    assert _init_sync(bn_model) == {}  # a plain factory: DDP broadcasts rank 0's weights
    prebuilt()
    skipped = {"init_sync": False}
    assert _init_sync(prebuilt) == skipped
    assert _init_sync(Controlled(prebuilt, 0)) == skipped
    assert _init_sync(Controlled(bn_model, 0)) == {}
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    assert _init_sync(prebuilt) == {}  # torchrun: every process built its own template


def test_probe_of_a_given_model_probes_it_without_a_copy() -> None:
    x = torch.randn(8, 4)
    kept, given = bn_model(), bn_model()
    before = kept[1].running_mean.clone()
    assert probe(kept, x) == probe(given, x, given=True)
    assert torch.equal(kept[1].running_mean, before)  # copied: untouched
    assert not torch.equal(given[1].running_mean, before)  # given: its own forward ran


def test_the_collector_pause_restores_its_state_and_freezes_only_when_asked() -> None:
    import gc

    from gpudiag.gcpause import paused

    frozen = gc.get_freeze_count()
    try:
        with paused():
            assert not gc.isenabled()
        assert gc.isenabled() and gc.get_freeze_count() == frozen
        gc.disable()
        with paused(freeze=True):
            kept = [object()]
        assert not gc.isenabled()  # (it was off before: it stays off)
        assert gc.get_freeze_count() > frozen and kept
    finally:
        gc.enable()
        gc.unfreeze()


def test_the_users_factory_and_forward_run_with_the_collector_on(tmp_path) -> None:
    """gradcheck pauses the collector while it imports torch and torchvision (issue 35.11),
    never while the user's code runs: a model that makes reference cycles must not grow."""
    import gc

    from click.testing import CliRunner

    from gpudiag.cli import cli

    (tmp_path / "gcmodel.py").write_text(
        "import gc\nimport torch\n\n"
        "class Net(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.fc = torch.nn.Linear(12, 3)\n\n"
        "    def forward(self, x):\n"
        "        assert gc.isenabled(), 'forward ran with the collector off'\n"
        "        return self.fc(x.flatten(1))\n\n"
        "def make():\n"
        "    assert gc.isenabled(), 'the factory ran with the collector off'\n"
        "    return Net()\n"
    )
    args = [
        "gradcheck",
        "--model",
        f"{tmp_path / 'gcmodel.py'}:make",
        "--input-shape",
        "3,2,2",
        "--num-classes",
        "3",
    ]
    try:
        result = CliRunner().invoke(cli, [*args, "--format", "json"])
    finally:
        gc.unfreeze()
    assert result.exit_code == 0, result.output
    assert gc.isenabled()
