"""Real ``DistributedDataParallel`` ranks, watched by a communication hook.

Each rank builds the model with the run's seed, wraps it in
``torch.nn.parallel.DistributedDataParallel`` (gloo on CPU, nccl on CUDA) and trains on
its contiguous ``torch.chunk`` shard of the global batch — rank r gets chunk r.

Watching registers :func:`watch_hook`, which does exactly what torch's default
``allreduce_hook`` does (divide by the world size, all-reduce, use the result) and also
keeps, per bucket, the norm and NaN/Inf count before and after the all-reduce — as
tensors, read back with one host sync per step (:meth:`HookState.flush`). Faults corrupt
what rank DST receives from the all-reduce. With watching off and no faults, DDP runs
with torch's default hook: the runtime adds nothing.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations at runtime.
import contextlib
import importlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from gpudiag.errors import InputError
from gpudiag.identity import hostname
from gpudiag.runtime.batch import call_model, micro_batches, shard, to_device
from gpudiag.runtime.config import ModelFn, RunConfig, RunResult, numerics_of, sync_batchnorm_note
from gpudiag.runtime.devices import DeviceSet
from gpudiag.runtime.faults import FaultPlan, corrupt
from gpudiag.runtime.feed import Feed
from gpudiag.runtime.launch import Ranks, UnpicklableJob, local_index, start, start_method, torchrun_world
from gpudiag.runtime.numerics import Numerics, nondeterministic_alerts
from gpudiag.runtime.record import Bucket, Recorder, StepRecord
from gpudiag.runtime.stats import norm_and_nonfinite, norms_and_nonfinite
from gpudiag.runtime.stepping import Stepper, build_model, digest
from gpudiag.runtime.timing import NO_TIMER, CommTimes, PhaseTimer, Timer, peak_memory, reset_peak_memory
from gpudiag.runtime.wire import pack, recorder_from_data, recorder_to_data, unpack


@dataclass
class _Pending:
    index: int
    before: torch.Tensor  # [norm, non-finite count] of the local gradient
    faults: list[str]
    time: float
    result: torch.Tensor | None = None  # the bucket buffer after the all-reduce


@dataclass
class HookState:
    """Per-rank state of :func:`watch_hook`. The statistics after the all-reduce are taken
    in :meth:`flush`, once backward is over, from the bucket buffers (DDP keeps them until
    the next backward), so they cost nothing while backward and communication overlap."""

    rank: int
    world_size: int
    faults: FaultPlan = field(default_factory=FaultPlan)
    step: int = 1
    pending: list[_Pending] = field(default_factory=list)
    #: called with each bucket and its ``[norm, non-finite count]`` before the all-reduce
    #: changes the buffer (``gpudiag.watch`` names the parameters of a non-finite bucket)
    on_bucket: Callable[[dist.GradBucket, torch.Tensor], None] | None = None

    def flush(self, recorder: Recorder) -> None:
        """Turn this step's buckets into :class:`Bucket` events, every statistic read back
        with one host sync; with recording off just forget them."""
        pending, self.pending = self.pending, []
        if not pending or not recorder.enabled:
            return
        reduced = [p for p in pending if p.result is not None]
        stats, before = norms_and_nonfinite([p.result for p in reduced], [p.before for p in pending])
        after = dict(zip(map(id, reduced), stats, strict=True))
        for p, (nb, fb) in zip(pending, before, strict=True):
            na, fa = after.get(id(p), (math.nan, -1))
            numel = p.result.numel() if p.result is not None else 0
            recorder.buckets.append(
                Bucket(
                    self.step,
                    self.rank,
                    p.index,
                    numel,
                    nb,
                    int(fb),
                    na,
                    int(fa),
                    p.faults,
                    p.time - recorder.origin,
                )
            )


def watch_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's ``allreduce_hook`` (divide by the world size, all-reduce, use the result)
    plus per-bucket statistics and fault injection."""
    tensor = bucket.buffer()
    due = state.faults.due_on_rank(state.rank, state.step) if state.faults else []
    pending = _Pending(bucket.index(), norm_and_nonfinite(tensor), [f.text for f in due], time.perf_counter())
    state.pending.append(pending)
    if state.on_bucket is not None:
        state.on_bucket(bucket, pending.before)
    tensor.div_(state.world_size)
    future = dist.all_reduce(tensor, async_op=True).get_future()  # type: ignore[union-attr, unused-ignore]

    def finish(fut: torch.futures.Future[Any]) -> torch.Tensor:
        result = fut.value()[0]
        for fault in due:
            result.copy_(corrupt(result, fault))
        pending.result = result
        return result

    return future.then(finish)


