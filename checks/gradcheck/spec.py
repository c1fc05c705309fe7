"""``gpudiag gradcheck``'s entry from the command line: a ``--model`` spec and the batch
settings turned into a factory and a seeded batch (or one read from a file), then
:func:`~gpudiag.checks.gradcheck.check.gradcheck`."""

from __future__ import annotations

from typing import Any

import torch

from gpudiag import defaults as D
from gpudiag.checks.gradcheck.check import gradcheck
from gpudiag.checks.gradcheck.report import GradcheckReport
from gpudiag.errors import naming_model


def gradcheck_spec(
    model: str,
    *,
    input_shape: tuple[int, ...] = D.INPUT_SHAPE,
    num_classes: int = D.NUM_CLASSES,
    batch_size: int = D.BATCH_SIZE,
    loss: str = "ce",
    input_dtype: str = "float",
    input_range: tuple[float, float] | None = None,
    inputs_file: str | None = None,
    **options: Any,
) -> GradcheckReport:
    """``gpudiag gradcheck``: resolve ``--model``, make the seeded batch (``input_dtype``
    and ``input_range``: see :func:`gpudiag.models.random_inputs`) or read it from
    ``inputs_file`` (:func:`gpudiag.models.load_inputs`; targets are generated), compare."""
    from gpudiag.models import load_function, load_inputs, random_batch, random_targets, resolve_model

    options["inject"] = tuple(options.get("inject", ()))
    options["strategies"] = tuple(options.get("strategies", ("single", "dp", "ddp")))
    seed = options.get("seed", 0)
    output = options.get("output")
    describe = {"model": model, "input_shape": list(input_shape), "num_classes": num_classes}
    if input_dtype != "float" or input_range is not None:
        describe.update(input_dtype=input_dtype, input_range=input_range and list(input_range))
    own = loss not in D.LOSSES
    run_loss: Any = SummedLoss(load_function(loss, "--loss"), loss) if own else loss
    targets_for = "ce" if own else loss  # the user's loss gets class labels (it may ignore them)
    with naming_model(model):
        factory = resolve_model(model, input_shape, num_classes)
        if inputs_file is None:
            inputs, targets = random_batch(
                factory,
                batch_size,
                input_shape,
                num_classes,
                targets_for,
                seed,
                output,
                input_dtype,
                input_range,
            )
        else:
            inputs = load_inputs(inputs_file)
            generator = torch.Generator().manual_seed(seed)
            targets = random_targets(factory, inputs, num_classes, targets_for, generator, seed, output)
            describe["inputs_file"] = inputs_file
        return gradcheck(factory, inputs, targets, loss=run_loss, describe=describe, **options)


class SummedLoss:
    """A user's ``loss(output, targets)`` from ``--loss FILE.py:NAME``: a scalar tensor, or
    a dict (list) of them summed (torchvision detection models' loss dicts). A value with
    more than one element is averaged: DataParallel gathers each replica's scalar loss into
    a vector, which a training script averages (``loss.mean()``). Named by its spec."""

    def __init__(self, fn: Any, spec: str):
        self.fn, self.__name__ = fn, spec

    def __call__(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        value = self.fn(output, target)
        parts = list(value.values()) if isinstance(value, dict) else value
        if not isinstance(parts, (list, tuple)):
            parts = [parts]
        if not parts or not all(isinstance(v, torch.Tensor) and v.numel() >= 1 for v in parts):
            raise TypeError(
                f"--loss {self.__name__}: expected a tensor or a dict of tensors, got {type(value).__name__}"
            )
        means = [v.mean() if v.numel() > 1 else v.reshape(()) for v in parts]
        return sum(means[1:], means[0])
