"""gpudiag: diagnostics and reproducible bug reports for multi-GPU PyTorch training.

Importing this package is cheap and touches no hardware: neither torch nor pynvml is
imported here (``tests/test_import_hygiene.py`` enforces it).
"""

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """``gpudiag.gradcheck``: the Python API, imported (with torch) on first use."""
    if name == "gradcheck":
        from gpudiag.checks.gradcheck import gradcheck

        return gradcheck
    raise AttributeError(f"module 'gpudiag' has no attribute {name!r}")
