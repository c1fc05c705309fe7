"""A batch as the runtime handles it: what goes into a model and what comes out of it.

Inputs are a tensor, a tuple of tensors (the model's positional arguments) or a dict of
tensors (its keyword arguments: ``model(**inputs)``, as Hugging Face models take them);
every tensor is split along dim 0 the way ``torch.chunk`` splits it (DDP shards and
micro-batches alike). Outputs are a tensor, a tuple/list (auxiliary logits: GoogLeNet,
Inception), a dict (segmentation models' ``{"out": …, "aux": …}``) or an object with
``.logits`` (Hugging Face's ``ModelOutput``); :func:`select_output` picks the tensor a
loss is computed on.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from gpudiag.errors import InputError

#: An output key: None (automatic), an index into a tuple, or a dict key / attribute name.
OutputKey = int | str | None


def call_model(model: nn.Module, inputs: Any) -> Any:
    """``model(**inputs)`` for a dict, ``model(*inputs)`` for a tuple, else ``model(inputs)``."""
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, tuple):
        return model(*inputs)
    return model(inputs)


def split(inputs: Any, count: int) -> list[Any]:
    """``inputs`` in ``torch.chunk(count)`` pieces along dim 0, structure kept (a batch of
    5 in 2 gives 3 + 2). Every tensor must split into the same number of pieces."""
    if isinstance(inputs, torch.Tensor):
        return list(inputs.chunk(count))
    if isinstance(inputs, dict):
        parts = {k: split(v, count) for k, v in inputs.items()}
        sizes = {len(p) for p in parts.values()}
        _same_pieces(sizes)
        return [{k: p[i] for k, p in parts.items()} for i in range(sizes.pop())] if parts else [{}]
    if isinstance(inputs, tuple):
        pieces = [split(x, count) for x in inputs]
        sizes = {len(p) for p in pieces}
        _same_pieces(sizes)
        return [tuple(p[i] for p in pieces) for i in range(sizes.pop())] if pieces else [()]
    raise InputError(f"inputs must be a tensor, a tuple or a dict of tensors, not {type(inputs).__name__}")


def _same_pieces(sizes: set[int]) -> None:
    if len(sizes) > 1:
        raise InputError("every input tensor must have the same batch size (dim 0)")


def micro_batches(
    inputs: Any, targets: torch.Tensor, count: int, device: torch.device
) -> list[tuple[Any, Any]]:
    """``(inputs, targets)`` in ``count`` micro-batches (``torch.chunk`` pieces), the inputs
    moved to ``device`` (the targets follow the model's output there)."""
    return [
        (to_device(x, device), y) for x, y in zip(split(inputs, count), targets.chunk(count), strict=True)
    ]


def shard(inputs: Any, rank: int, world: int) -> Any:
    """Rank ``rank``'s contiguous shard of the global batch (``torch.chunk`` piece ``rank``)."""
    return split(inputs, world)[rank]


def to_device(inputs: Any, device: torch.device) -> Any:
    if isinstance(inputs, dict):
        return {k: to_device(v, device) for k, v in inputs.items()}
    if isinstance(inputs, tuple):
        return tuple(to_device(x, device) for x in inputs)
    return inputs.to(device)


def batch_size(inputs: Any) -> int:
    """The batch size: dim 0 of the first tensor."""
    if isinstance(inputs, torch.Tensor):
        if inputs.dim() == 0:
            raise InputError("inputs need a batch dimension (dim 0), not a 0-d tensor")
        return len(inputs)
    if not isinstance(inputs, (tuple, dict)):
        raise InputError(
            f"inputs must be a tensor, a tuple or a dict of tensors, not {type(inputs).__name__}"
        )
    values = list(inputs.values()) if isinstance(inputs, dict) else list(inputs)
    if not values:
        raise InputError("the inputs hold no tensor")
    return batch_size(values[0])


def select_output(output: Any, key: OutputKey = None) -> torch.Tensor:
    """The tensor of ``output`` a loss is computed on.

    ``key`` None picks it automatically: a tensor itself; ``.logits`` of an object or a
    dict that has it (Hugging Face); ``"out"`` of a dict (torchvision segmentation); the
    only tensor of a dict; the first element of a tuple or list (GoogLeNet/Inception's
    main logits). An int indexes a tuple, a string names a dict key or an attribute."""
    if key is None:
        chosen = _automatic(output)
    elif isinstance(key, int) and isinstance(output, (tuple, list)):
        if not -len(output) <= key < len(output):
            raise InputError(f"--output {key}: the model returns {len(output)} value(s)")
        chosen = output[key]
    elif isinstance(key, str) and isinstance(output, Mapping) and key in output:
        chosen = output[key]
    elif isinstance(key, str) and hasattr(output, key):
        chosen = getattr(output, key)
    else:
        raise InputError(f"--output {key!r}: the model's output ({_shape_of(output)}) has no such part")
    if not isinstance(chosen, torch.Tensor):
        raise InputError(
            f"the model's output part is {type(chosen).__name__}, not a tensor: choose one with --output"
        )
    return chosen


def _automatic(output: Any) -> Any:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):
        for key in ("logits", "out"):
            if key in output:
                return output[key]
        tensors = [k for k, v in output.items() if isinstance(v, torch.Tensor)]
        if len(tensors) == 1:
            return output[tensors[0]]
        raise InputError(
            f"the model returns a dict ({_shape_of(output)}): choose the logits with --output KEY"
        )
    if isinstance(getattr(output, "logits", None), torch.Tensor):
        return output.logits
    if isinstance(output, (tuple, list)) and output:
        return output[0]
    raise InputError(f"the model returns {_shape_of(output)}: choose the tensor with --output")


def _shape_of(output: Any) -> str:
    if isinstance(output, Mapping):
        return "a dict with keys " + ", ".join(map(repr, output))
    if isinstance(output, (tuple, list)):
        return f"a {type(output).__name__} of {len(output)}"
    return type(output).__name__
