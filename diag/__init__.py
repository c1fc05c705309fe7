"""gpudiag: diagnostics and reproducible bug reports for multi-GPU PyTorch training.

Importing this package is cheap and touches no hardware: neither torch nor pynvml is
imported here (``tests/architecture/test_import_hygiene.py`` enforces it). The Python API below is
imported on first use (torch with it, where it needs torch):

- ``topology_report(from_file=None, machine=None)`` — ``gpudiag topology``;
- ``gradcheck(factory, inputs, targets, ...)`` / ``gradcheck_spec("torchvision:resnet18", ...)``
  — ``gpudiag gradcheck``;
- ``nancheck(factory, inputs, targets, machine=...)`` — ``gpudiag nancheck``;
- ``peer(machine=None, pairs="all")`` — ``gpudiag peer``;
- ``inspect_checkpoint(path)`` / ``convert_checkpoint(src, dst, ...)`` — ``gpudiag ckpt``;
- ``doctor(machine=None)`` — the checks ``gpudiag doctor`` runs, as a report (no bundle);
- ``bench(factory_or_spec, batch_size=..., strategies=..., gpus=..., dtypes=...)`` —
  ``gpudiag bench``;
- ``watch(model, on_nonfinite="raise")`` — name the rank, module and step where training
  first goes non-finite (``NonFiniteError``); docs/watch.md.
"""

__version__ = "0.1.0"

#: name → (module, attribute) of the public API, imported when first used.
_API = {
    "topology_report": ("gpudiag.hw.sources", "topology_report"),
    "gradcheck": ("gpudiag.checks.gradcheck", "gradcheck"),
    "gradcheck_spec": ("gpudiag.checks.gradcheck", "gradcheck_spec"),
    "nancheck": ("gpudiag.checks.nancheck", "nancheck"),
    "peer": ("gpudiag.checks.peer", "peer"),
    "inspect_checkpoint": ("gpudiag.repro.checkpoint", "inspect"),
    "convert_checkpoint": ("gpudiag.repro.checkpoint", "convert"),
    "doctor": ("gpudiag.repro.report", "doctor"),
    "bench": ("gpudiag.checks.bench", "bench"),
    "watch": ("gpudiag.watch", "watch"),
    "NonFiniteError": ("gpudiag.watch.record", "NonFiniteError"),
}
__all__ = ["__version__", *_API]


def __getattr__(name: str) -> object:
    if name in _API:
        import importlib

        module, attribute = _API[name]
        return getattr(importlib.import_module(module), attribute)
    raise AttributeError(f"module 'gpudiag' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
