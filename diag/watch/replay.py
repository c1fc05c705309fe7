"""Replay: how a clean step keeps no forward trail. A forward hook on every module is most of
what watching costs a small model (torch's slower call path for a hooked module, then the
hook), and the trail it keeps is read only on a faulty step. So for a model watched in one
process on one device (``localize="replay"``) the watcher keeps, per forward, only what it
takes to run that forward again — its arguments, the random number generators' states and
the autocast state as it began — and once a witness is not finite it replays the forward
with the module hooks on (:func:`replay`), which leaves the same trail the hooks would have.

The replay is the model called again on the same inputs, with the same parameters (the
optimizer has not stepped yet), the same dropout masks (the generators set back to their
state as the forward began, as ``torch.utils.checkpoint`` does), in the same autocast
mode, under ``no_grad`` (no second autograd graph: the replay holds only the module
outputs the hooks keep; torch's modules take the same path in training mode either way; a
forward that differentiates inside itself raises there, and is replayed in grad mode).
It runs on copies of the forward's tensor arguments (one that changes its input in place
changes the copy, not the batch autograd saved). Afterwards the generators go back to
where training left them (Python's and NumPy's too, set back for the replay where the
model draws from them: :class:`Draws`), and the buffers
(BatchNorm's running statistics, its batch count) are as before the replay (it updates
copies of them), so training goes on as if it had not run. What it cannot undo: a
forward's other side effects (the user's own forward hooks, a counter or a cache in the
model's Python code) happen twice on a faulty step, and a fault that does not recur (a
flaky device) is named at the output, saying so (:data:`DID_NOT_RECUR`)."""

import contextlib
import copy
import functools
import random
import sys
from collections import UserDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gpudiag.errors import InputError
from gpudiag.watch.torchapi import says_nothing
from gpudiag.watch.witness import tensor_version

#: What the report says where a replay found every module output finite.
DID_NOT_RECUR = (
    "the forward replayed with every module watched was finite throughout: the fault did not "
    "recur (a flaky device, or a forward that does not repeat: its own random generator, "
    "state it keeps in Python)"
)


#: (device type, autocast on there, its dtype where on)
AutocastState = tuple[str, bool, torch.dtype | None]


