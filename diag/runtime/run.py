"""Run training steps of a model under one strategy and return what happened.

``run(model_fn, inputs, targets, config) -> RunResult`` is the one interface every
comparison and divergence check uses:

- ``single``: the whole batch on the first device (the reference);
- ``dp``: DataParallel semantics (:mod:`gpudiag.runtime.dp`) over the device set;
- ``ddp``: real ``DistributedDataParallel``, one process per rank (gloo on CPU, nccl on
  CUDA), each rank on the contiguous ``torch.chunk`` shard of the same global batch.

Each step: zero the gradients, forward (under autocast for bf16/fp16), loss, backward
(through a GradScaler for fp16), optimizer step (SGD or Adam; ``none`` skips it). With
``accumulate=K`` the batch is split into K micro-batches whose losses are divided by K;
DDP skips the all-reduce on all but the last (``no_sync``). The model is built by
``model_fn()`` after ``torch.manual_seed(seed)``, so every strategy starts from the same
weights; the factory's train/eval mode is kept (eval makes BatchNorm use running stats).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import mmap
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from gpudiag.errors import InputError, from_user_code
from gpudiag.findings import Finding
from gpudiag.runtime.batch import OutputKey, call_model, micro_batches, select_output
from gpudiag.runtime.deadline import contained
from gpudiag.runtime.devices import DeviceSet
from gpudiag.runtime.dp import dp_forward
from gpudiag.runtime.faults import FaultPlan
from gpudiag.runtime.numerics import Numerics, nondeterministic_alerts
from gpudiag.runtime.record import Bucket, Phase, Recorder, StepRecord, Transfer
from gpudiag.runtime.transport import Transport

ModelFn = Callable[[], nn.Module]
Strategy = Literal["single", "dp", "ddp"]
STRATEGIES = ("single", "dp", "ddp")
LOSSES = ("ce", "ce-sum", "mse", "mse-sum")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class RunConfig:
    """How to run. ``faults`` are ``--inject`` specs (see :mod:`gpudiag.runtime.faults`).
    ``numerics``: the numeric settings (TF32, cuDNN, …) set for the run in this process
    and in every DDP rank alike; None runs under each process's settings as they are."""

    strategy: Strategy
    devices: DeviceSet
    steps: int = 1
    optimizer: Literal["sgd", "adam", "none"] = "sgd"
    lr: float = 0.01
    loss: str | Callable[[Any, torch.Tensor], torch.Tensor] = "ce"  # a name or loss(output, target)
    dtype: str = "fp32"
    accumulate: int = 1
    seed: int = 0
    watch: bool = True
    faults: tuple[str, ...] = ()
    find_unused_parameters: bool = False
    broadcast_buffers: bool = True
    sync_batchnorm: bool = False
    track_params: bool = False  # ddp: digest every rank's parameters after every step
    keep_state: bool = True  # return the parameters and buffers after the last step
    timeout: float = 120.0
    numerics: Numerics | None = None
    #: the part of the model's output the loss is computed on (see ``batch.select_output``);
    #: None: chosen automatically for a named loss, the whole output for a loss function
    output: OutputKey = None

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise InputError(f"unknown strategy {self.strategy!r} (expected {', '.join(STRATEGIES)})")
        if not callable(self.loss) and self.loss not in LOSSES:
            raise InputError(f"unknown loss {self.loss!r} (expected {', '.join(LOSSES)})")
        if self.dtype not in DTYPES:
            raise InputError(f"unknown dtype {self.dtype!r} (expected {', '.join(DTYPES)})")
        if self.steps < 1 or self.accumulate < 1:
            raise InputError("steps and accumulate must be at least 1")


@dataclass
class RunResult:
    """What a run produced. Tensors are on the CPU.

    ``grads``: parameter gradients of the first optimizer step (unscaled, before the
    step; for ddp: rank 0's, i.e. the all-reduced average). ``params``/``buffers``: after
    the last step. ``losses``: per step (ddp: rank 0's local loss). ``rank_digests``
    (ddp with ``track_params``): per rank, a digest of all parameters after each step.
    """

    strategy: str
    losses: list[float]
    grads: dict[str, torch.Tensor]
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    recorder: Recorder
    notes: list[Finding] = field(default_factory=list)
    rank_losses: list[list[float]] = field(default_factory=list)
    rank_digests: list[list[str]] = field(default_factory=list)
    initial_params: dict[str, torch.Tensor] = field(default_factory=dict)  # when steps > 1
    numerics: list[Numerics] = field(default_factory=list)  # as each process saw them (ddp: per rank)
    #: ops torch reported as having no deterministic implementation (any process, any step)
    nondeterministic: list[str] = field(default_factory=list)


