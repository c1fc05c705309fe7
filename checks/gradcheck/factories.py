"""The model factories gradcheck hands the runtime: each builds the same model.

- :class:`Prebuilt` builds the user's model once and hands out copies (and the RNG state
  a fresh build would leave);
- :class:`Controlled` hands out the controlled form (:func:`trainmode.neutralise`);
- :class:`OtherRng` hands out the model with the RNG in another state, to see whether
  the reference's gradient depends on random draws.

All are picklable when the user's factory is (DDP ranks in fresh interpreters get them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gpudiag.checks.gradcheck.trainmode import neutralise
from gpudiag.runtime.config import ModelFn


class Prebuilt:
    """A factory that builds the model once and then hands out copies.

    ``run`` calls ``torch.manual_seed(seed)`` and then the factory; the first call builds
    the model and records the RNG state it leaves, later calls return a deep copy and
    restore that state — the same weights and the same random stream (dropout masks) as a
    fresh build, at a fraction of the cost for large models.

    The copy kept is on the CPU, where the batch is: each run moves its copy to its own
    device. A factory may build on CUDA (``.cuda()``, or ``nn.DataParallel`` on a machine
    with one GPU, which moves its module to it); the probe and DDP ranks in fresh
    interpreters (which unpickle the template) then never touch GPU 0 for it."""

    def __init__(self, factory: ModelFn):
        self.factory = factory
        self.template: nn.Module | None = None
        self.rng_after: torch.Tensor | None = None
        self.unwrapped: list[str] = []

    def __call__(self) -> nn.Module:
        import copy

        if self.template is None:
            from gpudiag.models import unwrap

            # The seeds wrap models in nn.DataParallel before training: compare the model
            # itself (each strategy applies its own wrapping).
            template, self.unwrapped = unwrap(self.factory())
            self.template = template.cpu()
            self.rng_after = torch.get_rng_state()
            return copy.deepcopy(self.template)
        assert self.rng_after is not None
        torch.set_rng_state(self.rng_after)
        return copy.deepcopy(self.template)

    @property
    def same_on_every_rank(self) -> bool:
        """Whether every copy handed out from now on is the one model already built here
        (DDP then need not broadcast rank 0's parameters: see ``runtime.ddp``)."""
        return self.template is not None

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled (for DDP ranks in fresh interpreters) with the parent's template, so the
        rank's copies equal the parent's even for a factory whose own randomness torch's
        seed does not cover, and the rank builds nothing."""
        if self.template is None:
            return (Prebuilt, (self.factory,))
        return (_copied, (self.factory, self.template, self.rng_after, self.unwrapped))


def _copied(factory: ModelFn, template: nn.Module, rng_after: torch.Tensor, unwrapped: list[str]) -> Prebuilt:
    prebuilt = Prebuilt(factory)
    prebuilt.template, prebuilt.rng_after, prebuilt.unwrapped = template, rng_after, unwrapped
    return prebuilt


@dataclass(frozen=True)
class Controlled:
    """The model in controlled form: BatchNorm on running statistics, random draws at
    their expected value, the RNG re-seeded with ``seed`` at every forward."""

    factory: ModelFn
    seed: int = 0

    def __call__(self) -> nn.Module:
        return neutralise(self.factory(), self.seed)

    @property
    def same_on_every_rank(self) -> bool:
        """As its factory's (neutralising changes no parameter)."""
        return bool(getattr(self.factory, "same_on_every_rank", False))


#: Added to the run's seed for :class:`OtherRng` (any other state would do).
OTHER_RNG_OFFSET = 7919


@dataclass(frozen=True)
class OtherRng:
    """The model as ``factory`` builds it, with the RNG then seeded with ``seed +``
    :data:`OTHER_RNG_OFFSET`: the same weights, other random draws in forward."""

    factory: ModelFn
    seed: int = 0

    def __call__(self) -> nn.Module:
        model = self.factory()
        torch.manual_seed(self.seed + OTHER_RNG_OFFSET)
        return model