@dataclass(slots=True)
class Capture:
    """One forward, as it began: enough to run it again."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    #: (generator, its state) for torch's generators, where read (:class:`Draws`)
    rng: list[tuple[torch.Generator, torch.Tensor]]
    autocast: Sequence[AutocastState]
    #: the parameters' in-place versions as the forward ended, where it is judged only at the
    #: end of the backward (CUDA, an Inf output): an optimizer stepping inside the backward
    #: changes them, and a replay on changed parameters would blame them
    versions: tuple[int, ...] | None = None
    #: judged clean as it ended (the CPU): replayed for a gradient's order only, not searched
    #: for a later forward's fault (the hooks' trail of it was let go then too)
    settled: bool = False
    #: Python's and NumPy's global generator states as it began, where read (:class:`Draws`)
    host: tuple[Any, Any] | None = None
    probe: bool = False  # its states are to be compared as it ends (:meth:`Draws.ended`)


#: The first training forwards whose generator states are compared as they begin and end
#: (several: gradient accumulation's micro-batches may draw in only one)…
PROBES = 8
#: …and after them one forward in this many, for a model that draws only sometimes.
PROBE_EVERY = 64


def host_states() -> tuple[Any, Any]:
    """Python's global generator state and NumPy's (None where NumPy is not imported)."""
    numpy = sys.modules.get("numpy")
    return random.getstate(), numpy.random.get_state() if numpy is not None else None


def same_host_states(a: tuple[Any, Any], b: tuple[Any, Any]) -> bool:
    """Whether two :func:`host_states` are equal (NumPy's holds an array: compared by value)."""
    if a[0] != b[0] or a[1] is None or b[1] is None:
        return a[0] == b[0] and a[1] is None and b[1] is None
    return all(bool((x == y).all()) if hasattr(x, "all") else x == y for x, y in zip(a[1], b[1], strict=True))


def set_host_states(states: tuple[Any, Any]) -> None:
    """Set Python's and NumPy's global generators to ``states`` (:func:`host_states`)."""
    random.setstate(states[0])
    numpy = sys.modules.get("numpy")
    if states[1] is not None and numpy is not None:
        numpy.random.set_state(states[1])


class Draws:
    """Which generators a model's forwards draw from, which a replay must set back to each
    forward's start: torch's default generators (dropout, drop path, random masking) and
    Python's or NumPy's global ones (LayerDrop: ``random.random() < p``; wav2vec2's
    SpecAugment masks: ``np.random``). Reading their states costs, inside a training step,
    about 10 µs for torch's CPU generator (a 5 KB copy), 8 µs for Python's and 31 µs for
    NumPy's, so they are read as the first :data:`PROBES` training forwards begin and one in
    every :data:`PROBE_EVERY` after, and compared as each of those ends: a kind seen to be
    drawn from is read at every forward from then on. Until then a forward that draws is
    replayed with other draws (a model that draws rarely, or only after its first forwards:
    ``localize="trail"`` for it); torch's generators are set back after a replay either way."""

    def __init__(self, gens: list[torch.Generator]) -> None:
        self.gens = gens
        self.forwards = 0  # training forwards captured so far
        self.torch = False  # a forward drew from torch's generators: read at every forward
        self.host = False  # …from Python's or NumPy's

    def begin(self) -> tuple[list[tuple[torch.Generator, torch.Tensor]], tuple[Any, Any] | None, bool]:
        """(torch's generator states, Python's and NumPy's, whether to compare them as the
        forward ends) for a training forward's capture: each read where needed."""
        n, self.forwards = self.forwards, self.forwards + 1
        probe = n < PROBES or n % PROBE_EVERY == 0
        rng = [(g, g.get_state()) for g in self.gens] if probe or self.torch else []
        return rng, host_states() if probe or self.host else None, probe

    def ended(self, capture: Capture) -> None:
        """After a probed forward: whether it drew from either kind (compared once)."""
        if not capture.probe:
            return
        capture.probe = False
        if not self.torch:
            self.torch = any(not torch.equal(state, g.get_state()) for g, state in capture.rng)
        if not self.host and capture.host is not None:
            self.host = not same_host_states(capture.host, host_states())


def param_versions(params: Sequence[torch.Tensor]) -> tuple[int, ...]:
    """The parameters' in-place versions (``Tensor._version``, -1 where a torch has none)."""
    return tuple(tensor_version(p) for p in params)


def choose(localize: Any, placement: str, compiled: bool, own_root: bool) -> str:
    """``watch(localize=...)`` as "replay", "trail" or "off" (see :func:`gpudiag.watch.core.watch`):
    a replay for a model in one process on one device that is its own root (not compiled:
    a hook inside a compiled graph would break it, so "off", which its ``blind`` says)."""
    if localize is False or (compiled and localize in (True, "trail")):
        return "off"
    replayable = placement == "single" and not compiled and own_root
    if localize is True:
        return "replay" if replayable else "trail"
    if localize == "trail":
        return "trail"
    if localize == "replay":
        if not replayable:
            what = f"{placement} model{' compiled' if compiled else ''}"
            raise InputError(
                f"localize='replay' runs a faulty forward again in this process: not for a {what}, "
                "or one watched from another root, whose forward runs elsewhere or communicates — "
                "use localize='trail'"
            )
        return "replay"
    raise InputError(f"localize={localize!r}: expected True, False, 'trail' or 'replay'")


def hook_modules(watcher: Any) -> None:
    """The watcher's forward hook on every module below its root that could name an origin
    (:func:`says_nothing`), on every step from now on (``localize="trail"``): at ``watch()``,
    or once a loss comes to ``observe()`` in a step that never called the model (its modules
    called through its other methods, ``encode``/``decode``: no forward to replay)."""
    watcher.localize, watcher._gens = "trail", []
    for path, module in hookable(watcher.inner):
        watcher._handles.append(module.register_forward_hook(watcher._module_hook(path)))


def hookable(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, module) of every module below ``model`` whose forward hook could name a fault's
    origin (:func:`says_nothing`)."""
    return [(path, m) for path, m in model.named_modules() if not says_nothing(m)]


def generators(device: torch.device) -> list[torch.Generator]:
    """The default random number generators a forward on ``device`` draws from: the CPU's,
    and the device's own (``torch.cuda.default_generators[i]``) on CUDA."""
    gens = [torch.default_generator]
    if device.type == "cuda":
        cuda_gens = getattr(torch.cuda, "default_generators", ())
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index < len(cuda_gens):
            gens.append(cuda_gens[index])
    return gens


def autocast_devices(device: torch.device) -> tuple[str, ...]:
    """The device types whose autocast state a forward on ``device`` may run under."""
    return ("cpu",) if device.type == "cpu" else ("cpu", device.type)


def capture(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    devices: tuple[str, ...],
    draws: Draws,
) -> Capture:
    """What :func:`replay` needs of a forward that is beginning: the generator states it
    draws from (:class:`Draws`), the autocast state (a few flags), references to its
    arguments — about 30 µs inside a training step whose ops have taken the caches, 4 µs
    alone. Their containers are copied (:func:`held`): a forward taking a dict batch apart
    (``batch.pop("labels")``) leaves the replay the batch it was given."""
    rng, host, probe = draws.begin()
    autocast: Sequence[AutocastState]
    if _ANY_AUTOCAST is not None and _ANY_AUTOCAST_COVERS.issuperset(devices) and not _ANY_AUTOCAST():
        autocast = autocast_off(devices)
    else:
        autocast = [autocast_state(d) for d in devices]
    return Capture(held(args), held(kwargs) if kwargs else kwargs, rng, autocast, host=host, probe=probe)


#: Whether autocast is on for any device type (torch internals, guarded: None where a torch
#: has none, and each device type is asked): one call, where asking each type costs 5 µs.
_ANY_AUTOCAST = getattr(torch._C, "_is_any_autocast_enabled", None)
#: The device types that call answers for on every torch that has it (not MPS: autocast on
#: there alone reads as off, torch 2.14); a forward on any other is asked per device type.
_ANY_AUTOCAST_COVERS = frozenset(("cpu", "cuda"))


@functools.cache
def autocast_off(devices: tuple[str, ...]) -> tuple[AutocastState, ...]:
    """The autocast state of ``devices`` with autocast off everywhere."""
    return tuple((d, False, None) for d in devices)


def autocast_state(device: str) -> AutocastState:
    """(device type, whether autocast is on there, its dtype where it is): the dtype is asked
    only then (a replay's ``autocast(enabled=False)`` needs none)."""
    if torch.is_autocast_enabled(device):
        return device, True, torch.get_autocast_dtype(device)
    return device, False, None


def replay(
    model: nn.Module,
    captures: list[Capture],
    hook: Any,
    grad: bool = False,
    gens: Sequence[torch.Generator] = (),
) -> str | None:
    """Run ``captures``' forwards of ``model`` again, in order, with ``hook(path)``'s forward
    hook on every module that could name an origin (:func:`says_nothing`); put the
    generators and buffers back afterwards. Under ``no_grad``, or with ``grad`` in grad mode
    (a forward that differentiates inside itself, ``torch.autograd.grad``, needs it: the
    caller's second try). ``gens``: torch's generators the forwards may draw from, set back
    afterwards whether or not a capture read them. Returns None, or why it could not run
    (the parameters changed since, or the exception the model raised on the replay)."""
    params = list(model.parameters())
    if any(c.versions is not None and c.versions != param_versions(params) for c in captures):
        return "its parameters changed before it was checked: an optimizer stepping inside the backward"
    handles = [m.register_forward_hook(hook(path)) for path, m in hookable(model)]
    # The replay updates copies of the buffers: the originals are untouched, and their
    # in-place versions too (autograd checks them: BatchNorm saves its running statistics).
    buffers = [(m, name, b) for m in model.modules() for name, b in m.named_buffers(recurse=False)]
    now = {g: g.get_state() for g in [*gens, *(g for c in captures for g, _ in c.rng)]}
    host_now = host_states()  # (drawn from by some models' LayerDrop; numpy not imported for it)
    try:
        for m, name, b in buffers:
            setattr(m, name, b.detach().clone())
        for c in captures:
            for g, state in c.rng:
                g.set_state(state)
            if c.host is not None:  # (a model that draws from Python's or NumPy's generator)
                set_host_states(c.host)
            with contextlib.ExitStack() as stack:
                # no second graph, unless asked for: only the module outputs kept
                stack.enter_context(torch.enable_grad() if grad else torch.no_grad())
                for device, enabled, dtype in c.autocast:
                    stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))
                model(*copied(c.args), **copied(c.kwargs))
    except Exception as exc:  # the model's own failure on a second run: said, not raised
        return f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
    finally:
        for handle in handles:
            handle.remove()
        for m, name, b in buffers:
            setattr(m, name, b)
        for g, state in now.items():
            g.set_state(state)
        set_host_states(host_now)
    return None


