"""Small models for runtime tests (module-level: fresh-interpreter ranks import them by name)."""

from __future__ import annotations

import os
import time

import torch
from torch import nn


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def bn_net() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


class Crashes(nn.Module):
    """Raises in forward on rank 1."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if os.environ.get("RANK") == "1":
            raise RuntimeError("boom on rank 1")
        return self.fc(x)


class Hangs(nn.Module):
    """Never returns on rank 1."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if os.environ.get("RANK") == "1":
            time.sleep(3600)
        return self.fc(x)


class Unused(nn.Module):
    """Has a branch that never runs: DDP needs find_unused_parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(8, 4)
        self.unused = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


class CrashesWhenControlled(nn.Module):
    """BatchNorm; raises on rank 1 only when the BatchNorm runs on running statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if os.environ.get("RANK") == "1" and not self.bn.training:
            raise RuntimeError("boom in controlled mode")
        return self.head(self.bn(self.fc(x)))


class UnusedWithBatchNorm(nn.Module):
    """BatchNorm and a branch that never runs: both explanations are needed."""

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
        self.unused = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


class DictInput(nn.Module):
    """Takes nested inputs: a tuple (dict, list) and a keyword tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 4)
        self.b = nn.Linear(8, 4)

    def forward(self, batch: dict, extra: list, scale: torch.Tensor | None = None) -> dict:
        out = self.a(batch["x"]) + self.b(extra[0])
        if scale is not None:
            out = out * scale
        return {"logits": out, "pair": (out.sum(dim=1), extra[1])}


def batch(
    n: int = 8, features: int = 8, classes: int = 4, seed: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, features, generator=g), torch.randint(0, classes, (n,), generator=g)


class TwoInputRegressor(nn.Module):
    """A regression model with two input tensors and a dict output (not classification)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(4, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> dict:
        return {"pred": self.head(torch.tanh(self.a(x) + self.b(z)))}


def assert_close_dicts(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 1e-6) -> None:
    """Same keys, every tensor close (rtol 1e-5)."""
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=1e-5, msg=name)
