"""``gpudiag transport`` on this machine's GPUs: a small NCCL all-reduce, one process per
GPU, with NCCL's INFO lines captured to a file per rank (never the user's terminal:
:class:`~gpudiag.transport.capture.NcclCapture`), then read as ``--from-log`` reads a saved
log. Runs only where two or more GPUs are (the CLI refuses otherwise, exit 3); tested on
GPUs only (``multi_gpu``)."""

from __future__ import annotations

from gpudiag.errors import GpudiagError
from gpudiag.transport.analysis import SUBSYS_HINT, TransportReport
from gpudiag.transport.capture import NcclCapture, folder_texts, live_topology, texts_report

#: Elements all-reduced (4 KiB of float32: enough for NCCL to connect every ring).
ELEMENTS = 1024


def _rank(rank: int, world: int) -> bytes:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    values = torch.ones(ELEMENTS, device=f"cuda:{rank}")
    dist.all_reduce(values)
    torch.cuda.synchronize()
    return b"ok" if bool((values == world).all()) else b"wrong"


def live_texts(gpus: int, timeout: float = 120.0) -> list[tuple[str, str]]:
    """``(text, name)`` of each rank's log of an all-reduce over ``gpus`` GPUs; the
    private folder they were written to is gone when this returns."""
    from gpudiag.runtime.launch import launch

    with NcclCapture("gpudiag-transport-") as capture, capture.ranks("live") as folder:
        launch(_rank, gpus, backend="nccl", timeout=timeout)
        return folder_texts(folder)


def live_report(machine: str | None, gpus: int, timeout: float = 120.0) -> TransportReport:
    """Run the all-reduce on ``gpus`` GPUs and analyse its log, with the topology of
    ``machine`` or, without it, live NVML's (none if NVML cannot be read). The report
    keeps the ranks' logs (``nccl_logs``: a report bundle holds them)."""
    texts = live_texts(gpus, timeout)
    if machine is not None:
        from gpudiag.hw.sources import read_machine_or_capture

        topology = read_machine_or_capture(machine)
    else:
        topology = live_topology()
    report = texts_report(texts, topology)
    if report is None:
        raise GpudiagError(f"NCCL printed nothing at {SUBSYS_HINT}: is torch built with NCCL?")
    return report
