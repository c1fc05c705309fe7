"""gpudiag.watch on everyday models, not only the small test nets: torchvision families
(in-place activations, stochastic depth, concatenations, squeeze-excitation, layer norm),
a GPT-2 with tied embedding and output weights (transformers), and DDP over two gloo ranks.
A clean run reports nothing; a NaN put into one module's output at step 2 (or an Inf into
one module's input gradient) is named at that module, step and phase. Slow: ~30 s."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from torch import nn

import gpudiag
from gpudiag.runtime.launch import launch
from tests.helpers import models

pytestmark = pytest.mark.slow

#: torchvision model → a module deep inside it
TORCHVISION = {
    "mobilenet_v3_small": "features.6.block.2",
    "efficientnet_b0": "features.5.1.block.1",
    "convnext_tiny": "features.5.3.block.3",
    "densenet121": "features.denseblock3.denselayer5.conv1",
    "regnet_y_400mf": "trunk_output.block3.block3-1.f.b",
    "shufflenet_v2_x0_5": "stage3.1.branch2.3",
}


def _poisoned(model: nn.Module, path: str, when: Any, kind: str = "output") -> None:
    models.poison(model.get_submodule(path), when, kind)


def _train(model: nn.Module, watcher: Any, batch: Any, steps: int = 3) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        x, y = batch()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if watcher.report is not None:
            return


def _images() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(4, 3, 64, 64), torch.randint(0, 10, (4,))


@pytest.mark.parametrize("name", TORCHVISION)
def test_torchvision_models_clean_and_a_nan_named(name: str) -> None:
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.get_model(name, num_classes=10)
    with gpudiag.watch(model, "record", record_dir=False) as watcher:
        _train(model, watcher, _images)
        assert watcher.report is None and watcher.step == 3  # clean: dropout, drop path, BN
    torch.manual_seed(0)
    model = torchvision.models.get_model(name, num_classes=10)
    _poisoned(model, TORCHVISION[name], lambda: watcher.step == 2)
    with gpudiag.watch(model, "record", record_dir=False) as watcher:
        _train(model, watcher, _images)
    report = watcher.report
    assert report is not None and (report.step, report.module, report.phase) == (
        2,
        TORCHVISION[name],
        "forward",
    )


def test_gpt2_with_tied_weights() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=16)
    tokens = torch.randint(0, 100, (2, 12))

    def run(bad: bool) -> Any:
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(config)
        assert model.lm_head.weight is model.transformer.wte.weight  # tied
        _poisoned(model, "transformer.h.1.mlp.c_fc", lambda: bad and watcher.step == 1)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with gpudiag.watch(model, "record", record_dir=False) as watcher:
            for _ in range(3):
                model(input_ids=tokens, labels=tokens).loss.backward()
                opt.step()
                opt.zero_grad()
        return watcher

    assert run(False).report is None
    report = run(True).report
    assert report is not None and (report.step, report.module, report.phase) == (
        1,
        "transformer.h.1.mlp.c_fc",
        "forward",
    )


def _ddp_rank(rank: int, world: int, kind: str) -> bytes:
    import torchvision
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torchvision.models.get_model("mobilenet_v3_small", num_classes=10)
    if kind != "clean":
        _poisoned(model, "features.6.block.2", lambda: rank == 1 and watcher.step == 2, kind)
    ddp = DistributedDataParallel(model)
    watcher = gpudiag.watch(ddp, "record", record_dir=False)
    _train(ddp, watcher, _images, steps=4)
    report = watcher.report
    watcher.close()
    return json.dumps(
        None if report is None else [report.step, report.rank, report.module, report.phase]
    ).encode()


@pytest.mark.parametrize("kind", ["clean", "output", "grad"])
def test_ddp_mobilenet_on_two_ranks(kind: str) -> None:
    pytest.importorskip("torchvision")
    results = [json.loads(bytes(r)) for r in launch(_ddp_rank, 2, args=(kind,), timeout=180, method="fork")]
    if kind == "clean":
        assert results == [None, None]
    else:
        phase = "forward" if kind == "output" else "backward"
        for result in results:
            assert result is not None and result[:2] == [2, 1] and result[3] == phase, result
            if kind == "output":
                assert result[2] == "features.6.block.2"
