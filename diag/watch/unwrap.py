"""The user's model inside its wrappers, and which wrappers they were: the watcher hooks the
model inside and reads each wrapper differently (DDP's all-reduce, DataParallel's and
``VirtualDataParallel``'s copies, ``torch.compile``'s modules it cannot see into).

Not :func:`gpudiag.models.unwrap`: that one peels wrappers by type name to strip their
state-dict prefixes; this one tells the wrappers apart by type (subclasses included) and
also peels ``VirtualDataParallel``, whose state dict has no prefix.
"""

from dataclasses import dataclass
from typing import Any

from torch import nn


@dataclass
class Wrappers:
    """A model's wrappers, outermost first found of each kind (None: not wrapped so)."""

    inner: nn.Module
    ddp: Any = None
    dp: Any = None
    vdp: Any = None
    compiled: bool = False


def unwrap(model: nn.Module) -> Wrappers:
    """The module inside ``DistributedDataParallel``, ``nn.DataParallel``,
    ``VirtualDataParallel`` and ``torch.compile`` wrappers (any depth, any order), with
    the wrappers found."""
    from torch.nn.parallel import DistributedDataParallel

    from gpudiag.runtime.dp import VirtualDataParallel

    found = Wrappers(model)
    inner = model
    while True:
        if isinstance(inner, DistributedDataParallel):
            found.ddp, inner = inner, inner.module
        elif isinstance(inner, nn.DataParallel):
            found.dp, inner = inner, inner.module
        elif isinstance(inner, VirtualDataParallel):
            found.vdp, inner = inner, inner.module
        elif type(inner).__name__ == "OptimizedModule" and isinstance(
            getattr(inner, "_orig_mod", None), nn.Module
        ):
            found.compiled, inner = True, inner._orig_mod  # type: ignore[assignment]
        else:
            break
    found.inner = inner
    return found
