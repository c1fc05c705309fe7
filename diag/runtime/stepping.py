"""The training step every strategy shares (:class:`Stepper`: autocast, loss, backward,
GradScaler, optimizer) and the helpers around it: building the model from its factory
under the run's seed, the optimizer, the loss, a digest of the parameters."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gpudiag.errors import InputError, from_user_code
from gpudiag.runtime.batch import select_output
from gpudiag.runtime.config import DTYPES, ModelFn, RunConfig
from gpudiag.runtime.devices import DeviceSet
from gpudiag.runtime.timing import NO_TIMER, Timer


def build_model(model_fn: ModelFn, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    try:
        model = model_fn()
    except (Exception, SystemExit) as exc:
        raise from_user_code(exc, "the model factory") from exc
    if not isinstance(model, nn.Module):
        raise InputError(f"the model factory returned {type(model).__name__}, not an nn.Module")
    return model


def make_optimizer(model: nn.Module, config: RunConfig) -> torch.optim.Optimizer | None:
    params = [p for p in model.parameters() if p.requires_grad]
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=config.lr)
    if config.optimizer == "adam":
        return torch.optim.Adam(params, lr=config.lr)
    return None


def loss_fn(name: Any, output: Any, target: torch.Tensor) -> torch.Tensor:
    """``ce``/``mse`` with mean reduction, ``ce-sum``/``mse-sum`` with sum (in fp32), or a
    user's ``loss(output, target)``."""
    if callable(name):
        return name(output, target)
    reduction = "sum" if name.endswith("-sum") else "mean"
    output = output.float()
    if name.startswith("ce"):
        return F.cross_entropy(output, target, reduction=reduction)
    return F.mse_loss(output, target.to(output.dtype), reduction=reduction)


def _device_of(output: Any) -> Any:
    found = output if isinstance(output, torch.Tensor) else None
    if found is None and isinstance(output, dict):
        found = next((v for v in output.values() if isinstance(v, torch.Tensor)), None)
    if found is None and isinstance(output, (tuple, list)):
        found = next((v for v in output if isinstance(v, torch.Tensor)), None)
    return found.device if found is not None else "cpu"


def output_selector(config: RunConfig) -> Callable[[Any], Any] | None:
    """What picks the loss's tensor out of the model's output (None: the whole output,
    for a loss function given no ``output`` key)."""
    if callable(config.loss) and config.output is None:
        return None
    key = config.output
    return lambda output: select_output(output, key)


def device_type(devices: DeviceSet) -> str:
    return "cpu" if devices.kind == "virtual" else "cuda"


#: fp16: how many times a step whose gradients overflow is retried at half the loss scale.
MAX_SCALE_RETRIES = 24


