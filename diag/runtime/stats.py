"""Cheap health statistics of a tensor: its norm and how many values are NaN/Inf.

Counting non-finite values is a full pass that is slow on the CPU (a bool reduction:
~100 ms for 11M floats on one core, 40x a norm), while a norm or a sum already
turns non-finite when any value is. So on the CPU the count is computed only when the
norm says there is something to count; on CUDA both stay on the device (no host sync —
they are read back once per step).
"""

from __future__ import annotations

import math

import torch


def stored(tensor: torch.Tensor) -> torch.Tensor:
    """The values a tensor stores: itself, or a sparse tensor's values once coalesced
    (duplicates summed: the non-zero values of its dense form), which is what its norm,
    sum and NaN/Inf count are taken over."""
    return tensor.coalesce().values() if tensor.is_sparse else tensor


def nonfinite(data: torch.Tensor, witness: torch.Tensor) -> torch.Tensor:
    """Count of NaN/Inf in ``data``; ``witness`` is a reduction of it (norm or sum) that is
    finite whenever every value is."""
    if data.is_cuda or not math.isfinite(float(witness)):
        return (~torch.isfinite(stored(data))).sum().to(witness.dtype)
    return torch.zeros((), dtype=witness.dtype, device=witness.device)


def nonfinite_count(tensor: torch.Tensor) -> int:
    """The exact number of NaN/Inf in ``tensor`` (a sparse one's :func:`stored` values): a
    full pass, for when a witness has already said there are some."""
    return int((~torch.isfinite(stored(tensor.detach()))).sum())


def count_nonfinite(data: torch.Tensor, witness: float) -> int:
    """:func:`nonfinite` for a witness already read back to the host."""
    if math.isfinite(witness) or not (data.is_floating_point() or data.is_complex()):
        return 0
    return nonfinite_count(data)


def norm_and_nonfinite(tensor: torch.Tensor) -> torch.Tensor:
    """``[L2 norm, NaN/Inf count]`` as one tensor on the tensor's device: float32 for
    float32 and 16-bit floats (accumulated in float32), float64 for float64, the real
    dtype of a complex tensor (any dtype a DDP bucket can hold, watched in its own); a
    sparse tensor's over its :func:`stored` values."""
    data = stored(tensor.detach())
    if data.dtype == torch.float32 and data.dim() == 1 and data.is_contiguous():
        norm = torch.dot(data, data).sqrt()  # BLAS: ~1.5x faster than vector_norm on the CPU
    elif data.is_floating_point() and data.element_size() < 4:
        norm = torch.linalg.vector_norm(data, dtype=torch.float32)
    else:
        norm = torch.linalg.vector_norm(data)
    return torch.stack([norm, nonfinite(data, norm)])


def norms_and_nonfinite(
    tensors: list[torch.Tensor], kept: list[torch.Tensor]
) -> tuple[list[tuple[float, int]], list[list[float]]]:
    """``(L2 norm, NaN/Inf count)`` of each of ``tensors``, and the values of the ``kept``
    statistics (small tensors computed earlier, e.g. by :func:`norm_and_nonfinite`), all
    read back with one host sync in the usual case.

    On CUDA the norms are one multi-tensor launch (``torch._foreach_norm``, as
    ``clip_grad_norm_`` and GradScaler use), and exact counts are taken only for tensors
    whose norm is not finite (a non-finite value always makes it so; a finite overflow
    can too, and then the count says 0): the usual step runs no counting kernel. On the
    CPU, :func:`norm_and_nonfinite` per tensor (the BLAS norm is faster there)."""
    cuda = bool(tensors) and tensors[0].is_cuda
    data = [stored(t.detach()) for t in tensors]
    if cuda:
        parts = [n.reshape(1) for n in torch._foreach_norm(data)]
    else:
        parts = [norm_and_nonfinite(t) for t in data]
    # read back in float64: a float64 norm past float32's range stays finite
    parts = [p.double() for p in parts] + [k.double().reshape(-1) for k in kept]
    if not parts:
        return [], []
    device = parts[0].device
    flat = torch.cat([p.to(device) for p in parts]).tolist()
    width = 1 if cuda else 2
    values = []
    for i, d in enumerate(data):
        norm = flat[width * i]
        if cuda:
            count = 0 if math.isfinite(norm) else int((~torch.isfinite(d)).sum())
        else:
            count = int(flat[2 * i + 1])
        values.append((norm, count))
    at, out = width * len(data), []
    for k in kept:
        out.append(flat[at : at + k.numel()])
        at += k.numel()
    return values, out


def checksum(tensor: torch.Tensor) -> torch.Tensor:
    """A cheap checksum of a tensor: its sum, accumulated in float32 for 16-bit floats and
    in the tensor's own dtype otherwise (a float64 accumulation costs 3x on the CPU); a
    complex tensor's is the sum of its real and imaginary parts (a real number, so that
    a change in either part shows). The same bytes always give the same sum on the same
    device; any NaN/Inf makes it non-finite (a finite overflow can too — then the exact
    count says 0); a sparse tensor's is its :func:`stored` values' sum."""
    data = stored(tensor.detach())
    if data.is_complex():
        data = torch.view_as_real(data.resolve_conj())  # (lazily conjugated: x.conj())
    if data.is_floating_point() and data.element_size() < 4:
        return torch.sum(data, dtype=torch.float32)
    if not data.is_floating_point() and not data.is_complex():
        return torch.sum(data, dtype=torch.float64)
    return data.sum()
