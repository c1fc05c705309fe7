"""Witnesses: one cheap float per tensor that is non-finite whenever any element is, and the
exact counts taken only when a witness is not finite (what :mod:`gpudiag.watch.core` reads
back once a step). No state: functions of tensors."""

import functools
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gpudiag.runtime.stats import nonfinite_count, stored


def tensor_version(t: torch.Tensor) -> int:
    """A tensor's in-place version counter (``Tensor._version``, what autograd checks saved
    tensors against), guarded: -1 where a torch has none, so nothing counts as changed."""
    return int(getattr(t, "_version", -1))


@functools.cache
def has_versions() -> bool:
    """Whether this torch's tensors have in-place version counters (see :func:`tensor_version`)."""
    return tensor_version(torch.zeros(1)) >= 0


def grad_state(params: list[torch.Tensor]) -> tuple[Any, ...] | None:
    """Which gradient tensor each parameter holds and its in-place version: a backward
    that accumulates into any of them changes this, ``torch.autograd.grad`` does not.
    None where it cannot tell (no parameters, or a torch without version counters)."""
    if not params or not has_versions():
        return None
    return tuple(None if (g := p.grad) is None else (id(g), tensor_version(g)) for p in params)


def float_tensors(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """Floating-point tensors inside an output (tensors, tuples, lists, dicts, ModelOutput)."""
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() or obj.is_complex():
            yield obj
    elif depth < 4 and isinstance(obj, (tuple, list)):
        for item in obj:
            yield from float_tensors(item, depth + 1)
    elif depth < 4 and isinstance(obj, dict):
        for item in obj.values():
            yield from float_tensors(item, depth + 1)


def bad_count(obj: Any, nan_only: bool = False) -> tuple[int, int]:
    """(NaN/Inf count, element count) over the floating tensors of ``obj`` (exact; slow
    path); with ``nan_only`` the NaN count."""
    bad = total = 0
    for t in float_tensors(obj):
        data = t.detach()
        bad += int((torch.isnan(data) if nan_only else ~torch.isfinite(data)).sum())
        total += data.numel()
    return bad, total


def has_nan(obj: Any) -> bool:
    """Whether any floating tensor of ``obj`` holds a NaN (exact; slow path)."""
    return any(bool(torch.isnan(t.detach()).any()) for t in float_tensors(obj))


def bucket_gradients(bucket: dist.GradBucket) -> list[torch.Tensor]:
    """The gradients of a DDP bucket's parameters, one per parameter: views into a dense
    bucket's buffer; a sparse gradient (``nn.Embedding(sparse=True)``) is a bucket of its
    own, whose buffer is the gradient (``gradients()`` then lists nothing)."""
    grads = bucket.gradients()
    if not grads and len(bucket.parameters()) == 1:
        return [bucket.buffer()]
    return grads


def grad_witness(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One float32 value per gradient, non-finite whenever any of its elements is: the
    norms in one multi-tensor launch on CUDA, sums on the CPU (a sum is the cheapest full
    pass there: 2.7 ms for resnet18's 62 gradients on one core, against 3.5 ms for
    ``torch._foreach_norm`` and 3.4 ms for sums with ``dtype=float32``, which only
    half-precision gradients need). A value that overflowed on finite elements is found
    clean by the exact count taken only then."""
    if not tensors:
        return torch.zeros(0)
    with torch.no_grad():
        if tensors[0].is_cuda:
            return torch.stack(
                [n.reshape(()) for n in torch._foreach_norm([stored(t) for t in tensors])]
            ).float()
        return output_witness(tensors)


#: A vector parameter is concatenated with the others (one op for all of them) up to this
#: many elements; a larger one (a flat parameter holding a whole model) is summed where it
#: lies, as a matrix is, rather than copied every step.
LARGEST_CONCATENATED = 1 << 16

#: Parameters as :func:`step_clean` reads their gradients: (summed one by one,
#: concatenated); None while a lazy module's parameter has no shape yet.
GradGroups = tuple[list[torch.Tensor], list[torch.Tensor]] | None


def grad_groups(params: list[torch.Tensor]) -> GradGroups:
    """``params`` grouped once for :func:`step_clean`: those summed one by one (matrices and
    higher, large vectors) and the small vectors (biases, norms' weights: most of a model's
    parameters) concatenated. None while a lazy module's parameter has no shape yet
    (``nn.LazyLinear`` before its first forward): grouped later."""
    if any(nn.parameter.is_lazy(p) for p in params):
        return None
    small = [p for p in params if p.dim() == 1 and p.numel() <= LARGEST_CONCATENATED]
    kept = {id(p) for p in small}
    return [p for p in params if id(p) not in kept], small


def step_clean(groups: GradGroups, out_grads: list[torch.Tensor]) -> float | None:
    """One float over a CPU step's backward — every parameter gradient (a parameter without
    one this step, frozen or unused, has nothing to check) and the witnesses of the
    gradients that flowed into the model's outputs — non-finite whenever any of their
    elements is. None where it cannot tell, for the exact way to judge: parameters not
    grouped yet (lazy), a backward that builds a graph (``create_graph=True``), a first
    gradient that is not float32, float64 or bfloat16 (float16 sums overflow where the
    values do not), gradients torch cannot take together (sparse vectors, several devices).
    A sum that overflowed on finite elements is found clean by the exact way, taken only
    then.

    A sum per gradient in :data:`GradGroups`' first list, one stack of those sums with the
    output gradients' witnesses, one concatenation with the small vectors, one sum, one
    read: a small model's step is made of per-op and per-line costs, each several times
    dearer inside a training step than in a loop of its own (docs/watch.md, the one-read
    check)."""
    if groups is None or torch.is_grad_enabled():
        return None
    mats, vecs = groups
    grads = [g for p in mats if (g := p.grad) is not None]
    flat = [g for p in vecs if (g := p.grad) is not None]
    first = grads or flat or out_grads
    if not first:
        return 0.0
    if first[0].dtype not in (torch.float32, torch.float64, torch.bfloat16):
        return None
    try:
        sums = [g.sum() for g in grads]
        sums += out_grads
        if sums:
            flat.append(torch.stack(sums))
        return float(torch.cat(flat).sum())
    except (TypeError, RuntimeError):  # sparse vectors, several devices, complex: the exact way
        return None


def output_witness(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One float32 value per tensor, non-finite whenever any of its elements is: a
    0-dimensional tensor for one tensor (the usual model output: one op), else a vector."""
    if len(tensors) == 1:  # (detached: no autograd node, cheaper than entering no_grad)
        return sum32(tensors[0].detach())
    with torch.no_grad():
        return torch.stack([sum32(t) for t in tensors])


def output_grad_witness(grad: torch.Tensor) -> torch.Tensor:
    """A 0-dimensional witness of the gradient flowing into a model output, non-finite
    exactly when one of its elements is — a float32 sum alone overflows on huge finite
    values, which would name a finite loss non-finite. On the CPU its sum, read at once (no
    sync there) and, only where that is not finite, replaced by the exact verdict; on an
    accelerator its largest magnitude (``torch.linalg.vector_norm(ord=inf)``: one
    reduction, which no finite value overflows, read with the step's other values)."""
    if grad.requires_grad:  # (a create_graph backward's gradient)
        grad = grad.detach()
    if not grad.is_cpu:
        return torch.linalg.vector_norm(grad, math.inf)
    witness = sum32(grad)
    if math.isfinite(witness.item()):
        return witness
    return torch.tensor(math.nan if nonfinite_count(grad) else 0.0)


def sum32(t: torch.Tensor) -> torch.Tensor:
    """A tensor's sum as a 0-dimensional float32 tensor: float32 summed as it is, half
    precision accumulated in float32, float64 summed then rounded, complex over its parts.
    (One op for float32: each op costs several microseconds from Python in a training
    step, which is what a watched small model's steps are made of.)"""
    if t.dtype == torch.float32:  # (first: the usual case in one attribute read)
        return t.sum()
    if t.is_complex():
        t = torch.view_as_real(t.resolve_conj())  # (a lazily conjugated gradient: out.conj())
    if t.dtype == torch.float64:
        return t.sum().float()
    return t.sum(dtype=torch.float32)
