"""DataParallel semantics built from torch's own pieces, with every transfer watched.

``dp_forward`` does what ``nn.DataParallel.forward`` does, step for step:

1. **scatter**: every tensor in the positional and keyword arguments (inside tuples,
   lists and dicts too) is split along dim 0 by ``torch.chunk`` rules — a batch of 5 on 4
   devices gives chunks of 2, 2, 1, so 3 replicas run; other objects are passed to every
   replica as they are (``torch.nn.parallel.scatter_gather.scatter``);
2. **replicate**: parameters and buffers are copied from the first device to the others.
   Replica 0 uses the module's own tensors, so BatchNorm running statistics are updated
   only through the replica on the first device; other replicas' updates are dropped;
3. **parallel apply**: each replica runs on its chunk (``torch.func.functional_call``;
   sequentially on virtual devices, each drawing random numbers from its own generator
   as each GPU does: see :func:`_own_generator`);
4. **gather**: outputs are concatenated along dim 0 on the output device (the first);
   0-dim outputs are stacked into a vector, as ``Gather`` does;
5. backward: each replica's parameter gradients travel back to the first device
   (phase ``reduce``) and are summed into the original parameters by autograd.

Every copy goes through the :class:`~gpudiag.runtime.transport.Transport`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from gpudiag.runtime.record import Phase
from gpudiag.runtime.transport import Transport


def chunk_count(args: Sequence[Any], kwargs: Mapping[str, Any], devices: int) -> int:
    """How many replicas DataParallel runs: the number of ``torch.chunk`` pieces of the
    first tensor found in the arguments (all devices when there is no tensor)."""
    first = _first_tensor((tuple(args), dict(kwargs)))
    if first is None:
        return devices
    if first.dim() == 0:
        raise ValueError("DataParallel cannot scatter a 0-dim tensor argument")
    return len(first.chunk(devices, dim=0))


def _first_tensor(obj: Any) -> torch.Tensor | None:
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, (tuple, list)):
        items: Any = obj
    elif isinstance(obj, dict):
        items = obj.values()
    else:
        return None
    for item in items:
        found = _first_tensor(item)
        if found is not None:
            return found
    return None


def scatter(obj: Any, ids: Sequence[int], count: int, transport: Transport) -> list[Any]:
    """``count`` pieces of ``obj``: tensors chunked along dim 0 and sent to ``ids[i]``."""
    if isinstance(obj, torch.Tensor):
        pieces = obj.chunk(len(ids), dim=0)
        if len(pieces) != count:
            raise ValueError(
                f"DataParallel needs every tensor argument to split into {count} chunks; "
                f"one of shape {tuple(obj.shape)} splits into {len(pieces)}"
            )
        return [
            transport.send(piece, ids[0], ids[i], "scatter", None, "input")
            if piece.device == transport.devices.torch_device(ids[0])
            else piece.to(transport.devices.torch_device(ids[i]))
            for i, piece in enumerate(pieces)
        ]
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return [
            type(obj)(*parts) for parts in zip(*(scatter(o, ids, count, transport) for o in obj), strict=True)
        ]
    if isinstance(obj, (tuple, list)):
        if not obj:
            return [type(obj)() for _ in range(count)]
        parts = zip(*(scatter(o, ids, count, transport) for o in obj), strict=True)
        return [type(obj)(p) for p in parts]
    if isinstance(obj, dict):
        if not obj:
            return [type(obj)() for _ in range(count)]
        keys = list(obj)
        values = zip(*(scatter(obj[k], ids, count, transport) for k in keys), strict=True)
        return [type(obj)(zip(keys, v, strict=True)) for v in values]
    return [obj for _ in range(count)]


def gather(outputs: list[Any], ids: Sequence[int], transport: Transport) -> Any:
    """Concatenate replica outputs on ``ids[0]`` (dim 0), structure by structure."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        moved = [
            transport.send(out, ids[i], ids[0], "gather", "gather-grad", "output")
            for i, out in enumerate(outputs)
        ]
        if first.dim() == 0:
            return torch.stack(moved)
        return torch.cat(moved, dim=0)
    if first is None:
        return None
    if isinstance(first, dict):
        return type(first)((k, gather([o[k] for o in outputs], ids, transport)) for k in first)
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(gather(list(parts), ids, transport) for parts in zip(*outputs, strict=True)))
    if isinstance(first, (tuple, list)):
        return type(first)(gather(list(parts), ids, transport) for parts in zip(*outputs, strict=True))
    return first


