"""``localize="replay"`` (the default for a model in one process on one device): a clean
step keeps no trail; a faulty one replays its forward with the module hooks on. It must name
what the hooks on every step (``localize="trail"``) name, reproduce dropout, leave training
(generators, BatchNorm statistics) as it was, and say so where the fault does not recur."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import gpudiag
from gpudiag.errors import InputError
from gpudiag.hw.sources import read_machine_or_capture
from gpudiag.runtime.devices import DeviceSet
from gpudiag.runtime.dp import VirtualDataParallel
from gpudiag.watch.replay import DID_NOT_RECUR, Draws, capture, generators, replay
from tests.helpers import models


class Net(nn.Module):
    """Dropout, BatchNorm, an attention block and nested paths: ``body.2.lin``."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(8, 16), nn.Dropout(0.5), models.LinearNormBlock(), nn.BatchNorm1d(16)
        )
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        h = self.body(x) * scale
        a = self.attn(h[:, None], h[:, None], h[:, None], need_weights=False)[0][:, 0]
        return self.head(h + a)


def run(localize: Any, fault: str, steps: int = 4) -> gpudiag.watch.NonFiniteReport:
    torch.manual_seed(0)
    net = Net()
    if fault == "output":
        models.poison(net.body[2].lin, lambda: watcher.step == 2)
    elif fault == "grad":
        models.poison(net.body[2].norm, lambda: watcher.step == 2, kind="grad")
    watcher = gpudiag.watch(net, "record", record_dir=False, localize=localize)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        x = torch.randn(6, 8, generator=g)
        if fault == "input" and step == 2:
            x[0, 0] = float("nan")
        if fault == "optimizer" and step == 2:
            with torch.no_grad():
                net.body[2].lin.weight[0, 0] = float("nan")
        net(x, scale=0.5).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    watcher.close()
    assert watcher.report is not None
    return watcher.report


@pytest.mark.parametrize("fault", ["output", "grad", "input", "optimizer"])
def test_a_replay_names_what_the_hooks_on_every_step_name(fault: str) -> None:
    trail, replayed = run("trail", fault), run(True, fault)
    assert (replayed.step, replayed.module, replayed.phase, replayed.detail) == (
        trail.step,
        trail.module,
        trail.phase,
        trail.detail,
    )
    assert replayed.module  # named at a module or the input, not at the output


def test_a_clean_step_keeps_no_trail_and_hooks_only_the_root() -> None:
    torch.manual_seed(0)
    net = Net()
    with gpudiag.watch(net, record_dir=False) as watcher:
        assert watcher.localize == "replay"
        hooked = [m for m in net.modules() if m._forward_hooks or m._forward_pre_hooks]
        assert hooked == [net]
        for _ in range(3):
            net(torch.randn(4, 8)).sum().backward()
            assert watcher._trail == [] and watcher._captures == [] and watcher.report is None


def test_a_replay_reproduces_dropout_and_leaves_training_as_it_was() -> None:
    """The NaN count depends on the dropout mask: the same count as the hooks saw means the
    replay drew the same mask. Afterwards the generator and BatchNorm's statistics are where
    an unwatched twin's are."""

    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Linear(8, 64), nn.BatchNorm1d(64), nn.Dropout(0.5), models.ZeroToNaN(), nn.Linear(64, 1)
        )

    x = torch.randn(16, 8)
    reports = {}
    for localize in ("trail", "replay"):
        net = make()
        torch.manual_seed(5)
        with gpudiag.watch(net, "record", record_dir=False, localize=localize) as watcher:
            net(x).mean().backward()
            after = torch.rand(3)
        assert watcher.report is not None
        reports[localize] = watcher.report
        twin = make()
        torch.manual_seed(5)
        twin(x).mean().backward()
        assert torch.equal(after, torch.rand(3))  # the generator went on as without watching
        for mine, theirs in zip(net.buffers(), twin.buffers(), strict=True):
            assert torch.equal(mine, theirs)  # running statistics (finite: before the NaN), batch count
    assert reports["replay"].module == "3" and reports["replay"].phase == "forward"
    assert reports["replay"].detail == reports["trail"].detail  # "... 5xx NaN/Inf of 1024"