def timed_hook(state: CommTimes, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """bench: torch's ``allreduce_hook`` (divide by the world size, all-reduce, use the
    result) that notes when each bucket's all-reduce started (the bucket was ready) and
    when it finished: host clock on gloo; on CUDA events, the finish recorded in the
    future's callback, whose stream waits for NCCL's work."""
    tensor = bucket.buffer()
    timer = state.timer if tensor.is_cuda else None
    if timer is not None:
        ready = timer.mark(current=True)
        tensor.div_(state.world_size)
        queued = dist.all_reduce(tensor, async_op=True).get_future()  # type: ignore[union-attr, unused-ignore]

        def done(fut: torch.futures.Future[Any]) -> torch.Tensor:
            timer.add("allreduce", ready, stop=timer.mark(current=True))
            return fut.value()[0]

        return queued.then(done)
    span = [time.perf_counter(), math.nan]
    state.spans.append(span)
    tensor.div_(state.world_size)
    future = dist.all_reduce(tensor, async_op=True).get_future()  # type: ignore[union-attr, unused-ignore]

    def finish(fut: torch.futures.Future[Any]) -> torch.Tensor:
        span[1] = time.perf_counter()
        return fut.value()[0]

    return future.then(finish)


def run_ddp(model_fn: ModelFn, inputs: Any, targets: torch.Tensor, config: RunConfig) -> RunResult:
    """Launch one process per device of ``config.devices`` and run DDP steps."""
    with start_ddp([(model_fn, config)], inputs, targets) as runs:
        return runs.results()[0]


def start_ddp(jobs: Sequence[tuple[ModelFn, RunConfig]], inputs: Any, targets: torch.Tensor) -> "DdpRuns":
    """Start the ranks for one or more DDP runs on the same devices and return at once;
    the runs happen one after another in one process group (one start, one rendezvous).
    Use the result as a context manager and call ``results()`` inside it."""
    configs = [config for _, config in jobs]
    devices = configs[0].devices
    if any(c.devices != devices for c in configs):
        raise ValueError("DDP runs started together must use the same devices")
    world = torchrun_world() or len(devices)  # under torchrun: its processes, on every node
    shards = len(targets.chunk(world))
    if shards < world:
        raise InputError(f"a batch of {len(targets)} gives {shards} shard(s) for {world} DDP ranks")
    for config in configs:
        FaultPlan.parse(config.faults)  # bad specs fail here, before any rank starts
    backend = _backend(devices)
    if start_method(backend) == "fork":
        # DDP's constructor imports torch._dynamo (0.85 s here): import it once, before
        # the fork, rather than once in every rank.
        importlib.import_module("torch._dynamo")
    origin = time.perf_counter()
    try:
        ranks = start(
            _rank,
            world,
            backend=backend,
            timeout=sum(c.timeout for c in configs),
            args=(list(jobs), inputs, targets, origin),
        )
    except UnpicklableJob as exc:
        raise UnpicklableJob(
            "the DDP ranks start as fresh Python processes here (CUDA in use, other threads "
            "running, or GPUDIAG_RANK_START=subprocess), and the model factory or the loss "
            f"cannot be sent to them ({exc.reason}): make them picklable, "
            "e.g. without open files, locks or CUDA streams inside",
            exc.reason,
        ) from exc
    return DdpRuns(ranks, configs, origin)


def _backend(devices: DeviceSet) -> str:
    return "gloo" if devices.kind == "virtual" else "nccl"


def forks(devices: DeviceSet) -> bool:
    """Whether DDP ranks on ``devices`` would be forked from this process now (so they
    start at once), rather than start as fresh interpreters (see ``launch.start_method``)."""
    return start_method(_backend(devices)) == "fork"


class _PlainBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
    """What a SyncBatchNorm computes without the synchronisation: BatchNorm over the
    process's own batch, for inputs of any dimension SyncBatchNorm takes."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")


def plain_batchnorm(module: torch.nn.Module) -> tuple[torch.nn.Module, int]:
    """``module`` with every ``SyncBatchNorm`` replaced by plain BatchNorm holding the same
    parameters and buffers (the reverse of ``convert_sync_batchnorm``), and how many were
    replaced. For DDP on CPU, where torch's SyncBatchNorm refuses to run."""
    out, count = module, 0
    if isinstance(module, torch.nn.SyncBatchNorm):
        out = _PlainBatchNorm(
            module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats
        )
        if module.affine:
            out.weight, out.bias = module.weight, module.bias
        out.running_mean, out.running_var = module.running_mean, module.running_var
        out.num_batches_tracked = module.num_batches_tracked
        out.train(module.training)
        count = 1
    for name, child in module.named_children():
        new, n = plain_batchnorm(child)
        out.add_module(name, new)
        count += n
    return out, count


class DdpRuns:
    """Runs started by :func:`start_ddp`: ``results()`` waits for them (rank failures
    raise :class:`~gpudiag.runtime.launch.RankFailure`); leaving the ``with`` block
    reaps the ranks."""

    def __init__(self, ranks: Ranks, configs: list[RunConfig], origin: float):
        self.ranks, self.configs, self.origin = ranks, configs, origin

    def results(self) -> list[RunResult]:
        per_rank = [unpack(payload)["jobs"] for payload in self.ranks.wait()]
        return [self._result(config, [jobs[i] for jobs in per_rank]) for i, config in enumerate(self.configs)]

    def _result(self, config: RunConfig, ranks: list[dict[str, Any]]) -> RunResult:
        recorder = Recorder(enabled=config.watch, origin=self.origin)
        for data in ranks:
            recorder_from_data(recorder, data["recorder"])
        first = ranks[0]
        return RunResult(
            strategy="ddp",
            losses=first["losses"],
            grads=first["grads"],
            params=first["params"],
            buffers=first["buffers"],
            recorder=recorder,
            notes=[sync_batchnorm_note("ddp")]
            if config.devices.kind == "virtual" and (config.sync_batchnorm or first.get("plain_batchnorm"))
            else [],
            rank_losses=[r["losses"] for r in ranks],
            rank_digests=[r["digests"] for r in ranks],
            initial_params=first["initial"],
            numerics=[Numerics.from_json(r["numerics"]) for r in ranks],
            nondeterministic=list(dict.fromkeys(op for r in ranks for op in r["nondeterministic"])),
            timing=_timing(ranks) if config.time_phases else {},
        )

    def __enter__(self) -> "DdpRuns":
        return self

    def __exit__(self, *exc: object) -> None:
        self.ranks.close()


def _timing(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """bench: every rank's peak memory (one CUDA device each) and threads, together."""
    peaks = {int(d): b for r in ranks for d, b in r["timing"]["peak_memory"].items()}
    return {
        "peak_memory": peaks,
        "threads": [t for r in ranks for t in r["timing"]["threads"]],
        "hosts": [r["timing"].get("host", "") for r in ranks],
    }


def _buffer_sync(broadcast: bool) -> dict[str, Any]:
    """DDP's buffer-broadcast option: ``broadcast_buffers`` was renamed
    ``forward_sync_buffers`` in newer torch (the old name warns); the default needs neither."""
    if broadcast:
        return {}
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    names = inspect.signature(DistributedDataParallel.__init__).parameters
    return (
        {"forward_sync_buffers": False} if "forward_sync_buffers" in names else {"broadcast_buffers": False}
    )


def _init_sync(model_fn: ModelFn) -> dict[str, Any]:
    """DDP's start-up sync (verify the parameters' shapes on every rank, broadcast rank 0's
    parameters and buffers) left out where it copies nothing: every rank of this launch
    copies one model built once (``model_fn.same_on_every_rank``, gradcheck's prebuilt
    template, forked or sent whole to the ranks) — not under torchrun, whose processes
    each build their own. Public DDP argument (``init_sync``, torch 2.4 on); resnet18 on
    two gloo ranks: 0.1 s less per DDP run (measured 2026-11-27, docs/gradcheck.md)."""
    if torchrun_world() is not None or not getattr(model_fn, "same_on_every_rank", False):
        return {}
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    return (
        {"init_sync": False}
        if "init_sync" in inspect.signature(DistributedDataParallel.__init__).parameters
        else {}
    )


def _rank(
    rank: int,
    world: int,
    jobs: list[tuple[ModelFn, RunConfig]],
    inputs: Any,
    targets: torch.Tensor,
    origin: float,
) -> list[bytes | memoryview]:
    """One DDP rank: every job in turn, each under its run's numeric settings (set here,
    in the rank: a forked rank would keep the parent's, a fresh one torch's defaults),
    all returned as bytes (see :func:`pack`)."""
    results = []
    for model_fn, config in jobs:
        with numerics_of(config):
            results.append(_train(rank, world, model_fn, inputs, targets, config, origin))
    return pack({"jobs": results})


def _train(
    rank: int,
    world: int,
    model_fn: ModelFn,
    inputs: Any,
    targets: torch.Tensor,
    config: RunConfig,
    origin: float,
) -> dict[str, Any]:
    """One DDP run on this rank: build, wrap, train on the shard, return what happened
    (and the numeric settings it ran under)."""
    from torch.nn.parallel import DistributedDataParallel

    cuda = config.devices.kind == "cuda"
    own = config.devices.ids[local_index(rank)]  # this machine's device of this rank
    device = config.devices.torch_device(own)
    if cuda:
        torch.cuda.set_device(device)
    init_sync = _init_sync(model_fn)  # (asked before the build: a first build is no copy)
    model = build_model(model_fn, config.seed).to(device)
    if config.sync_batchnorm and cuda:
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    plain = 0
    if not cuda:  # the factory's own SyncBatchNorm: torch refuses it on CPU, as --sync-batchnorm is
        model, plain = plain_batchnorm(model)
    ddp = DistributedDataParallel(
        model,
        device_ids=[device.index] if cuda else None,
        find_unused_parameters=config.find_unused_parameters,
        **_buffer_sync(config.broadcast_buffers),
        **init_sync,
    )
    recorder = Recorder(enabled=config.watch, origin=origin)
    faults = FaultPlan.parse(config.faults)
    state = HookState(rank, world, faults)
    comm = CommTimes(world) if config.time_phases else None
    if config.watch or faults:
        ddp.register_comm_hook(state, watch_hook)
    elif comm is not None:
        ddp.register_comm_hook(comm, timed_hook)

    def forward(x: Any) -> Any:
        return call_model(ddp, x)

    stepper = Stepper(ddp.module, config, forward)
    initial = (
        {n: p.detach().cpu().clone() for n, p in ddp.module.named_parameters()}
        if config.steps > 1 and rank == 0
        else {}
    )
    shard_inputs, shard_targets = shard(inputs, rank, world), targets.chunk(world)[rank]
    timer: Timer = NO_TIMER
    if config.time_phases:  # bench: the shard on its device once (synthetic data)
        timer = stepper.timer = PhaseTimer(recorder, device, rank)
        if comm is not None and timer.cuda:
            comm.timer = timer
        if config.loader is None:
            shard_inputs, shard_targets = to_device(shard_inputs, device), shard_targets.to(device)
        reset_peak_memory(config.devices, (own,))
    losses, digests = [], []
    feed = Feed(config.loader, rank, world) if config.loader is not None else None
    with nondeterministic_alerts() as alerts, feed or contextlib.nullcontext():
        for step in range(1, config.steps + 1):
            state.step = step
            start = recorder.now()
            timer.begin(step)
            if feed is not None:
                with timer.phase("data"):
                    shard_inputs, shard_targets = feed.next()
            with timer.phase("copy"):
                micro = micro_batches(shard_inputs, shard_targets, config.accumulate, device)
            loss = stepper.step(
                step, micro, no_sync=ddp.no_sync, after_backward=lambda: state.flush(recorder)
            )
            timer.end(comm.take() if comm is not None else None)
            losses.append(loss)
            if recorder.enabled:
                recorder.steps.append(StepRecord(step, loss, start, recorder.now(), rank))
            if config.track_params:
                digests.append(digest(ddp.module))
    module = ddp.module
    lead = rank == 0  # the others' tensors are rank 0's after the all-reduce: send only theirs
    send_state = lead and config.keep_state
    return {
        "losses": losses,
        "plain_batchnorm": plain,
        "digests": digests,
        "grads": stepper.first_grads if lead else {},
        "params": {n: p.detach().cpu().clone() for n, p in module.named_parameters()} if send_state else {},
        "buffers": {n: b.detach().cpu().clone() for n, b in module.named_buffers()} if send_state else {},
        "recorder": recorder_to_data(recorder),
        "initial": initial,
        "numerics": Numerics.observe().to_json(),
        "nondeterministic": alerts,
        "timing": {
            "peak_memory": peak_memory(config.devices, (own,)),
            "threads": [torch.get_num_threads()],
            "host": hostname(),
        }
        if config.time_phases
        else {},
    }
