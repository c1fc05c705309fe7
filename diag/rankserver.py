"""The forkserver that DDP ranks start from, started early so its imports overlap ours.

A command that will launch DDP ranks enters :func:`warm_ranks` first thing, before it
imports torch. The server (Python's ``multiprocessing`` forkserver: a fresh interpreter
that imports ``preload`` once and forks every rank from itself) then imports torch,
``torch._dynamo`` (which DDP's constructor imports) and torchvision on another core
while this process imports torch and runs the in-process strategies, and every
rank starts with all of it imported. Inside the block
:func:`gpudiag.runtime.launch.start_method` picks the forkserver, so the rank function
and its arguments must be picklable. The server stays up, for later blocks too, until
this process exits; then it leaves at once (:mod:`gpudiag.rankserver_exit`).

This module imports neither torch nor anything else heavy.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import shutil
from collections.abc import Iterator, Mapping, Sequence

_warm = False


def torchrun_env(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process was started by torchrun (or another env:// launcher)."""
    env = os.environ if env is None else env
    return all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


#: Ranks from the forkserver receive their tensors (the model, the batch) through
#: /dev/shm, as torch.multiprocessing shares them. Below this much free room — a default
#: Docker container has 64 MB — ranks are forked instead, which needs none.
SHM_ROOM = 1 << 30


def shared_memory_room(path: str = "/dev/shm") -> bool:
    """Whether ``path`` has :data:`SHM_ROOM` bytes free."""
    try:
        return shutil.disk_usage(path).free >= SHM_ROOM
    except OSError:
        return False


def warm() -> bool:
    """Whether launches now start their ranks from the warmed forkserver."""
    return _warm


#: What a DDP rank imports: torch, dynamo (DDP's constructor), torchvision (models named
#: torchvision:…; skipped where it is not installed), the runtime, gradcheck (its model
#: factories) and the CLI (a rank re-imports the parent's __main__).
DDP_PRELOAD = (
    "torch",
    "torch._dynamo",
    "torchvision",
    "gpudiag.runtime.ddp",
    "gpudiag.checks.gradcheck",
    "gpudiag.cli",
)


@contextlib.contextmanager
def warm_ranks(preload: Sequence[str] = DDP_PRELOAD) -> Iterator[None]:
    """Start the forkserver now, importing ``preload`` (module names) in it, and start
    the ranks of every launch inside the block from it. The server's preload is fixed
    when it first starts; later blocks reuse it."""
    global _warm
    from multiprocessing import forkserver

    usable = "forkserver" in mp.get_all_start_methods() and shared_memory_room()
    if torchrun_env() or not usable:  # nothing to warm: ranks are forked (or torchrun's)
        yield
        return

    # Last: makes the server leave without tearing its interpreter down (rankserver_exit).
    mp.get_context("forkserver").set_forkserver_preload([*preload, "gpudiag.rankserver_exit"])
    forkserver.ensure_running()
    previous, _warm = _warm, True
    try:
        yield
    finally:
        _warm = previous
