"""``gpudiag.watch(model)``: name the rank, module and step where training first goes
non-finite. See ``docs/watch.md``.

This module is callable — ``gpudiag.watch(model)`` is :func:`gpudiag.watch.core.watch` —
so the function and the package (``gpudiag.watch.lightning``, ``.hf``,
``.accelerate``) share one name. Importing it does not import torch; calling it does.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from gpudiag.watch.record import (
    SCHEMA as SCHEMA,
)
from gpudiag.watch.record import (
    NonFiniteError as NonFiniteError,
)
from gpudiag.watch.record import (
    NonFiniteReport as NonFiniteReport,
)
from gpudiag.watch.record import (
    NonFiniteWarning as NonFiniteWarning,
)
from gpudiag.watch.record import (
    read_records as read_records,
)


def watch(model: Any, on_nonfinite: str = "raise", **options: Any) -> Any:
    """:func:`gpudiag.watch.core.watch` (imported on first use: it needs torch)."""
    from gpudiag.watch.core import watch as _watch

    return _watch(model, on_nonfinite, **options)


class _CallableModule(types.ModuleType):
    def __call__(self, model: Any, on_nonfinite: str = "raise", **options: Any) -> Any:
        return watch(model, on_nonfinite, **options)


sys.modules[__name__].__class__ = _CallableModule
