"""``--data``: where bench's batches come from.

- ``synthetic``: one random batch placed on the device before the first step — no input
  pipeline at all, the GPU's ceiling.
- ``loader[:WORKERS]``: a real ``torch.utils.data.DataLoader`` with ``WORKERS`` worker
  processes (default 2; 0 loads in the training process), one per training process as in
  a ``torchrun`` script, over a dataset built here: torchvision's ``FakeData`` with
  ``ToTensor`` for 1-, 3- or 4-channel images (a random image made, turned into a PIL
  image and back per sample: real per-sample CPU work, like decoding), random tensors per
  sample for any other input. Every process reads its own ``torch.chunk`` share of each
  global batch, the samples the synthetic runs give it, so the two modes differ only in
  where the batch comes from; an input-bound pipeline shows as the ``data`` phase.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpudiag.errors import InputError

DEFAULT_WORKERS = 2


def parse_data(text: str) -> tuple[str, int]:
    """``synthetic`` → ("synthetic", 0); ``loader`` / ``loader:N`` → ("loader", N)."""
    kind, sep, workers = text.partition(":")
    if kind == "synthetic" and not sep:
        return "synthetic", 0
    if kind == "loader":
        if not sep:
            return "loader", DEFAULT_WORKERS
        if workers.isascii() and workers.isdigit() and int(workers) <= 256:
            return "loader", int(workers)
        raise InputError(f"--data {text}: the workers must be a whole number from 0 to 256")
    raise InputError(f"--data {text}: expected synthetic, loader or loader:WORKERS")


def shares(batch: int, world: int) -> list[tuple[int, int]]:
    """Each rank's (offset, size) in a global batch of ``batch`` split like ``torch.chunk``
    into ``world`` pieces (a batch of 5 in 2: 3 + 2)."""
    piece = -(-batch // world)
    out = []
    for rank in range(world):
        start = min(rank * piece, batch)
        out.append((start, min(piece, batch - start)))
    return out


class RandomSamples:
    """Sample ``i``: a random input of ``input_shape`` drawn from a generator seeded with
    ``seed`` and ``i`` (as ``--input-dtype``/``--input-range`` ask) and a class below
    ``num_classes``."""

    def __init__(
        self,
        size: int,
        input_shape: tuple[int, ...],
        num_classes: int,
        input_dtype: str,
        input_range: tuple[float, float] | None,
        seed: int,
    ):
        self.size, self.input_shape, self.num_classes = size, input_shape, num_classes
        self.input_dtype, self.input_range, self.seed = input_dtype, input_range, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        import torch

        from gpudiag.models import random_inputs

        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        x = random_inputs(generator, 1, self.input_shape, self.input_dtype, self.input_range)[0]
        return x, int(torch.randint(0, self.num_classes, (1,), generator=generator))


@dataclass(frozen=True)
class LoaderData:
    """``loader(rank, world)`` for :class:`~gpudiag.runtime.RunConfig` (picklable): a
    ``DataLoader`` over this process's share of ``steps`` global batches of
    ``global_batch`` samples, ``workers`` worker processes, ``pin_memory`` on CUDA."""

    workers: int
    global_batch: int
    steps: int
    input_shape: tuple[int, ...]
    num_classes: int
    input_dtype: str = "float"
    input_range: tuple[float, float] | None = None
    seed: int = 0
    pin_memory: bool = False

    def dataset(self) -> Any:
        size = self.global_batch * self.steps
        shape = self.input_shape
        if (
            self.input_dtype == "float"
            and self.input_range is None
            and len(shape) == 3
            and shape[0] in (1, 3, 4)
        ):
            from torchvision.datasets import FakeData
            from torchvision.transforms import ToTensor

            return FakeData(
                size,
                image_size=shape,
                num_classes=self.num_classes,
                transform=ToTensor(),
                random_offset=self.seed,
            )
        return RandomSamples(size, shape, self.num_classes, self.input_dtype, self.input_range, self.seed)

    def __call__(self, rank: int, world: int) -> Any:
        from torch.utils.data import DataLoader, Subset

        offset, size = shares(self.global_batch, world)[rank]
        if size == 0:
            raise InputError(
                f"a global batch of {self.global_batch} leaves rank {rank} of {world} no samples"
            )
        indices = [step * self.global_batch + offset + i for step in range(self.steps) for i in range(size)]
        return DataLoader(
            Subset(self.dataset(), indices),
            batch_size=size,
            shuffle=False,
            num_workers=self.workers,
            pin_memory=self.pin_memory,
            worker_init_fn=leave_signals_to_the_trainer if self.workers else None,
        )


#: How often a DataLoader worker checks that its training process is still there (seconds).
PARENT_POLL_S = 0.1


def leave_signals_to_the_trainer(_worker: int) -> None:
    """A DataLoader worker ignores SIGINT and SIGTERM: Ctrl-C and ``kill`` of the job reach
    every process of its group, and the training process stops its workers itself (the
    worker forked with gpudiag's handlers, which would raise in it, and a worker killed
    first makes the loader fail with "worker exited unexpectedly" instead of the
    interruption; on an interruption the trainer kills them: ``gpudiag.runtime.feed``).
    A worker whose training process is gone (killed outright, or a rank ended by its
    launcher) leaves within :data:`PARENT_POLL_S` seconds by itself — torch's own watchdog
    takes up to 5 s."""
    import os
    import signal
    import threading
    import time

    from torch.utils.data import get_worker_info

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if get_worker_info() is None:
        return  # (called outside a worker: nothing to watch)
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(0)

    threading.Thread(target=watch, name="gpudiag-trainer-watch", daemon=True).start()
