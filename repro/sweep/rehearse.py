"""A cluster rehearsed on one machine: several "nodes", each its own ``torchrun`` on
127.0.0.1 with its own host name (``GPUDIAG_HOSTNAME``), machine file (CPU virtual devices
laid out like it) and rehearsal options (``--inject``, ``--inject-delay``). The tests and
``bench/sweep_nodes.py`` use it; everything it reports is simulated.

Each node is started in a process group of its own and killed (group and all) when the
deadline passes, so no rank outlives the rehearsal.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

#: The rules a rehearsal judges by. CPU figures on a shared 2-core machine vary up to
#: fivefold between processes (measured: 0.097 against a median of 0.476 GB/s, a healthy
#: node); a rehearsed slow node (0.5 s before each transfer) is ~100× slower, so figures
#: count as low below 0.05 × — and figures of virtual devices are judged at all.
LOOSE_RULES = {
    "figures": {
        "intra_busbw_gbps": {"min_fraction_of_median": 0.05},
        "pair_busbw_gbps": {"min_fraction_of_median": 0.05},
    },
    "pair_slow_fraction": 0.05,
    "judge_simulated_figures": True,
}


@dataclass
class Node:
    """One rehearsed node: its host name, machine file, extra ``gpudiag sweep`` options and
    extra environment variables (its torchrun's and so its ranks')."""

    host: str
    machine: str
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Finished:
    host: str
    returncode: int | None  # None: killed at the deadline
    output: str


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun() -> list[str]:
    """``python -m torch.distributed.run``: torchrun of this interpreter."""
    return [sys.executable, "-m", "torch.distributed.run"]


def rehearse(
    nodes: Sequence[Node],
    output: str | os.PathLike[str],
    common: Sequence[str] = (),
    *,
    deadline: float = 120.0,
    port: int | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> list[Finished]:
    """Start one torchrun per node (``--nnodes len(nodes)``, static rendezvous on
    127.0.0.1), wait for all of them up to ``deadline`` seconds, return each node's exit
    code and output. ``common``: options every node gets (``--quick``, ``--expect-hosts``).
    The nodes' temporary folders (``TMPDIR``) are one folder of the rehearsal's, removed at
    its end: a node it kills (``--inject-stall NAME:kill``, or past the deadline) cannot
    remove its own."""
    port = port or free_port()
    procs: list[tuple[Node, subprocess.Popen[bytes]]] = []
    logs: list[Path] = []
    folder = Path(cwd or ".")
    scratch = tempfile.mkdtemp(prefix="gpudiag-rehearse-")
    try:
        for index, node in enumerate(nodes):
            argv = [
                *torchrun(),
                f"--nnodes={len(nodes)}",
                "--nproc-per-node=1",
                f"--node-rank={index}",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
                "-m",
                "gpudiag",
                "sweep",
                "-o",
                str(output),
                "--machine",
                node.machine,
                *common,
                *node.args,
            ]
            env = {**os.environ, "GPUDIAG_HOSTNAME": node.host, "OMP_NUM_THREADS": "1", "TMPDIR": scratch}
            env.update(node.env)
            log = folder / f".rehearse-{os.getpid()}-{index}.log"
            logs.append(log)
            with open(log, "wb") as out:
                procs.append(
                    (
                        node,
                        subprocess.Popen(
                            argv,
                            stdout=out,
                            stderr=subprocess.STDOUT,
                            env=env,
                            cwd=cwd,
                            start_new_session=True,
                        ),
                    )
                )
        end = time.monotonic() + deadline
        codes: list[int | None] = []
        for _, proc in procs:
            try:
                codes.append(proc.wait(timeout=max(0.1, end - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
    finally:
        for _, proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        shutil.rmtree(scratch, ignore_errors=True)
    finished = []
    for (node, _), code, log in zip(procs, codes, logs, strict=True):
        text = log.read_text(errors="replace")
        log.unlink()
        finished.append(Finished(node.host, code, text))
    return finished
