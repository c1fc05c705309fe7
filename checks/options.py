"""Each check's options, declared once: a frozen options type per check whose fields carry
their default, their choices or range and their help. From it are derived the click
options of the command (:func:`click_options`), the Python API's defaults (``GRADCHECK.lr``
…), the suite's defaults (:func:`suite_defaults`) and the checks a bundle's configuration
is validated with (``gpudiag.checks.fields``). ``tests/checks/test_options.py`` holds the four equal.

Plain values only: importing this module imports neither torch nor click.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from gpudiag import defaults as D

#: gradcheck --mode: as the model is, with train-mode randomness and batch statistics
#: controlled, or as-is then controlled where that could explain a difference.
MODES = ("auto", "as-is", "controlled")


@dataclass(frozen=True)
class Spec:
    """What an option may be: one of ``choices``, or a number from ``low`` to ``high``
    (``low_open``: above ``low``, not at it); ``many``: a comma-separated list of choices."""

    choices: tuple[str, ...] | None = None
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    many: bool = False
    help: str = ""
    #: kept in a report bundle's configuration (False: a setting of this run only, which a
    #: bundle — someone else's input — may not set for replay, e.g. a deadline)
    recorded: bool = True
    #: the command-line flag where it is not ``--NAME`` (``--dtype`` for bench's ``dtypes``)
    flag: str | None = None
    #: besides ``choices``, a function ``FILE.py:NAME`` (gradcheck's ``--loss``); a bundle
    #: still takes the choices only (replay runs no file a bundle names)
    or_function: bool = False


def option(default: Any, **spec: Any) -> Any:
    """A field of an options type: its default and its :class:`Spec`."""
    return field(default=default, metadata={"spec": Spec(**spec)})


@dataclass(frozen=True)
class GradcheckOptions:
    """``gpudiag gradcheck``'s options (and ``gradcheck()``'s keyword arguments)."""

    strategies: tuple[str, ...] = option(
        ("single", "dp", "ddp"),
        choices=D.STRATEGIES,
        many=True,
        help="Comma-separated; single is always the reference.",
    )
    world_size: int = option(
        D.WORLD_SIZE,
        low=1,
        high=64,
        help="Devices for dp and ranks for ddp (CUDA if there are enough GPUs, else CPU virtual devices).",
    )
    steps: int = option(1, low=1, high=10_000, help="Optimizer steps.")
    lr: float = option(D.LR, help="Learning rate.")
    optimizer: str = option("sgd", choices=D.OPTIMIZERS, help="none: gradients only, no optimizer step.")
    dtype: str = option("fp32", choices=D.DTYPES, help="The precision the strategies compute in (autocast).")
    loss: str = option(
        "ce",
        choices=D.LOSSES,
        or_function=True,
        help="The loss: ce for class labels, mse for regression (-sum: summed), or FILE.py:NAME, your "
        "loss(output, targets) on the model's whole output (a dict of losses is summed).",
    )
    mode: str = option(
        "auto",
        choices=MODES,
        help="controlled: BatchNorm on running statistics, random draws (dropout, drop path, RReLU, "
        "noise) at their expected value; auto: as-is, then controlled where that could explain a difference.",
    )
    seed: int = option(D.SEED, low=0, high=2**63 - 1, help="Seed of the model's weights and the batch.")
    timeout: float = option(
        D.TIMEOUT_S,
        low=0,
        low_open=True,
        recorded=False,
        help="Deadline for each phase (the reference, each strategy, the ranks), in seconds.",
    )


@dataclass(frozen=True)
class NancheckOptions:
    """``gpudiag nancheck``'s options (and ``nancheck()``'s keyword arguments)."""

    strategy: str = option("dp", choices=("dp", "ddp"), help="How each pair trains.")
    steps: int = option(D.NANCHECK_STEPS, low=1, high=10_000, help="Training steps per run.")
    lr: float = option(D.LR, help="Learning rate.")
    loss: str = option("ce", choices=D.LOSSES, help="The loss.")
    seed: int = option(D.SEED, low=0, high=2**63 - 1, help="Seed of the model's weights and the batch.")
    timeout: float = option(
        D.TIMEOUT_S,
        low=0,
        low_open=True,
        recorded=False,
        help="Deadline for each run (a GPU alone or a pair), in seconds.",
    )


@dataclass(frozen=True)
class BenchOptions:
    """``gpudiag bench``'s measuring options (and ``bench()``'s keyword arguments). Not a
    check of the suite: no bundle holds them, so nothing here is recorded for replay."""

    batch_size: int = option(32, low=1, help="Samples per step (see --per-gpu/--global).")
    strategies: tuple[str, ...] = option(
        D.STRATEGIES, choices=D.STRATEGIES, many=True, help="Comma-separated strategies to measure."
    )
    dtypes: tuple[str, ...] = option(
        ("fp32",), choices=D.DTYPES, many=True, flag="--dtype", help="Comma-separated precisions to measure."
    )
    epoch_samples: int = option(
        50_000, low=1, help="Samples in an epoch, for the time per epoch (CIFAR-10's training set: 50,000)."
    )
    steps: int = option(20, low=2, help="Timed steps.")
    warmup: int = option(3, low=1, help="Steps run first and not timed.")
    timeout: float = option(D.TIMEOUT_S, low=0, low_open=True, help="Deadline for each case, in seconds.")


#: The defaults, as instances: ``gradcheck(..., lr=GRADCHECK.lr)``.
GRADCHECK = GradcheckOptions()
NANCHECK = NancheckOptions()
BENCH = BenchOptions()
#: The options type of each check that has one.
OPTIONS: dict[str, type] = {"gradcheck": GradcheckOptions, "nancheck": NancheckOptions}


def specs(options: type) -> dict[str, tuple[Any, Spec]]:
    """Field name → (default, spec) of an options type."""
    out = {}
    for f in fields(options):
        default = f.default if f.default is not MISSING else None
        out[f.name] = (default, f.metadata["spec"])
    return out


def suite_defaults(options: type, names: tuple[str, ...]) -> dict[str, Any]:
    """The defaults of ``names`` as a JSON configuration records them (tuples as lists)."""
    table = specs(options)
    return {
        name: list(table[name][0]) if isinstance(table[name][0], tuple) else table[name][0] for name in names
    }


def validator(spec: Spec) -> Any:
    """The bundle's check of a value of an option (why it is wrong, or None)."""
    import math

    def check(value: Any) -> str | None:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        if spec.choices is not None and spec.many:
            if not isinstance(value, list) or not value or not all(v in spec.choices for v in value):
                return f"{shown} is not a list of {', '.join(spec.choices)}"
            return None
        if spec.choices is not None:
            return None if value in spec.choices else f"{shown} is not one of {', '.join(spec.choices)}"
        integer = spec.low is not None and float(spec.low).is_integer() and spec.high is not None
        if integer:
            if not isinstance(value, int) or isinstance(value, bool):
                return f"{shown} is not an integer (expected {spec.low:g} to {spec.high:g})"
        elif not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            return f"{shown} is not a finite number"
        too_low = spec.low is not None and (value <= spec.low if spec.low_open else value < spec.low)
        if too_low or (spec.high is not None and value > spec.high):
            if spec.low_open or spec.high is None:
                return f"{value} is out of range (expected above {spec.low:g})"
            return f"{value} is out of range (expected {spec.low:g} to {spec.high:g})"
        return None

    return check
