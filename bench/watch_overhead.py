"""Cost of ``gpudiag.watch``: a watched DDP training step against the same step unwatched.

    .venv/bin/python bench/watch_overhead.py [--steps 150] [--warmup 3] [--kinds plain,watched]
    python3 bench/watch_overhead.py --device cuda [--world 1] [--steps 100] [--warmup 10]

``--device cpu`` (default): DDP over gloo, 2 ranks on the CPU, torchvision resnet18, a
global batch of 32 images of 3x64x64 (16 per rank), SGD — the configuration of
``runtime_overhead.py`` — with the machine's cores shared out between the ranks
(``torch.set_num_threads``). ``--device cuda``: DDP over NCCL, one rank per GPU (``--world``,
default 1): resnet18 batch 32 at 64 px, resnet50 batch 64 at 224 px.

Each rank holds DDP models of the same weights (``--kinds``; by default ``plain`` and
``watched``, ``--kinds plain,hooked,watched,watched-bucket`` for all four), stepped
round-robin (the order rotates every step) so all see the same machine load:

- ``plain``: DDP as users run it (no comm hook: the reducer's C++ all-reduce) — the baseline;
- ``hooked``: DDP with torch's Python ``allreduce_hook``, for reference (what any Python
  comm hook costs before it does anything);
- ``watched``: ``gpudiag.watch(ddp)`` as users call it — module hooks, output witnesses,
  DDP's own C++ all-reduce with each rank's gradients witnessed in one pass before DDP's
  finalize and once after, the per-step MIN all-reduce and one read-back;
- ``watched-bucket``: ``gpudiag.watch(ddp, comm_hook=True)`` — the same, but through the
  runtime's Python comm hook (torch's ``allreduce_hook`` plus each bucket's norm), the way
  models with ``gradient_as_bucket_view=True`` are watched.

A step is zero_grad, forward, loss, backward, optimizer step, and the loss read back (a
host sync, as a training loop's logging does). Beside the step times it prints each kind's
CPU time against plain's: the whole process's, and the training thread's (paired per
round) — the work watching adds, which a loaded machine's preemptions hardly move.

Prints the median and the best step over ``--steps`` steps after ``--warmup`` (the best is
what a loaded machine disturbs least) and, as its last line, ``watched/plain = R`` —
gpudiag.watch's default against plain DDP as the median over steps of each round's ratio
(the kinds of one round run back to back, so a load that comes and goes on a shared machine
hits both sides of a ratio alike; the ratio of the medians is printed too), on CUDA the
worst configuration's; the target is R <= 1.03.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import gpudiag
from gpudiag.runtime.launch import launch
from gpudiag.runtime.wire import pack, unpack

KINDS = ("plain", "hooked", "watched", "watched-bucket")
#: (model, global batch, image side) per device.
CONFIGS = {
    "cpu": [("resnet18", 32, 64)],
    "cuda": [("resnet18", 32, 64), ("resnet50", 64, 224)],
}


def _rank(
    rank: int,
    world: int,
    device: str,
    config: tuple[str, int, int],
    steps: int,
    warmup: int,
    kinds: tuple[str, ...] = KINDS,
) -> bytes:
    import torch.distributed as dist
    import torch.nn.functional as F
    import torchvision
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    name, batch, side = config
    target = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")
    if device == "cuda":
        torch.cuda.set_device(target)
    else:  # the cores shared out between the ranks: no rank's threads wait for another's
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    models = {}
    watchers = []
    for kind in kinds:
        torch.manual_seed(0)
        model = torchvision.models.get_model(name, num_classes=10).to(target)
        ddp = DistributedDataParallel(model, device_ids=[rank] if device == "cuda" else None)
        if kind == "hooked":
            ddp.register_comm_hook(dist.group.WORLD, default_hooks.allreduce_hook)
        elif kind == "watched":
            watchers.append(gpudiag.watch(ddp, "raise", record_dir=False))
        elif kind == "watched-bucket":
            watchers.append(gpudiag.watch(ddp, "raise", record_dir=False, comm_hook=True))
        models[kind] = (ddp, torch.optim.SGD(ddp.parameters(), lr=0.01))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 3, side, side, generator=g).chunk(world)[rank].to(target)
    y = torch.randint(0, 10, (batch,), generator=g).chunk(world)[rank].to(target)
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    cpu: dict[str, list[float]] = {kind: [] for kind in kinds}  # this process's CPU time, all threads
    work: dict[str, list[float]] = {kind: [] for kind in kinds}  # the training thread's CPU time
    for i in range(warmup + steps):
        order = kinds[i % len(kinds) :] + kinds[: i % len(kinds)]
        for kind in order:
            ddp, optimizer = models[kind]
            start, cpu_start, work_start = time.perf_counter(), time.process_time(), time.thread_time()
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(ddp(x), y)
            loss.backward()
            optimizer.step()
            float(loss.detach())
            if i >= warmup:
                times[kind].append(time.perf_counter() - start)
                cpu[kind].append(time.process_time() - cpu_start)
                work[kind].append(time.thread_time() - work_start)
    assert all(w.step == warmup + steps and w.report is None for w in watchers)
    for w in watchers:
        w.close()
    return pack({"wall": times, "cpu": cpu, "work": work})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--world", type=int, default=None, help="ranks (default: 2 on cpu, 1 on cuda)")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--kinds",
        default="plain,watched",
        help="the models stepped round-robin, plain and watched among them (fewer kinds: more rounds "
        "in the same time, a tighter median)",
    )
    args = parser.parse_args()
    kinds = tuple(args.kinds.split(","))
    if kinds[0] != "plain" or "watched" not in kinds or not set(kinds) <= set(KINDS):
        parser.error(f"--kinds: plain first, watched among them, from {', '.join(KINDS)}")
    world = args.world or (2 if args.device == "cpu" else 1)
    backend = "gloo" if args.device == "cpu" else "nccl"
    worst = 0.0
    for config in CONFIGS[args.device]:
        task = (args.device, config, args.steps, args.warmup, kinds)
        raw = [unpack(p) for p in launch(_rank, world, backend=backend, timeout=3600, args=task)]
        results = [r["wall"] for r in raw]
        median = {kind: statistics.median(results[0][kind]) for kind in kinds}
        best = {kind: min(results[0][kind]) for kind in kinds}
        name, batch, side = config
        print(f"{name} batch {batch} at {side} px, {world} rank(s) over {backend}, torch {torch.__version__}")
        for kind in kinds:
            print(
                f"  {kind:14s} median {median[kind] * 1e3:.2f} ms/step, best {best[kind] * 1e3:.2f} "
                f"over {args.steps} steps (rank 0)"
            )
        for kind in kinds[1:]:
            print(
                f"  {kind}/plain = {median[kind] / median['plain']:.3f} "
                f"(best/best {best[kind] / best['plain']:.3f})"
            )
        if "hooked" in kinds:
            print(f"  watched/hooked = {median['watched'] / median['hooked']:.3f}")
        paired = {
            kind: statistics.median(a / b for a, b in zip(results[0][kind], results[0]["plain"], strict=True))
            for kind in kinds
        }
        print(
            "  paired (median over steps of each round's ratio): "
            + ", ".join(f"{kind}/plain {paired[kind]:.3f}" for kind in kinds[1:])
        )
        cpu = {kind: statistics.median(raw[0]["cpu"][kind]) for kind in kinds}
        print(
            "  CPU time of rank 0's process (what the watcher adds as work, not waiting): "
            + ", ".join(f"{kind}/plain {cpu[kind] / cpu['plain']:.3f}" for kind in kinds[1:])
        )
        base = raw[0]["work"]["plain"]
        work = {
            kind: statistics.median(a / b for a, b in zip(raw[0]["work"][kind], base, strict=True))
            for kind in kinds
        }
        print(
            "  training thread's CPU time, paired (the work watching adds; a machine's load hardly "
            "moves it): " + ", ".join(f"{kind}/plain {work[kind]:.3f}" for kind in kinds[1:])
        )
        ratios = sorted(a / b for a, b in zip(results[0]["watched"], results[0]["plain"], strict=True))
        quarter = len(ratios) // 4
        print(
            f"  watched/plain per round: median {statistics.median(ratios):.3f}, "
            f"interquartile {ratios[quarter]:.3f}-{ratios[-1 - quarter]:.3f} over {len(ratios)} rounds"
        )
        worst = max(worst, paired["watched"])
    print(f"watched/plain = {worst:.3f} (paired median)")


if __name__ == "__main__":
    main()
