"""Hugging Face ``transformers``: a ``TrainerCallback``.

    trainer = Trainer(model=model, args=args, train_dataset=data)
    gpudiag.watch.hf.WatchCallback.attach(trainer)      # or callbacks=[WatchCallback(...)]
    trainer.train()

With the trainer attached, the callback watches ``trainer.model_wrapped`` (the
``DistributedDataParallel`` Accelerate wraps the model in on several processes) and takes
Accelerate's GradScaler (``fp16=True``), so an overflow it skips is noted, not reported as a
fault; module paths are those of the model you gave the trainer. A callback given in
``callbacks=[...]`` gets only the unwrapped model from the trainer: enough on one process;
on several it refuses to start (it could not tell a rank's own fault from one the
all-reduce brought) and says to attach it. ``pip install gpudiag[transformers]``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from gpudiag.errors import InputError


class WatchCallback(TrainerCallback):
    """``gpudiag.watch`` for a ``transformers.Trainer``; ``watcher`` is the
    :class:`~gpudiag.watch.core.Watcher` while training runs (its ``report`` stays after)."""

    def __init__(
        self,
        on_nonfinite: str = "raise",
        *,
        trainer: Any = None,
        record_dir: str | Path | bool | None = None,
        localize: bool = True,
    ):
        self.on_nonfinite, self.trainer = on_nonfinite, trainer
        self.record_dir, self.localize = record_dir, localize
        self.watcher: Any = None

    @classmethod
    def attach(cls, trainer: Any, on_nonfinite: str = "raise", **options: Any) -> WatchCallback:
        """A callback that knows ``trainer``, added to it."""
        callback = cls(on_nonfinite, trainer=trainer, **options)
        trainer.add_callback(callback)
        return callback

    @property
    def report(self) -> Any:
        return self.watcher.report if self.watcher is not None else None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        import torch.distributed as dist

        from gpudiag.watch.core import watch

        trainer = self.trainer
        wrapped = getattr(trainer, "model_wrapped", None) if trainer is not None else None
        if trainer is None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise InputError(
                "gpudiag.watch.hf.WatchCallback on several processes needs the trainer: "
                "WatchCallback.attach(trainer) (or WatchCallback(trainer=trainer))"
            )
        accelerator = getattr(trainer, "accelerator", None)
        self.watcher = watch(
            wrapped if wrapped is not None else model,
            self.on_nonfinite,
            scaler=getattr(accelerator, "scaler", None),
            root=model if model is not None else getattr(trainer, "model", None),
            record_dir=self.record_dir,
            localize=self.localize,
        )

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.watcher is not None:
            self.watcher.close()
