"""The watcher: hooks on the user's model that find the first non-finite value.

Cost model (a clean step):

- every module's forward hook keeps a *reference* to its output (no computation; the
  tensors are the ones autograd keeps for backward anyway) — only read when a step goes
  bad, to name the first module whose output was non-finite; modules whose hook could
  name nothing are not hooked (:func:`_says_nothing`);
- the model's outputs get one float32 sum each (a witness: non-finite whenever any element
  is) and a gradient hook whose sum witnesses the gradient coming in from the loss;
- gradients: under DDP, each rank's own gradients are witnessed in one pass at the end of
  the backward, before DDP's finalize copies the all-reduced buckets over them (DDP keeps
  its C++ all-reduce; :func:`_grad_path` names the other ways, for bucket-view gradients),
  and what came back is witnessed after it; elsewhere (single device, DataParallel,
  ``no_sync`` micro-steps) one witness per parameter gradient (:func:`_grad_witness`),
  on the CPU a few over all of them (:func:`_host_witnesses`);
- at the end of each backward every witness is read back with **one** host sync; under
  DDP a word per rank (the first step its own values went non-finite, and the first it
  received non-finite from the all-reduce) is all-reduced (MIN) on the way, so every rank
  learns the same thing at the same step.

Only when a witness is not finite does the watcher look closer (exact NaN/Inf counts of
the kept outputs, per-parameter gradients, the DataParallel transfers), and under DDP the
ranks then exchange what each saw (``all_gather_object``). A witness that overflowed on
finite values is found to be clean there, and not reported.
"""

# No `from __future__ import annotations`: DDP checks the comm hook's annotations at runtime.
import functools
import math
import sys
import uuid
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gpudiag.errors import CannotRunHere, InputError
from gpudiag.runtime.ddp import HookState, watch_hook
from gpudiag.runtime.stats import nonfinite_count, stored
from gpudiag.watch.record import (
    NonFiniteError,
    NonFiniteReport,
    NonFiniteWarning,
    Transfer,
    record_dir,
    write_record,
)

MODES = ("raise", "warn", "record")
#: model → a weak reference to its open watcher (neither is kept alive by this table)
_WATCHING: "weakref.WeakKeyDictionary[nn.Module, weakref.ref[Watcher]]" = weakref.WeakKeyDictionary()
#: Module outputs kept per step at most (beyond it, forward localisation stops for the step).
TRAIL_LIMIT = 100_000
#: Forwards kept awaiting one backward (several losses, then one backward); beyond, the
#: oldest are let go (a forward whose backward never comes keeps nothing for long).
MAX_FORWARDS = 8
#: GradScaler: skipped optimizer steps in a row (no clean backward between them) after which
#: the skips are reported as a fault — a healthy run's scale falls from 2**16 to what its
#: gradients need in a dozen or so halvings; twenty in a row is a gradient that stays
#: non-finite at every scale (``max_skips=``).
MAX_SKIPS = 20
#: GradScaler: a skip at a scale below this is reported as a fault, in a row or not
#: (``scale_floor=``): float16's smallest normal number, 2**-14 — gradients that overflow
#: even scaled down 16384 times are not an overflow the scaler can fix.
SCALE_FLOOR = 2.0**-14
_INF = math.inf


@dataclass(slots=True)
class _Seen:
    """One module's forward call: what it got and gave (references, not copies)."""

    path: str
    module: nn.Module
    inputs: Any
    output: Any
    replica: int | None  # VirtualDataParallel: the virtual device running this replica
    versions: tuple[int, ...] = ()  # the output tensors' in-place versions when returned

    def changed_since(self, later: list["_Seen"]) -> bool:
        """Whether the output was modified in place after the module returned it by code
        that is not a watched module (ResNet's ``out += identity``): its values then are not
        what the module produced. A watched in-place module that took it next (``ReLU(inplace=
        True)``: the same tensor, one version on) changed nothing that matters here."""
        now = tuple(_version(t) for t in _tensors(self.output))
        if not self.versions or now == self.versions:
            return False
        for i, seen in enumerate(later):
            if seen.output is self.output:
                return seen.versions != tuple(v + 1 for v in self.versions) or seen.changed_since(
                    later[i + 1 :]
                )
        return True


@dataclass
class _Local:
    """What this rank saw go non-finite first (sent to the other ranks on a fault)."""

    step: int
    phase: str
    module: str
    device: str
    detail: str
    rank: int
    transfer: dict[str, Any] | None = None
    kind: str = "fault"
    blind: list[str] = field(default_factory=list)


@dataclass
class _PreFinalize:
    """A DDP step's own gradients read at the end of its backward, before DDP's finalize:
    one witness per parameter, the gradients' in-place versions (to check that finalize
    came after), and on the CPU the non-finite ones counted exactly."""

    params: list[nn.Parameter]
    witness: torch.Tensor
    versions: list[tuple[torch.Tensor, int]]
    bad: list[tuple[torch.Tensor, int]] = field(default_factory=list)


def _grad_path(ddp: Any, comm_hook: bool | None) -> str:
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
class _Agreement:
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
class _CommState:
    """The DDP comm hook's state: the runtime's :class:`HookState` and the watcher (None
    once closed: the hook is then torch's ``allreduce_hook``)."""

    hook: HookState
    group: Any
    watcher: Any = None  # weakref.ref[Watcher] | None


def _bucket_hook(state: _CommState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's ``allreduce_hook`` with the runtime's per-bucket statistics while watching."""
    watcher = state.watcher() if state.watcher is not None else None
    if watcher is None or watcher.done:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        return allreduce_hook(state.group, bucket)
    watcher._synced = True
    return watch_hook(state.hook, bucket)


def _end_of_backward_callback() -> Any:
    """Autograd's "run this once the current backward is over" (``queue_callback`` of the
    execution engine: torch internals, which DDP's reducer and FSDP rely on too), guarded:
    a torch without it cannot be watched, said when ``watch`` is called."""
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    queue = getattr(engine, "queue_callback", None)
    if not callable(queue):
        raise CannotRunHere(
            f"gpudiag.watch needs autograd's end-of-backward callback, which torch {torch.__version__} "
            "does not have (torch.autograd.Variable._execution_engine.queue_callback)"
        )
    return queue


def _version(t: torch.Tensor) -> int:
    """A tensor's in-place version counter (``Tensor._version``, what autograd checks saved
    tensors against), guarded: -1 where a torch has none, so nothing counts as changed."""
    return int(getattr(t, "_version", -1))


#: Where in a step each phase comes (the order a fault's consequences follow it in).
_PHASE_ORDER = {"input": 0, "transfer": 1, "forward": 1, "backward": 2, "all-reduce": 3, "optimizer": 4}

#: Packages whose frames a warning skips to point at the user's line (``loss.backward()``).
_LIBRARIES = ("gpudiag", "torch", "lightning", "pytorch_lightning", "transformers", "accelerate")


def _user_stacklevel() -> int:
    """The ``stacklevel`` for a warning raised from inside the watcher that points at the
    first frame outside gpudiag, torch and the training libraries: the user's
    ``loss.backward()`` (or ``trainer.fit``). Python 3.12's ``skip_file_prefixes``, by hand."""
    frame = sys._getframe(1)  # the caller of this function: warnings.warn's caller
    level = 1
    while frame is not None:
        module = str(frame.f_globals.get("__name__", ""))
        if module.partition(".")[0] not in _LIBRARIES:
            return level
        frame, level = frame.f_back, level + 1  # type: ignore[assignment]
    return 1


