"""Defaults that the command line, the Python API and ``report``/``doctor`` share: one
place, so ``gpudiag gradcheck --help``, ``gpudiag.gradcheck_spec()`` and a bundle's
recorded configuration cannot drift apart. Plain values only (no torch)."""

from __future__ import annotations

#: One sample's shape, without the batch dimension (a CIFAR-sized image).
INPUT_SHAPE = (3, 32, 32)
NUM_CLASSES = 10
BATCH_SIZE = 8
LR = 0.01
SEED = 0
#: gradcheck: devices for dp and ranks for ddp.
WORLD_SIZE = 2
#: nancheck: training steps per run.
NANCHECK_STEPS = 10
#: How long one phase may run (the reference, a strategy, the ranks), in seconds.
TIMEOUT_S = 300.0

#: The choices every command and the runtime share (the runtime checks against these).
STRATEGIES = ("single", "dp", "ddp")
LOSSES = ("ce", "ce-sum", "mse", "mse-sum")
DTYPES = ("fp32", "bf16", "fp16")
OPTIMIZERS = ("sgd", "adam", "none")


def shape_text(shape: tuple[int, ...] = INPUT_SHAPE) -> str:
    """``(3, 32, 32)`` → ``"3,32,32"``, as ``--input-shape`` takes it."""
    return ",".join(map(str, shape))
