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
