"""Cost of watching DDP: the runtime's comm hook against plain DDP.

    .venv/bin/python bench/runtime_overhead.py [--steps 40] [--warmup 3]

DDP over gloo, 2 ranks on the CPU, torchvision resnet18, a global batch of 32 images of
3x64x64 (16 per rank), SGD. Each rank holds three DDP models stepped round-robin (the
order rotates every step), so all see the same machine load:

- ``plain``: DDP with torch's default hook, ``default_hooks.allreduce_hook``
  (torch.distributed.algorithms.ddp_comm_hooks) — the baseline the issue names;
- ``builtin``: DDP with no hook registered (the reducer's C++ all-reduce), for reference;
- ``watched``: DDP with gpudiag's hook (per-bucket norm and NaN/Inf count before and
  after the all-reduce, read back once per step).

Prints the medians over ``--steps`` steps after ``--warmup`` and, as its last line,
watched / plain (target <= 1.03).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from gpudiag.runtime.ddp import HookState, watch_hook
from gpudiag.runtime.launch import launch
from gpudiag.runtime.record import Recorder
from gpudiag.runtime.run import pack, unpack

KINDS = ("plain", "builtin", "watched")


def _rank(rank: int, world: int, steps: int, warmup: int) -> bytes:
    import torch.distributed as dist
    import torch.nn.functional as F
    import torchvision
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    state, recorder = HookState(rank, world), Recorder()
    models = {}
    for kind in KINDS:
        torch.manual_seed(0)
        ddp = DistributedDataParallel(torchvision.models.resnet18(num_classes=10))
        if kind == "plain":
            ddp.register_comm_hook(dist.group.WORLD, default_hooks.allreduce_hook)
        elif kind == "watched":
            ddp.register_comm_hook(state, watch_hook)
        models[kind] = (ddp, torch.optim.SGD(ddp.parameters(), lr=0.01))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 3, 64, 64, generator=g).chunk(world)[rank]
    y = torch.randint(0, 10, (32,), generator=g).chunk(world)[rank]
    times: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for i in range(warmup + steps):
        order = KINDS[i % 3 :] + KINDS[: i % 3]
        for kind in order:
            ddp, optimizer = models[kind]
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(ddp(x), y)
            loss.backward()
            if kind == "watched":
                state.flush(recorder)
                state.step += 1
            optimizer.step()
            float(loss.detach())
            if i >= warmup:
                times[kind].append(time.perf_counter() - start)
    return pack(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    results = [unpack(p) for p in launch(_rank, 2, timeout=3600, args=(args.steps, args.warmup))]
    median = {kind: statistics.median(results[0][kind]) for kind in KINDS}
    for kind in KINDS:
        print(f"{kind:8s} median {median[kind] * 1e3:.1f} ms/step over {args.steps} steps (rank 0)")
    print(f"watched/builtin = {median['watched'] / median['builtin']:.3f}")
    print(f"watched/plain = {median['watched'] / median['plain']:.3f}")


if __name__ == "__main__":
    main()
