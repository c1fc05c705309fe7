"""CUDA checks of the runtime; they skip with a reason where no GPU is present."""

from __future__ import annotations

import pytest
import torch

from gpudiag.runtime import DeviceSet, RunConfig, run
from gpudiag.runtime.dp import dp_forward
from gpudiag.runtime.numerics import Numerics
from gpudiag.runtime.transport import Transport
from tests.helpers import models


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


class _AdaptivePool(torch.nn.Module):
    """Adaptive average pooling, whose CUDA backward has no deterministic kernel (torch
    2.11-2.15 alert ``adaptive_avg_pool2d_backward_cuda``; index_add_, used here before,
    is deterministic in that mode). 4x4 to 3x3: a 1x1 output would take the mean instead."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 16)
        self.pool = torch.nn.AdaptiveAvgPool2d((3, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(self.linear(x).view(-1, 1, 4, 4)).flatten(1)[:, :4]


@pytest.mark.gpu
def test_an_op_without_a_deterministic_cuda_kernel_is_recorded() -> None:
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    config = RunConfig("single", DeviceSet.cuda([0]), loss="mse", numerics=Numerics.comparison())
    result = run(_AdaptivePool, x, y, config)
    assert any("adaptive_avg_pool2d" in op for op in result.nondeterministic), result.nondeterministic
    on_cpu = RunConfig("single", DeviceSet.virtual(1), loss="mse", numerics=Numerics.comparison())
    cpu = run(_AdaptivePool, x, y, on_cpu)
    assert cpu.nondeterministic == []  # the CPU kernel is deterministic


@pytest.mark.gpu
def test_bench_on_cuda_times_with_events_and_reads_peak_memory() -> None:
    """bench on one CUDA GPU (single and a one-rank DDP), synthetic and DataLoader data:
    CUDA-event timing, peak memory per device, pinned loader batches."""
    import gpudiag

    result = gpudiag.bench(
        models.flat_mlp,
        input_shape=(3, 4, 4),  # (flat_mlp's Linear takes 48 features)
        num_classes=4,
        batch_size=8,
        strategies=("single", "ddp"),
        gpus=(1,),
        steps=3,
        warmup=1,
        data="loader:1",
    )
    assert not result.simulated and result.exit_code() == 0
    assert result.config["devices"] == "cuda" and "CUDA events" in result.config["timing"]
    for case in result.cases:
        assert case.peak_memory and all(b > 0 for b in case.peak_memory.values()), case.label
        assert case.phases["data"] > 0 and case.phases["forward"] > 0, case.label
    ddp = next(c for c in result.cases if c.strategy == "ddp")
    # the all-reduce timed by CUDA events (NCCL's future is "done" once queued): it took time
    assert ddp.allreduce_hidden is not None and ddp.allreduce_hidden + ddp.phases["allreduce"] > 0


def _mlp_built_on_cuda() -> torch.nn.Module:
    return models.mlp().cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("factory", [_mlp_built_on_cuda, lambda: torch.nn.DataParallel(models.mlp())])
def test_gradcheck_of_a_factory_that_builds_on_cuda(factory) -> None:  # type: ignore[no-untyped-def]
    """A factory may return its model on CUDA, as nn.DataParallel does on a machine with one
    GPU: gradcheck compares it (its copy kept on the CPU, each run on its own device)."""
    import gpudiag

    x, y = models.batch(8)
    report = gpudiag.gradcheck(factory, x, y)
    assert report.verdict == "pass", report.summary()
