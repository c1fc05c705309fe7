"""Cost of ``gpudiag.watch``: watched training steps against the same steps unwatched, on
four model sizes — the curve docs/watch.md states.

    .venv/bin/python bench/watch_overhead.py [--models mlp,transformer,resnet18,ddp-resnet18]
        [--steps N] [--warmup 3] [--kinds plain,watched]
    python3 bench/watch_overhead.py --device cuda [--world 1] [--steps 100] [--warmup 10]

The models (``--models``, all four by default), from the smallest step to the largest:

- ``mlp``: 12 × (``Linear(128, 128)``, ``ReLU``) and a ``Linear(128, 10)`` — 25 modules,
  batch 32 (about 1.5 ms a step on one CPU thread);
- ``transformer``: a small pre-norm transformer language model — ``Embedding(256, 64)``,
  2 blocks of (``LayerNorm``, ``MultiheadAttention(64, 4 heads)``, ``LayerNorm``, an MLP
  64→256→64 with ``GELU``), a final ``LayerNorm`` and a ``Linear(64, 256)`` head; 23
  modules, batch 8 × 32 tokens, cross-entropy on the tokens (about 7 ms);
- ``resnet18``: torchvision's, 10 classes, batch 16 at 64 px;
- ``ddp-resnet18``: DDP over gloo, 2 ranks (``--world``), torchvision resnet18, global
  batch 32 at 64 px (16 per rank), the machine's cores shared out between the ranks.

The first three run in this process, on one thread on the CPU (``torch.set_num_threads(1)``:
figures that a shared machine's other load disturbs least); ``--device cuda`` runs them on
``cuda:0`` and ``ddp-resnet18`` (and ``ddp-resnet50``, batch 64 at 224 px) with one NCCL rank
per GPU.

Each process holds models of the same weights (``--kinds``; by default ``plain`` and
``watched``, for DDP also ``--kinds plain,hooked,watched,watched-bucket``), stepped
round-robin (the order rotates every step) so all see the same machine load; in one
process two of each kind, made in the order plain, watched, watched, plain (two models
made one after the other differ by up to 1 % in speed, by where they lie in memory; the
DDP ranks still make one of each kind, in ``--kinds`` order):

- ``plain``: the model as users run it (DDP without a comm hook: the reducer's C++
  all-reduce) — the baseline;
- ``hooked`` (DDP only): DDP with torch's Python ``allreduce_hook``, for reference;
- ``watched``: ``gpudiag.watch(model)`` as users call it;
- ``watched-bucket`` (DDP only): ``gpudiag.watch(ddp, comm_hook=True)``, the way models
  with ``gradient_as_bucket_view=True`` are watched.

A step is zero_grad, forward, loss, backward, optimizer step (SGD), and the loss read back
(a host sync, as a training loop's logging does). Per model it prints the median and the
best step time, each kind's ratio to plain as the median over rounds of each round's ratio
(*paired*: the kinds of one round run back to back, so a load that comes and goes hits both
sides alike), the ratio of the medians, and the training thread's CPU time, paired. The
last line is ``watched/plain = R``: the worst model's paired median, with every model's
after it (the curve). Targets (docs/watch.md): ``transformer`` ≤ 1.05, ``ddp-resnet18``
≤ 1.03.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import gpudiag
from gpudiag.runtime.launch import launch
from gpudiag.runtime.wire import pack, unpack

KINDS = ("plain", "hooked", "watched", "watched-bucket")
#: The models run in this process (on one CPU thread, or cuda:0).
SINGLE = ("mlp", "transformer", "resnet18")
#: DDP models: (torchvision model, global batch, image side).
DDP = {"ddp-resnet18": ("resnet18", 32, 64), "ddp-resnet50": ("resnet50", 64, 224)}
MODELS = {
    "cpu": "mlp,transformer,resnet18,ddp-resnet18",
    "cuda": "mlp,transformer,resnet18,ddp-resnet18,ddp-resnet50",
}
#: The order the single-process models are made in: (replica, kind). Two models of the same
#: kind made one after the other step at speeds up to 1 % apart, every run (where each lies
#: in memory, most likely: in a plain/plain pair the first made was 0.1-1.1 % slower in nine
#: runs, 2026-11-27), so each kind is two models in the balanced order plain, watched,
#: watched, plain.
ORDER = ((1, "plain"), (1, "watched"), (2, "watched"), (2, "plain"))
#: Rounds per model by default: more for short steps, whose single ratios swing more.
STEPS = {"mlp": 600, "transformer": 300, "resnet18": 60, "ddp-resnet18": 150, "ddp-resnet50": 100}


class _Block(torch.nn.Module):
    """A pre-norm transformer block: attention and an MLP, each around a LayerNorm."""

    def __init__(self, width: int = 64, heads: int = 4) -> None:
        super().__init__()
        from torch import nn

        self.ln1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class _TinyLM(torch.nn.Module):
    """The ``transformer`` model: 23 modules, 2 blocks of width 64, a vocabulary of 256."""

    def __init__(self, vocab: int = 256, width: int = 64, layers: int = 2) -> None:
        super().__init__()
        from torch import nn

        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.Sequential(*[_Block(width) for _ in range(layers)])
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln(self.blocks(self.embed(tokens))))


def _single_case(name: str, target: torch.device) -> tuple[Any, Any]:
    """(make a model, the step's loss given a model) for one of :data:`SINGLE`."""
    import torch.nn.functional as F
    from torch import nn

    g = torch.Generator().manual_seed(1)
    if name == "mlp":
        x = torch.randn(32, 128, generator=g).to(target)
        y = torch.randint(0, 10, (32,), generator=g).to(target)

        def mlp() -> nn.Module:
            layers: list[nn.Module] = []
            for _ in range(12):
                layers += [nn.Linear(128, 128), nn.ReLU()]
            return nn.Sequential(*layers, nn.Linear(128, 10))

        return mlp, lambda model: F.cross_entropy(model(x), y)
    if name == "transformer":
        tokens = torch.randint(0, 256, (8, 32), generator=g).to(target)
        return _TinyLM, lambda model: F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    import torchvision

    images = torch.randn(16, 3, 64, 64, generator=g).to(target)
    labels = torch.randint(0, 10, (16,), generator=g).to(target)
    return (
        lambda: torchvision.models.resnet18(num_classes=10),
        lambda model: F.cross_entropy(model(images), labels),
    )


def _single(name: str, device: str, steps: int, warmup: int, kinds: tuple[str, ...]) -> dict[str, Any]:
    """One process: two models of each kind, made in the balanced order plain, watched,
    watched, plain (:data:`ORDER`), stepped round-robin; a kind's time in a round is the
    mean of its two models'."""
    target = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    if device == "cpu":
        torch.set_num_threads(1)
    make, loss_of = _single_case(name, target)
    models = {}
    watchers = []
    made = [(kind, i) for i, kind in ORDER if kind in kinds]
    for kind, i in made:
        torch.manual_seed(0)
        model = make().to(target)
        if kind == "watched":
            watchers.append(gpudiag.watch(model, "raise", record_dir=False))
        models[f"{kind}{i}"] = (model, torch.optim.SGD(model.parameters(), lr=0.01))
    raw = _rounds(models, loss_of, tuple(models), steps, warmup)
    assert all(w.step == warmup + steps and w.report is None for w in watchers)
    for w in watchers:
        w.close()
    return {
        measure: {kind: _mean_of_pairs(times[f"{kind}1"], times[f"{kind}2"]) for kind in kinds}
        for measure, times in raw.items()
    }


def _mean_of_pairs(first: list[float], second: list[float]) -> list[float]:
    """Round by round, the mean of a kind's two models' times."""
    return [(a + b) / 2 for a, b in zip(first, second, strict=True)]


def _rounds(
    models: dict[str, Any], loss_of: Any, kinds: tuple[str, ...], steps: int, warmup: int
) -> dict[str, Any]:
    """Step each kind's model once per round, the order rotating; the step times (wall),
    this process's CPU time and the training thread's, per kind, after ``warmup`` rounds."""
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    cpu: dict[str, list[float]] = {kind: [] for kind in kinds}  # this process's CPU time, all threads
    work: dict[str, list[float]] = {kind: [] for kind in kinds}  # the training thread's CPU time
    for i in range(warmup + steps):
        order = kinds[i % len(kinds) :] + kinds[: i % len(kinds)]
        for kind in order:
            model, optimizer = models[kind]
            start, cpu_start, work_start = time.perf_counter(), time.process_time(), time.thread_time()
            optimizer.zero_grad(set_to_none=True)
            loss = loss_of(model)
            loss.backward()
            optimizer.step()
            float(loss.detach())
            if i >= warmup:
                times[kind].append(time.perf_counter() - start)
                cpu[kind].append(time.process_time() - cpu_start)
                work[kind].append(time.thread_time() - work_start)
    return {"wall": times, "cpu": cpu, "work": work}


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
    result = _rounds(models, lambda model: F.cross_entropy(model(x), y), kinds, steps, warmup)
    assert all(w.step == warmup + steps and w.report is None for w in watchers)
    for w in watchers:
        w.close()
    return pack(result)


def _summarise(title: str, raw: dict[str, Any], kinds: tuple[str, ...], steps: int) -> float:
    """Print one model's figures (rank 0's under DDP); its paired watched/plain ratio."""
    results = raw["wall"]
    median = {kind: statistics.median(results[kind]) for kind in kinds}
    best = {kind: min(results[kind]) for kind in kinds}
    print(title)
    for kind in kinds:
        print(
            f"  {kind:14s} median {median[kind] * 1e3:.2f} ms/step, best {best[kind] * 1e3:.2f} "
            f"over {steps} steps"
        )
    for kind in kinds[1:]:
        print(
            f"  {kind}/plain = {median[kind] / median['plain']:.3f} "
            f"(best/best {best[kind] / best['plain']:.3f})"
        )
    if "hooked" in kinds:
        print(f"  watched/hooked = {median['watched'] / median['hooked']:.3f}")
    paired = {
        kind: statistics.median(a / b for a, b in zip(results[kind], results["plain"], strict=True))
        for kind in kinds
    }
    print(
        "  paired (median over rounds of each round's ratio): "
        + ", ".join(f"{kind}/plain {paired[kind]:.3f}" for kind in kinds[1:])
    )
    cpu = {kind: statistics.median(raw["cpu"][kind]) for kind in kinds}
    print(
        "  CPU time of the process (what the watcher adds as work, not waiting): "
        + ", ".join(f"{kind}/plain {cpu[kind] / cpu['plain']:.3f}" for kind in kinds[1:])
    )
    base = raw["work"]["plain"]
    work = {
        kind: statistics.median(a / b for a, b in zip(raw["work"][kind], base, strict=True)) for kind in kinds
    }
    print(
        "  training thread's CPU time, paired (the work watching adds; a machine's load hardly "
        "moves it): " + ", ".join(f"{kind}/plain {work[kind]:.3f}" for kind in kinds[1:])
    )
    ratios = sorted(a / b for a, b in zip(results["watched"], results["plain"], strict=True))
    quarter = len(ratios) // 4
    print(
        f"  watched/plain per round: median {statistics.median(ratios):.3f}, "
        f"interquartile {ratios[quarter]:.3f}-{ratios[-1 - quarter]:.3f} over {len(ratios)} rounds"
    )
    return paired["watched"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--models", default=None, help=f"from {', '.join((*SINGLE, *DDP))} (default: {MODELS['cpu']})"
    )
    parser.add_argument("--world", type=int, default=None, help="DDP ranks (default: 2 on cpu, 1 on cuda)")
    parser.add_argument("--steps", type=int, default=None, help=f"rounds per model (default: {STEPS})")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--kinds",
        default="plain,watched",
        help="the models stepped round-robin, plain and watched among them (fewer kinds: more rounds "
        "in the same time, a tighter median; hooked and watched-bucket: DDP only)",
    )
    args = parser.parse_args()
    kinds = tuple(args.kinds.split(","))
    if kinds[0] != "plain" or "watched" not in kinds or not set(kinds) <= set(KINDS):
        parser.error(f"--kinds: plain first, watched among them, from {', '.join(KINDS)}")
    names = (args.models or MODELS[args.device]).split(",")
    unknown = [n for n in names if n not in SINGLE and n not in DDP]
    if unknown:
        parser.error(f"--models: {', '.join(unknown)}: expected names from {', '.join((*SINGLE, *DDP))}")
    world = args.world or (2 if args.device == "cpu" else 1)
    backend = "gloo" if args.device == "cpu" else "nccl"
    curve: dict[str, float] = {}
    for name in names:
        steps = args.steps or STEPS[name]
        if name in SINGLE:
            single = tuple(k for k in kinds if k in ("plain", "watched"))
            raw = _single(name, args.device, steps, args.warmup, single)
            where = "1 CPU thread" if args.device == "cpu" else "cuda:0"
            title = f"{name}, one process on {where}, torch {torch.__version__}"
            curve[name] = _summarise(title, raw, single, steps)
            continue
        config = DDP[name]
        task = (args.device, config, steps, args.warmup, kinds)
        raw = unpack(launch(_rank, world, backend=backend, timeout=3600, args=task)[0])
        model, batch, side = config
        title = (
            f"{name}: {model} batch {batch} at {side} px, {world} rank(s) over {backend}, "
            f"torch {torch.__version__} (rank 0)"
        )
        curve[name] = _summarise(title, raw, kinds, steps)
    worst = max(curve, key=lambda n: curve[n])
    listed = ", ".join(f"{n} {r:.3f}" for n, r in curve.items())
    print(f"watched/plain = {curve[worst]:.3f} (paired median, worst: {worst}; {listed})")


if __name__ == "__main__":
    main()