def run(model_fn: ModelFn, inputs: Any, targets: torch.Tensor, config: RunConfig) -> RunResult:
    """Run ``config.steps`` steps of ``model_fn()`` on ``(inputs, targets)``."""
    FaultPlan.parse(config.faults)  # bad specs fail here, before anything starts
    if config.strategy == "ddp":
        from gpudiag.runtime.ddp import run_ddp

        return run_ddp(model_fn, inputs, targets, config)
    used = config.devices.ids[:1] if config.strategy == "single" else config.devices.ids
    devices = ",".join(map(str, used))
    with numerics_of(config), contained(config.timeout, f"the {config.strategy} run on device {devices}"):
        return _run_local(model_fn, inputs, targets, config)


def numerics_of(config: RunConfig) -> contextlib.AbstractContextManager[Any]:
    """The run's numeric settings for the length of a block (none: as they are)."""
    return config.numerics.applied() if config.numerics is not None else contextlib.nullcontext()


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

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The run's optimizer (None for ``none``), built on first use."""
        if self._optimizer is None:
            self._optimizer = make_optimizer(self.model, self.config)
        return self._optimizer

    def micro_step(self, inputs: Any, targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward of one micro-batch; returns the (unscaled) loss."""
        if self.autocast is not None:
            with self.autocast:
                output = self.forward(inputs)
        else:
            output = self.forward(inputs)
        if self.select is not None:
            output = self.select(output)
        loss = loss_fn(self.config.loss, output, targets.to(_device_of(output)))
        scaled = loss / self.config.accumulate
        (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
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
            total = 0.0
            for i, (x, y) in enumerate(micro):
                context = (
                    no_sync() if no_sync is not None and i < len(micro) - 1 else contextlib.nullcontext()
                )
                with context:
                    total += float(self.micro_step(x, y))
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
                n: _detached_copy(p.grad) if copy else p.grad.detach().float().cpu()
                for n, p in self.model.named_parameters()
                if p.grad is not None
            }
        optimizer = self.optimizer if self.updates(step) else None
        if optimizer is not None:
            if self.scaler is not None:
                self.scaler.step(optimizer)
                self.scaler.update()
            else:
                optimizer.step()
        elif self.scaler is not None:
            self.scaler.update()
        return total / len(micro)

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


def _run_local(model_fn: ModelFn, inputs: Any, targets: torch.Tensor, config: RunConfig) -> RunResult:
    devices = config.devices
    recorder = Recorder(enabled=config.watch)
    transport = Transport(devices, recorder, FaultPlan.parse(config.faults))
    model = build_model(model_fn, config.seed).to(devices.torch_device(devices.ids[0]))
    notes: list[Finding] = []
    if config.sync_batchnorm and config.strategy == "dp":
        notes.append(sync_batchnorm_note(config.strategy))

    select = output_selector(config)

    def forward(x: Any) -> Any:
        if config.strategy == "single":
            return call_model(model, x)
        args, kwargs = ((), x) if isinstance(x, dict) else (x if isinstance(x, tuple) else (x,), {})
        # DataParallel picks each replica's loss tensor before gathering (only it travels).
        return dp_forward(model, args, kwargs, transport, select)

    stepper = Stepper(model, config, forward, selects=config.strategy == "dp")
    initial = _cpu(dict(model.named_parameters())) if config.steps > 1 else {}
    losses = []
    first = devices.torch_device(devices.ids[0])
    with nondeterministic_alerts() as alerts:
        for step in range(1, config.steps + 1):
            transport.step = step
            start = recorder.now()
            loss = stepper.step(step, micro_batches(inputs, targets, config.accumulate, first))
            losses.append(loss)
            if recorder.enabled:
                recorder.steps.append(StepRecord(step, loss, start, recorder.now()))
    return RunResult(
        strategy=config.strategy,
        losses=losses,
        grads=stepper.first_grads,
        params=_cpu(dict(model.named_parameters())) if config.keep_state else {},
        buffers=_cpu(dict(model.named_buffers())) if config.keep_state else {},
        recorder=recorder,
        notes=notes,
        initial_params=initial,
        numerics=[Numerics.observe()],
        nondeterministic=alerts,
    )


def sync_batchnorm_note(strategy: str) -> Finding:
    """SyncBatchNorm needs CUDA (torch refuses CPU modules) and only applies to DDP."""
    why = (
        "SyncBatchNorm only works with DistributedDataParallel"
        if strategy != "ddp"
        else "torch's SyncBatchNorm refuses CPU tensors, so it cannot run over gloo on CPU"
    )
    return Finding(
        "syncbn-skipped",
        "warning",
        f"SyncBatchNorm was not used: {why}; BatchNorm statistics stay per replica",
        {"strategy": strategy},
        fix="run on CUDA devices with ddp to compare with SyncBatchNorm",
    )


def _detached_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A float32 CPU copy that shares no memory with ``tensor``."""
    out = tensor.detach().float().cpu()
    return out.clone() if out.data_ptr() == tensor.data_ptr() else out


def _cpu(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.detach().cpu().clone() for n, t in tensors.items()}


def digest(model: nn.Module) -> str:
    """A digest of every parameter's bytes: equal digests mean identical parameters."""
    h = hashlib.blake2b(digest_size=16)
    for _, p in sorted(model.named_parameters()):
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


_ALIGN = 64  # every tensor's bytes start at a multiple of this (torch.frombuffer needs alignment)


def pack(obj: Any) -> list[bytes | memoryview]:
    """Plain data with tensors in it → the chunks of one byte string, without pickle and
    without copying the tensors: everything but the tensors goes into a JSON header that
    records each tensor's dtype, shape and offset; the tensors' own memory follows.
    Layout: 8-byte little-endian header length, the header (padded), then each tensor's
    bytes, each starting at a multiple of 64. Write the chunks in order (a file's
    ``write`` takes them without copying); read them back with :func:`unpack`."""
    chunks: list[bytes | memoryview] = []
    specs: list[dict[str, Any]] = []
    offset = 0

    def encode(value: Any) -> Any:
        nonlocal offset
        if isinstance(value, torch.Tensor):
            flat = value.detach().cpu().contiguous().reshape(-1)
            raw = memoryview(flat.view(torch.uint8).numpy())
            pad = -offset % _ALIGN
            if pad:
                chunks.append(bytes(pad))
            specs.append(
                {
                    "dtype": str(flat.dtype).removeprefix("torch."),
                    "shape": list(value.shape),
                    "at": offset + pad,
                }
            )
            chunks.append(raw)
            offset += pad + raw.nbytes
            return {"__tensor__": len(specs) - 1}
        if isinstance(value, dict):
            return {"__dict__": [[encode(k), encode(v)] for k, v in value.items()]}
        if isinstance(value, (list, tuple)):
            return [encode(v) for v in value]
        if isinstance(value, float) and not math.isfinite(value):
            return {"__float__": repr(value)}
        return value

    tree = encode(obj)
    header = json.dumps({"tensors": specs, "value": tree}).encode()
    header += b" " * (-(8 + len(header)) % _ALIGN)
    return [len(header).to_bytes(8, "little"), header, *chunks]


def unpack(data: bytes | bytearray | memoryview | mmap.mmap) -> Any:
    """The inverse of :func:`pack`, from the concatenated chunks. With a writable buffer
    (a ``bytearray``, a writable ``mmap``) the tensors are views of it, no copy; read-only
    data is copied once."""
    if not isinstance(data, (bytearray, mmap.mmap)):
        data = bytearray(data)
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    base = 8 + size
    tensors = []
    for spec in header["tensors"]:
        dtype = getattr(torch, spec["dtype"])
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"packed data names an unknown dtype {spec['dtype']!r}")
        count = math.prod(spec["shape"])
        if count == 0:
            tensors.append(torch.empty(spec["shape"], dtype=dtype))
        else:
            flat = torch.frombuffer(data, dtype=dtype, count=count, offset=base + spec["at"])
            tensors.append(flat.view(spec["shape"]))

    def decode(value: Any) -> Any:
        if isinstance(value, dict):
            if "__tensor__" in value:
                return tensors[value["__tensor__"]]
            if "__float__" in value:
                return float(value["__float__"])
            return {decode(k): decode(v) for k, v in value["__dict__"]}
        if isinstance(value, list):
            return [decode(v) for v in value]
        return value

    return decode(header["value"])


def recorder_to_data(recorder: Recorder) -> dict[str, Any]:
    return {
        "transfers": [asdict(t) for t in recorder.transfers],
        "buckets": [asdict(b) for b in recorder.buckets],
        "phases": [asdict(p) for p in recorder.phases],
        "steps": [asdict(s) for s in recorder.steps],
    }


def recorder_from_data(recorder: Recorder, data: dict[str, Any]) -> None:
    recorder.transfers += [Transfer(**t) for t in data["transfers"]]
    recorder.buckets += [Bucket(**b) for b in data["buckets"]]
    recorder.phases += [Phase(**p) for p in data["phases"]]
    recorder.steps += [StepRecord(**s) for s in data["steps"]]
