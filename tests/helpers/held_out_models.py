"""Small models of the kinds a held-out zoo tripped gpudiag on (issue 35): gradients that
are not plain float32 — sparse (``nn.Embedding(sparse=True)``), float64, complex — each
with a twin whose gradient depends on how the batch is split, so that a comparison that
drops part of the gradient is seen to pass what it must fail; a parameter DDP finds
unused; SyncBatchNorm built by the factory. (Module-level: gpudiag loads them by file
path, fresh-interpreter ranks too.)"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

#: what the models take: gradcheck --input-shape for the dense ones, tokens for the sparse
SHAPE = "3,4,4"
TOKENS, VOCAB = "6", 50


class BatchScaledGrad(torch.autograd.Function):
    """Identity forward; the backward multiplies by the local batch size (a sum-vs-mean
    slip in a hand-written backward): the forward is the same however the batch is split,
    the gradient behind it is not."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.batch = x.shape[0]
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * ctx.batch


class SparseEmbedding(nn.Module):
    """Token ids → a sparse-gradient embedding, mean over the tokens, a linear head."""

    def __init__(self, split_dependent: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16, sparse=True)
        self.head = nn.Linear(16, 4)
        self.split_dependent = split_dependent

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.emb(x)
        if self.split_dependent:
            e = BatchScaledGrad.apply(e)
        return self.head(e.mean(1))


def sparse_embedding() -> nn.Module:
    return SparseEmbedding()


def sparse_embedding_split_dependent() -> nn.Module:
    """The embedding's (sparse) gradient depends on the batch split; nothing else's does."""
    return SparseEmbedding(split_dependent=True)


class Float64Net(nn.Module):
    """An MLP in float64 (parameters and arithmetic)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(48, 16), nn.ReLU(), nn.Linear(16, 4)).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.double())


def float64() -> nn.Module:
    return Float64Net()


class ComplexNet(nn.Module):
    """A complex linear map; the head reads its real and imaginary parts. With
    ``split_dependent`` the imaginary part's gradient depends on the batch split, and only
    it: the real part of every gradient is the same under every strategy."""

    def __init__(self, split_dependent: bool = False) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(48, 8, dtype=torch.complex64) * 0.1)
        self.head = nn.Linear(16, 4)
        self.split_dependent = split_dependent

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = x.flatten(1).to(torch.complex64) @ self.w
        imag = BatchScaledGrad.apply(z.imag) if self.split_dependent else z.imag
        return self.head(torch.cat([z.real, imag], dim=1))


def complex_net() -> nn.Module:
    return ComplexNet()


def complex_split_dependent() -> nn.Module:
    return ComplexNet(split_dependent=True)


class UnusedHead(nn.Module):
    """A second head that never runs: DDP needs find_unused_parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Sequential(nn.Flatten(), nn.Linear(48, 4))
        self.unused = nn.Linear(48, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def unused_head() -> nn.Module:
    return UnusedHead()


def sync_batchnorm() -> nn.Module:
    """BatchNorm converted to SyncBatchNorm by the factory, as training scripts do."""
    net = nn.Sequential(nn.Flatten(), nn.Linear(48, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    return nn.SyncBatchNorm.convert_sync_batchnorm(net)
