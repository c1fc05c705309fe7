"""The one place gpudiag asks torch how many CUDA devices this process sees.

``torch.cuda.device_count()`` when ``torch.cuda.is_available()``, else 0 — the count
after ``CUDA_VISIBLE_DEVICES`` (``nvidia-smi -L`` lists them all). Importing this module
does not import torch; calling it does.
"""

from __future__ import annotations


def cuda_device_count() -> int:
    """CUDA devices torch can use here (0 without CUDA, a driver or a GPU)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
