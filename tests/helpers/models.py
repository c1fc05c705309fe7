"""Small models for runtime tests (module-level: fresh-interpreter ranks import them by name)."""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from torch import nn


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def bn_net() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def flat_mlp() -> nn.Module:
    """mlp for (3, 4, 4) samples."""
    return nn.Sequential(nn.Flatten(), nn.Linear(48, 16), nn.ReLU(), nn.Linear(16, 4))


def flat_bn_net() -> nn.Module:
    """bn_net for (3, 4, 4) samples."""
    return nn.Sequential(nn.Flatten(), nn.Linear(48, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


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


# -- train-mode behaviour and randomness (tests/checks/gradcheck/test_gradcheck_trainmode.py) ---------------


class Residual(nn.Module):
    """x + StochasticDepth(Linear(x)): torchvision's stochastic depth, row mode."""

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        import torchvision

        self.inner = nn.Sequential(nn.Flatten(), nn.Linear(48, 48))
        self.drop = torchvision.ops.StochasticDepth(p, "row")
        self.head = nn.Linear(48, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.flatten(1)
        return self.head(h + self.drop(self.inner(x)))


class LinearNormBlock(nn.Module):
    """``norm(lin(x)) + x``: a Linear inside a block, so paths nest (``body.2.lin``)."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(x)) + x


class ZeroToNaN(nn.Module):
    """NaN wherever its input is 0 (``0 / 0``): after a Dropout, as many NaNs as the mask
    dropped — a count that tells which mask a forward drew."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / x * x


class FunctionalDropout(nn.Module):
    """F.dropout called in forward (no nn.Dropout module anywhere)."""

    def __init__(self, p: float = 0.3) -> None:
        super().__init__()
        self.p = p
        self.body, self.head = nn.Linear(48, 32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.nn.functional.dropout(self.body(x.flatten(1)).relu(), self.p, self.training))


class Attention(nn.Module):
    """A TransformerEncoderLayer (attention dropout and dropout modules) on (B, 4, 12)."""

    def __init__(self, dropout: float = 0.1) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(12, 2, dim_feedforward=24, dropout=dropout, batch_first=True)
        self.head = nn.Linear(48, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(x.reshape(len(x), 4, 12)).flatten(1))


class RReLUNet(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.Flatten(), nn.Linear(48, 32), nn.RReLU(), nn.Linear(32, 4))


class RandomRows(nn.Module):
    """Each sample keeps 2 of its 4 rows chosen with torch.randint: draws with no expected
    value, shaped by the batch (so replicas cannot draw what single draws)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(24, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(len(x), 4, 12)
        pick = torch.randint(0, 4, (len(x), 2, 1)).expand(-1, -1, 12)
        return self.head(rows.gather(1, pick).flatten(1))


_CALLS = [0]


class NondeterministicKernel(nn.Module):
    """Stands in for a CUDA kernel without a deterministic implementation: each forward
    scales its output by 1 + 1e-3·(calls so far), and says so the way torch alerts under
    ``use_deterministic_algorithms(True, warn_only=True)``."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(48, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import warnings

        _CALLS[0] += 1
        warnings.warn(
            "fake_index_add_cuda_ does not have a deterministic implementation, but you set "
            "'torch.use_deterministic_algorithms(True, warn_only=True)'.",
            UserWarning,
            stacklevel=2,
        )
        return self.body(x) * (1 + 1e-3 * _CALLS[0])


class TupleOutput(nn.Module):
    """(logits, features): a tuple whose first element is the logits, as GoogLeNet and
    Inception return in train mode (the features are a 16-class output of their own)."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(48, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(x.flatten(1)).relu()
        return self.head(h), h


class DictOutput(TupleOutput):
    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:  # type: ignore[override]
        out, aux = super().forward(x)
        return {"out": out, "aux": aux}


class ModelOutput(dict):  # type: ignore[type-arg]
    """Like Hugging Face's ModelOutput: a dict whose keys are attributes too."""

    def __getattr__(self, name: str) -> torch.Tensor:
        try:
            return self[name]
        except KeyError as exc:
            raise AttributeError(name) from exc


class HfStyle(nn.Module):
    """Keyword inputs (input_ids, attention_mask) and a ModelOutput with .logits."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(20, 8), nn.Linear(8, 4)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> ModelOutput:
        h = (self.embed(input_ids) * attention_mask[..., None]).sum(1)
        return ModelOutput(logits=self.head(h), hidden=h)


class Warns(nn.Module):
    """mlp whose forward warns (as DDP's reducer does about gradient strides)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import warnings

        warnings.warn("a harmless warning from the model", UserWarning, stacklevel=2)
        return self.body(x)


def bn_without_running_stats() -> nn.Module:
    """BatchNorm1d(track_running_stats=False): batch statistics in every mode."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(48, 16),
        nn.BatchNorm1d(16, track_running_stats=False),
        nn.ReLU(),
        nn.Linear(16, 4),
    )


def factory_that_raises() -> nn.Module:
    raise RuntimeError("factory boom")


class _Plain:
    """An output object that is neither a tensor, a tuple nor a dict (DDP cannot look inside)."""

    def __init__(self, logits: torch.Tensor, other: torch.Tensor) -> None:
        self.logits, self.other = logits, other


class PlainObjectWithUnusedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.fc2 = nn.Linear(48, 4), nn.Linear(48, 4)

    def forward(self, x: torch.Tensor) -> _Plain:
        h = x.flatten(1)
        return _Plain(self.fc(h), self.fc2(h))


def poison(module: nn.Module, when: Any, kind: str = "output") -> Any:
    """Make one element of ``module``'s forward output NaN (``kind="output"``), or of its
    input's gradient in backward (``kind="grad"``), whenever ``when()`` is true."""

    def forward_hook(m: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor | None:
        if not when():
            return None
        out = out.clone()
        out.view(-1)[3] = float("nan")
        return out

    def backward_hook(m: nn.Module, grad_in: Any, grad_out: Any) -> Any:
        if not when() or grad_in[0] is None:
            return None
        g = grad_in[0].clone()
        g.view(-1)[0] = float("inf")
        return (g, *grad_in[1:])

    if kind == "output":
        return module.register_forward_hook(forward_hook)
    return module.register_full_backward_hook(backward_hook)
