"""The instrumented parallel runtime: single, DataParallel and DDP steps you can watch
and break. See ``docs/runtime.md``.

The names below are imported on first use: importing a torch-free part of the runtime
(``gpudiag.runtime.faults``, which the CLI uses to check ``--inject`` while it parses
options) does not import torch. The modules that run anything import it.
"""

from __future__ import annotations

from typing import Any

# torch-free, and imported here so that ``gpudiag.runtime.launch`` names the function
# (a submodule imported later would otherwise shadow a lazily exported name)
from gpudiag.runtime.launch import RankFailure as RankFailure
from gpudiag.runtime.launch import launch as launch

#: name → the module that defines it.
_EXPORTS = {
    "DeviceSet": "gpudiag.runtime.devices",
    "Fault": "gpudiag.runtime.faults",
    "FaultPlan": "gpudiag.runtime.faults",
    "InjectSpecError": "gpudiag.runtime.faults",
    "parse_fault": "gpudiag.runtime.faults",
    "Recorder": "gpudiag.runtime.record",
    "RunConfig": "gpudiag.runtime.config",
    "RunResult": "gpudiag.runtime.config",
    "run": "gpudiag.runtime.dispatch",
}
__all__ = sorted([*_EXPORTS, "RankFailure", "launch"])


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'gpudiag.runtime' has no attribute {name!r}")