class Stepper:
    """The training step shared by every strategy: autocast, loss, backward, scaler, step.

    fp16 uses a GradScaler. A step whose gradients overflow at the current scale is
    retried at half the scale — where GradScaler would skip the step — so every counted
    step updates the weights and the first step's gradients are finite when the model's
    are (after :data:`MAX_SCALE_RETRIES` halvings the gradients are taken as they are).
    """

    def __init__(
        self, model: nn.Module, config: RunConfig, forward: Callable[[Any], Any], selects: bool = False
    ):
        """``selects``: ``forward`` already returns the loss's part of the output."""
        self.model = model
        self.config = config
        self.forward = forward
        kind = device_type(config.devices)
        self.autocast = torch.autocast(kind, dtype=DTYPES[config.dtype]) if config.dtype != "fp32" else None
        self.scaler = torch.amp.GradScaler(kind) if config.dtype == "fp16" else None
        # The optimizer is built when first needed: a run whose only step applies no
        # update (see updates()) never builds one.
        self._optimizer: torch.optim.Optimizer | None = None
        self.unscaler: torch.optim.Optimizer | None = None
        if self.scaler is not None:  # something to unscale with
            self.unscaler = self.optimizer or torch.optim.SGD(model.parameters(), lr=0.0)
        self.first_grads: dict[str, torch.Tensor] = {}
        self.select = None if selects else output_selector(config)
        #: bench (``RunConfig.time_phases``): times forward, backward and the optimizer step
        self.timer: Timer = NO_TIMER

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The run's optimizer (None for ``none``), built on first use."""
        if self._optimizer is None:
            self._optimizer = make_optimizer(self.model, self.config)
        return self._optimizer

    def micro_step(self, inputs: Any, targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward of one micro-batch; returns the (unscaled) loss."""
        timer = self.timer
        start = timer.mark()
        if self.autocast is not None:
            with self.autocast:
                output = self.forward(inputs)
        else:
            output = self.forward(inputs)
        if self.select is not None:
            output = self.select(output)
        loss = loss_fn(self.config.loss, output, targets.to(_device_of(output)))
        scaled = loss / self.config.accumulate
        timer.add("forward", start)
        start = timer.mark()
        (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
        timer.add("backward", start)
        return loss.detach()

    def step(
        self,
        step: int,
        micro: list[tuple[Any, torch.Tensor]],
        no_sync: Callable[[], Any] | None = None,
        after_backward: Callable[[], None] | None = None,
    ) -> float:
        """One optimizer step over the micro-batches; returns the mean micro-batch loss.
        ``no_sync`` (DDP) wraps every micro-batch but the last. The last step's update is
        skipped when nothing reads the weights after it (see :meth:`updates`)."""
        for attempt in range(MAX_SCALE_RETRIES + 1):
            self.model.zero_grad(set_to_none=True)
            losses = []  # read once the step is queued: a read here would stall CUDA mid-step
            for i, (x, y) in enumerate(micro):
                context = (
                    no_sync() if no_sync is not None and i < len(micro) - 1 else contextlib.nullcontext()
                )
                with context:
                    losses.append(self.micro_step(x, y))
            if after_backward is not None:
                after_backward()
            if self.scaler is None or self.unscaler is None:
                break
            self.scaler.unscale_(self.unscaler)
            if self._grads_finite() or attempt == MAX_SCALE_RETRIES:
                break
            self.scaler.update(new_scale=self.scaler.get_scale() / 2)
        if step == 1:
            # Copied only if something may still change them: an update (or a later step).
            copy = self.updates(step)
            self.first_grads = {
                n: _grad_copy(p.grad, copy) for n, p in self.model.named_parameters() if p.grad is not None
            }
        optimizer = self.optimizer if self.updates(step) else None
        start = self.timer.mark()
        if optimizer is not None:
            if self.scaler is not None:
                self.scaler.step(optimizer)
                self.scaler.update()
            else:
                optimizer.step()
        elif self.scaler is not None:
            self.scaler.update()
        self.timer.add("optimizer", start)
        return sum(torch.stack(losses).tolist()) / len(micro)

    def updates(self, step: int) -> bool:
        """Whether ``step`` applies its optimizer update: every step but a last one whose
        weights nobody reads (no kept state, no per-step digests). Skipping it changes no
        result, and spares eager torch building an optimizer: its ``add_param_group``
        imports ``torch._dynamo`` (0.85 s here) through ``torch._disable_dynamo``."""
        config = self.config
        return step < config.steps or config.keep_state or config.track_params

    def _grads_finite(self) -> bool:
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if not grads:
            return True
        norms = torch._foreach_norm(grads)  # one fused pass, as GradScaler and clip_grad_norm_ do
        return bool(torch.isfinite(torch.stack([n.float() for n in norms]).sum()))


def compared_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a gradient of ``dtype`` is compared in: float32 for float32 and 16-bit
    floats (their arithmetic's own precision is what the tolerances allow for), its own
    for float64 and complex (narrowing a float64 gradient loses the digits that tell
    strategies apart; casting a complex one to a real dtype drops its imaginary part)."""
    if dtype == torch.float64 or dtype.is_complex:
        return dtype
    return torch.float32


def _grad_copy(grad: torch.Tensor, copy: bool) -> torch.Tensor:
    """A gradient as the comparison reads it: dense (a sparse gradient, as
    ``nn.Embedding(sparse=True)`` gives, summed into its dense form: the gradient a dense
    embedding would have), on the CPU, in :func:`compared_dtype`; with ``copy``, sharing
    no memory with ``grad`` (which a later update may change)."""
    if grad.is_sparse:
        return grad.detach().to_dense().to(compared_dtype(grad.dtype)).cpu()  # new memory
    out = grad.detach().to(compared_dtype(grad.dtype)).cpu()
    return out.clone() if copy and out.data_ptr() == grad.data_ptr() else out


def _cpu(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.detach().cpu().clone() for n, t in tensors.items()}


def digest(model: nn.Module) -> str:
    """A digest of every parameter's bytes: equal digests mean identical parameters."""
    h = hashlib.blake2b(digest_size=16)
    for _, p in sorted(model.named_parameters()):
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()
