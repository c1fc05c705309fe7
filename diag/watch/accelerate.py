"""Hugging Face Accelerate: watch a model ``accelerator.prepare`` returned.

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    watcher = gpudiag.watch.accelerate.watch(accelerator, model)
    for x, y in loader:
        accelerator.backward(loss_fn(model(x), y))
        ...

The prepared model may be a ``DistributedDataParallel`` (several processes), a compiled
or plain module; module paths are those of ``accelerator.unwrap_model(model)``; the
accelerator's GradScaler (``mixed_precision="fp16"``) is taken, so an overflow it skips is
noted, not reported as a fault. ``pip install gpudiag[accelerate]``.
"""

from __future__ import annotations

from typing import Any


def watch(accelerator: Any, model: Any, on_nonfinite: str = "raise", **options: Any) -> Any:
    """:func:`gpudiag.watch` for a prepared model (``options``: those of ``gpudiag.watch``)."""
    from gpudiag.watch.core import watch as _watch

    options.setdefault("scaler", getattr(accelerator, "scaler", None))
    options.setdefault("root", accelerator.unwrap_model(model))
    return _watch(model, on_nonfinite, **options)
