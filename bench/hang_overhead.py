"""Cost of ``gpudiag run``'s hang watchdog: DDP steps with the watchdog thread polling
against the same steps without it, paired.

    .venv/bin/python bench/hang_overhead.py [--pairs 20] [--block 6] [--batch 16] [--size 64] [--poll 1.0]

DDP over gloo, 2 ranks on the CPU (one intra-op thread each), torchvision resnet18, a global
batch of ``--batch`` images of 3x``--size``x``--size``, SGD; the flight recorder on
(``TORCH_FR_BUFFER_SIZE=2000``, as ``gpudiag run`` sets it) in both conditions. A step is
zero_grad, forward, loss, backward, optimizer step and the loss read back.

Steps run in blocks of ``--block``, in the order plain, watched, watched, plain, … (ABBA:
a drift in the machine's load hits both sides alike); a watched block starts a
:class:`gpudiag.hang.watchdog.Watchdog` through :func:`gpudiag.hang.arm.start` (poll every
``--poll`` s, its default 1 s; a stall limit that never fires) and stops it after, and the
first step of every block is not counted. Each pair of neighbouring blocks gives a ratio
watched / plain of its median step; the figures are the median of those ratios (*paired*),
on rank 0, of:

- the wall time of a step;
- the training thread's CPU time per step (``time.thread_time``: what the step itself ran);
- the CPU time of the rank's process per step (every thread: the training thread, gloo's,
  and the watchdog's own — a shared machine's other load moves it least);
- and, directly, the watchdog thread's own CPU time (its clock, ``pthread_getcpuclockid``)
  over the plain steps' wall time: what it takes from the rank, GIL included (the training
  thread can wait for the GIL at most as long as the watchdog holds it, which is never
  longer than it runs).

The last line is ``watched/plain = R``: the paired median of the process CPU time (target
<= 1.01, docs/hang.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")

import torch

from gpudiag.hang.arm import start, stop
from gpudiag.hang.watchdog import Watchdog
from gpudiag.runtime.launch import launch
from gpudiag.runtime.wire import pack, unpack


def _thread_cpu(watchdog: Watchdog) -> float:
    """The watchdog thread's CPU seconds so far (0 where this system cannot tell)."""
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(watchdog.ident or 0))
    except (AttributeError, OSError):
        return 0.0


def _rank(rank: int, world: int, pairs: int, block: int, batch: int, size: int, poll: float) -> bytes:
    import torch.nn.functional as F
    import torchvision
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    torch.manual_seed(0)
    ddp = DistributedDataParallel(torchvision.models.get_model("resnet18", num_classes=10))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 3, size, size, generator=g).chunk(world)[rank]
    y = torch.randint(0, 10, (batch,), generator=g).chunk(world)[rank]
    blocks: list[dict[str, float | str]] = []
    order = ["plain", "watched", "watched", "plain"]
    with tempfile.TemporaryDirectory() as scratch:
        for b in range(2 + 2 * pairs):  # two warm-up blocks
            kind = order[b % 4]
            watchdog = (
                start(Watchdog(stall_s=1e9, out=Path(scratch), poll_s=poll)) if kind == "watched" else None
            )
            walls, cpus, works = [], [], []
            began, began_cpu = time.perf_counter(), 0.0
            for step in range(block):
                start_wall, start_cpu, start_work = (
                    time.perf_counter(),
                    time.process_time(),
                    time.thread_time(),
                )
                if step == 1 and watchdog is not None:
                    began, began_cpu = start_wall, _thread_cpu(watchdog)
                optimizer.zero_grad(set_to_none=True)
                loss = F.cross_entropy(ddp(x), y)
                loss.backward()
                optimizer.step()
                float(loss.detach())
                if step:  # the first step of a block is not counted
                    walls.append(time.perf_counter() - start_wall)
                    cpus.append(time.process_time() - start_cpu)
                    works.append(time.thread_time() - start_work)
            thread_cpu = 0.0
            if watchdog is not None:
                thread_cpu = _thread_cpu(watchdog) - began_cpu
                stop(watchdog)
            if b >= 2:
                blocks.append(
                    {
                        "kind": kind,
                        "wall": statistics.median(walls),
                        "cpu": statistics.median(cpus),
                        "work": statistics.median(works),
                        "watchdog_cpu": thread_cpu,
                        "span": time.perf_counter() - began,
                    }
                )
    return pack(blocks)


def paired(blocks: list[dict], key: str) -> list[float]:
    """watched / plain of ``key`` for each pair of neighbouring blocks."""
    out = []
    for a, b in zip(blocks[::2], blocks[1::2], strict=False):
        watched, plain = (a, b) if a["kind"] == "watched" else (b, a)
        out.append(watched[key] / plain[key])
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=20, help="pairs of blocks (plain, watched)")
    parser.add_argument("--block", type=int, default=6, help="steps per block (the first not counted)")
    parser.add_argument("--batch", type=int, default=16, help="global batch")
    parser.add_argument("--size", type=int, default=64, help="image side, px")
    parser.add_argument("--poll", type=float, default=1.0, help="the watchdog's poll interval, s")
    args = parser.parse_args()
    results = launch(
        _rank,
        2,
        backend="gloo",
        timeout=3600,
        args=(args.pairs, args.block, args.batch, args.size, args.poll),
    )
    blocks = unpack(results[0])
    plain = [b for b in blocks if b["kind"] == "plain"]
    watched = [b for b in blocks if b["kind"] == "watched"]
    print(
        f"resnet18, global batch {args.batch} at {args.size} px, 2 ranks over gloo, "
        "flight recorder on (rank 0):"
    )
    for name, group in (("plain", plain), ("watched", watched)):
        steps = statistics.median(b["wall"] for b in group)
        print(
            f"  {name:8s} median {steps * 1e3:.1f} ms/step over {len(group)} blocks "
            f"of {args.block - 1} counted steps"
        )
    direct = sum(b["watchdog_cpu"] for b in watched) / sum(b["span"] for b in watched)
    print(f"  the watchdog thread's own CPU time: {direct * 100:.4f} % of the watched blocks' wall time")
    wall, cpu, work = paired(blocks, "wall"), paired(blocks, "cpu"), paired(blocks, "work")
    print(
        f"  wall time per step, paired: median {statistics.median(wall):.4f} "
        f"(pairs from {min(wall):.3f} to {max(wall):.3f})"
    )
    print(
        f"  the training thread's CPU time per step, paired: median {statistics.median(work):.4f} "
        f"(pairs from {min(work):.3f} to {max(work):.3f})"
    )
    print(f"  process CPU time per step, paired: pairs from {min(cpu):.3f} to {max(cpu):.3f}")
    print(f"watched/plain = {statistics.median(cpu):.4f}")


if __name__ == "__main__":
    main()
