"""The watcher: hooks on the user's model that find the first non-finite value.

Cost model (a clean step; docs/watch.md has the figures):

- forwards: in one process on one device, what it takes to run the forward again (its
  arguments, generator and autocast state: :mod:`gpudiag.watch.replay`), replayed with the
  module hooks on only once a step goes bad; elsewhere each module's forward hook keeps a
  *reference* to its output (modules that could name nothing are not hooked: :func:`says_nothing`);
- the model's outputs get one float32 sum each (a witness: non-finite whenever any element
  is) and a node pre-hook that witnesses the gradient coming in from the loss (exactly:
  :func:`gpudiag.watch.witness.output_grad_witness`);
- gradients: under DDP each rank's own gradients are witnessed in one pass at the end of
  the backward, before DDP's finalize copies the all-reduced buckets over them (or as
  :func:`gpudiag.watch.ddp.attach` chose), and what came back after it; elsewhere one pass
  (on the CPU in one op, for a model of at most 2^22 trainable values:
  :func:`gpudiag.watch.witness.step_clean`; a sum per gradient beyond);
- at the end of each backward every witness is read back with **one** host sync; under
  DDP a word per rank (the first step its own values went non-finite, and the first it
  received non-finite from the all-reduce) is all-reduced (MIN) on the way.

Only when a witness is not finite does the watcher look closer (exact NaN/Inf counts of
the kept outputs, per-parameter gradients, the DataParallel transfers), and under DDP the
ranks then exchange what each saw (``all_gather_object``). A witness that overflowed on
finite values is found to be clean there, and not reported.
"""

# No `from __future__ import annotations`: DDP checks the comm hook's annotations at runtime.
import uuid
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gpudiag.errors import InputError
from gpudiag.hang import arm
from gpudiag.watch import replay as rp
from gpudiag.watch.ddp import (
    Agreement,
    CommState,
    PreFinalize,
    agree,
    attach,
    check_synced,
    finalize_came_after,
    own_witnesses,
    read_before_finalize,
)
from gpudiag.watch.found import Local
from gpudiag.watch.localize import check_local, settle_forward
from gpudiag.watch.outcome import MAX_SKIPS, SCALE_FLOOR, conclude, skip_limits
from gpudiag.watch.record import NonFiniteReport
from gpudiag.watch.torchapi import end_of_backward_callback as _end_of_backward_callback
from gpudiag.watch.torchapi import on_gradient
from gpudiag.watch.unwrap import unwrap
from gpudiag.watch.witness import (
    float_tensors,
    grad_state,
    one_pass_fits,
    output_grad_witness,
    output_witness,
    tensor_version,
)

MODES = ("raise", "warn", "record")
#: model → a weak reference to its open watcher (neither is kept alive by this table)
_WATCHING: "weakref.WeakKeyDictionary[nn.Module, weakref.ref[Watcher]]" = weakref.WeakKeyDictionary()
#: Module outputs kept per step at most (beyond it, forward localisation stops for the step).
TRAIL_LIMIT = 100_000
#: Forwards kept awaiting one backward (several losses, then one backward); beyond, the
#: oldest are let go (a forward whose backward never comes keeps nothing for long).
MAX_FORWARDS = 8


