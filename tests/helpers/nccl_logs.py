"""A real NCCL log split as its ranks would have printed it (the bench and report tests of
gpudiag transport's capture: a DDP case's rank logs, one file per rank)."""

from __future__ import annotations

import re

from tests.helpers import NCCL

#: NVIDIA/nccl#1817: one process driving 8 GPUs, SHM and P2P/direct (tests/data/nccl/SOURCES.md).
LOG = NCCL / "nccl1817_shm_and_p2p_direct_one_process.log"
_PRINTER = re.compile(r"\[(\d+)\] NCCL INFO")


def rank_lines(rank: int, world: int) -> list[str]:
    """The real log's lines that rank ``rank`` of ``world`` prints: those of the devices
    ``d`` with ``d % world == rank`` (a line with no printing device — the cut last one — none)."""
    out = []
    for line in LOG.read_text(encoding="utf-8").splitlines():
        match = _PRINTER.search(line)
        if match is not None and int(match[1]) % world == rank:
            out.append(line)
    return out
