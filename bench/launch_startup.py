"""How much the launcher saves by forking CPU ranks instead of starting fresh interpreters.

    .venv/bin/python bench/launch_startup.py [--world-size 2] [--repeats 5]

Times launch() of ranks that join a gloo group, do one all-reduce and return, with the
start method the runtime picks on CPU (fork: no new interpreter, no second torch import)
and with fresh interpreters (``subprocess``: what it does on CUDA or beside other threads,
and what torch.multiprocessing.spawn costs too: a new interpreter imports torch per rank).
Prints the medians and, as its last line, subprocess / fork.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpudiag.runtime.launch import launch, start_method


def _rank(rank: int, world: int) -> bytes:
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return str(t.item()).encode()


def measure(method: str, world: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        launch(_rank, world, method=method, timeout=120)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    chosen = start_method("gloo")
    fast = measure(chosen, args.world_size, args.repeats)
    slow = measure("subprocess", args.world_size, args.repeats)
    print(f"{chosen}: median {fast:.3f} s per launch of {args.world_size} ranks")
    print(f"subprocess: median {slow:.3f} s per launch of {args.world_size} ranks")
    print(f"subprocess/{chosen} = {slow / fast:.2f}")


if __name__ == "__main__":
    main()
