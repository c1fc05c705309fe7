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
    tensors against), guarded: -1 where a torch has none or the tensor keeps none (an
    inference-mode tensor, whose ``_version`` raises), so nothing counts as changed."""
    try:
        return int(getattr(t, "_version", -1))
    except RuntimeError:  # "Inference tensors do not track version counter"
        return -1


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
        return output_witness(tensors).reshape(-1)  # (a vector for one gradient too)


#: The most trainable values :func:`step_clean`'s one pass is used for (16 MiB of float32
#: gradients, about what a processor's caches hold): the pass writes every value back, which past the
#: caches costs memory traffic, while a model that large no longer shows per-op costs — its
#: steps are read by a sum per gradient (the exact way).
ONE_PASS_LIMIT = 1 << 22


def one_pass_fits(params: list[torch.Tensor]) -> bool | None:
    """Whether a model's gradients are few enough for :func:`step_clean`'s one pass
    (:data:`ONE_PASS_LIMIT`): its trainable parameters' values, as ``watch()`` finds them
    (a frozen backbone under small adapters has no gradients to read); None while a lazy
    module's parameters have no size yet."""
    if any(nn.parameter.is_lazy(p) for p in params):
        return None
    return sum(p.numel() for p in params if p.requires_grad) <= ONE_PASS_LIMIT


def step_clean(params: list[torch.Tensor], out_grads: list[torch.Tensor]) -> bool | None:
    """Whether a CPU step's backward is clean: every parameter gradient (a parameter without
    one this step, frozen or unused, has nothing to check) and every witness of a gradient
    that flowed into the model's outputs finite — one pass over them all (:func:`all_finite`)
    and one read. None where it cannot tell, for the exact way to judge: a backward that
    builds a graph (``create_graph=True``), gradients the pass does not take (complex,
    sparse, an expanded tensor, several devices, a tensor subclass), a torch without it.

    One op for the whole model: a small model's step is made of per-op and per-line costs,
    each several times dearer inside a training step than in a loop of its own
    (docs/watch.md, the one-read check)."""
    if torch.is_grad_enabled():
        return None
    tensors = [g for p in params if (g := p.grad) is not None]
    tensors += out_grads
    return all_finite(tensors)


#: GradScaler's pass (see :func:`all_finite`), None on a torch without it.
_NON_FINITE_CHECK = getattr(torch, "_amp_foreach_non_finite_check_and_unscale_", None)


@functools.cache
def _unit_scale() -> torch.Tensor:
    """The inverse scale :func:`all_finite` passes (1: every value written back as it was)."""
    return torch.ones(1, dtype=torch.float32, device="cpu")


def all_finite(tensors: list[torch.Tensor]) -> bool | None:
    """Whether every element of ``tensors`` is finite (exact: no sum that could overflow),
    in one pass over all of them and one read; None where it cannot tell. The pass is
    ``torch._amp_foreach_non_finite_check_and_unscale_``, what ``GradScaler.unscale_`` runs
    (torch internals, guarded: None on a torch without it, or for tensors it refuses — complex,
    sparse, an expanded tensor, several devices, a tensor subclass that raises whatever it
    raises): each element checked with ``isfinite``, then written back multiplied by the
    inverse scale, here 1 — the values unchanged (a half-precision NaN's bits aside, on a
    faulty step only: bfloat16's become the one quiet NaN, sign dropped; float16's
    signalling ones quiet), no in-place version counted. On one CPU thread it takes
    resnet18's 62 gradients as fast as their sums, and a small transformer's 29 in about
    two thirds of the time of the sums' ops (docs/watch.md)."""
    if not tensors:
        return True
    if _NON_FINITE_CHECK is None:
        return None
    found = torch.zeros(1, dtype=torch.float32, device="cpu")  # (the pass takes float32 alone)
    try:
        _NON_FINITE_CHECK(tensors, found, _unit_scale())
    except Exception:  # (RuntimeError for complex, sparse, expanded; a tensor subclass's own, any)
        return None
    return not found.item()


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