def dp_forward(
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    transport: Transport,
    select: Callable[[Any], Any] | None = None,
) -> Any:
    """One DataParallel forward of ``module`` (which lives on the first device).
    ``select`` picks the part of each replica's output to gather (the loss's tensor);
    None gathers the whole output."""
    ids = transport.devices.ids
    recorder = transport.recorder
    step = transport.step

    timer = transport.timer

    def phase(name: str, start: Any, device: int | None = None) -> None:
        if timer is not None:
            timer.add(name, start, device)
        elif recorder is not None:
            recorder.phases.append(Phase(step, name, start, recorder.now(), device))

    now = timer.mark if timer is not None else recorder.now if recorder is not None else (lambda: 0.0)
    pick = select or (lambda output: output)
    if len(ids) == 1:
        return pick(module(*args, **kwargs))
    count = chunk_count(args, kwargs, len(ids))
    start = now()
    inputs = scatter(tuple(args), ids, count, transport)
    kw_inputs = scatter(dict(kwargs), ids, count, transport)
    phase("scatter", start)

    start = now()
    params = dict(module.named_parameters())
    buffers = dict(module.named_buffers())
    states = []
    for i in range(count):
        state: dict[str, Any] = {}
        for name, p in params.items():
            state[name] = transport.send(p, ids[0], ids[i], "replicate", "reduce", name)
        for name, b in buffers.items():
            state[name] = b if i == 0 else transport.send(b, ids[0], ids[i], "replicate", None, name)
        states.append(state)
    phase("replicate", start)

    outputs = []
    virtual = transport.devices.kind == "virtual"
    if virtual:  # every device starts where the first stands, as torch.manual_seed seeds all GPUs alike
        first_state = torch.get_rng_state()
        for i in range(1, count):
            transport.generators.setdefault(ids[i], first_state)
    for i in range(count):
        start = now()
        transport.replica = ids[i]
        try:
            with _own_generator(transport, ids[i]) if virtual and i else contextlib.nullcontext():
                output = torch.func.functional_call(module, states[i], tuple(inputs[i]), kw_inputs[i])
            outputs.append(pick(output))
        finally:
            transport.replica = None
        phase("forward", start, ids[i])

    start = now()
    result = gather(outputs, ids, transport)
    phase("gather", start)
    return result


@contextlib.contextmanager
def _own_generator(transport: Transport, device: int) -> Iterator[None]:
    """Replica ``device`` draws from its own generator. On GPUs each device has one
    (``torch.manual_seed`` seeds them all alike), so two replicas of a dropout model draw
    the same first numbers for their sub-batches — not what single draws for the whole
    batch. Virtual devices share the CPU generator: drawing from it in turn would hand
    replica 1 the continuation of replica 0's stream, and DataParallel would match single
    exactly where real GPUs differ. So the CPU generator is swapped for the device's state
    (:attr:`Transport.generators`) while its replica runs, and put back after."""
    first = torch.get_rng_state()
    torch.set_rng_state(transport.generators[device])
    try:
        yield
    finally:
        transport.generators[device] = torch.get_rng_state()
        torch.set_rng_state(first)


class VirtualDataParallel(nn.Module):
    """``nn.DataParallel`` over a :class:`~gpudiag.runtime.devices.DeviceSet`: on CPU
    virtual devices (laid out like a machine: ``DeviceSet.virtual([5, 6], machine)``) it
    runs the same scatter/replicate/apply/gather arithmetic as DataParallel on those GPUs,
    every copy through a :class:`Transport` that records it (link, checksums, NaN/Inf
    count) and can break it (``faults``: ``--inject`` specs; ``@STEP`` counts forwards
    with gradients on, from 1). ``module`` lives on the first device, as for
    ``nn.DataParallel``; what ``gpudiag.watch`` watches on a CPU-only machine."""

    def __init__(self, module: nn.Module, devices: Any, faults: Sequence[str] = ()):
        super().__init__()
        from gpudiag.runtime.faults import FaultPlan
        from gpudiag.runtime.record import Recorder

        self.module = module
        self.transport = Transport(devices, Recorder(enabled=True), FaultPlan.parse(list(faults)))
        self.transport.step = 0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            self.transport.step += 1
            recorder = self.transport.recorder
            if recorder is not None:  # the transfers of the previous forwards are not kept
                recorder.transfers = [t for t in recorder.transfers if t.step >= self.transport.step - 1]
        return dp_forward(self.module, args, kwargs, self.transport)
