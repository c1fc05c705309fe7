"""What ranks in fresh interpreters receive, and how: one job file per launch (any number
of tensors, no /dev/shm), objects that cannot be imported by name (closures, lambdas,
``__main__`` classes, a user's file) by value, a clear error before any rank starts for
what cannot be sent, the parent's model weights, and no rank outliving its launcher."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from gpudiag.checks.gradcheck import Prebuilt, gradcheck
from gpudiag.errors import InputError
from gpudiag.models import resolve_model
from gpudiag.runtime.launch import launch
from gpudiag.runtime.wire import pack, unpack
from tests.core.runtime.test_runtime_ddp import children
from tests.helpers import ROOT, models


def _apply(rank: int, world: int, fn: object, tensors: list[torch.Tensor]) -> bytes:
    assert callable(fn)
    return f"{rank}:{fn(tensors)}".encode()


def test_fresh_ranks_get_many_tensors_and_a_closure() -> None:
    """resnet50 has 320 tensors, densenet121 over 700: the transport must not care."""
    tensors = [torch.full((3,), float(i)) for i in range(2000)]
    scale = 2.0

    def total(ts: list[torch.Tensor]) -> float:  # a closure: not importable by name
        return scale * float(sum(t.sum() for t in ts))

    want = 2.0 * 3 * sum(range(2000))
    results = launch(_apply, 2, args=(total, tensors), method="subprocess", timeout=120)
    assert [r[:] for r in results] == [f"0:{want}".encode(), f"1:{want}".encode()]
    assert children() == []


class _Noisy(nn.Module):
    """Initialised from Python's random module, which torch's seed does not cover."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)
        with torch.no_grad():
            self.fc.weight.fill_(random.random())


class _NoisyWithHook(_Noisy):
    """The same, with a lambda hook: it travels by value."""

    def __init__(self) -> None:
        super().__init__()
        self.register_forward_hook(lambda module, args, output: None)


def _built(rank: int, world: int, factories: list[Prebuilt]) -> list[bytes | memoryview]:
    return pack([f().state_dict() for f in factories])


def test_ranks_build_the_parents_model_even_from_a_users_file() -> None:
    factories = [
        Prebuilt(_Noisy),
        Prebuilt(_NoisyWithHook),
        Prebuilt(resolve_model(f"{Path(models.__file__)}:UnusedWithBatchNorm", (8,), 4)),  # a private module
    ]
    torch.manual_seed(0)
    want = [f().state_dict() for f in factories]
    (got,) = [unpack(r) for r in launch(_built, 1, args=(factories,), method="subprocess", timeout=120)]
    for w, g in zip(want, got, strict=True):
        assert list(g) == list(w) and all(torch.equal(g[k], w[k]) for k in w)


def test_a_resolved_torchvision_factory_pickles_by_name() -> None:
    import pickle

    factory = resolve_model("torchvision:resnet18?num_classes=10")
    assert len(pickle.dumps(factory)) < 1000  # the spec, not a model


def test_what_cannot_be_sent_fails_before_any_rank_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    lock = threading.Lock()

    def factory() -> nn.Module:
        with lock:  # a lock cannot be pickled, not even by value
            return models.mlp()

    monkeypatch.setenv("GPUDIAG_RANK_START", "subprocess")
    before = set(Path(os.environ.get("TMPDIR", "/tmp")).glob("gpudiag-ranks-*"))
    x, y = models.batch(8)
    with pytest.raises(InputError) as info:
        gradcheck(factory, x, y, strategies=("single", "ddp"))
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("the DDP ranks start as fresh Python processes here")
    assert "cannot pickle '_thread.lock' object" in message and "make them picklable" in message
    assert children() == []
    assert set(Path(os.environ.get("TMPDIR", "/tmp")).glob("gpudiag-ranks-*")) == before


SCRIPT = """\
# A user's script: a model class and a loss in __main__, no `if __name__ == "__main__":`.
import torch
from torch import nn
import gpudiag

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(x)

weight = 1.0
loss = lambda out, y: weight * nn.functional.cross_entropy(out, y)
torch.manual_seed(0)
x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
report = gpudiag.gradcheck(Net, x, y, strategies=("single", "ddp"), loss=loss)
print("verdict", report.verdict)
"""


@pytest.mark.parametrize("start", ["auto", "subprocess"])
def test_a_script_with_main_classes_and_no_main_guard(tmp_path: Path, start: str) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "GPUDIAG_RANK_START": start, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["verdict pass"]
    assert "Traceback" not in done.stderr


LAUNCHER = """\
import sys, time
from gpudiag.runtime.launch import start
from tests.core.runtime.test_rank_transport import _sleep
ranks = start(_sleep, 2, method=sys.argv[1], timeout=300)
time.sleep(0.5)
print(ranks.folder, " ".join(str(p.pid) for p in ranks.procs), flush=True)
time.sleep(300)
"""


def _sleep(rank: int, world: int) -> bytes:
    time.sleep(300)
    return b""


@pytest.mark.parametrize("method", ["fork", "subprocess"])
def test_ranks_leave_when_their_launcher_is_killed(method: str) -> None:
    """SIGKILL gives the launcher no chance to reap: the ranks notice, remove the launch's
    folder and leave."""
    with subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, method], cwd=ROOT, stdout=subprocess.PIPE, text=True
    ) as proc:
        try:
            assert proc.stdout is not None
            folder, *numbers = proc.stdout.readline().split()
            pids = [int(p) for p in numbers]
            assert len(pids) == 2 and all(Path(f"/proc/{p}").exists() for p in pids)
        finally:
            proc.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(_running(p) for p in pids):
        time.sleep(0.1)
    assert not [p for p in pids if _running(p)]
    assert not Path(folder).exists()  # the launch's folder went with them


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan is reaped by init, maybe not at once)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_a_run_without_an_optimizer_update_imports_no_dynamo() -> None:
    """DDP imports torch._dynamo; a single-device run whose one update nobody reads builds
    no optimizer, whose add_param_group would import it (0.85 s here)."""
    code = textwrap.dedent(
        """
        import sys, torch
        from gpudiag.runtime import DeviceSet, RunConfig, run
        from tests.helpers import models
        x, y = models.batch(8)
        run(models.mlp, x, y, RunConfig('dp', DeviceSet.virtual(2), keep_state=False))
        print('torch._dynamo' in sys.modules)
        """
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False"]
