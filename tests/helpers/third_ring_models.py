"""Small models of the kinds the third held-out zoo (issue 46) tripped gradcheck on, each
with its expected verdict: an MoE whose experts get no tokens on one DDP rank (a per-rank
unused parameter), BatchNorm beside a ``randperm`` sampler (two causes, one explaining
most), a LayerDrop that skips a layer by a draw, and real bugs — a forward that divides by
the per-device batch, an unseeded ``randperm`` token drop, a data-dependent init in the
forward (per-replica state). (Module-level: gpudiag loads them by file path, fresh-
interpreter ranks too.)"""

from __future__ import annotations

import torch
from torch import nn

#: gradcheck --input-shape of the dense models here
SHAPE = (3, 4, 4)
FEATURES = 48


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ff = nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), nn.Linear(16, FEATURES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ff(x)


class ModalityMoE(nn.Module):
    """Samples whose first feature is positive ("image" tokens) go to the image expert, the
    others to the text expert: a shard without image samples leaves the image expert's
    parameters without a gradient on that rank alone."""

    def __init__(self) -> None:
        super().__init__()
        self.text = Expert()
        self.image = Expert()
        self.head = nn.Linear(FEATURES, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        is_image = x[:, 0] > 0
        out = torch.zeros_like(x)
        if bool((~is_image).any()):
            out[~is_image] = self.text(x[~is_image])
        if bool(is_image.any()):
            out[is_image] = self.image(x[is_image])
        return self.head(out + x)


def moe() -> nn.Module:
    return ModalityMoE()


def moe_batch(batch: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch whose first half (rank 0's shard at world size 2) holds text samples only."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, *SHAPE, generator=g)
    first = x[:, 0, 0, 0].abs()
    x[:, 0, 0, 0] = torch.where(torch.arange(batch) < batch // 2, -first, first)
    return x, torch.randint(0, 4, (batch,), generator=g)


class PerDeviceBatchNorm(nn.Module):
    """A user's bug: the forward divides by the batch it sees (``out / x.shape[0]``), so
    each replica's output, and gradient, is W times single's."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(FEATURES, 16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) / x.shape[0]


def per_device_batch() -> nn.Module:
    return PerDeviceBatchNorm()


class BatchNormSampler(nn.Module):
    """BatchNorm in train mode, then a sampler (as detection heads sample proposals over
    the whole batch) that draws ``randperm`` over the batch rows and halves a quarter of
    them: BatchNorm makes most of the difference between strategies, the draw the rest."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten())
        self.head = nn.Linear(8 * 16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.body(x))
        n = logits.shape[0]
        weight = torch.ones(n)
        weight[torch.randperm(n)[: max(1, n // 4)]] = 0.97
        return logits * weight[:, None]


def batchnorm_sampler() -> nn.Module:
    return BatchNormSampler()


class LayerDropNet(nn.Module):
    """LayerDrop (wav2vec2, BART): each layer is skipped in train mode when a draw falls
    below ``p``: which parameters get a gradient is a draw, not a fixed property."""

    def __init__(self, p: float = 0.3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(FEATURES, FEATURES) for _ in range(4))
        self.head = nn.Linear(FEATURES, 4)
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        for layer in self.layers:
            if self.training and torch.rand([]) < self.p:
                continue
            x = x + torch.tanh(layer(x))
        return self.head(x)


def layerdrop() -> nn.Module:
    return LayerDropNet()


class UnseededTokenDrop(nn.Module):
    """A user's bug: a token drop that draws its ``randperm`` from a generator seeded from
    the clock, which no seed reaches."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(FEATURES, 16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.flatten(1)
        g = torch.Generator()
        g.seed()
        keep = torch.ones(tokens.shape[1])
        keep[torch.randperm(tokens.shape[1], generator=g)[: tokens.shape[1] // 4]] = 0.0
        return self.net(tokens * keep)


def unseeded_token_drop() -> nn.Module:
    return UnseededTokenDrop()


class ActNorm(nn.Module):
    """A data-dependent init in forward (Glow's ActNorm): the first forward sets the
    parameters from the batch it sees — per replica under DataParallel and DDP."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(features))
        self.scale = nn.Parameter(torch.ones(features))
        self.register_buffer("initialised", torch.tensor(False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not bool(self.initialised):
            with torch.no_grad():
                self.bias.copy_(-x.mean(0))
                self.scale.copy_(1 / (x.std(0) + 1e-6))
                self.initialised.fill_(True)
        return (x + self.bias) * self.scale


def actnorm() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(FEATURES, 16), ActNorm(16), nn.ReLU(), nn.Linear(16, 4))


def cancelling_linear() -> nn.Module:
    """A linear map; with :func:`cancelling_batch` its weight gradient is a sum of terms
    that nearly cancel, so float32's reduction order shows (~1e-5), and every strategy is
    as right as single (measured against float64)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(FEATURES, 4))


class SlightlyBatchScaled(nn.Module):
    """A bug of a near-miss size: the output is scaled by 1 + 1e-4 × the batch it sees, so
    DDP and DataParallel differ from single by ~4e-4 — and from float64 by as much."""

    def __init__(self) -> None:
        super().__init__()
        self.net = cancelling_linear()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) * (1 + 1e-4 * x.shape[0])


def slightly_batch_scaled() -> nn.Module:
    return SlightlyBatchScaled()


def cancelling_batch(factory: object = None, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs of nearly equal samples whose ``mse`` targets sit on either side of the
    model's output (built as gradcheck builds it: ``torch.manual_seed(seed)``): each pair's
    gradients cancel to ~1e-4 of their size."""
    g = torch.Generator().manual_seed(1)
    base = torch.randn(4, FEATURES, generator=g)
    x = torch.stack([base, base + 1e-4 * torch.randn(4, FEATURES, generator=g)], 1).reshape(8, *SHAPE)
    torch.manual_seed(seed)
    model = cancelling_linear() if factory is None else factory()  # type: ignore[operator]
    with torch.no_grad():
        y = model(x)
    sign = torch.tensor([1.0, -1.0] * 4)[:, None]
    return x, y + sign + torch.tensor([0.0, 1e-4] * 4)[:, None]


class LossDict(nn.Module):
    """Returns its losses as a dict, as torchvision detection models do in train mode."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(FEATURES, 8))

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.body(x)
        return {"loss_classifier": h[:, :4].pow(2).mean(), "loss_box_reg": h[:, 4:].abs().mean()}


def loss_dict() -> nn.Module:
    return LossDict()


def own_losses(output: dict[str, torch.Tensor], targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """``--loss``: the model's own loss dict (the targets are not needed)."""
    return output


def loss_per_device(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``--loss``: a user's loss that sums and divides by a constant, not by the batch:
    under DDP it is W times smaller, a bug gradcheck must fail."""
    return nn.functional.cross_entropy(output, targets, reduction="sum") / 8


def wav2vec2_layerdrop() -> nn.Module:
    """A tiny Hugging Face wav2vec2 classifier with LayerDrop 0.5 (and its dropouts): in
    the probe's forward a draw skips encoder layers."""
    from transformers import Wav2Vec2Config, Wav2Vec2ForSequenceClassification

    config = Wav2Vec2Config(
        conv_dim=(8, 8),
        conv_kernel=(10, 3),
        conv_stride=(5, 2),
        hidden_size=16,
        num_hidden_layers=4,
        num_attention_heads=2,
        intermediate_size=32,
        num_conv_pos_embeddings=4,
        num_conv_pos_embedding_groups=2,
        layerdrop=0.5,
        num_labels=4,
        apply_spec_augment=False,
    )
    return Wav2Vec2ForSequenceClassification(config)
