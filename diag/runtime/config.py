"""What a run is asked to do and what it gives back: :class:`RunConfig`,
:class:`RunResult`, the strategies, losses and dtypes every strategy accepts."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from gpudiag import defaults as D
from gpudiag.errors import InputError
from gpudiag.findings import Finding
from gpudiag.runtime.batch import OutputKey
from gpudiag.runtime.devices import DeviceSet
from gpudiag.runtime.feed import LoaderFn
from gpudiag.runtime.numerics import Numerics
from gpudiag.runtime.record import Recorder

ModelFn = Callable[[], nn.Module]
Strategy = Literal["single", "dp", "ddp"]
STRATEGIES = D.STRATEGIES
LOSSES = D.LOSSES
DTYPES = dict(zip(D.DTYPES, (torch.float32, torch.bfloat16, torch.float16), strict=True))


@dataclass(frozen=True)
class RunConfig:
    """How to run. ``faults`` are ``--inject`` specs (see :mod:`gpudiag.runtime.faults`).
    ``numerics``: the numeric settings (TF32, cuDNN, …) set for the run in this process
    and in every DDP rank alike; None runs under each process's settings as they are."""

    strategy: Strategy
    devices: DeviceSet
    steps: int = 1
    optimizer: Literal["sgd", "adam", "none"] = "sgd"
    lr: float = 0.01
    loss: str | Callable[[Any, torch.Tensor], torch.Tensor] = "ce"  # a name or loss(output, target)
    dtype: str = "fp32"
    accumulate: int = 1
    seed: int = 0
    watch: bool = True
    faults: tuple[str, ...] = ()
    find_unused_parameters: bool = False
    broadcast_buffers: bool = True
    sync_batchnorm: bool = False
    track_params: bool = False  # ddp: digest every rank's parameters after every step
    keep_state: bool = True  # return the parameters and buffers after the last step
    timeout: float = 120.0
    numerics: Numerics | None = None
    #: the part of the model's output the loss is computed on (see ``batch.select_output``);
    #: None: chosen automatically for a named loss, the whole output for a loss function
    output: OutputKey = None
    #: bench: record each step's phases as :class:`~gpudiag.runtime.record.Phase` events
    #: (device time, one synchronisation per step: :mod:`gpudiag.runtime.timing`), the
    #: batch placed on its device once, before the first step (synthetic data), and the
    #: peak memory per CUDA device in ``RunResult.timing``. Off: nothing of it runs.
    time_phases: bool = False
    #: batches from a data loader, one per step (:mod:`gpudiag.runtime.feed`), instead of
    #: the run's one batch: ``loader(rank, world)``, built where the steps run; with
    #: ``time_phases`` the wait for each batch is the ``data`` phase
    loader: LoaderFn | None = None

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise InputError(f"unknown strategy {self.strategy!r} (expected {', '.join(STRATEGIES)})")
        if not callable(self.loss) and self.loss not in LOSSES:
            raise InputError(f"unknown loss {self.loss!r} (expected {', '.join(LOSSES)})")
        if self.dtype not in DTYPES:
            raise InputError(f"unknown dtype {self.dtype!r} (expected {', '.join(DTYPES)})")
        if self.steps < 1 or self.accumulate < 1:
            raise InputError("steps and accumulate must be at least 1")


@dataclass
class RunResult:
    """What a run produced. Tensors are on the CPU.

    ``grads``: parameter gradients of the first optimizer step (unscaled, before the
    step; for ddp: rank 0's, i.e. the all-reduced average). ``params``/``buffers``: after
    the last step. ``losses``: per step (ddp: rank 0's local loss). ``rank_digests``
    (ddp with ``track_params``): per rank, a digest of all parameters after each step.
    """

    strategy: str
    losses: list[float]
    grads: dict[str, torch.Tensor]
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    recorder: Recorder
    notes: list[Finding] = field(default_factory=list)
    rank_losses: list[list[float]] = field(default_factory=list)
    rank_digests: list[list[str]] = field(default_factory=list)
    initial_params: dict[str, torch.Tensor] = field(default_factory=dict)  # when steps > 1
    numerics: list[Numerics] = field(default_factory=list)  # as each process saw them (ddp: per rank)
    #: ops torch reported as having no deterministic implementation (any process, any step)
    nondeterministic: list[str] = field(default_factory=list)
    #: with ``time_phases``: ``peak_memory`` (CUDA device → bytes; empty on virtual devices)
    #: and ``threads`` (torch's intra-op threads in each process that computed)
    timing: dict[str, Any] = field(default_factory=dict)


def numerics_of(config: RunConfig) -> contextlib.AbstractContextManager[Any]:
    """The run's numeric settings for the length of a block (none: as they are)."""
    return config.numerics.applied() if config.numerics is not None else contextlib.nullcontext()


def sync_batchnorm_note(strategy: str) -> Finding:
    """SyncBatchNorm needs CUDA (torch refuses CPU modules) and only applies to DDP."""
    why = (
        "SyncBatchNorm only works with DistributedDataParallel"
        if strategy != "ddp"
        else "torch's SyncBatchNorm refuses CPU tensors, so it cannot run over gloo on CPU"
    )
    return Finding(
        "syncbn-skipped",
        "warning",
        f"SyncBatchNorm was not used: {why}; BatchNorm statistics stay per replica",
        {"strategy": strategy},
        fix="run on CUDA devices with ddp to compare with SyncBatchNorm",
    )
