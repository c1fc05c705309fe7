"""Cost of ``gpudiag run``'s hang watchdog: DDP steps with the watchdog thread polling
against the same steps without it.

    .venv/bin/python bench/hang_overhead.py [--steps 60] [--block 5] [--poll 1.0]

DDP over gloo, 2 ranks on the CPU, torchvision resnet18, a global batch of 32 images of
3x64x64, SGD; the flight recorder on (``TORCH_FR_BUFFER_SIZE=2000``, as ``gpudiag run``
sets it) in both conditions. Steps run in blocks of ``--block``, alternately with a
:class:`gpudiag.hang.watchdog.Watchdog` (poll every ``--poll`` s, its default 1 s; a stall
limit that never fires) and without one, so both see the same machine load. Prints the
median step time of each, the ratio of the process's CPU time per step (every thread,
the watchdog's included: less sensitive to other load on a shared machine) and, as its
last line, watched / plain of the wall time (target <= 1.01).
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

from gpudiag.hang.watchdog import Watchdog
from gpudiag.runtime.launch import launch
from gpudiag.runtime.wire import pack, unpack


def _rank(rank: int, world: int, steps: int, block: int, poll: float) -> bytes:
    import torch.nn.functional as F
    import torchvision
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    ddp = DistributedDataParallel(torchvision.models.get_model("resnet18", num_classes=10))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 3, 64, 64, generator=g).chunk(world)[rank]
    y = torch.randint(0, 10, (32,), generator=g).chunk(world)[rank]
    times: dict[str, list[float]] = {"plain": [], "watched": [], "plain_cpu": [], "watched_cpu": []}
    with tempfile.TemporaryDirectory() as scratch:
        for b in range(2 + 2 * (steps // block)):  # two warm-up blocks
            kind = "watched" if b % 2 else "plain"
            watchdog = None
            if kind == "watched":
                watchdog = Watchdog(stall_s=1e9, out=Path(scratch), poll_s=poll)
                watchdog.start()
            for _ in range(block):
                start, cpu = time.perf_counter(), time.process_time()
                optimizer.zero_grad(set_to_none=True)
                loss = F.cross_entropy(ddp(x), y)
                loss.backward()
                optimizer.step()
                float(loss.detach())
                if b >= 2:
                    times[kind].append(time.perf_counter() - start)
                    times[f"{kind}_cpu"].append(time.process_time() - cpu)  # every thread of the rank
            if watchdog is not None:
                watchdog.stopping.set()
                watchdog.join(timeout=10)
    return pack(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60, help="steps per condition")
    parser.add_argument("--block", type=int, default=5)
    parser.add_argument("--poll", type=float, default=1.0, help="the watchdog's poll interval, s")
    args = parser.parse_args()
    results = [
        unpack(p)
        for p in launch(_rank, 2, backend="gloo", timeout=3600, args=(args.steps, args.block, args.poll))
    ]
    median = {kind: statistics.median(results[0][kind]) for kind in ("plain", "watched")}
    print("resnet18 batch 32 at 64 px, 2 ranks over gloo, flight recorder on:")
    for kind, value in median.items():
        print(f"  {kind:8s} median {value * 1e3:.2f} ms/step over {len(results[0][kind])} steps (rank 0)")
    cpu = {kind: statistics.median(results[0][f"{kind}_cpu"]) for kind in ("plain", "watched")}
    print(
        f"  CPU time of the rank's process per step (less sensitive to other load): watched/plain = "
        f"{cpu['watched'] / cpu['plain']:.3f}"
    )
    print(f"watched/plain = {median['watched'] / median['plain']:.3f}")


if __name__ == "__main__":
    main()
