"""Device sets: real CUDA devices, or CPU *virtual devices* laid out like a machine.

A virtual device set runs every replica on the CPU but keeps the identity of the GPUs it
plays — numbered as in the machine file (nvidia-smi numbering) — so each transfer knows
its link (``NV4``, ``SYS``…). ``DeviceSet.virtual([5, 6], machine)`` plays GPUs 5 and 6 of
the seed machine, joined by ``NODE``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from gpudiag.errors import CannotRunHere, InputError
from gpudiag.hw.cuda import cuda_device_count
from gpudiag.topology.model import Topology


@dataclass(frozen=True)
class DeviceSet:
    """The devices a strategy runs on; ``ids[0]`` is the output device (as in DataParallel)."""

    kind: Literal["cuda", "virtual"]
    ids: tuple[int, ...]
    topology: Topology | None = None

    @classmethod
    def virtual(cls, ids: int | list[int] | tuple[int, ...], machine: Topology | None = None) -> DeviceSet:
        """CPU virtual devices: ``ids`` (or ``range(ids)``), optionally GPUs of ``machine``."""
        chosen = tuple(range(ids)) if isinstance(ids, int) else tuple(ids)
        if not chosen or len(set(chosen)) != len(chosen):
            raise InputError(f"virtual devices must be distinct, got {list(chosen)}")
        if machine is not None:
            missing = [i for i in chosen if f"GPU{i}" not in machine.gpus]
            if missing:
                raise InputError(f"the machine has no GPU {', '.join(map(str, missing))}")
        return cls("virtual", chosen, machine)

    @classmethod
    def cuda(
        cls, ids: list[int] | tuple[int, ...] | None = None, machine: Topology | None = None
    ) -> DeviceSet:
        """Real CUDA devices by torch index (default: all visible)."""

        count = cuda_device_count()
        chosen = tuple(range(count)) if ids is None else tuple(ids)
        if count == 0:
            raise CannotRunHere("no CUDA GPU here; use virtual devices (--machine FILE) to simulate")
        bad = [i for i in chosen if not 0 <= i < count]
        if bad or not chosen:
            raise InputError(f"CUDA devices {list(chosen)} requested, {count} visible")
        return cls("cuda", chosen, machine)

    def __len__(self) -> int:
        return len(self.ids)

    def torch_device(self, device: int) -> Any:
        """The torch device that holds the tensors of device ``device``."""
        import torch

        return torch.device("cpu") if self.kind == "virtual" else torch.device("cuda", device)

    def link(self, a: int, b: int) -> str | None:
        """The link code between devices ``a`` and ``b`` (``None`` when unknown)."""
        if a == b:
            return "X"
        if self.topology is None:
            return None
        return self.topology.cell(f"GPU{a}", f"GPU{b}")