#: Activations that make a finite output of a finite input (bounded, or at most |x|): a
#: non-finite value never arises in them, so their forward hooks (what a hook costs is most
#: of what watching costs a small model: torch's slow call path) would name nothing.
_CANNOT_ARISE = (
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.GELU,
    nn.SiLU,
    nn.Sigmoid,
    nn.Tanh,
    nn.Hardtanh,
    nn.Hardswish,
    nn.Hardsigmoid,
    nn.ELU,
)


def _says_nothing(module: nn.Module) -> bool:
    """Whether a module's forward hook could never name a fault's origin, so it is not
    hooked: an ``nn.Sequential`` (its output is its last child's, its input its first's),
    ``nn.Identity``, and the activations of :data:`_CANNOT_ARISE` unless ``inplace`` (an
    in-place one is hooked: it tells a module's output changed by it from one changed by
    other code, :meth:`_Seen.changed_since`)."""
    kind = type(module)
    if kind is nn.Sequential or kind is nn.Identity:
        return True
    return kind in _CANNOT_ARISE and not getattr(module, "inplace", False)


@functools.cache
def _versioned() -> bool:
    """Whether this torch's tensors have in-place version counters (see :func:`_version`)."""
    return _version(torch.zeros(1)) >= 0


def _tensors(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """Floating-point tensors inside an output (tensors, tuples, lists, dicts, ModelOutput)."""
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() or obj.is_complex():
            yield obj
    elif depth < 4 and isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _tensors(item, depth + 1)
    elif depth < 4 and isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item, depth + 1)


def _bad_count(obj: Any, nan_only: bool = False) -> tuple[int, int]:
    """(NaN/Inf count, element count) over the floating tensors of ``obj`` (exact; slow
    path); with ``nan_only`` the NaN count."""
    bad = total = 0
    for t in _tensors(obj):
        data = t.detach()
        bad += int((torch.isnan(data) if nan_only else ~torch.isfinite(data)).sum())
        total += data.numel()
    return bad, total


def _bucket_gradients(bucket: dist.GradBucket) -> list[torch.Tensor]:
    """The gradients of a DDP bucket's parameters, one per parameter: views into a dense
    bucket's buffer; a sparse gradient (``nn.Embedding(sparse=True)``) is a bucket of its
    own, whose buffer is the gradient (``gradients()`` then lists nothing)."""
    grads = bucket.gradients()
    if not grads and len(bucket.parameters()) == 1:
        return [bucket.buffer()]
    return grads


def _has_nan(obj: Any) -> bool:
    """Whether any floating tensor of ``obj`` holds a NaN (exact; slow path)."""
    return any(bool(torch.isnan(t.detach()).any()) for t in _tensors(obj))


