"""The sweep's flight-recorder settings and its own dump of a rank's record.

:data:`FLIGHT_RECORDER` (and under NCCL :data:`FLIGHT_RECORDER_NCCL`) are what
:func:`~gpudiag.repro.sweep.run.sweep` sets for its own collectives, with the dumps in the
sweep's temporary folder; :func:`dump_flight_recorder` writes a rank's record there itself
when one of the sweep's collectives hangs.
"""

from __future__ import annotations

from pathlib import Path

__all__ = [
    "DUMP_PREFIX",
    "FLIGHT_RECORDER",
    "FLIGHT_RECORDER_NCCL",
    "dump_flight_recorder",
    "flight_settings",
]


#: Settings the sweep turns on for its own collectives (unless already set), before any
#: process group exists: PyTorch's flight recorder, with its dumps in the sweep's own
#: folder (``{scratch}``), and NCCL's NaN check. PyTorch reads each under different names
#: in different places (read in torch 2.15's headers, include/torch/csrc/distributed/c10d/):
#:
#: - FlightRecorder.hpp: the buffer is ``TORCH_FR_BUFFER_SIZE`` or (older name)
#:   ``TORCH_NCCL_TRACE_BUFFER_SIZE``; dump-on-timeout ``TORCH_FR_DUMP_ON_TIMEOUT`` or
#:   ``TORCH_NCCL_DUMP_ON_TIMEOUT`` — gloo's recorder and NCCL's;
#: - ProcessGroupNCCL.hpp: its watchdog reads only ``TORCH_NCCL_DUMP_ON_TIMEOUT`` and
#:   ``TORCH_NCCL_TRACE_BUFFER_SIZE`` ("must be set together"), and ``TORCH_NCCL_NAN_CHECK``;
#: - FlightRecorder.cpp (pytorch/pytorch, ``DebugInfoWriter::getWriter``): the dump goes
#:   to ``<prefix><rank>``, the prefix from ``TORCH_FR_DUMP_TEMP_FILE`` or
#:   ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE`` (default ``~/.cache/torch/comm_lib_trace_rank_``;
#:   older releases read ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE`` alone, default
#:   ``/tmp/nccl_trace_rank_``).
#:
#: Utils.hpp's ``getCvar*`` warns once per process ("is deprecated; use TORCH_FR_...")
#: whenever an older name of a list is set, even beside the new one: so the older names
#: (:data:`FLIGHT_RECORDER_NCCL`) are set only for NCCL runs, whose watchdog needs them.
FLIGHT_RECORDER = {
    "TORCH_FR_BUFFER_SIZE": "2000",
    "TORCH_FR_DUMP_ON_TIMEOUT": "1",
    "TORCH_FR_DUMP_TEMP_FILE": "{scratch}/" + "nccl_trace_rank_",
    "TORCH_NCCL_NAN_CHECK": "1",
}
FLIGHT_RECORDER_NCCL = {
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "{scratch}/" + "nccl_trace_rank_",
}


def flight_settings(backend: str, scratch: Path) -> dict[str, str]:
    """The variables :func:`~gpudiag.repro.sweep.run.sweep` sets for ``backend`` (before
    the user's own win)."""
    recorder = {**FLIGHT_RECORDER, **(FLIGHT_RECORDER_NCCL if backend == "nccl" else {})}
    return {**{k: v.format(scratch=scratch) for k, v in recorder.items()}, "NCCL_ALGO": "Ring"}


DUMP_PREFIX = "nccl_trace_rank_"  # (the dump of rank R: <scratch>/nccl_trace_rank_R)


def dump_flight_recorder(scratch: Path, rank: int, backend: str) -> Path | None:
    """This rank's flight record written where the watchdog would write it
    (``<scratch>/nccl_trace_rank_<rank>``), when a collective of the sweep hung: NCCL's own
    dump comes only at the group's timeout, after rank 0 has written, and gloo makes none.
    Through torch's private ``torch._C._distributed_c10d._dump_nccl_trace()`` (NCCL) or
    ``_dump_fr_trace`` (``backend="gloo"`` on 2.15; 2.11 takes no backend and dumps the
    same recorder), so best effort: None when absent or failing."""
    path = scratch / f"{DUMP_PREFIX}{rank}"
    if path.exists():  # (the watchdog's own)
        return path
    try:
        import torch._C._distributed_c10d as c10d

        # ProcessGroupNCCL keeps its own recorder (of CUDA events), dumped by
        # _dump_nccl_trace; gloo's is the c10::Event one _dump_fr_trace reads (2.15).
        # Private and versioned: reached through getattr, never typed against one torch.
        nccl_dump = getattr(c10d, "_dump_nccl_trace", None) if backend == "nccl" else None
        fr_dump = getattr(c10d, "_dump_fr_trace", None)
        if nccl_dump is not None:
            data = nccl_dump()
        elif fr_dump is not None:
            try:
                data = fr_dump(backend=backend)
            except TypeError:  # torch < 2.15: one recorder, no backend argument
                data = fr_dump()
        else:
            return None
        path.write_bytes(bytes(data))
    except Exception:
        return None
    return path