class Watcher:
    """Watches a model for the first non-finite value; see :func:`watch`."""

    def __init__(
        self,
        model: nn.Module,
        on_nonfinite: str = "raise",
        *,
        scaler: Any = None,
        root: nn.Module | None = None,
        record_dir: str | Path | bool | None = None,
        localize: bool | str = True,
        comm_hook: bool | None = None,
        max_skips: int = MAX_SKIPS,
        scale_floor: float = SCALE_FLOOR,
        hang_timeout: float | None = None,
        hang_dir: str | Path | None = None,
    ):
        if on_nonfinite not in MODES:
            raise InputError(f"on_nonfinite={on_nonfinite!r}: expected one of {', '.join(MODES)}")
        self.max_skips, self.scale_floor = skip_limits(max_skips, scale_floor)
        self._skips = 0  # GradScaler updates skipped in a row (no clean backward between)
        self._skip_scale: float | None = None  # the scale at the last of them
        self._skip_first: NonFiniteReport | None = None  # the first of them
        self._skipped_now = False  # this backward's check noted a skip
        #: autograd's end-of-backward queue (refused here, not in the middle of the user's backward)
        self._queue = _end_of_backward_callback()
        if not isinstance(model, nn.Module):
            raise InputError(f"gpudiag.watch needs a torch.nn.Module, got {type(model).__name__}")
        ref = _WATCHING.get(model)
        earlier = ref() if ref is not None else None
        if earlier is not None and not getattr(earlier, "closed", True):
            raise InputError(
                "this model is watched already: close() the first watcher (or use it) — two would "
                "hook every module twice"
            )
        #: the hang watchdog (hang_timeout), checked here, started last, stopped by close()
        self._hang = arm.for_watch(hang_timeout, hang_dir)
        self.model, self.mode, self.scaler = model, on_nonfinite, scaler
        _WATCHING[model] = weakref.ref(self)
        self._record_dir = record_dir
        wrappers = unwrap(model)
        self.ddp, self.dp, self.vdp = wrappers.ddp, wrappers.dp, wrappers.vdp
        self.compiled, inner = wrappers.compiled, wrappers.inner
        self.inner = root if root is not None else inner
        self.placement = "ddp" if self.ddp is not None else "dp" if self.dp is not None else "single"
        if self.vdp is not None:
            self.placement = "dp-virtual"
        self.group = self.ddp.process_group if self.ddp is not None else None
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if distributed else 0
        self.group_rank = dist.get_rank(self.group) if self.ddp is not None else 0
        self.world = dist.get_world_size(self.group) if self.ddp is not None else 1
        first = next(iter(self.inner.parameters()), None)
        self.device = first.device if first is not None else torch.device("cpu")
        self.names = {id(p): n for n, p in self.inner.named_parameters()}
        self.owner = {id(p): n.rpartition(".")[0] for n, p in self.inner.named_parameters()}
        self.index = {id(p): i for i, p in enumerate(self.inner.parameters())}
        self.blind: list[str] = []
        if self.compiled:
            self.blind.append(
                "torch.compile: the modules inside the compiled model are not watched one by one "
                "(a forward fault is named at the model's output; gradients still per parameter)"
            )
        #: how a forward fault is traced to its module: "replay", "trail" or "off" (see
        #: :func:`watch`; "off" for a compiled model too, whose `blind` says so)
        self.localize = rp.choose(localize, self.placement, self.compiled, self.inner is model)
        if localize is False:
            self.blind.append("localize=False: forward faults are named at the model's output")
        #: replay: the generators a forward draws from, the device types whose autocast it runs under
        self._gens = rp.generators(self.device) if self.localize == "replay" else []
        self._autocast = rp.autocast_devices(self.device)
        self._draws = rp.Draws(self._gens)  # replay: which generators the forwards draw from

        self.step = 0  # backward passes completed
        #: this run's name in its records (under DDP the first rank's, agreed on at watch())
        self.run = uuid.uuid4().hex[:12]
        self.done = False  # the first fault was reported: nothing more is checked
        self.closed = False
        self.report: NonFiniteReport | None = None
        self.events: list[NonFiniteReport] = []  # the fault and every GradScaler-skipped overflow
        self._handles: list[Any] = []
        #: this forward's module calls as the hooks saw them: Seen's fields as a tuple (a
        #: tuple is quicker to make, and almost never read: :func:`gpudiag.watch.localize.seen_calls`)
        self._trail: list[tuple[Any, ...]] = []
        #: the module paths of this step's forwards let go already, in the order they ran
        self._order: list[list[str]] = []
        self._early: Local | None = None  # a forward fault found as the forward ended (CPU)
        #: an output held an Inf but no NaN (masked logits): judged by the gradients, so on the
        #: CPU the module outputs are kept to the end of the backward to name it if they go bad
        self._holding = False
        self._inputs: list[Any] = []
        #: replay: this step's training forwards as they began (what it takes to run them again)
        self._captures: list[rp.Capture] = []
        self._replaying = False  # the watcher's own replay of a forward is running
        self._replayed = False  # replay: this step's forwards were replayed (the trail holds them)
        self._replay_error: str | None = None  # why they could not be (the model's exception)
        #: on the CPU, the witnesses of this step's outputs as read when each forward ended
        self._fwd_host: list[float] = []
        self._fwd_device = False  # a witness of this step is on an accelerator (not read yet)
        self._outputs: list[tuple[torch.Tensor, Any, str]] = []  # (witness, output, name) per root forward
        self._out_grads: list[torch.Tensor] = []
        self._leaf_hooks: list[Any] = []  # this step's hooks on outputs that are leaves
        self._awaiting = False  # a forward whose outputs need gradients ran; no backward yet
        self._eval = False  # the model's current forward runs in eval mode
        self._only_eval = True  # everything kept since the last step came from eval-mode forwards
        self._forwards = 0  # forwards of the model since the last check
        self._queued = False
        self._grads_before: tuple[Any, ...] | None = None  # the gradients as this backward began
        self._out_grads_mark = 0
        self._synced = False
        self._dirty = False
        self._bad_params: list[tuple[int, str, int, int]] = []  # (bucket order, name, bad, numel)
        self._bucket_norms: list[tuple[list[torch.Tensor], torch.Tensor]] = []
        self._local: Local | None = None  # a no_sync micro-step's local fault, not yet agreed
        self._pre_read: PreFinalize | None = None  # this step's before-finalize read, while checked
        self._agreement: Agreement | None = None  # this step's agreement word, in flight
        self._order_seen = False  # DDP's finalize was seen to come after the before-finalize read
        self._received_here: Local | None = None  # what the all-reduce alone corrupted here, not yet agreed

        self._handles.append(model.register_forward_pre_hook(self._pre_root, with_kwargs=True))
        if self.localize == "trail":
            rp.hook_modules(self)
        # after the module hooks: where the model is its own root, its output is kept first
        self._handles.append(model.register_forward_hook(self._post_root))
        self._comm: CommState | None = None
        self._param_sums: list[tuple[torch.Tensor, torch.Tensor]] = []  # (parameter, its gradient's sum)
        self._params = [p for p in self.inner.parameters() if p.requires_grad]
        #: every parameter, listed once (walking the modules costs ~0.1 ms a step)
        self._all_params = list(self.inner.parameters())
        self._one_pass = one_pass_fits(self._all_params)  # a CPU step read in one pass (not large)
        self._pre: PreFinalize | None = None
        #: how DDP gradients are seen before the all-reduce (see :func:`watch`): "before-finalize",
        #: "bucket-hook" or "tensor-hooks"; "local" without DDP
        self.grad_path = "local"
        if self.ddp is not None:
            attach(self, comm_hook)
        if self._hang is not None:
            arm.start(self._hang)

    # -- hooks -------------------------------------------------------------------------

    def _module_hook(self, path: str) -> Any:
        trail = self._trail

        grad_enabled = torch.is_grad_enabled
        vdp = self.vdp

        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            # Run by every module on every forward: kept to a few attribute reads and one append.
            if (
                self.done
                or self._eval
                or not (grad_enabled() or self._replaying)
                or len(trail) >= TRAIL_LIMIT
            ):
                return
            versions: tuple[int, ...]
            if type(output) is torch.Tensor:  # the usual case, without the generator
                versions = (getattr(output, "_version", -1),) if output.is_floating_point() else ()
            else:
                versions = tuple(tensor_version(t) for t in float_tensors(output))
            trail.append((path, module, inputs, output, vdp.transport.replica if vdp else None, versions))

        return hook

    def _pre_root(self, module: nn.Module, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.done or self._replaying or not torch.is_grad_enabled():
            return
        self._forwards += 1
        evaluating = not module.training
        if not self._queued and (
            not self._awaiting or self._forwards > MAX_FORWARDS or (self._only_eval and not evaluating)
        ):
            # A new step, or forwards whose backward never came (evaluation with gradients
            # on, a skipped batch): what they kept is let go.
            self._let_go()
            self._awaiting, self._forwards, self._only_eval = False, 1, True
        # A forward in eval mode (validation that forgot torch.no_grad) keeps nothing but its
        # output's witness: no module outputs, no inputs, no reference to its output.
        self._eval = evaluating
        if not evaluating:
            self._only_eval = False
            self._inputs.append((inputs, kwargs) if kwargs else inputs)
            if self._gens:
                self._captures.append(rp.capture(inputs, kwargs, self._autocast, self._draws))

    def _post_root(self, module: nn.Module, inputs: Any, output: Any) -> None:
        if self._captures and self._captures[-1].probe:  # (a forward probed for draws)
            self._draws.ended(self._captures[-1])
        if not self._replaying:
            self.observe(output, "")

    def observe(self, output: Any, name: str = "<loss>") -> None:
        """Watch ``output`` (a loss, or the model's output) like the model's own outputs: a
        witness now, and a gradient hook that checks the step once its backward is over.
        Integrations whose framework computes the loss outside ``model(...)`` (Lightning's
        ``training_step``) pass it here; ``name`` is what a fault first seen in it is called."""
        if self.done or self.closed or not torch.is_grad_enabled():
            return
        if name and self.localize == "replay" and not self._forwards:  # the model was not called
            rp.hook_modules(self)
        if type(output) is torch.Tensor:  # the usual case, without the generator
            tensors = [output] if output.is_floating_point() or output.is_complex() else []
        else:
            tensors = list(float_tensors(output))
        if not tensors:
            return
        self._dirty = True
        witness = output_witness(tensors)
        self._outputs.append((witness, None if self._eval else output, name))
        for t in tensors:
            if t.requires_grad:
                self._awaiting = True
                handle = on_gradient(t, self._on_output_grad, self._on_first_grad)
                if handle is not None:  # (a leaf's tensor hook: removed as the step is let go)
                    self._leaf_hooks.append(handle)
        if witness.is_cuda:
            self._fwd_device = True
            if self._captures and self._captures[-1].versions is None:  # judged after the backward
                self._captures[-1].versions = rp.param_versions(self._all_params)
        else:
            settle_forward(self, witness)

    def _on_first_grad(self, grads: tuple[torch.Tensor | None, ...]) -> None:
        """The node pre-hook of an output that is its node's first (:func:`on_gradient`)."""
        self._on_output_grad(grads[0] if grads else None)

    def _on_output_grad(self, grad: torch.Tensor | None) -> None:
        if self.done:
            return
        if not self._queued:  # the first output this backward reaches
            self._queued, self._dirty = True, True
            # grad mode inside a backward is its create_graph: a gradient penalty's autograd.grad
            self._grads_before = grad_state(self._params) if torch.is_grad_enabled() else None
            self._out_grads_mark = len(self._out_grads)
            # Runs once the backward is over; it queues the check behind DDP's own
            # end-of-backward work (queued later), so the all-reduced gradients are in place.
            self._queue(self._end_of_backward)
        if grad is not None:  # None: an output the loss does not use (DDP's unused-parameter search)
            self._out_grads.append(output_grad_witness(grad))

    def _end_of_backward(self) -> None:
        """The first end-of-backward callback, queued as the backward reached the model's
        outputs, so before DDP's own (its reducer queues ``finalize_backward`` once the last
        bucket is ready, reducer.cpp): under ``before-finalize`` each rank's own gradients
        are still in ``param.grad`` here, the all-reduced ones only in DDP's buckets.

        A backward with ``create_graph=True`` that accumulated no gradient (a gradient
        penalty's ``torch.autograd.grad`` before the real backward) is not a step: nothing is
        checked or let go. Any other backward is (``autograd.grad`` whose gradients the loop
        assigns itself, an optimizer stepping inside the backward that empties ``.grad``)."""
        before, self._grads_before = self._grads_before, None
        if before is not None and before == grad_state(self._params):
            self._queued = False
            del self._out_grads[self._out_grads_mark :]
            return
        if self.ddp is None:  # nothing of DDP's to wait for: the check now
            self.after_backward()
            return
        if (
            self.grad_path == "before-finalize"
            and not self.done
            and not self.closed
            and self.ddp.require_backward_grad_sync
        ):
            self._pre = read_before_finalize(self)
        befores = own_witnesses(self)
        if befores is not None:
            self._agreement = agree(self, befores)
        self._queue(self.after_backward)

    # -- the check at the end of each backward -----------------------------------------

    def after_backward(self) -> None:
        """Check the step that just finished its backward (called by the watcher itself at
        the end of every backward that went through the model's outputs; integrations whose
        framework calls the model otherwise call it after backward)."""
        self._queued = False
        if self.done or self.closed:
            return
        befores = own_witnesses(self)  # (None: nothing all-reduced this backward)
        pre, self._pre, self._synced = self._pre, None, False
        if pre is not None and not finalize_came_after(self, pre):
            pre = PreFinalize([], torch.zeros(0), [])  # what was read came back from the all-reduce
        pending = self._comm.hook.pending if self._comm is not None else []
        if self._comm is not None:
            self._comm.hook.pending = []
        if not (self._dirty or befores is not None or self._trail):
            return
        self._dirty = False
        try:
            if befores is None:
                local = check_local(self)
                if self.ddp is not None:  # no_sync: agreed on at the next synchronised backward
                    if local is not None and self._local is None:
                        self._local = local
                elif local is not None:
                    conclude(self, local, [], [])
            elif self._comm is not None:
                check_synced(self, befores, [p.result for p in pending if p.result is not None])
            else:
                self._pre_read = pre
                check_synced(self, befores, [p.grad for p in self._params if p.grad is not None])
        finally:
            self._awaiting, self._forwards = False, 0
            self._let_go()
            self._bad_params.clear()
            self._bucket_norms.clear()
            self._param_sums.clear()
            self._pre_read = None
            if not self._skipped_now and self._local is None:  # a clean step ends a run of skips
                self._skips, self._skip_scale, self._skip_first = 0, None, None
            self._skipped_now = False
            self.step += 1
            if self._comm is not None:  # the runtime's fault plan counts steps from 1
                self._comm.hook.step = self.step + 1

    def _let_go(self) -> None:
        """Forget what this step's forwards kept."""
        self._trail.clear()
        self._inputs.clear()
        self._captures.clear()
        self._replayed, self._replay_error = False, None
        self._outputs.clear()
        self._fwd_host.clear()
        self._fwd_device = False
        self._out_grads.clear()
        for handle in self._leaf_hooks:
            handle.remove()
        self._leaf_hooks.clear()
        self._order.clear()
        self._early = None
        self._holding = False

    # -- lifetime ----------------------------------------------------------------------

    def close(self) -> None:
        """Remove every hook. DDP cannot unregister a communication hook: from now on ours
        does exactly what torch's ``allreduce_hook`` does, with nothing kept. Values the
        all-reduce alone made non-finite on this rank at the last step, or that a last
        ``no_sync`` micro-step made, which no later step's agreement told the other ranks,
        are reported here by this rank alone (the record and a warning: close() does not
        raise)."""
        for pending in (self._local, self._received_here):  # (a no_sync micro-step's, too)
            if pending is not None and not self.done and not self.closed:
                conclude(self, pending, [], [], raising=False)
        self._local = self._received_here = None
        if self._hang is not None:
            arm.stop(self._hang)
            self._hang = None
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._comm is not None:
            self._comm.watcher = None
        self.closed = True
        ref = _WATCHING.get(self.model)
        if ref is not None and ref() is self:
            del _WATCHING[self.model]
        self._let_go()

    def __enter__(self) -> "Watcher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"step {self.step}"
        found = f", {self.report.message()}" if self.report is not None else ""
        return f"<gpudiag.watch {self.placement}, rank {self.rank}/{self.world}, {state}{found}>"


def watch(
    model: nn.Module,
    on_nonfinite: str = "raise",
    *,
    scaler: Any = None,
    root: nn.Module | None = None,
    record_dir: str | Path | bool | None = None,
    localize: bool | str = True,
    comm_hook: bool | None = None,
    max_skips: int = MAX_SKIPS,
    scale_floor: float = SCALE_FLOOR,
    hang_timeout: float | None = None,
    hang_dir: str | Path | None = None,
) -> Watcher:
    """Watch ``model`` (a module, ``DistributedDataParallel``, ``nn.DataParallel``,
    ``VirtualDataParallel`` or ``torch.compile``\\ d) for the first non-finite value.

    ``on_nonfinite``: ``"raise"`` (:class:`NonFiniteError` from ``backward()`` on every
    rank), ``"warn"`` (:class:`NonFiniteWarning`) or ``"record"`` (only ``watcher.report``
    and the JSON record). ``scaler``: the ``torch.amp.GradScaler`` in use — a gradient
    overflow it skips is noted in ``watcher.events`` as ``scaler-skip``, not reported as a
    fault — until ``max_skips`` (20) optimizer steps in a row were skipped, or one at a scale
    below ``scale_floor`` (2**-14): then the run of skips is the fault. ``root``: the module
    whose paths name modules (default: the model inside its wrappers). ``record_dir``: where
    ``watch-rank<R>.json`` goes on a fault (default ``$GPUDIAG_WATCH_DIR`` or
    ``./gpudiag-watch``; False: none; a link or a FIFO there is warned about, not written).
    ``localize``: how a forward fault is traced to its module — True (default): ``"replay"``
    in one process on one device, else ``"trail"``; ``"trail"``: every module's forward hook
    keeps a reference to its output, every step; ``"replay"``: a faulty step's forward runs
    again with the hooks on (:mod:`gpudiag.watch.replay`: its side effects run twice);
    False: neither (named at the model's output).
    ``comm_hook`` (DDP): None (default) leaves DDP's own C++ all-reduce (or your comm hook)
    alone and reads each rank's gradients once at the end of the backward, before DDP's
    finalize overwrites them — unless the model has ``gradient_as_bucket_view=True``, then
    the watcher's comm hook; True: always the comm hook (torch's ``allreduce_hook`` plus
    each bucket's norm); False: never a comm hook (with bucket views, a hook per
    parameter). See docs/watch.md: cost.
    ``hang_timeout`` (s): also arm ``gpudiag run``'s hang watchdog, its dumps into
    ``hang_dir`` (default ``./gpudiag-hang``); ``close()`` stops it (docs/hang.md).

    Create it after wrapping the model in DDP and before the first backward."""
    options: dict[str, Any] = dict(scaler=scaler, root=root, record_dir=record_dir, localize=localize)
    limits: dict[str, Any] = dict(max_skips=max_skips, scale_floor=scale_floor, hang_timeout=hang_timeout)
    options.update(comm_hook=comm_hook, hang_dir=hang_dir)
    return Watcher(model, on_nonfinite, **options, **limits)
