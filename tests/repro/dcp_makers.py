"""Real DCP checkpoints for the tests: written by torch's own save paths on CPU."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.attn = nn.Linear(width, width)
        self.mlp = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(torch.relu(self.attn(x)))


class Tiny(nn.Module):
    """Embedding, blocks, head: shapes that shard unevenly over 2 and 3 ranks."""

    def __init__(self, width: int = 10, depth: int = 2, vocab: int = 13) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def tiny() -> nn.Module:
    torch.manual_seed(0)
    return Tiny()


def train_step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    torch.manual_seed(1)
    idx = torch.randint(0, 13, (4, 5))
    model(idx).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def save_single(folder: Path, model: nn.Module | None = None, optimizer: bool = True, extra: Any = None) -> Path:
    """dcp.save of get_state_dict from one process (no process group)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = model if model is not None else tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, opt)
    msd, osd = get_state_dict(model, opt)
    state: dict[str, Any] = {"model": msd}
    if optimizer:
        state["optim"] = osd
    if extra is not None:
        state["extra"] = extra
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(folder))
    return folder


def fsdp2_rank(rank: int, world: int, folder: str) -> bytes:
    """One rank of an FSDP2 (fully_shard) job on gloo: a step, then dcp.save."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard  # type: ignore[no-redef]

    mesh = init_device_mesh("cpu", (world,))
    model = tiny()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, opt)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=folder)
    return b""


def save_fsdp2(folder: Path, world: int) -> Path:
    from gpudiag.runtime.launch import launch

    folder.mkdir(parents=True, exist_ok=True)
    launch(fsdp2_rank, world, args=(str(folder),), timeout=120)
    return folder


def ddp_rank(rank: int, world: int, folder: str) -> bytes:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(tiny())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, opt)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=folder)
    return b""


def save_ddp(folder: Path, world: int = 2) -> Path:
    from gpudiag.runtime.launch import launch

    folder.mkdir(parents=True, exist_ok=True)
    launch(ddp_rank, world, args=(str(folder),), timeout=120)
    return folder