def _grad_witness(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One float32 value per gradient, non-finite whenever any of its elements is: the
    norms in one multi-tensor launch on CUDA, sums on the CPU (a sum is the cheapest full
    pass there: 2.7 ms for resnet18's 62 gradients on one core, against 3.5 ms for
    ``torch._foreach_norm`` and 3.4 ms for sums with ``dtype=float32``, which only
    half-precision gradients need). A value that overflowed on finite elements is found
    clean by the exact count taken only then."""
    if not tensors:
        return torch.zeros(0)
    with torch.no_grad():
        if tensors[0].is_cuda:
            return torch.stack(
                [n.reshape(()) for n in torch._foreach_norm([stored(t) for t in tensors])]
            ).float()
        return _witness(tensors)


def _host_witnesses(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """A few 0-dimensional float values over CPU gradients, one of them non-finite whenever
    any gradient element is (which gradient: :func:`_grad_witness`, taken only then). A
    small model's step is made of per-tensor costs — each reduction torch starts costs about
    4 us on the CPU whatever its size, and a small transformer has 29 gradients — so: the
    1-dimensional gradients (biases, norms' weights: most of them, and small) concatenated
    and summed in one reduction, the others' norms in one call (``torch._foreach_norm``,
    its loop in C++), a sum per gradient for half precision (whose norm would overflow
    float16 where the values do not) or a torch without it. A value that overflowed on
    finite elements is found clean by the exact count taken only then."""
    if not grads:
        return []
    norms = getattr(torch, "_foreach_norm", None)  # (private: a torch without it sums)
    with torch.no_grad():
        if norms is None or grads[0].dtype not in (torch.float32, torch.float64):
            return [_sum32(g) for g in grads]
        flat = [g for g in grads if g.dim() == 1]
        rest = [g for g in grads if g.dim() != 1] if flat else grads
        out = list(norms(rest)) if rest else []
        if len(flat) > 1:
            out.append(torch.cat(flat).sum())
        elif flat:
            out.append(flat[0].sum())
        return out


def _witness(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One float32 value per tensor, non-finite whenever any of its elements is: a
    0-dimensional tensor for one tensor (the usual model output: one op), else a vector."""
    with torch.no_grad():
        if len(tensors) == 1:
            return _sum32(tensors[0])
        return torch.stack([_sum32(t) for t in tensors])


def _sum32(t: torch.Tensor) -> torch.Tensor:
    """A tensor's sum as a 0-dimensional float32 tensor: float32 summed as it is, half
    precision accumulated in float32, float64 summed then rounded, complex over its parts.
    (One op for float32: each op costs several microseconds from Python in a training
    step, which is what a watched small model's steps are made of.)"""
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.dtype == torch.float32:
        return t.sum()
    if t.dtype == torch.float64:
        return t.sum().float()
    return t.sum(dtype=torch.float32)


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
        localize: bool = True,
        comm_hook: bool | None = None,
        max_skips: int = MAX_SKIPS,
        scale_floor: float = SCALE_FLOOR,
    ):
        if on_nonfinite not in MODES:
            raise InputError(f"on_nonfinite={on_nonfinite!r}: expected one of {', '.join(MODES)}")
        if isinstance(max_skips, bool) or not isinstance(max_skips, int) or max_skips < 1:
            raise InputError(f"max_skips={max_skips!r}: expected a whole number of steps, 1 or more")
        if not isinstance(scale_floor, (int, float)) or not 0 <= scale_floor < _INF:
            raise InputError(f"scale_floor={scale_floor!r}: expected a finite scale, 0 or more")
        self.max_skips, self.scale_floor = max_skips, float(scale_floor)
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
        from torch.nn.parallel import DistributedDataParallel

        from gpudiag.runtime.dp import VirtualDataParallel

        self.model, self.mode, self.scaler = model, on_nonfinite, scaler
        _WATCHING[model] = weakref.ref(self)
        self._record_dir = record_dir
        self.ddp: Any = None
        self.dp: Any = None
        self.vdp: Any = None
        self.compiled = False
        inner = model
        while True:
            if isinstance(inner, DistributedDataParallel):
                self.ddp, inner = inner, inner.module
            elif isinstance(inner, nn.DataParallel):
                self.dp, inner = inner, inner.module
            elif isinstance(inner, VirtualDataParallel):
                self.vdp, inner = inner, inner.module
            elif type(inner).__name__ == "OptimizedModule" and isinstance(
                getattr(inner, "_orig_mod", None), nn.Module
            ):
                self.compiled, inner = True, inner._orig_mod  # type: ignore[assignment]
            else:
                break
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
        if not localize:
            self.blind.append("localize=False: forward faults are named at the model's output")

        self.step = 0  # backward passes completed
        #: this run's name in its records (under DDP the first rank's, agreed on at watch())
        self.run = uuid.uuid4().hex[:12]
        self.done = False  # the first fault was reported: nothing more is checked
        self.closed = False
        self.report: NonFiniteReport | None = None
        self.events: list[NonFiniteReport] = []  # the fault and every GradScaler-skipped overflow
        self._handles: list[Any] = []
        #: this forward's module calls as the hooks saw them: _Seen's fields as a tuple (a
        #: tuple is quicker to make, and almost never read: :meth:`_seen`)
        self._trail: list[tuple[Any, ...]] = []
        #: the module paths of this step's forwards let go already, in the order they ran
        self._order: list[list[str]] = []
        self._early: _Local | None = None  # a forward fault found as the forward ended (CPU)
        #: an output held an Inf but no NaN (masked logits): judged by the gradients, so on the
        #: CPU the module outputs are kept to the end of the backward to name it if they go bad
        self._holding = False
        self._inputs: list[Any] = []
        #: on the CPU, the witnesses of this step's outputs as read when each forward ended
        self._fwd_host: list[float] = []
        self._fwd_device = False  # a witness of this step is on an accelerator (not read yet)
        self._outputs: list[tuple[torch.Tensor, Any, str]] = []  # (witness, output, name) per root forward
        self._out_grads: list[torch.Tensor] = []
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
        self._local: _Local | None = None  # a no_sync micro-step's local fault, not yet agreed
        self._pre_read: _PreFinalize | None = None  # this step's before-finalize read, while checked
        self._agreement: _Agreement | None = None  # this step's agreement word, in flight
        self._order_seen = False  # DDP's finalize was seen to come after the before-finalize read
        self._received_here: _Local | None = None  # what the all-reduce alone corrupted here, not yet agreed

        self._handles.append(model.register_forward_pre_hook(self._pre_root))
        if localize and not self.compiled:
            for path, module in self.inner.named_modules():
                if not _says_nothing(module):
                    self._handles.append(module.register_forward_hook(self._module_hook(path)))
        # after the module hooks: where the model is its own root, its output is kept first
        self._handles.append(model.register_forward_hook(self._post_root))
        self._comm: _CommState | None = None
        self._param_sums: list[tuple[torch.Tensor, torch.Tensor]] = []  # (parameter, its gradient's sum)
        self._params = [p for p in self.inner.parameters() if p.requires_grad]
        #: every parameter, listed once (walking the modules for them costs ~0.1 ms a step)
        self._all_params = list(self.inner.parameters())
        self._pre: _PreFinalize | None = None
        #: how DDP gradients are seen before the all-reduce (see :func:`watch`): "before-finalize",
        #: "bucket-hook" or "tensor-hooks"; "local" without DDP
        self.grad_path = "local"
        if self.ddp is not None:
            self.grad_path = _grad_path(self.ddp, comm_hook)
        if self.ddp is not None and self.world > 1:  # one name for the job's records, its first rank's
            names = [self.run]
            first_rank = 0 if self.group is None else dist.get_global_rank(self.group, 0)
            dist.broadcast_object_list(names, src=first_rank, group=self.group)
            self.run = str(names[0])
        if self.grad_path == "bucket-hook":
            state = HookState(self.group_rank, self.world)
            state.on_bucket = self._on_bucket
            self._comm = _CommState(state, self.group, weakref.ref(self))
            try:
                self.ddp.register_comm_hook(self._comm, _bucket_hook)
            except RuntimeError as exc:
                self.close()
                raise InputError(
                    "gpudiag.watch registers a DDP communication hook, and this model has one already "
                    f"({exc}); watch the model before registering yours, or pass comm_hook=False"
                ) from exc
        elif self.grad_path == "tensor-hooks":
            self._watch_each_gradient()

    def _watch_each_gradient(self) -> None:
        """DDP's own all-reduce, each parameter's gradient summed as it arrives (a Python
        hook per parameter: the slowest way, for models whose gradients are bucket views)."""
        self.grad_path = "tensor-hooks"
        for p in self._params:
            self._handles.append(p.register_hook(self._param_hook(p)))

    # -- hooks -------------------------------------------------------------------------

    def _module_hook(self, path: str) -> Any:
        trail = self._trail

        grad_enabled = torch.is_grad_enabled
        vdp = self.vdp

        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            # Run by every module on every forward: kept to a few attribute reads and one append.
            if self.done or self._eval or not grad_enabled() or len(trail) >= TRAIL_LIMIT:
                return
            versions: tuple[int, ...]
            if type(output) is torch.Tensor:  # the usual case, without the generator
                versions = (getattr(output, "_version", -1),) if output.is_floating_point() else ()
            else:
                versions = tuple(_version(t) for t in _tensors(output))
            trail.append((path, module, inputs, output, vdp.transport.replica if vdp else None, versions))

        return hook

    def _pre_root(self, module: nn.Module, inputs: Any) -> None:
        if self.done or not torch.is_grad_enabled():
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
            self._inputs.append(inputs)

    def _post_root(self, module: nn.Module, inputs: Any, output: Any) -> None:
        self.observe(output, "")

    def observe(self, output: Any, name: str = "<loss>") -> None:
        """Watch ``output`` (a loss, or the model's output) like the model's own outputs: a
        witness now, and a gradient hook that checks the step once its backward is over.
        Integrations whose framework computes the loss outside ``model(...)`` (Lightning's
        ``training_step``) pass it here; ``name`` is what a fault first seen in it is called."""
        if self.done or self.closed or not torch.is_grad_enabled():
            return
        if type(output) is torch.Tensor:  # the usual case, without the generator
            tensors = [output] if output.is_floating_point() or output.is_complex() else []
        else:
            tensors = list(_tensors(output))
        if not tensors:
            return
        self._dirty = True
        witness = _witness(tensors)
        self._outputs.append((witness, None if self._eval else output, name))
        for t in tensors:
            if t.requires_grad:
                self._awaiting = True
                self._hook_gradient(t)
        if witness.is_cuda:
            self._fwd_device = True
        else:
            self._settle_forward(witness)

    def _hook_gradient(self, t: torch.Tensor) -> None:
        """Have :meth:`_on_output_grad` see the gradient flowing into output ``t``: a
        pre-hook on the autograd node that made it (less than half of what ``Tensor.register_hook``
        costs, which builds a Python hook dictionary and handle on every step's output),
        picking ``t``'s own gradient among the node's; a tensor hook where ``t`` has no node
        (a leaf) or the node takes no pre-hooks."""
        node = t.grad_fn
        prehook = getattr(node, "register_prehook", None)
        if prehook is None:
            t.register_hook(self._on_output_grad)
            return
        index, seen = t.output_nr, self._on_output_grad
        prehook(lambda grads: seen(grads[index] if index < len(grads) else None))

    def _settle_forward(self, witness: torch.Tensor) -> None:
        """On the CPU a witness is read without a sync: the forward is judged as it ends
        (its fault named now, while its module outputs are at hand) and what it kept is let
        go before the backward, so the allocator can reuse it. On CUDA that read would stall
        the queue: the outputs are kept to the end of the backward and read only if a
        witness read with everything else there is not finite."""
        values = witness.tolist()  # one op: a float, or a list for several tensors
        values = values if isinstance(values, list) else [values]
        self._fwd_host.extend(values)
        clean = all(math.isfinite(v) for v in values)
        verdict = "clean" if clean else self._forward_verdict(self._outputs[-1:])
        if verdict == "nan" and self._early is None:
            self._early = self._first_bad_output(nan_only=True)
        if verdict == "inf":
            self._holding = True  # judged by the gradients at the end of the backward
        if self._holding:
            return
        self._order.append([seen[0] for seen in self._trail])
        self._trail.clear()
        self._inputs.clear()
        if clean:
            self._outputs[-1] = (witness, None, self._outputs[-1][2])

    def _on_output_grad(self, grad: torch.Tensor | None) -> None:
        if self.done:
            return
        if not self._queued:  # the first output this backward reaches
            self._queued, self._dirty = True, True
            # grad mode inside a backward is its create_graph: a gradient penalty's autograd.grad
            self._grads_before = self._grad_state() if torch.is_grad_enabled() else None
            self._out_grads_mark = len(self._out_grads)
            # Runs once the backward is over; it queues the check behind DDP's own
            # end-of-backward work (queued later), so the all-reduced gradients are in place.
            self._queue(self._end_of_backward)
        if grad is not None:  # None: an output the loss does not use (DDP's unused-parameter search)
            self._out_grads.append(_sum32(grad.detach() if grad.requires_grad else grad))

    def _grad_state(self) -> tuple[Any, ...] | None:
        """Which gradient tensor each parameter holds and its in-place version: a backward
        that accumulates into any of them changes this, ``torch.autograd.grad`` does not.
        None where it cannot tell (no parameters, or a torch without version counters)."""
        if not self._params or not _versioned():
            return None
        return tuple(None if (g := p.grad) is None else (id(g), _version(g)) for p in self._params)

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
        if before is not None and before == self._grad_state():
            self._queued = False
            del self._out_grads[self._out_grads_mark :]
            return
        if (
            self.grad_path == "before-finalize"
            and not self.done
            and not self.closed
            and self.ddp.require_backward_grad_sync
        ):
            self._pre = self._read_before_finalize()
        befores = self._befores()
        if befores is not None:
            self._agreement = self._agree(befores)
        self._queue(self.after_backward)

    def _befores(self) -> list[torch.Tensor] | None:
        """This DDP step's witnesses of each rank's own gradients before the all-reduce
        (per bucket, per gradient, or one vector), or None when this backward all-reduces
        nothing (no DDP, ``no_sync``)."""
        if self.ddp is None or self.done or self.closed or not self.ddp.require_backward_grad_sync:
            return None
        if self.grad_path == "before-finalize":
            return [self._pre.witness] if self._pre is not None else None
        if self.grad_path == "tensor-hooks":
            return [w for _, w in self._param_sums] if self._param_sums else None
        if self._comm is not None and self._synced:
            return [p.before[:1] for p in self._comm.hook.pending]
        return None

    def _agree(self, befores: list[torch.Tensor]) -> _Agreement:
        """Launch this step's agreement: per rank, the first step its own values went
        non-finite (this one if a witness is, or an earlier ``no_sync`` micro-step's) and
        the first step the all-reduce alone brought it non-finite values (found at an
        earlier step's end, see :meth:`_check_synced`); MIN over the ranks, asynchronously."""
        outs = [w for w, _, _ in self._outputs]
        parts = [t.reshape(-1).float() for t in [*outs, *self._out_grads, *befores]]
        device = parts[0].device if parts else self.device
        parts = [t.to(device) for t in parts]
        words = torch.full((2 * self.world,), _INF, dtype=torch.float32, device=device)
        prior = float(self._local.step) if self._local is not None else _INF
        if parts:
            bad = ~torch.isfinite(torch.cat(parts)).all()
            words[self.group_rank] = torch.where(bad, float(self.step), prior)
        else:
            words[self.group_rank] = prior
        if self._received_here is not None:
            words[self.world + self.group_rank] = float(self._received_here.step)
        work = None
        if not self._joining():
            work = dist.all_reduce(words, op=dist.ReduceOp.MIN, group=self.group, async_op=True)
        return _Agreement(work, words, parts, len(outs), len(self._out_grads))

    def _joining(self) -> bool:
        """Whether DDP runs under ``join()`` (uneven inputs: a rank out of data shadows only
        DDP's own collectives, so the watcher's would hang): then each rank judges what it
        saw, its own values and what the all-reduce brought it, and exchanges nothing.
        (DDP's ``_join_config``, guarded: a torch without it is taken as not joining.)"""
        config = getattr(self.ddp, "_join_config", None)
        return bool(getattr(config, "enable", False))

    def _read_before_finalize(self) -> "_PreFinalize":
        """Each rank's own gradients, witnessed in one pass before DDP copies the all-reduced
        values over them; on the CPU a non-finite one is counted exactly at once."""
        params = [p for p in self._params if p.grad is not None]
        grads: list[torch.Tensor] = [p.grad for p in params]  # type: ignore[misc]
        witness = _grad_witness(grads)
        pre = _PreFinalize(params, witness, [(g, _version(g)) for g in grads])
        if not witness.is_cuda:  # on the host already: name the bad ones while they are local
            for p, g, v in zip(params, grads, witness.tolist(), strict=True):
                if not math.isfinite(v) and (bad := nonfinite_count(g)):
                    pre.bad.append((p, bad))
        return pre

    def _finalize_came_after(self, pre: "_PreFinalize") -> bool:
        """Whether DDP's finalize wrote the all-reduced gradients *after* this rank's own were
        read (what ``before-finalize`` rests on): it copies into each used gradient in place,
        so their in-place versions moved on. If none did, this torch orders its callbacks
        otherwise: say so once, and watch each gradient as it arrives from the next step.
        Checked until seen once (the order is the torch's, not the step's): a backward DDP
        does not all-reduce (a second one through a retained graph) moves nothing."""
        if self._order_seen or not pre.versions:
            return True
        if any(_version(g) != v for g, v in pre.versions):
            self._order_seen = True
            return True
        warnings.warn(
            "gpudiag.watch: DDP's end-of-backward work ran before the watcher's on this torch "
            f"({torch.__version__}); from the next step each gradient is watched as it arrives "
            "(slower), and this step's gradients are judged after the all-reduce only",
            RuntimeWarning,
            stacklevel=_user_stacklevel(),
        )
        self._watch_each_gradient()
        return False

    def _param_hook(self, param: torch.Tensor) -> Any:
        sums = self._param_sums

        def hook(grad: torch.Tensor) -> None:
            if not self.done:
                sums.append((param, _sum32(grad.detach()).reshape(1)))

        return hook

    def _on_bucket(self, bucket: dist.GradBucket, before: torch.Tensor) -> None:
        """Before the all-reduce: on the CPU the bucket's norm is on the host already, so
        a non-finite bucket's parameters are named now; on CUDA each gradient's norm is
        kept (one multi-tensor launch) and read only if the step goes bad."""
        grads = _bucket_gradients(bucket)
        if before.is_cuda:
            norms = torch.stack([n.reshape(()) for n in torch._foreach_norm([stored(g) for g in grads])])
            self._bucket_norms.append((list(bucket.parameters()), norms))
            return
        if math.isfinite(float(before[0])):
            return
        for param, grad in zip(bucket.parameters(), grads, strict=True):
            bad = nonfinite_count(grad)
            if bad:
                name = self.names.get(id(param), "?")
                self._bad_params.append((len(self._bad_params), name, bad, grad.numel()))

    # -- the check at the end of each backward -----------------------------------------

    def after_backward(self) -> None:
        """Check the step that just finished its backward (called by the watcher itself at
        the end of every backward that went through the model's outputs; integrations whose
        framework calls the model otherwise call it after backward)."""
        self._queued = False
        if self.done or self.closed:
            return
        befores = self._befores()  # (None: nothing all-reduced this backward)
        pre, self._pre, self._synced = self._pre, None, False
        if pre is not None and not self._finalize_came_after(pre):
            pre = _PreFinalize([], torch.zeros(0), [])  # what was read came back from the all-reduce
        pending = self._comm.hook.pending if self._comm is not None else []
        if self._comm is not None:
            self._comm.hook.pending = []
        if not (self._dirty or befores is not None or self._trail):
            return
        self._dirty = False
        try:
            if befores is None:
                self._check_local()
            elif self._comm is not None:
                self._check_synced(befores, [p.result for p in pending if p.result is not None])
            else:
                self._pre_read = pre
                self._check_synced(befores, [p.grad for p in self._params if p.grad is not None])
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

    def _check_local(self) -> None:
        """Single device, DataParallel, or a DDP ``no_sync`` micro-step: this process's
        values only, one read-back."""
        every = [p.grad for p in self._all_params]
        if any(g is None for g in every):
            params = [p for p, g in zip(self._all_params, every, strict=True) if g is not None]
            grads: list[torch.Tensor] = [g for g in every if g is not None]
        else:
            params, grads = self._all_params, every  # type: ignore[assignment]
        if not self._fwd_device and not any(g.is_cuda for g in self._out_grads[:1] + grads[:1]):
            # The CPU: the forward was read as it ended; one read-back of the rest, in as
            # few ops as it takes (one multi-tensor norm, one stack, one read).
            parts = [*self._out_grads, *_host_witnesses(grads)]
            flat = torch.stack(parts).tolist() if parts else []
            if math.isfinite(sum(flat) + sum(self._fwd_host)):
                return  # the usual step (a sum that overflowed on finite values: looked at below)
            fwd, out_grads = self._fwd_host, flat[: len(self._out_grads)]
            values = _grad_witness(grads).tolist()  # which gradients: one value each
        else:
            outs = [w.reshape(-1) for w, _, _ in self._outputs]
            witness = _grad_witness(grads)
            parts = [*outs, *(g.reshape(-1) for g in self._out_grads)]
            device = parts[0].device if parts else witness.device
            flat = torch.cat([*(t.to(device) for t in parts), witness.to(device)]).tolist()
            n_out = sum(o.numel() for o in outs)
            fwd, out_grads = flat[:n_out], flat[n_out : len(flat) - len(params)]
            values = flat[len(flat) - len(params) :]
        suspects = [p for p, v in zip(params, values, strict=True) if not math.isfinite(v)]
        bad_grads = [(p, c) for p in suspects if p.grad is not None and (c := nonfinite_count(p.grad))]
        local = self._diagnose(fwd, out_grads, bad_grads)
        if self.ddp is not None:  # no_sync: agreed on at the next synchronised backward
            if local is not None and self._local is None:
                self._local = local
            return
        if local is not None:
            self._conclude(local, [], [])

    def _check_synced(self, befores: list[torch.Tensor], results: list[torch.Tensor]) -> None:
        """DDP: the agreement launched at the end of the backward (or now, for a backward
        the watcher did not see end), what came back from the all-reduce (``results``),
        one read-back. A fault any rank's own values show is agreed on now, by every rank;
        values that only the all-reduce made non-finite here (every rank's own finite)
        are agreed on at the next step's agreement (or said at ``close()``)."""
        agreement, self._agreement = self._agreement, None
        if agreement is None:
            agreement = self._agree(befores)
        after = _grad_witness(results) if results else None
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
        agreed = flat[-1 - 2 * self.world : -1]
        firsts, received = agreed[: self.world], agreed[self.world :]
        if all(math.isinf(v) for v in firsts + received):
            if here_bad and self._received_here is None:
                # every rank's own values were finite: the all-reduce made these, here
                self._received_here = self._received(results)
                if alone and self._received_here is not None:  # nobody to tell later
                    said, self._received_here = self._received_here, None
                    self._conclude(said, [], [])
            return  # the usual step: nothing to see
        # Some rank saw a non-finite witness: every rank looks closer and all share it.
        n_out, n_grad = agreement.n_out, agreement.n_grad
        fwd = flat[:n_out]
        out_grads = flat[n_out : n_out + n_grad]
        local = self._local
        if local is None and math.isfinite(firsts[self.group_rank]):
            seen = flat[n_out + n_grad : len(flat) - 1 - 2 * self.world]
            local = self._diagnose(fwd, out_grads, self._synced_bad_grads(seen))
        got = self._received_here
        mine = {"local": asdict_local(local), "received": asdict_local(got), "rank": self.rank}
        views: list[Any] = [mine]
        if not alone:
            views = [None] * self.world
            dist.all_gather_object(views, mine, group=self.group)
        self._local = self._received_here = None
        origins = [v["local"] for v in views if v["local"] is not None]
        receivers = [v["received"] for v in views if v["received"] is not None]
        # the earliest step first; within it the earliest phase (a step's optimizer comes after
        # its all-reduce: parameters the optimizer made non-finite from gradients the all-reduce
        # broke are that all-reduce's doing); at one phase a rank's own fault first. Overflows
        # a GradScaler skips are noted one per step, and never hide a fault beside them.
        entries = sorted(
            [(d["step"], _PHASE_ORDER.get(d["phase"], 0), 0, d["rank"], d) for d in origins]
            + [(d["step"], _PHASE_ORDER.get(d["phase"], 0), 1, d["rank"], d) for d in receivers],
            key=lambda t: t[:4],
        )
        skipped = set()
        for step, _, kind, _, first in entries:
            if first["kind"] == "scaler-skip":
                if step not in skipped:
                    skipped.add(step)
                    self._conclude(_Local(**first), [], [dict(v) for v in views])
                continue
            same = origins if kind == 0 else receivers
            also = [
                d["rank"] for d in same if d is not first and d["step"] == step and d["kind"] != "scaler-skip"
            ]
            arrived = kind == 0 and mine["local"] is None and first["rank"] != self.rank
            self._conclude(_Local(**first), also, [dict(v) for v in views], arrived=arrived)
            return

    def _synced_bad_grads(self, befores: list[float]) -> list[tuple[Any, int]]:
        """The parameters whose own (pre-all-reduce) gradients were non-finite."""
        pre = self._pre_read
        if pre is not None:  # before-finalize: counted already on the CPU, else by witness
            if pre.bad or not pre.witness.is_cuda:
                return list(pre.bad)
            return [(p, -1) for p, v in zip(pre.params, befores, strict=True) if not math.isfinite(v)]
        if self._param_sums:  # no comm hook: each gradient's sum as it arrived
            return [
                (p, -1) for (p, _), v in zip(self._param_sums, befores, strict=True) if not math.isfinite(v)
            ]
        if self._bucket_norms:  # CUDA: the kept per-gradient norms, read now
            out = []
            for params, norms in self._bucket_norms:
                for p, n in zip(params, norms.tolist(), strict=True):
                    if not math.isfinite(n):
                        out.append((p, -1))
            return out
        by_name = {n: p for n, p in self.inner.named_parameters()}
        return [(by_name[name], bad) for _, name, bad, _ in self._bad_params if name in by_name]

    def _received(self, results: list[torch.Tensor]) -> _Local | None:
        """What the all-reduce alone made non-finite here (exact count), or None. Under an
        enabled GradScaler it is an overflow the scaler skips (a compressing comm hook's
        fp16 overflowing is the usual one), noted, not a fault."""
        bad = sum(nonfinite_count(r) for r in results)
        if not bad:
            return None
        total = sum(r.numel() for r in results)
        return self._scaler_skip(
            _Local(
                self.step,
                "all-reduce",
                "",
                str(self.device),
                f"{bad} of {total} gradient values came back non-finite from the all-reduce while every "
                "rank's own gradients were finite",
                self.rank,
            )
        )

    # -- naming the origin (only once a witness is not finite) -------------------------

    def _diagnose(
        self, fwd: list[float], out_grads: list[float], bad_grads: list[tuple[Any, int]]
    ) -> _Local | None:
        """What went non-finite first on this rank this step, or None (a witness that
        overflowed on finite values)."""
        transfer = self._corrupted_transfer()
        if transfer is not None:
            return transfer
        if any(not math.isfinite(v) for v in fwd):
            # A NaN in the model's outputs (or a non-finite loss given to observe()) is a
            # fault; an Inf alone (masked logits, an unused entry) only if it reached the
            # loss's gradient: the gradient flowing into the outputs went non-finite. (Other
            # non-finite gradients beside a masked output are the backward's, named below.)
            verdict = self._forward_verdict(self._outputs)
            reached = any(not math.isfinite(v) for v in out_grads)
            if verdict == "nan" or (verdict == "inf" and reached):
                found = self._first_bad_output(nan_only=verdict == "nan")
                if found is not None:
                    return found
        if any(not math.isfinite(v) for v in out_grads):
            return self._scaler_skip(
                self._local_at(
                    "backward",
                    "<loss>",
                    "the gradient flowing into the model's output from the loss was non-finite: "
                    "the loss, computed outside the model, is non-finite",
                )
            )
        if bad_grads:
            return self._bad_gradient(bad_grads)
        return None

    def _scaler_skip(self, local: _Local) -> _Local:
        """A backward fault under an enabled GradScaler is its overflow: the scaler skips
        the step and lowers its scale (what it is for), noted, not a fault."""
        if self.scaler is not None and getattr(self.scaler, "is_enabled", lambda: True)():
            local.kind = "scaler-skip"
            local.detail += "; the GradScaler skips this step and lowers its scale"
        return local

    def _device_label(self, seen: _Seen | None = None) -> str:
        if seen is not None and seen.replica is not None and self.vdp is not None:
            return f"virtual GPU{seen.replica}"
        if seen is not None:
            t = next(_tensors(seen.output), None)
            if t is not None:
                return str(t.device)
        if self.vdp is not None:
            return f"virtual GPU{self.vdp.transport.devices.ids[0]}"
        return str(self.device)

    def _local_at(
        self, phase: str, module: str, detail: str, seen: _Seen | None = None, step: int | None = None
    ) -> _Local:
        return _Local(
            self.step if step is None else step,
            phase,
            module,
            self._device_label(seen),
            detail,
            self.rank,
            kind="fault",
            blind=list(self.blind),
        )

    def _let_go(self) -> None:
        """Forget what this step's forwards kept."""
        self._trail.clear()
        self._inputs.clear()
        self._outputs.clear()
        self._fwd_host.clear()
        self._fwd_device = False
        self._out_grads.clear()
        self._order.clear()
        self._early = None
        self._holding = False

    @staticmethod
    def _forward_verdict(outputs: list[tuple[torch.Tensor, Any, str]]) -> str:
        """``"nan"``: a model output holds a NaN, or a loss given to :meth:`observe` is
        non-finite (a fault); ``"inf"``: the model's outputs hold Infs and no NaN (masked
        logits, an unused entry of a dict: a fault only if the gradients go non-finite);
        ``"clean"``. An output let go (an eval-mode forward) is judged by its witness, whose
        NaN may also be two Infs of opposite signs: taken as a NaN."""
        verdict = "clean"
        for witness, output, name in outputs:
            if bool(torch.isfinite(witness).all()):
                continue
            if name or (_has_nan(output) if output is not None else bool(torch.isnan(witness).any())):
                return "nan"
            verdict = "inf"
        return verdict

    def _seen(self) -> list[_Seen]:
        """This forward's module calls, in the order they returned."""
        return [_Seen(*seen) for seen in self._trail]

    def _nan_arose_from_finite(self) -> bool:
        """Whether the first kept module output holding a NaN had finite inputs: the NaN
        arose there, and an Inf before it (a masked score) is not its origin."""
        for seen in self._seen():
            if _has_nan(seen.output):
                return not _bad_count(seen.inputs)[0]
        return False

    def _first_bad_output(self, nan_only: bool = False) -> _Local | None:
        """The first input or module output, in the order they ran, that was non-finite.
        ``nan_only`` (the step's outputs hold a NaN): if the first module output holding a
        NaN made it from finite inputs, Infs before it (masking) are not blamed."""
        if self._early is not None:
            return self._early
        nan_only = nan_only and self._nan_arose_from_finite()
        for inputs in self._inputs:
            bad, total = _bad_count(inputs, nan_only)
            if bad:
                return self._local_at("input", "<input>", f"{bad} of {total} input values were non-finite")
        suspects: list[str] = []
        trail = self._seen()
        for i, seen in enumerate(trail):
            bad, total = _bad_count(seen.output, nan_only)
            if not bad:
                continue
            if seen.changed_since(trail[i + 1 :]):
                suspects.append(seen.path)  # changed in place later: judged by what came after
                continue
            stale = self._bad_parameter(seen.module)
            if stale is not None:
                name, pbad = stale
                path = f"{seen.path}.{name}" if seen.path else name
                if self.step == 0:
                    return self._local_at(
                        "forward", seen.path, f"parameter {path} was non-finite before the first step", seen
                    )
                return self._local_at(
                    "optimizer",
                    seen.path,
                    f"parameter {path} ({pbad} non-finite) became non-finite in the optimizer step "
                    f"after backward {self.step - 1}, whose gradients were finite",
                    seen,
                    step=self.step - 1,
                )
            in_bad, _ = _bad_count(seen.inputs)
            kind = type(seen.module).__name__
            if in_bad:
                parent = seen.path.rpartition(".")[0]
                also = (
                    f" (or in {', '.join(suspects)}, whose output that code changed in place afterwards)"
                    if suspects
                    else ""
                )
                return self._local_at(
                    "forward",
                    parent,
                    f"the input of {seen.path or 'the model'} ({kind}) was already non-finite: it arose "
                    f"in {parent or 'the model'}'s own forward code, outside its submodules{also}",
                    seen,
                )
            where = f" on replica {self._device_label(seen)}" if self.placement.startswith("dp") else ""
            local = self._local_at(
                "forward",
                seen.path,
                f"forward output of {seen.path or 'the model'} ({kind}){where}: {bad} NaN/Inf of {total}",
                seen,
            )
            local.transfer = self._carrier(seen)
            return local
        for _, out, name in self._outputs:
            bad, total = _bad_count(out, nan_only and not name)
            if bad and name:
                return self._local_at(
                    "forward", name, f"{name} was non-finite ({bad} of {total}), every module output finite"
                )
            if bad:
                return self._local_at(
                    "forward",
                    "",
                    f"the model's output: {bad} NaN/Inf of {total} (modules not watched one by one)",
                )
        return None

    def _bad_parameter(self, module: nn.Module) -> tuple[str, int] | None:
        for name, p in module.named_parameters(recurse=False):
            bad = int((~torch.isfinite(p.detach())).sum())
            if bad:
                return name, bad
        return None

    def _bad_gradient(self, bad_grads: list[tuple[Any, int]]) -> _Local:
        """The first module in backward order (the last in forward order) whose
        parameters' own gradients were non-finite."""
        order: dict[str, int] = {}
        for path in [*(p for paths in self._order for p in paths), *(seen[0] for seen in self._trail)]:
            order.setdefault(path, len(order))

        def rank(item: tuple[Any, int]) -> tuple[int, int]:
            return order.get(self.owner.get(id(item[0]), ""), -1), self.index.get(id(item[0]), -1)

        param, bad = max(bad_grads, key=rank)
        name = self.names.get(id(param), "?")
        module = self.owner.get(id(param), "")
        count = f"{bad} NaN/Inf of {param.numel()}" if bad >= 0 else "non-finite"
        return self._scaler_skip(self._local_at("backward", module, f"gradient of {name}: {count}"))

    # -- DataParallel transfers ----------------------------------------------------------

    def _transfers(self) -> list[Any]:
        if self.vdp is None or self.vdp.transport.recorder is None:
            return []
        step = self.vdp.transport.step
        return [t for t in self.vdp.transport.recorder.transfers if t.step == step]

    def _corrupted_transfer(self) -> _Local | None:
        for t in self._transfers():
            if t.nonfinite and t.corrupted and math.isfinite(t.sent_checksum or 0.0):
                local = _Local(
                    self.step,
                    "transfer",
                    t.name if t.name not in ("input", "output") else f"<{t.name}>",
                    f"virtual GPU{t.dst}",
                    f"{t.nonfinite} value(s) arrived non-finite on GPU{t.dst} from GPU{t.src} although "
                    f"they were finite when sent ({t.phase})",
                    self.rank,
                    blind=list(self.blind),
                )
                local.transfer = _transfer_json(t, corrupted=True)
                return local
        return None

    def _carrier(self, seen: _Seen) -> dict[str, Any] | None:
        """The DataParallel copy that carried a replica's non-finite value on."""
        if self.vdp is not None and seen.replica is not None:
            for t in self._transfers():
                if t.nonfinite and t.src == seen.replica:
                    return _transfer_json(t, corrupted=False)
            return None
        if self.dp is not None:
            t = next(_tensors(seen.output), None)
            out = torch.device("cuda", self.dp.output_device) if self.dp.device_ids else None
            if t is not None and out is not None and t.device != out:
                src, dst = t.device.index or 0, out.index or 0
                return {
                    "kind": "gather",
                    "src": str(t.device),
                    "dst": str(out),
                    "link": _cuda_link(src, dst),
                    "corrupted": False,
                    "name": "output",
                }
        return None

    # -- reporting ---------------------------------------------------------------------

    def _conclude(
        self,
        origin: _Local,
        also: list[int],
        views: list[dict[str, Any]],
        arrived: bool = False,
        raising: bool = True,
    ) -> None:
        if self.done:
            return  # the first fault is said once
        report = NonFiniteReport(
            step=origin.step,
            rank=origin.rank,
            device=origin.device,
            module=origin.module,
            phase=origin.phase,
            detail=origin.detail,
            this_rank=self.rank,
            world_size=self.world,
            arrived=arrived,
            placement=self.placement,
            transfer=Transfer(**origin.transfer) if origin.transfer else None,
            kind=origin.kind,
            also=also,
            blind=origin.blind,
            run=self.run,
            ranks=[
                {
                    "rank": v["rank"],
                    "own": v["local"] is not None,
                    "received": v["received"] is not None,
                }
                for v in views
                if "rank" in v
            ],
        )
        self.events.append(report)
        if report.kind == "scaler-skip":
            report = self._skip_run(report)
            if report.kind == "scaler-skip":
                return  # an overflow the scaler deals with: noted, not a fault
            self.events.append(report)  # a run of skips: the fault
        self.report, self.done = report, True
        self._trail.clear()
        if self._record_dir is not False:
            folder = record_dir(None if self._record_dir in (None, True) else self._record_dir)
            try:
                write_record(report, folder)
            except (OSError, InputError) as exc:  # (a link or a FIFO planted there): training goes on
                warnings.warn(
                    f"gpudiag.watch could not write its record in {folder}: {exc}",
                    stacklevel=_user_stacklevel(),
                )
        if self.mode == "raise" and raising:
            raise NonFiniteError(report)
        if self.mode == "warn" or self.mode == "raise":
            warnings.warn(NonFiniteWarning(report), stacklevel=_user_stacklevel())

    def _skip_run(self, skip: NonFiniteReport) -> NonFiniteReport:
        """Count a GradScaler skip; ``skip`` itself while skips are what the scaler is for,
        or a fault (the run's first skip, its detail saying why) once ``max_skips`` optimizer
        steps in a row were skipped or the scale fell below ``scale_floor``. Skips at one
        scale (micro-steps of one accumulated step) count once: the scale moves only when
        the scaler updates."""
        self._skipped_now = True
        scale = self._scale()
        if self._skip_first is None or scale is None or scale != self._skip_scale:
            self._skips += 1
        self._skip_scale = scale
        first = self._skip_first = self._skip_first or skip
        low = scale is not None and scale < self.scale_floor
        if self._skips < self.max_skips and not low:
            return skip
        shown = f"{scale:.3g}" if scale is not None else "?"
        why = (
            f"its scale fell to {shown}, below the floor {self.scale_floor:.3g}"
            if low
            else f"its scale fell to {shown}"
        )
        reason = (
            f"the GradScaler skipped {self._skips} optimizer step(s) in a row (backwards {first.step}-"
            f"{skip.step}) and {why}: a gradient that stays non-finite however far the loss is scaled "
            "down, not an overflow"
        )
        detail = first.detail.replace("; the GradScaler skips this step and lowers its scale", "")
        return replace(first, kind="fault", detail=f"{detail}; {reason}", this_rank=self.rank)

    def _scale(self) -> float | None:
        """The GradScaler's current scale (``get_scale()``, a host sync on CUDA: read only
        on a skip), or None where it cannot be read."""
        try:
            return float(self.scaler.get_scale())
        except Exception:  # a scaler-like object without it: count every skip
            return None

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
                self._conclude(pending, [], [], raising=False)
        self._local = self._received_here = None
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


