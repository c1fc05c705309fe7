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


def test_the_collector_pause_restores_its_state_and_freezes_only_when_asked(monkeypatch) -> None:
    import gc

    from gpudiag import gcpause
    from gpudiag.gcpause import paused

    monkeypatch.setattr(gcpause, "_owned", True)  # (as gpudiag's command line: gcpause.own())

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


def test_a_model_spec_resolved_in_the_users_process_freezes_none_of_the_users_objects() -> None:
    """The Python API (``gpudiag.gradcheck_spec("torchvision:…")``) runs in the user's
    process: importing torchvision there must not ``gc.freeze()`` the user's objects, or a
    reference cycle of theirs alive at that moment is never collected (it was: the
    torchvision import froze everything alive)."""
    import subprocess
    import sys

    script = (
        "import gc, weakref\n"
        "from gpudiag.models import resolve_model\n"
        "class Node: pass\n"
        "a = Node(); a.me = a; ref = weakref.ref(a)\n"
        "resolve_model('torchvision:resnet18', (3, 8, 8), 3)()\n"
        "del a\n"
        "gc.collect()\n"
        "print(gc.isenabled(), gc.get_freeze_count(), ref() is None)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "0", "True"]  # collector on, nothing frozen, the cycle freed


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
