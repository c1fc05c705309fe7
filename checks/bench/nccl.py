"""bench's DDP cases on NCCL: their ranks' NCCL log captured and read into the transport table.

On CUDA each DDP case's ranks write their output to a private log per rank
(:class:`~gpudiag.transport.capture.NcclCapture`: ``NCCL_DEBUG=INFO``,
``NCCL_DEBUG_SUBSYS=INIT,P2P,NET,GRAPH`` unless the user set them, removed at the end and
on Ctrl-C), never to the terminal. After the cases, the widest DDP case whose log holds
NCCL lines (the most GPUs, so the most pairs; the first of equals) is read as
``gpudiag transport`` reads a log, with the topology beside it (``--machine``, else NVML),
and its findings join bench's: a DDP case that is slow because NCCL fell back to SHM or the
network gets that explanation. Without NCCL (CPU virtual devices, gloo) nothing is
captured and nothing said; under torchrun the ranks are torchrun's and their log is not
bench's to capture (one note says how to read it).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from gpudiag.topology.model import Topology

from .figures import Case


def records(kind: str) -> bool:
    """Whether DDP ranks on devices of ``kind`` talk through NCCL (``cuda``), so that
    there is an NCCL log to capture; gloo (``virtual``) has none."""
    return kind == "cuda"


@dataclass
class Transport:
    """What bench attaches: the report (None: no NCCL log read), the case it is of, a note."""

    report: Any = None  # a gpudiag.transport.report.TransportReport
    case: str | None = None
    note: str | None = None
    findings: list[Any] = field(default_factory=list)


class BenchNccl:
    """Captures the NCCL log of each DDP case (``with BenchNccl(on): … with nccl.case(c):``)."""

    def __init__(self, on: bool, torchrun: bool = False) -> None:
        self.on = on and not torchrun
        self.torchrun = on and torchrun
        self.logs: list[tuple[Case, list[tuple[str, str]]]] = []
        self._capture: Any = None

    def __enter__(self) -> BenchNccl:
        if self.on:
            from gpudiag.transport.capture import NcclCapture

            self._capture = NcclCapture("gpudiag-bench-nccl-").__enter__()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._capture is not None:
            self._capture.__exit__(kind, exc, tb)
            self._capture = None

    @contextlib.contextmanager
    def case(self, case: Case) -> Iterator[None]:
        """Around one case's run: a DDP case's ranks log to the private folder, read once
        it ends (also when it failed: NCCL's warnings say why)."""
        if self._capture is None or case.strategy != "ddp":
            yield
            return
        from gpudiag.transport.capture import folder_texts

        with self._capture.ranks(f"case{len(self.logs) + 1}") as folder:
            try:
                yield
            finally:
                self.logs.append((case, folder_texts(folder)))

    def result(self, topology: Topology | None) -> Transport:
        """The transport of the widest DDP case with an NCCL log (see the module)."""
        from gpudiag.transport.capture import live_topology, texts_report, user_settings

        if self.torchrun:
            return Transport(
                note="under torchrun the DDP ranks are torchrun's: their NCCL log is not captured; "
                "run with NCCL_DEBUG=INFO and read it with gpudiag transport --from-log FILE"
            )
        if not self.logs:
            return Transport()
        theirs = user_settings()
        kept = (
            f"{' and '.join(f'{k}={v}' for k, v in theirs.items())} set by you: kept for the DDP ranks "
            "(their output went to bench's private log, not the terminal)"
            if theirs
            else None
        )
        topology = topology if topology is not None else live_topology()
        for case, texts in sorted(self.logs, key=lambda item: -item[0].gpus):
            report = texts_report(texts, topology)
            if report is not None:
                return Transport(report, case.label, kept, list(report.findings))
        why = "the DDP ranks' log holds no NCCL line"
        if os.environ.get("NCCL_DEBUG_FILE"):  # (NCCL writes there instead of stdout)
            why += (
                f"; NCCL_DEBUG_FILE={os.environ['NCCL_DEBUG_FILE']} sends NCCL's lines to your file: "
                "read it with gpudiag transport --from-log FILE"
            )
        return Transport(note=f"{why}; {kept}" if kept else why)
