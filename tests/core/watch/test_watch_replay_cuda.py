"""The replay on CUDA (marked ``gpu``: skipped without one). There a forward is judged only at
the end of its backward (reading its witness earlier would stall the queue), so the replay
runs then: the device's generator is set back for it and put back after, and parameters an
optimizer changed inside the backward are refused by their versions."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import gpudiag
from tests.helpers import models


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 64)
        self.drop = nn.Dropout(0.5)
        self.block = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64))
        self.head = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.drop(self.lin(x))))


def run(localize: Any, optimizer_in_backward: bool = False) -> tuple[Any, torch.Tensor]:
    torch.manual_seed(0)
    net = Net().cuda()
    models.poison(net.block[0], lambda: watcher.step == 2)
    opts = [torch.optim.SGD([p], lr=0.05) for p in net.parameters()]
    if optimizer_in_backward:
        for p, opt in zip(net.parameters(), opts, strict=True):
            p.register_post_accumulate_grad_hook(lambda q, opt=opt: (opt.step(), opt.zero_grad()))
    watcher = gpudiag.watch(net, "record", record_dir=False, localize=localize)
    for _ in range(4):
        net(torch.randn(16, 8, device="cuda")).pow(2).mean().backward()
        if not optimizer_in_backward:
            for opt in opts:
                opt.step()
                opt.zero_grad()
    watcher.close()
    return watcher.report, torch.rand(3, device="cuda")


@pytest.mark.gpu
def test_on_cuda_a_replay_names_what_the_trail_names_and_the_generator_goes_on() -> None:
    (trail, after_trail), (replayed, after_replay) = run("trail"), run(True)
    assert replayed is not None and trail is not None
    assert (replayed.step, replayed.module, replayed.phase, replayed.detail) == (
        trail.step,
        trail.module,
        trail.phase,
        trail.detail,
    )
    assert (replayed.step, replayed.module, replayed.device) == (2, "block.0", "cuda:0")
    assert torch.equal(after_trail, after_replay)  # the CUDA generator went on as without it


@pytest.mark.gpu
def test_on_cuda_dropout_is_replayed_with_the_same_mask() -> None:
    details = []
    for localize in ("trail", "replay"):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 64), nn.Dropout(0.5), models.ZeroToNaN(), nn.Linear(64, 1)).cuda()
        with gpudiag.watch(net, "record", record_dir=False, localize=localize) as watcher:
            net(torch.randn(16, 8, device="cuda")).mean().backward()
        assert watcher.report is not None and watcher.report.module == "2"
        details.append(watcher.report.detail)  # "... N NaN/Inf of 1024": N is the mask's
    assert details[0] == details[1]


@pytest.mark.gpu
def test_on_cuda_parameters_an_optimizer_changed_inside_the_backward_are_not_replayed() -> None:
    report, _ = run(True, optimizer_in_backward=True)
    assert report is not None and report.step == 2 and report.module == ""
    assert "parameters changed before it was checked" in report.detail