def copied(value: Any) -> Any:
    """``value`` with each tensor in it a copy — in tuples, named tuples, lists, dicts and
    dict-like containers (``OrderedDict``, a ``UserDict`` such as transformers'
    ``BatchEncoding``) too: a forward that changes its input in place (``x.sub_(mean)``)
    changes the copy on the replay, not the tensor the first forward saved for its backward
    (whose version autograd checks). Other objects are passed as they are."""
    return rebuilt(value, True)


def held(value: Any) -> Any:
    """``value``'s containers copied as :func:`copied` copies them, its tensors not (the
    same tensors, no memory): what a forward does to the containers it is given (a dict
    batch's ``pop``) leaves the copy as it was."""
    if type(value) is torch.Tensor:  # the usual argument, without the walk
        return value
    if type(value) is tuple and all(type(v) is torch.Tensor for v in value):  # the usual args
        return value  # (a tuple of tensors: nothing in it to copy)
    try:
        return rebuilt(value, False)
    except Exception:  # (a container that cannot be copied, nested past Python's limit: as given)
        return value


def rebuilt(value: Any, tensors: bool) -> Any:
    """``value`` with its containers copied, and its tensors too if ``tensors``."""
    if isinstance(value, torch.Tensor):  # (requires_grad kept: a forward may differentiate by it)
        return value.detach().clone().requires_grad_(value.requires_grad) if tensors else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(rebuilt(v, tensors) for v in value))
    if type(value) in (tuple, list):
        return type(value)(rebuilt(v, tensors) for v in value)
    if isinstance(value, (dict, UserDict)):
        new = copy.copy(value)  # (the same kind of mapping, its other state kept)
        for key in list(value.keys()):
            new[key] = rebuilt(value[key], tensors)
        return new
    return value
