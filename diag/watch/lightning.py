"""PyTorch Lightning: ``Trainer(callbacks=[gpudiag.watch.lightning.WatchCallback()])``.

The callback watches the model the strategy trains (``trainer.strategy.model``: the
``DistributedDataParallel`` of the ``ddp`` strategies, or the LightningModule itself),
names modules by their path in the LightningModule, watches the loss ``training_step``
returns (``on_before_backward``), checks each step after its backward
(``on_after_backward``) and takes the precision plugin's GradScaler, so an overflow it
skips (``16-mixed``) is noted, not reported as a fault. Built on ``pytorch_lightning``
when it is installed, else on ``lightning.pytorch`` (``pip install gpudiag[lightning]``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

try:
    from pytorch_lightning import Callback
except ImportError:  # the unified package
    from lightning.pytorch import Callback


class WatchCallback(Callback):
    """``gpudiag.watch`` for a Lightning ``Trainer``; ``watcher`` is the
    :class:`~gpudiag.watch.core.Watcher` while training runs (its ``report`` stays after)."""

    def __init__(
        self,
        on_nonfinite: str = "raise",
        *,
        record_dir: str | Path | bool | None = None,
        localize: bool = True,
    ):
        super().__init__()
        self.on_nonfinite, self.record_dir, self.localize = on_nonfinite, record_dir, localize
        self.watcher: Any = None

    @property
    def report(self) -> Any:
        return self.watcher.report if self.watcher is not None else None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        from gpudiag.watch.core import watch

        strategy = trainer.strategy
        plugin = getattr(strategy, "precision_plugin", None) or getattr(trainer, "precision_plugin", None)
        self.watcher = watch(
            strategy.model if strategy.model is not None else pl_module,
            self.on_nonfinite,
            scaler=getattr(plugin, "scaler", None),
            root=pl_module,
            record_dir=self.record_dir,
            # Lightning calls training_step, not the model: no forward of the model to replay
            localize="trail" if self.localize is True else self.localize,
        )

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        if self.watcher is not None:
            self.watcher.observe(loss, "<loss>")

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        if self.watcher is not None:
            self.watcher.after_backward()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.watcher is not None:
            self.watcher.close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self.watcher is not None:
            self.watcher.close()
