"""The instrumented parallel runtime: single, DataParallel and DDP steps you can watch
and break. See ``docs/runtime.md``.

Importing this package imports torch; the CLI imports it only inside commands.
"""

from gpudiag.runtime.devices import DeviceSet
from gpudiag.runtime.faults import Fault, FaultPlan, InjectSpecError, parse_fault
from gpudiag.runtime.launch import RankFailure, launch
from gpudiag.runtime.record import Recorder
from gpudiag.runtime.run import RunConfig, RunResult, run

__all__ = [
    "DeviceSet",
    "Fault",
    "FaultPlan",
    "InjectSpecError",
    "RankFailure",
    "Recorder",
    "RunConfig",
    "RunResult",
    "launch",
    "parse_fault",
    "run",
]
