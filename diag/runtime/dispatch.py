"""Run training steps of a model under one strategy and return what happened.

``run(model_fn, inputs, targets, config) -> RunResult`` is the one interface every
comparison and divergence check uses:

- ``single``: the whole batch on the first device (the reference);
- ``dp``: DataParallel semantics (:mod:`gpudiag.runtime.dp`) over the device set;
- ``ddp``: real ``DistributedDataParallel``, one process per rank (gloo on CPU, nccl on
  CUDA), each rank on the contiguous ``torch.chunk`` shard of the same global batch.

Each step: zero the gradients, forward (under autocast for bf16/fp16), loss, backward
(through a GradScaler for fp16), optimizer step (SGD or Adam; ``none`` skips it). With
``accumulate=K`` the batch is split into K micro-batches whose losses are divided by K;
DDP skips the all-reduce on all but the last (``no_sync``). The model is built by
``model_fn()`` after ``torch.manual_seed(seed)``, so every strategy starts from the same
weights; the factory's train/eval mode is kept (eval makes BatchNorm use running stats).
"""

from __future__ import annotations

from typing import Any

import torch

from gpudiag.runtime.config import ModelFn, RunConfig, RunResult, numerics_of
from gpudiag.runtime.ddp import run_ddp
from gpudiag.runtime.deadline import contained
from gpudiag.runtime.faults import FaultPlan
from gpudiag.runtime.local import run_local


def run(model_fn: ModelFn, inputs: Any, targets: torch.Tensor, config: RunConfig) -> RunResult:
    """Run ``config.steps`` steps of ``model_fn()`` on ``(inputs, targets)``."""
    FaultPlan.parse(config.faults)  # bad specs fail here, before anything starts
    if config.strategy == "ddp":
        return run_ddp(model_fn, inputs, targets, config)
    used = config.devices.ids[:1] if config.strategy == "single" else config.devices.ids
    devices = ",".join(map(str, used))
    with numerics_of(config), contained(config.timeout, f"the {config.strategy} run on device {devices}"):
        return run_local(model_fn, inputs, targets, config)