def test_a_fault_that_does_not_recur_is_named_at_the_output_saying_so() -> None:
    torch.manual_seed(0)
    net = Net()
    fired = []

    def once(m: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor | None:
        if watcher.step == 1 and not fired:  # a flaky device: once, not on the replay
            fired.append(True)
            return out.index_fill(0, torch.tensor([0]), float("nan"))
        return None

    net.body[2].lin.register_forward_hook(once)
    with gpudiag.watch(net, "record", record_dir=False) as watcher:
        for _ in range(3):
            net(torch.randn(4, 8)).sum().backward()
    report = watcher.report
    assert report is not None and (report.step, report.module, report.phase) == (1, "", "forward")
    assert DID_NOT_RECUR in report.detail


def test_a_replay_that_fails_is_said_and_training_is_not_broken() -> None:
    class Fragile(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            if self.calls in (3, 4):  # the replays of the second forward (without, then with grad mode)
                raise RuntimeError("cannot run twice\nsecond line")
            y = self.lin(x)
            return y * float("nan") if self.calls == 2 else y

    net = Fragile()
    with gpudiag.watch(net, "record", record_dir=False) as watcher:
        for _ in range(3):
            net(torch.randn(2, 4)).sum().backward()
    report = watcher.report
    assert report is not None and report.step == 1 and report.module == ""
    assert "could not be replayed to find the module (RuntimeError: cannot run twice)" in report.detail


def test_a_replay_on_parameters_changed_since_the_forward_is_refused() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    x = torch.randn(2, 4)
    c = capture((x,), {}, ("cpu",), Draws(generators(torch.device("cpu"))))
    c.versions = tuple(int(p._version) for p in net.parameters())
    with torch.no_grad():
        net[0].weight.add_(1.0)  # an optimizer step inside the backward
    trail: list[Any] = []
    why = replay(net, [c], lambda path: lambda m, i, o: trail.append(path))
    assert why is not None and "parameters changed" in why and trail == []


def test_localize_is_chosen_by_placement_and_checked() -> None:
    net = Net()
    with gpudiag.watch(net, record_dir=False, localize="trail") as watcher:
        assert watcher.localize == "trail"
    with gpudiag.watch(net, record_dir=False, localize=False) as watcher:
        assert watcher.localize == "off" and watcher.blind
    with gpudiag.watch(torch.compile(Net(), backend="eager"), record_dir=False) as watcher:
        assert watcher.localize == "off"
    machine = read_machine_or_capture("seed_8gpu_topo.txt")
    vdp = VirtualDataParallel(Net(), DeviceSet.virtual([5, 6], machine))
    with gpudiag.watch(vdp, record_dir=False) as watcher:
        assert watcher.localize == "trail"  # its forward copies between devices
    with pytest.raises(InputError, match="localize='replay'"):
        gpudiag.watch(vdp, record_dir=False, localize="replay")
    with pytest.raises(InputError, match="expected True, False, 'trail' or 'replay'"):
        gpudiag.watch(Net(), record_dir=False, localize="sometimes")


def scaler_run(localize: str) -> tuple[list[tuple[str, int, str, str]], int]:
    """Four steps under a GradScaler whose backward overflows at steps 1 and 2: the events
    noted, and how many times the forward ran."""
    torch.manual_seed(0)
    net = Net()
    calls = []
    net.body[0].register_forward_pre_hook(lambda m, args: calls.append(1))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    models.poison(net.body[2].norm, lambda: watcher.step in (1, 2), kind="grad")
    watcher = gpudiag.watch(net, "raise", scaler=scaler, record_dir=False, localize=localize)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    for _ in range(4):
        scaler.scale(net(torch.randn(6, 8)).pow(2).mean()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert watcher.report is None
    return [(e.kind, e.step, e.module, e.detail) for e in watcher.events], len(calls)


def test_a_grad_scaler_skip_is_not_replayed() -> None:
    """An overflow in the backward the GradScaler skips (normal in fp16 training) is noted
    without running the forward again — each step's forward runs once — and named as the
    hooks on every step name it."""
    (trail, _), (replayed, calls) = scaler_run("trail"), scaler_run("replay")
    assert calls == 4 and replayed == trail
    assert [e[:3] for e in replayed] == [("scaler-skip", 1, "body.2.lin"), ("scaler-skip", 2, "body.2.lin")]


def test_autocast_on_a_device_type_the_one_call_misses_is_captured() -> None:
    """``torch._C._is_any_autocast_enabled`` reads MPS's autocast as off: a forward on MPS
    under ``torch.autocast("mps")`` alone is still captured (and replayed) under it, the
    state asked per device type (no MPS device is needed to set it)."""
    torch.set_autocast_enabled("mps", True)
    try:
        c = capture((torch.ones(1),), {}, ("cpu", "mps"), Draws([]))
    finally:
        torch.set_autocast_enabled("mps", False)
    assert list(c.autocast) == [("cpu", False, None), ("mps", True, torch.get_autocast_dtype("mps"))]
