"""CUDA checks of the runtime; they skip with a reason where no GPU is present."""

from __future__ import annotations

import pytest
import torch

from gpudiag.runtime import DeviceSet, RunConfig, run
from gpudiag.runtime.dp import dp_forward
from gpudiag.runtime.numerics import Numerics
from gpudiag.runtime.transport import Transport
from tests import models


@pytest.mark.multi_gpu
def test_dp_on_cuda_equals_nn_dataparallel_bit_for_bit() -> None:
    torchvision = pytest.importorskip("torchvision")
    ids = [0, 1]
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(6, 3, 32, 32, generator=g), torch.randint(0, 10, (6,), generator=g)

    def grads(use_runtime: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = torchvision.models.resnet18(num_classes=10).cuda(0)
        if use_runtime:
            out = dp_forward(model, (x.cuda(0),), {}, Transport(DeviceSet.cuda(ids)))
        else:
            out = torch.nn.DataParallel(model, device_ids=ids)(x.cuda(0))
        torch.nn.functional.cross_entropy(out, y.cuda(0)).backward()
        return {n: p.grad.cpu() for n, p in model.named_parameters()}

    with Numerics.comparison().applied():  # no TF32, deterministic cuDNN; restored after
        ours, theirs = grads(True), grads(False)
    for name in theirs:
        assert torch.equal(ours[name], theirs[name]), name


@pytest.mark.gpu
def test_single_strategy_on_cuda_matches_cpu() -> None:
    x, y = models.batch(8)
    cpu = run(models.mlp, x, y, RunConfig("single", DeviceSet.virtual(1)))
    gpu = run(models.mlp, x, y, RunConfig("single", DeviceSet.cuda([0])))
    for name in cpu.grads:
        torch.testing.assert_close(cpu.grads[name], gpu.grads[name], atol=1e-5, rtol=1e-4)


@pytest.mark.gpu
def test_ddp_over_nccl_on_one_gpu() -> None:
    x, y = models.batch(8)
    result = run(models.mlp, x, y, RunConfig("ddp", DeviceSet.cuda([0]), steps=2))
    assert len(result.losses) == 2 and result.recorder.buckets
