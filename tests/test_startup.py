"""What keeps a command's start cheap: torchvision without torch._dynamo, no optimizer
for an update nobody reads, the DDP rank forkserver warmed before torch loads, and
models pickled for it with the parent's weights. (Speed itself is measured in bench/.)"""

from __future__ import annotations

import pickle
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from gpudiag.checks.gradcheck import Prebuilt
from gpudiag.models import resolve_model

ROOT = Path(__file__).parent.parent


def python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_torchvision_without_dynamo_then_dynamo_as_usual() -> None:
    out = python(
        "import sys, torch\n"
        "from gpudiag.vision import import_torchvision\n"
        "from gpudiag.runtime import DeviceSet, RunConfig, run\n"
        "tv = import_torchvision()\n"
        "print('after import', 'torch._dynamo' in sys.modules)\n"
        "factory = lambda: tv.models.resnet18(num_classes=10)\n"
        "x, y = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])\n"
        "run(factory, x, y, RunConfig('dp', DeviceSet.virtual(2), keep_state=False))\n"
        "print('after a run', 'torch._dynamo' in sys.modules)\n"
        "roi = sys.modules['torchvision.ops.roi_align']\n"
        "print('forwarded', roi.is_compile_supported('cpu'), 'torch._dynamo' in sys.modules)\n"
        "print('compiled', torch.compile(lambda a: a * 2, backend='eager')(torch.ones(2)).tolist())\n"
    )
    assert out.splitlines() == [
        "after import False",
        "after a run False",  # no optimizer is built for an update nobody reads
        "forwarded True True",  # the stand-in's function imports the real dynamo when called
        "compiled [2.0, 2.0]",
    ]


def test_torchvision_that_wants_more_of_dynamo_is_imported_plainly() -> None:
    out = python(
        "import sys, torch, gpudiag.vision as v\n"
        "v.FORWARDED = frozenset()  # as if torchvision took another name from dynamo\n"
        "tv = v.import_torchvision()\n"
        "print('torch._dynamo' in sys.modules, tv.models.resnet18(num_classes=3).fc.out_features)\n"
    )
    assert out.split() == ["True", "3"]


def test_a_torchvision_module_keeping_the_stand_in_is_noticed(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    from gpudiag import vision

    stand_in = vision._StandIn("torch._dynamo")
    kept = types.ModuleType("torchvision._gpudiag_test")
    monkeypatch.setitem(sys.modules, kept.__name__, kept)
    assert not vision._holds([stand_in])
    kept.dynamo = stand_in  # as `import torch._dynamo as dynamo` at module level would
    assert vision._holds([stand_in])


def test_the_rank_forkserver_starts_before_torch_is_imported() -> None:
    out = python(
        "import sys, gpudiag.rankserver as r\n"
        "real = r.warm_ranks\n"
        "def warm(*args):\n"
        "    print('torch loaded when warming:', 'torch' in sys.modules)\n"
        "    return real(*args)\n"
        "r.warm_ranks = warm\n"
        "from gpudiag.cli import main\n"
        "sys.argv = ['gpudiag', 'gradcheck', '--model', 'mlp', '--input-shape', '8', '--format', 'json']\n"
        "main()\n"
    )
    assert out.splitlines()[0] == "torch loaded when warming: False"
    assert '"verdict": "pass"' in out


def test_without_room_in_dev_shm_ranks_are_forked(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpudiag import rankserver
    from gpudiag.runtime.launch import start_method

    monkeypatch.setattr(rankserver, "SHM_ROOM", 1 << 60)  # more than any machine has
    with rankserver.warm_ranks():
        assert not rankserver.warm() and start_method("gloo") == "fork"
    monkeypatch.undo()
    with rankserver.warm_ranks():
        assert rankserver.warm() and start_method("gloo") == "forkserver"
    assert start_method("gloo") == "fork"  # outside the block: as before


class _Noisy(nn.Module):
    """Initialised from Python's random module, which torch's seed does not cover."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)
        with torch.no_grad():
            self.fc.weight.fill_(random.random())


class _NoisyWithHook(_Noisy):
    """The same, with a hook no pickle can carry: the rank must rebuild it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_forward_hook(lambda module, args, output: None)


@pytest.mark.parametrize(("factory", "portable"), [(_Noisy, True), (_NoisyWithHook, False)])
def test_a_prebuilt_model_pickles_with_the_parents_weights(factory: type[nn.Module], portable: bool) -> None:
    prebuilt = Prebuilt(factory)
    torch.manual_seed(0)
    original = prebuilt()
    copy = pickle.loads(pickle.dumps(prebuilt))()
    assert prebuilt.portable is portable  # sent as the module itself, or rebuilt and loaded
    assert torch.equal(copy.fc.weight, original.fc.weight) and torch.equal(copy.fc.bias, original.fc.bias)
    assert torch.equal(copy.fc.weight, prebuilt().fc.weight)


def test_a_model_from_a_users_file_is_rebuilt_in_the_rank() -> None:
    prebuilt = Prebuilt(resolve_model("tests/models.py:UnusedWithBatchNorm", (8,), 4))
    torch.manual_seed(0)
    original = prebuilt()
    copy = pickle.loads(pickle.dumps(prebuilt))()
    assert prebuilt.portable is False
    got, want = copy.state_dict(), original.state_dict()
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_a_resolved_torchvision_factory_pickles_by_name() -> None:
    factory = resolve_model("torchvision:resnet18?num_classes=10")
    assert len(pickle.dumps(factory)) < 1000  # the spec, not a model
