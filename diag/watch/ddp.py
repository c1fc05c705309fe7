"""DDP agreement: how each rank's own gradients are seen before the all-reduce
(:func:`grad_path`), the word every rank all-reduces (MIN) once a step so all learn the same
fault at the same step (:func:`agree`), and the check of a synchronised step
(:func:`check_synced`), which exchanges what each rank found only when a witness is not
finite. Functions of the watcher (:class:`gpudiag.watch.core.Watcher`, passed in: not
imported)."""

# No `from __future__ import annotations`: DDP checks the comm hook's annotations at runtime.
import functools
import math
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gpudiag.errors import InputError
from gpudiag.runtime.ddp import HookState, watch_hook
from gpudiag.runtime.stats import nonfinite_count, stored
from gpudiag.watch.found import PHASE_ORDER, Local, asdict_local
from gpudiag.watch.localize import diagnose, scaler_skip
from gpudiag.watch.outcome import conclude
from gpudiag.watch.torchapi import user_stacklevel
from gpudiag.watch.witness import bucket_gradients, grad_witness, sum32, tensor_version

_INF = math.inf


def grad_path(ddp: Any, comm_hook: bool | None) -> str:
    """How a DDP model's gradients are seen before the all-reduce:

    - ``before-finalize`` (default when DDP keeps gradients apart from its buckets, i.e.
      ``gradient_as_bucket_view=False``, torch's default): DDP keeps its C++ all-reduce (or
      the user's comm hook); at the end of the backward, before DDP's finalize copies the
      all-reduced buckets back, every gradient is still this rank's own — one fused pass;
    - ``bucket-hook`` (``comm_hook=True``, or by default with bucket views, where the
      all-reduce changes ``param.grad`` in place while the backward runs): the runtime's
      comm hook, torch's ``allreduce_hook`` plus each bucket's norm before it;
    - ``tensor-hooks`` (``comm_hook=False`` with bucket views): a Python hook per parameter.
    """
    views = bool(getattr(ddp, "gradient_as_bucket_view", True))
    if comm_hook is True or (comm_hook is None and views):
        return "bucket-hook"
    return "tensor-hooks" if views else "before-finalize"


@dataclass
class PreFinalize:
    """A DDP step's own gradients read at the end of its backward, before DDP's finalize:
    one witness per parameter, the gradients' in-place versions (to check that finalize
    came after), and on the CPU the non-finite ones counted exactly."""

    params: list[nn.Parameter]
    witness: torch.Tensor
    versions: list[tuple[torch.Tensor, int]]
    bad: list[tuple[torch.Tensor, int]] = field(default_factory=list)


@dataclass
class Agreement:
    """A DDP step's agreement word in flight: launched (MIN, async) at the end of the
    backward, before DDP's finalize, so waiting for the other ranks overlaps the wait DDP's
    finalize does anyway; ``parts``: this rank's witnesses it was made from (outputs, the
    gradients into them, gradients before the all-reduce), read back with its result."""

    work: Any
    words: torch.Tensor
    parts: list[torch.Tensor]
    n_out: int
    n_grad: int


@dataclass
class CommState:
    """The DDP comm hook's state: the runtime's :class:`HookState` and the watcher (None
    once closed: the hook is then torch's ``allreduce_hook``)."""

    hook: HookState
    group: Any
    watcher: Any = None  # weakref.ref[Watcher] | None


