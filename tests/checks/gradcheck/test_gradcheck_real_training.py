"""gradcheck on what real training code does that the train-mode probe and the runtime
must not get wrong (issue 35): activation checkpointing with dropout, batch norm called
without a module, a SyncBatchNorm the user's factory built, DataParallel's random draws
per device, and a strategy that crashes beside one that can still be explained."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from gpudiag.checks.gradcheck import GradcheckReport, gradcheck
from gpudiag.checks.gradcheck.trainmode import probe
from gpudiag.runtime.devices import DeviceSet
from gpudiag.runtime.dp import dp_forward
from gpudiag.runtime.transport import Transport
from tests.helpers import codes

X = torch.randn(8, 3, 4, 4, generator=torch.Generator().manual_seed(1))
Y = torch.randint(0, 4, (8,), generator=torch.Generator().manual_seed(2))


def check(factory: Callable[[], nn.Module], **options: object) -> GradcheckReport:
    """On CPU virtual devices on every machine: what is tested is the simulation."""
    options.setdefault("devices", DeviceSet.virtual(2))
    return gradcheck(factory, options.pop("inputs", X), options.pop("targets", Y), **options)  # type: ignore[arg-type]


# -- activation checkpointing ---------------------------------------------------------------


class CheckpointedBlock(nn.Module):
    """A residual MLP block run under torch.utils.checkpoint, with dropout in the middle
    of the checkpointed part (so the recompute in backward runs it again)."""

    def __init__(self, reentrant: bool):
        super().__init__()
        self.embed = nn.Linear(48, 32)
        self.up, self.drop, self.down = nn.Linear(32, 64), nn.Dropout(0.3), nn.Linear(64, 32)
        self.head = nn.Linear(32, 4)
        self.reentrant = reentrant

    def block(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(self.drop(torch.relu(self.up(h))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x.flatten(1))
        return self.head(checkpoint(self.block, h, use_reentrant=self.reentrant))


def checkpointed() -> nn.Module:
    return CheckpointedBlock(reentrant=False)


def checkpointed_reentrant() -> nn.Module:
    return CheckpointedBlock(reentrant=True)


@pytest.mark.parametrize("factory", [checkpointed, checkpointed_reentrant])
def test_activation_checkpointing_with_dropout_is_explained_as_dropout(
    factory: Callable[[], nn.Module],
) -> None:
    # Before: non-reentrant raised CheckpointError in controlled mode (exit 2, "the model
    # under single raised"); reentrant compared the controlled forward's gradients with a
    # recompute that drew real masks (FAIL, mismatch-unexplained).
    report = check(factory)
    assert report.verdict == "explained", report.summary()
    assert codes(report) == ["dropout-active"], report.summary()
    controlled = [c for c in report.comparisons if c.mode == "controlled"]
    assert {c.strategy for c in controlled} == {"dp", "ddp"} and all(c.ok for c in controlled)


def tiny_bert_checkpointed() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=48,
        max_position_embeddings=32,
        num_labels=4,
    )
    model = transformers.BertForSequenceClassification(config)
    # gradient_checkpointing_enable(), named activation_checkpointing_enable() since transformers 5.2x
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    return model


def test_hugging_face_gradient_checkpointing_is_explained_as_dropout() -> None:
    pytest.importorskip("transformers")
    ids = torch.randint(0, 64, (8, 12), generator=torch.Generator().manual_seed(3))
    report = check(tiny_bert_checkpointed, inputs={"input_ids": ids})
    assert report.verdict == "explained", report.summary()
    assert codes(report) == ["dropout-active"], report.summary()
    assert all(c.ok for c in report.comparisons if c.mode == "controlled"), report.summary()


# -- batch norm without a module ------------------------------------------------------------


class FunctionalBatchNorm(nn.Module):
    """BatchNorm written with F.batch_norm (as in code ported from other frameworks):
    its own parameters and running statistics, batch statistics in training."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.weight, self.bias = nn.Parameter(torch.ones(8)), nn.Parameter(torch.zeros(8))
        self.register_buffer("running_mean", torch.zeros(8))
        self.register_buffer("running_var", torch.ones(8))
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stats = self.running_mean, self.running_var
        h = F.batch_norm(self.conv(x), *stats, self.weight, self.bias, training=True)
        return self.head(torch.relu(h).mean((2, 3)))


