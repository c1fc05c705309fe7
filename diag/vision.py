"""Import torchvision without importing ``torch._dynamo``.

torchvision's ``ops/roi_align.py`` runs ``from torch._dynamo.utils import
is_compile_supported`` when it is imported, so ``import torchvision`` imports all of
dynamo: 0.85 s of the 2 s that ``python -c "import torch, torchvision"`` takes on the
2-core development machine (``python -X importtime``), for a function that only
``roi_align`` calls, and only on GPU tensors in deterministic mode. torch itself imports
dynamo lazily, and torchvision meant not to import it eagerly either (pytorch/vision#8436:
"importing dynamo has undesirable side effects for eager mode only users").

:func:`import_torchvision` imports torchvision while ``torch._dynamo.utils`` is a
stand-in whose ``is_compile_supported`` imports the real one on its first call, and
removes the stand-in before it returns, so everything after it (``torch.compile``, DDP,
the user's code) imports the real dynamo as usual. If torchvision asks the stand-in for
anything else, or keeps a reference to it, the attempt is undone and torchvision is
imported the ordinary way.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Iterable
from typing import Any

#: What torchvision takes from ``torch._dynamo.utils`` when it is imported.
FORWARDED = frozenset({"is_compile_supported"})


class _StandIn(types.ModuleType):
    """``torch._dynamo`` / ``torch._dynamo.utils`` while torchvision is being imported."""

    def __getattr__(self, name: str) -> Any:
        if self.__name__ == "torch._dynamo.utils" and name in FORWARDED:
            return _forwarder(name)
        raise AttributeError(f"{self.__name__}.{name} (gpudiag imports torchvision without dynamo)")


def _forwarder(name: str) -> Any:
    def forward(*args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module("torch._dynamo.utils"), name)(*args, **kwargs)

    forward.__name__ = forward.__qualname__ = name
    return forward


def _holds(stand_ins: Iterable[types.ModuleType]) -> bool:
    """Whether a torchvision module kept a stand-in itself (``import torch._dynamo`` at
    module level, used later): then the stand-in would be asked for more later on."""
    kept = {id(m) for m in stand_ins}
    modules = [m for n, m in list(sys.modules.items()) if n == "torchvision" or n.startswith("torchvision.")]
    return any(id(value) in kept for m in modules for value in vars(m).values())


def import_torchvision() -> types.ModuleType:
    """``import torchvision``, without paying for ``torch._dynamo`` when it is not loaded yet."""
    if "torchvision" in sys.modules or "torch._dynamo" in sys.modules:
        return importlib.import_module("torchvision")
    import torch

    stand_ins = {name: _StandIn(name) for name in ("torch._dynamo", "torch._dynamo.utils")}
    stand_ins["torch._dynamo"].__path__ = []  # a package, so the submodule import resolves
    sys.modules.update(stand_ins)
    try:
        importlib.import_module("torchvision")
        clean = not _holds(stand_ins.values())
    except Exception:  # this torchvision wants more of dynamo than the stand-in has
        clean = False
    finally:
        for name, module in stand_ins.items():
            if sys.modules.get(name) is module:
                del sys.modules[name]
        if torch.__dict__.get("_dynamo") is stand_ins["torch._dynamo"]:
            del torch._dynamo
    if not clean:  # forget the half-imported package; import it plainly below
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
    return importlib.import_module("torchvision")