def asdict_local(local: _Local | None) -> dict[str, Any] | None:
    if local is None:
        return None
    from dataclasses import asdict

    return asdict(local)


def _transfer_json(t: Any, corrupted: bool) -> dict[str, Any]:
    return {
        "kind": t.phase,
        "src": f"GPU{t.src}",
        "dst": f"GPU{t.dst}",
        "link": t.link,
        "corrupted": corrupted,
        "name": t.name,
    }


def _cuda_link(a: int, b: int) -> str | None:
    """The topology's link code between torch devices ``cuda:a`` and ``cuda:b`` (NVML),
    or None when it cannot be read."""
    try:
        from gpudiag.hw.devices import bus_id_from_torch, map_torch_indices
        from gpudiag.hw.sources import read_topology

        topology = read_topology()
        props: list[Any] = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
        buses = [bus_id_from_torch(p.pci_domain_id, p.pci_bus_id, p.pci_device_id) for p in props]
        import os

        mapping = map_torch_indices(list(topology.gpus.values()), os.environ, buses)
        smi = {t: s for s, t in mapping.torch_of.items() if t is not None}
        return topology.cell(f"GPU{smi[a]}", f"GPU{smi[b]}")
    except Exception:  # the topology is a nicety here: never fail the report for it
        return None


def watch(
    model: nn.Module,
    on_nonfinite: str = "raise",
    *,
    scaler: Any = None,
    root: nn.Module | None = None,
    record_dir: str | Path | bool | None = None,
    localize: bool = True,
    comm_hook: bool | None = None,
    max_skips: int = MAX_SKIPS,
    scale_floor: float = SCALE_FLOOR,
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
    ``localize=False`` keeps no module outputs (less memory; a forward fault is named at the
    model's output).
    ``comm_hook`` (DDP): None (default) leaves DDP's own C++ all-reduce (or your comm hook)
    alone and reads each rank's gradients once at the end of the backward, before DDP's
    finalize overwrites them — unless the model has ``gradient_as_bucket_view=True``, then
    the watcher's comm hook; True: always the comm hook (torch's ``allreduce_hook`` plus
    each bucket's norm); False: never a comm hook (with bucket views, a hook per
    parameter). See docs/watch.md: cost.

    Create it after wrapping the model in DDP and before the first backward."""
    return Watcher(
        model,
        on_nonfinite,
        scaler=scaler,
        root=root,
        record_dir=record_dir,
        localize=localize,
        comm_hook=comm_hook,
        max_skips=max_skips,
        scale_floor=scale_floor,
    )
