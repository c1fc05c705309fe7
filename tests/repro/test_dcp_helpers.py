"""Real DCP checkpoints for the DCP tests (no tests here): written by torch's own save
paths on CPU — dcp.save of get_state_dict from one process, and from 2- and 3-rank FSDP2
(fully_shard) and DDP jobs on gloo. Each kind is written once per test session
(:func:`healthy`) and copied before a test damages it (:func:`copy_of`)."""

from __future__ import annotations

import shutil
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


def tiny_bf16() -> nn.Module:
    """The same model built in bfloat16 (a checkpoint of fp32 casts into it silently)."""
    return tiny().to(torch.bfloat16)


def tiny_wide_vocab() -> nn.Module:
    """Another vocabulary: embed.weight and head.weight differ in shape."""
    torch.manual_seed(0)
    return Tiny(vocab=14)


def ac_compiled() -> nn.Module:
    """Activation checkpointing around a compiled block (torchtitan #2622): its keys keep an
    inner ``_orig_mod.`` in get_model_state_dict."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = tiny()
    model.layers[0] = checkpoint_wrapper(torch.compile(model.layers[0]))
    return model


def train_step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    torch.manual_seed(1)
    idx = torch.randint(0, 13, (4, 5))
    model(idx).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def save_single(
    folder: Path, model: nn.Module | None = None, optimizer: bool = True, step: bool = True
) -> Path:
    """dcp.save of get_state_dict from one process (no process group)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = model if model is not None else tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if step:
        train_step(model, opt)
    msd, osd = get_state_dict(model, opt)
    state: dict[str, Any] = {"model": msd}
    if optimizer:
        state["optim"] = osd
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


def colwise_rank(rank: int, world: int, folder: str) -> bytes:
    """Tensors sharded along their columns (Shard(1), as tensor parallelism shards a
    row-parallel weight) and along both dimensions of a 3-D tensor: chunks that are not
    contiguous runs of the global tensor."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    full = {
        "w": torch.randn(6, 7),
        "cube": torch.randn(3, 5, 4, dtype=torch.float64),
        "half": torch.randn(5, 3).to(torch.bfloat16),
    }
    state = {
        "model": {
            "w": distribute_tensor(full["w"], mesh, [Shard(1)]),
            "cube": distribute_tensor(full["cube"], mesh, [Shard(1)]),
            "half": distribute_tensor(full["half"], mesh, [Shard(0)]),
        }
    }
    dcp.save(state, checkpoint_id=folder)
    return b""


def edge_rank(rank: int, world: int, folder: str) -> bytes:
    """A 2x2 mesh (4 ranks): a tensor sharded over both dimensions (a grid of chunks), one
    with fewer rows than ranks (an empty chunk), a channels_last conv weight (a strided
    storage), a float16 tensor, and plain objects beside the tensors."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2))
    torch.manual_seed(0)
    conv = nn.Conv2d(4, 6, 3).to(memory_format=torch.channels_last)
    state = {
        "model": {
            "tiny": distribute_tensor(torch.randn(1, 3), mesh, [Shard(0), Replicate()]),
            "grid": distribute_tensor(torch.randn(5, 7), mesh, [Shard(0), Shard(1)]),
            "conv": conv.weight.detach(),
            "half": torch.randn(3, 2).half(),
        },
        "extra": {"note": "hello", "values": [1, 2.5, None]},
    }
    dcp.save(state, checkpoint_id=folder)
    return b""


class RunsCode:
    """An object whose unpickling would run a command (a stand-in for a job's own class)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        import os

        return (os.system, (f"touch {self.marker}",))


def save_with_object(folder: Path, marker: Path) -> Path:
    """dcp.save of a model and, beside it, an object pickled with a global of its own."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": tiny().state_dict(), "job": {"cfg": RunsCode(marker)}}, checkpoint_id=str(folder))
    return folder


_MADE: dict[str, Path] = {}


def healthy(kind: str, root: Path) -> Path:
    """A healthy checkpoint of ``kind`` (single, ac_compiled, fsdp2-2, fsdp2-3, ddp), written
    once per session under ``root``."""
    if kind not in _MADE:
        folder = root / kind
        if kind == "single":
            save_single(folder)
        elif kind == "ac_compiled":
            save_single(folder, ac_compiled(), step=False)  # its keys matter, not a compile
        elif kind.startswith("fsdp2-"):
            save_fsdp2(folder, int(kind.split("-")[1]))
        elif kind == "ddp":
            save_ddp(folder)
        elif kind in ("colwise", "edge"):
            from gpudiag.runtime.launch import launch

            folder.mkdir(parents=True)
            job, world = (colwise_rank, 2) if kind == "colwise" else (edge_rank, 4)
            launch(job, world, args=(str(folder),), timeout=120)
        else:
            raise ValueError(kind)
        _MADE[kind] = folder
    return _MADE[kind]


def copy_of(folder: Path, dst: Path) -> Path:
    shutil.copytree(folder, dst)
    return dst


def snapshot(folder: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every file's size, mtime and bytes: the input must be the same after any command."""
    return {
        p.name: (p.stat().st_size, p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(folder.iterdir())
    }


def rewrite_metadata(folder: Path, change: Any) -> None:
    """Load .metadata with torch's own (trusted, test-only) pickle, ``change(metadata)``,
    write it back: a .metadata made inconsistent the way a mixed-up save would."""
    import pickle

    path = folder / ".metadata"
    with open(path, "rb") as handle:
        meta = pickle.load(handle)  # the test's own file
    change(meta)
    with open(path, "wb") as handle:
        pickle.dump(meta, handle)