def bucket_hook(state: CommState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's ``allreduce_hook`` with the runtime's per-bucket statistics while watching."""
    watcher = state.watcher() if state.watcher is not None else None
    if watcher is None or watcher.done:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        return allreduce_hook(state.group, bucket)
    watcher._synced = True
    return watch_hook(state.hook, bucket)


def own_witnesses(watcher: Any) -> list[torch.Tensor] | None:
    """This DDP step's witnesses of each rank's own gradients before the all-reduce
    (per bucket, per gradient, or one vector), or None when this backward all-reduces
    nothing (no DDP, ``no_sync``)."""
    if watcher.ddp is None or watcher.done or watcher.closed or not watcher.ddp.require_backward_grad_sync:
        return None
    if watcher.grad_path == "before-finalize":
        return [watcher._pre.witness] if watcher._pre is not None else None
    if watcher.grad_path == "tensor-hooks":
        return [w for _, w in watcher._param_sums] if watcher._param_sums else None
    if watcher._comm is not None and watcher._synced:
        return [p.before[:1] for p in watcher._comm.hook.pending]
    return None


def agree(watcher: Any, befores: list[torch.Tensor]) -> Agreement:
    """Launch this step's agreement: per rank, the first step its own values went
    non-finite (this one if a witness is, or an earlier ``no_sync`` micro-step's) and
    the first step the all-reduce alone brought it non-finite values (found at an
    earlier step's end, see :func:`check_synced`); MIN over the ranks, asynchronously."""
    outs = [w for w, _, _ in watcher._outputs]
    parts = [t.reshape(-1).float() for t in [*outs, *watcher._out_grads, *befores]]
    device = parts[0].device if parts else watcher.device
    parts = [t.to(device) for t in parts]
    words = torch.full((2 * watcher.world,), _INF, dtype=torch.float32, device=device)
    prior = float(watcher._local.step) if watcher._local is not None else _INF
    if parts:
        bad = ~torch.isfinite(torch.cat(parts)).all()
        words[watcher.group_rank] = torch.where(bad, float(watcher.step), prior)
    else:
        words[watcher.group_rank] = prior
    if watcher._received_here is not None:
        words[watcher.world + watcher.group_rank] = float(watcher._received_here.step)
    work = None
    if not joining(watcher):
        work = dist.all_reduce(words, op=dist.ReduceOp.MIN, group=watcher.group, async_op=True)
    return Agreement(work, words, parts, len(outs), len(watcher._out_grads))


def joining(watcher: Any) -> bool:
    """Whether DDP runs under ``join()`` (uneven inputs: a rank out of data shadows only
    DDP's own collectives, so the watcher's would hang): then each rank judges what it
    saw, its own values and what the all-reduce brought it, and exchanges nothing.
    (DDP's ``_join_config``, guarded: a torch without it is taken as not joining.)"""
    config = getattr(watcher.ddp, "_join_config", None)
    return bool(getattr(config, "enable", False))


def read_before_finalize(watcher: Any) -> "PreFinalize":
    """Each rank's own gradients, witnessed in one pass before DDP copies the all-reduced
    values over them; on the CPU a non-finite one is counted exactly at once."""
    params = [p for p in watcher._params if p.grad is not None]
    grads: list[torch.Tensor] = [p.grad for p in params]
    witness = grad_witness(grads)
    pre = PreFinalize(params, witness, [(g, tensor_version(g)) for g in grads])
    if not witness.is_cuda:  # on the host already: name the bad ones while they are local
        for p, g, v in zip(params, grads, witness.tolist(), strict=True):
            if not math.isfinite(v) and (bad := nonfinite_count(g)):
                pre.bad.append((p, bad))
    return pre


def finalize_came_after(watcher: Any, pre: "PreFinalize") -> bool:
    """Whether DDP's finalize wrote the all-reduced gradients *after* this rank's own were
    read (what ``before-finalize`` rests on): it copies into each used gradient in place,
    so their in-place versions moved on. If none did, this torch orders its callbacks
    otherwise: say so once, and watch each gradient as it arrives from the next step.
    Checked until seen once (the order is the torch's, not the step's): a backward DDP
    does not all-reduce (a second one through a retained graph) moves nothing."""
    if watcher._order_seen or not pre.versions:
        return True
    if any(tensor_version(g) != v for g, v in pre.versions):
        watcher._order_seen = True
        return True
    warnings.warn(
        "gpudiag.watch: DDP's end-of-backward work ran before the watcher's on this torch "
        f"({torch.__version__}); from the next step each gradient is watched as it arrives "
        "(slower), and this step's gradients are judged after the all-reduce only",
        RuntimeWarning,
        stacklevel=user_stacklevel(),
    )
    watch_each_gradient(watcher)
    return False


def on_bucket(watcher: Any, bucket: dist.GradBucket, before: torch.Tensor) -> None:
    """Before the all-reduce: on the CPU the bucket's norm is on the host already, so
    a non-finite bucket's parameters are named now; on CUDA each gradient's norm is
    kept (one multi-tensor launch) and read only if the step goes bad."""
    grads = bucket_gradients(bucket)
    if before.is_cuda:
        norms = torch.stack([n.reshape(()) for n in torch._foreach_norm([stored(g) for g in grads])])
        watcher._bucket_norms.append((list(bucket.parameters()), norms))
        return
    if math.isfinite(float(before[0])):
        return
    for param, grad in zip(bucket.parameters(), grads, strict=True):
        bad = nonfinite_count(grad)
        if bad:
            name = watcher.names.get(id(param), "?")
            watcher._bad_params.append((len(watcher._bad_params), name, bad, grad.numel()))


def check_synced(watcher: Any, befores: list[torch.Tensor], results: list[torch.Tensor]) -> None:
    """DDP: the agreement launched at the end of the backward (or now, for a backward
    the watcher did not see end), what came back from the all-reduce (``results``),
    one read-back. A fault any rank's own values show is agreed on now, by every rank;
    values that only the all-reduce made non-finite here (every rank's own finite)
    are agreed on at the next step's agreement (or said at ``close()``)."""
    agreement, watcher._agreement = watcher._agreement, None
    if agreement is None:
        agreement = agree(watcher, befores)
    after = grad_witness(results) if results else None
    got_bad = (
        (~torch.isfinite(after).all()).float().reshape(1).to(agreement.words.device)
        if after is not None
        else torch.zeros(1, device=agreement.words.device)
    )
    alone = agreement.work is None
    if not alone:
        agreement.work.wait()
    flat = torch.cat([*agreement.parts, agreement.words, got_bad]).tolist()
    here_bad = flat[-1] > 0
    agreed = flat[-1 - 2 * watcher.world : -1]
    firsts, received = agreed[: watcher.world], agreed[watcher.world :]
    if all(math.isinf(v) for v in firsts + received):
        if here_bad and watcher._received_here is None:
            # every rank's own values were finite: the all-reduce made these, here
            watcher._received_here = received_fault(watcher, results)
            if alone and watcher._received_here is not None:  # nobody to tell later
                said, watcher._received_here = watcher._received_here, None
                conclude(watcher, said, [], [])
        return  # the usual step: nothing to see
    # Some rank saw a non-finite witness: every rank looks closer and all share it.
    n_out, n_grad = agreement.n_out, agreement.n_grad
    fwd = flat[:n_out]
    out_grads = flat[n_out : n_out + n_grad]
    local = watcher._local
    if local is None and math.isfinite(firsts[watcher.group_rank]):
        seen = flat[n_out + n_grad : len(flat) - 1 - 2 * watcher.world]
        local = diagnose(watcher, fwd, out_grads, synced_bad_grads(watcher, seen))
    got = watcher._received_here
    mine = {"local": asdict_local(local), "received": asdict_local(got), "rank": watcher.rank}
    views: list[Any] = [mine]
    if not alone:
        views = [None] * watcher.world
        dist.all_gather_object(views, mine, group=watcher.group)
    watcher._local = watcher._received_here = None
    origins = [v["local"] for v in views if v["local"] is not None]
    receivers = [v["received"] for v in views if v["received"] is not None]
    # the earliest step first; within it the earliest phase (a step's optimizer comes after
    # its all-reduce: parameters the optimizer made non-finite from gradients the all-reduce
    # broke are that all-reduce's doing); at one phase a rank's own fault first. Overflows
    # a GradScaler skips are noted one per step, and never hide a fault beside them.
    entries = sorted(
        [(d["step"], PHASE_ORDER.get(d["phase"], 0), 0, d["rank"], d) for d in origins]
        + [(d["step"], PHASE_ORDER.get(d["phase"], 0), 1, d["rank"], d) for d in receivers],
        key=lambda t: t[:4],
    )
    skipped = set()
    for step, _, kind, _, first in entries:
        if first["kind"] == "scaler-skip":
            if step not in skipped:
                skipped.add(step)
                conclude(watcher, Local(**first), [], [dict(v) for v in views])
            continue
        same = origins if kind == 0 else receivers
        also = [
            d["rank"] for d in same if d is not first and d["step"] == step and d["kind"] != "scaler-skip"
        ]
        arrived = kind == 0 and mine["local"] is None and first["rank"] != watcher.rank
        conclude(watcher, Local(**first), also, [dict(v) for v in views], arrived=arrived)
        return


def synced_bad_grads(watcher: Any, befores: list[float]) -> list[tuple[Any, int]]:
    """The parameters whose own (pre-all-reduce) gradients were non-finite."""
    pre = watcher._pre_read
    if pre is not None:  # before-finalize: counted already on the CPU, else by witness
        if pre.bad or not pre.witness.is_cuda:
            return list(pre.bad)
        return [(p, -1) for p, v in zip(pre.params, befores, strict=True) if not math.isfinite(v)]
    if watcher._param_sums:  # no comm hook: each gradient's sum as it arrived
        return [
            (p, -1) for (p, _), v in zip(watcher._param_sums, befores, strict=True) if not math.isfinite(v)
        ]
    if watcher._bucket_norms:  # CUDA: the kept per-gradient norms, read now
        out = []
        for params, norms in watcher._bucket_norms:
            for p, n in zip(params, norms.tolist(), strict=True):
                if not math.isfinite(n):
                    out.append((p, -1))
        return out
    by_name = {n: p for n, p in watcher.inner.named_parameters()}
    return [(by_name[name], bad) for _, name, bad, _ in watcher._bad_params if name in by_name]


def received_fault(watcher: Any, results: list[torch.Tensor]) -> Local | None:
    """What the all-reduce alone made non-finite here (exact count), or None. Under an
    enabled GradScaler it is an overflow the scaler skips (a compressing comm hook's
    fp16 overflowing is the usual one), noted, not a fault."""
    bad = sum(nonfinite_count(r) for r in results)
    if not bad:
        return None
    total = sum(r.numel() for r in results)
    return scaler_skip(
        watcher,
        Local(
            watcher.step,
            "all-reduce",
            "",
            str(watcher.device),
            f"{bad} of {total} gradient values came back non-finite from the all-reduce while every "
            "rank's own gradients were finite",
            watcher.rank,
        ),
    )


def attach(watcher: Any, comm_hook: bool | None) -> None:
    """Set a DDP model's watching up: how its gradients are seen (:func:`grad_path`), one
    run name for the job's records (its first rank's), and the comm hook or the per-parameter
    hooks where that way needs them."""
    watcher.grad_path = grad_path(watcher.ddp, comm_hook)
    if watcher.world > 1:  # one name for the job's records, its first rank's
        names = [watcher.run]
        first_rank = 0 if watcher.group is None else dist.get_global_rank(watcher.group, 0)
        dist.broadcast_object_list(names, src=first_rank, group=watcher.group)
        watcher.run = str(names[0])
    if watcher.grad_path == "bucket-hook":
        state = HookState(watcher.group_rank, watcher.world)
        state.on_bucket = functools.partial(on_bucket, watcher)
        watcher._comm = CommState(state, watcher.group, weakref.ref(watcher))
        try:
            watcher.ddp.register_comm_hook(watcher._comm, bucket_hook)
        except RuntimeError as exc:
            watcher.close()
            raise InputError(
                "gpudiag.watch registers a DDP communication hook, and this model has one already "
                f"({exc}); watch the model before registering yours, or pass comm_hook=False"
            ) from exc
    elif watcher.grad_path == "tensor-hooks":
        watch_each_gradient(watcher)


def watch_each_gradient(watcher: Any) -> None:
    """DDP's own all-reduce, each parameter's gradient summed as it arrives (a Python hook
    per parameter: the slowest way, for models whose gradients are bucket views)."""
    watcher.grad_path = "tensor-hooks"
    sums = watcher._param_sums

    def hook_for(param: torch.Tensor) -> Any:
        def hook(grad: torch.Tensor) -> None:
            if not watcher.done:
                sums.append((param, sum32(grad.detach()).reshape(1)))

        return hook

    for p in watcher._params:
        watcher._handles.append(p.register_hook(hook_for(p)))
