"""``gpudiag transport`` on this machine's GPUs: a small NCCL all-reduce, one process per
GPU, with NCCL's INFO lines captured to a file per rank (never the user's terminal), then
read as ``--from-log`` reads a saved log. Runs only where two or more GPUs are (the CLI
refuses otherwise, exit 3); tested on GPUs only (``multi_gpu``)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from gpudiag.errors import GpudiagError
from gpudiag.topology.model import Topology
from gpudiag.transport.analysis import SUBSYS_HINT, TransportReport, analyze
from gpudiag.transport.reader import read_log
from gpudiag.transport.run import read_log_file

#: Elements all-reduced (4 KiB of float32: enough for NCCL to connect every ring).
ELEMENTS = 1024
#: What NCCL is asked to log (only where the user set nothing).
DEBUG_ENV = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,P2P,NET,GRAPH"}


def _rank(rank: int, world: int) -> bytes:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    values = torch.ones(ELEMENTS, device=f"cuda:{rank}")
    dist.all_reduce(values)
    torch.cuda.synchronize()
    return b"ok" if bool((values == world).all()) else b"wrong"


@contextlib.contextmanager
def _nccl_debug() -> Iterator[None]:
    """NCCL_DEBUG=INFO and the subsystems with connection lines, for the ranks started
    inside (they inherit this environment); the user's own values are kept."""
    added = [name for name in DEBUG_ENV if name not in os.environ]
    for name in added:
        os.environ[name] = DEBUG_ENV[name]
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def _live_topology() -> Topology | None:
    from gpudiag.hw.nvml import NvmlBackend

    try:
        with NvmlBackend() as backend:
            return backend.topology()
    except GpudiagError:
        return None


def live_report(machine: str | None, gpus: int, timeout: float = 120.0) -> TransportReport:
    """Run the all-reduce on ``gpus`` GPUs and analyse its log, with the topology of
    ``machine`` or, without it, live NVML's (none if NVML cannot be read)."""
    from gpudiag.runtime.launch import launch, rank_logs

    with tempfile.TemporaryDirectory(prefix="gpudiag-transport-") as folder, _nccl_debug():
        with rank_logs(folder):
            launch(_rank, gpus, backend="nccl", timeout=timeout)
        texts = [read_log_file(str(path)) for path in sorted(Path(folder).glob("*.log"))]
    if machine is not None:
        from gpudiag.hw.sources import read_machine_or_capture

        topology = read_machine_or_capture(machine)
    else:
        topology = _live_topology()
    report = analyze(read_log(texts), topology)
    if not report.log.connections and not report.log.nccl_lines:
        raise GpudiagError(f"NCCL printed nothing at {SUBSYS_HINT}: is torch built with NCCL?")
    return report