class ModuleBatchNorm(nn.Module):
    """The same arithmetic with nn.BatchNorm2d."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.norm(self.conv(x))).mean((2, 3)))


def test_functional_batch_norm_is_explained_as_nn_batchnorm_is() -> None:
    functional, module = check(FunctionalBatchNorm), check(ModuleBatchNorm)
    assert functional.verdict == module.verdict == "explained", functional.summary()
    assert codes(functional) == codes(module) == ["batchnorm-per-replica"], functional.summary()
    assert functional.train_mode["batch_statistics"] == [
        {"module": "", "class": "FunctionalBatchNorm", "what": "batch statistics"}
    ]

    def as_is(report: GradcheckReport) -> dict[str, float]:
        return {c.strategy: c.rel_norm_err for c in report.comparisons if c.mode == "as-is"}

    assert as_is(functional) == pytest.approx(as_is(module))


def test_instance_norm_is_not_batch_statistics() -> None:
    # instance norm runs the batch-norm op on the batch viewed as one sample
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.InstanceNorm2d(8), nn.Flatten(), nn.Linear(8 * 2 * 2, 4))
    assert probe(model, X).batch_statistics == ()


# -- SyncBatchNorm from the factory, and a crash beside an explanation ----------------------


def user_sync_batchnorm() -> nn.Module:
    return nn.SyncBatchNorm.convert_sync_batchnorm(ModuleBatchNorm())


def test_a_factory_built_sync_batchnorm_is_treated_as_the_sync_batchnorm_option() -> None:
    # Before: DDP's rank crashed on CPU (FAIL, rank-crashed) and DataParallel's plain
    # BatchNorm difference was left unexplained.
    report = check(user_sync_batchnorm)
    assert report.verdict == "explained", report.summary()
    assert codes(report) == ["syncbn-skipped", "batchnorm-per-replica"], report.summary()
    explained = next(f for f in report.findings if f.code == "batchnorm-per-replica")
    assert set(explained.evidence["strategies"]) == {"dp", "ddp"}, explained.evidence


class AllReducesOnCuda(ModuleBatchNorm):
    """A BatchNorm model whose forward all-reduces a statistic on CUDA when it runs under
    torch.distributed (as custom load-balancing code does): on a CPU-only machine its DDP
    run crashes while single and DataParallel run."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(x.detach().mean().cuda())
        return super().forward(x)


def test_a_crashed_strategy_does_not_stop_the_others_explanation() -> None:
    report = check(AllReducesOnCuda)
    assert report.verdict == "fail", report.summary()
    assert "rank-crashed" in codes(report) and "batchnorm-per-replica" in codes(report), report.summary()
    explained = next(f for f in report.findings if f.code == "batchnorm-per-replica")
    assert explained.evidence["strategies"] == ["dp"], explained.evidence
    assert "mismatch-unexplained" not in codes(report)


# -- DataParallel's random draws ------------------------------------------------------------


def one_dropout() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(48, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 4))


def test_dataparallel_replicas_draw_from_their_own_generators() -> None:
    # Before: virtual replicas drew from the CPU generator in turn, so together they drew
    # single's mask for the whole batch and dp matched single exactly (ok, no finding)
    # where replicas on real GPUs, each with its own generator, draw other masks.
    report = check(one_dropout, strategies=("single", "dp"))
    dp = next(c for c in report.comparisons if c.strategy == "dp" and c.mode == "as-is")
    assert not dp.ok, report.summary()
    assert codes(report) == ["dropout-active"], report.summary()
    # Each device's generator starts where torch.manual_seed leaves every GPU: alike, so
    # both replicas of an even split draw the same mask (the first rows of single's).
    masks = nn.Dropout(0.5)
    torch.manual_seed(0)
    out = dp_forward(masks, (torch.ones(8, 16),), {}, Transport(DeviceSet.virtual(2)))
    assert torch.equal(out[:4] == 0, out[4:] == 0)
