"""What train mode switches on in a model: found by watching one forward, and neutralised.

Two things make strategies disagree although nothing is broken, and both are
train-mode behaviour:

- **batch statistics**: a BatchNorm module in train mode normalises with the statistics
  of the batch it sees, so each replica's sub-batch gives other numbers than the whole
  batch (every ``torch.nn.modules.batchnorm._BatchNorm``: BatchNorm1d/2d/3d, SyncBatchNorm,
  the lazy ones), and so does a batch-norm op in training mode called without a module
  (``F.batch_norm(..., training=True)``: aten ``native_batch_norm`` and its kin over a
  batch of more than one sample; instance norm, which runs it over a batch of one, is not);
- **random draws in forward**: dropout of every kind, attention dropout, stochastic depth /
  drop path, RReLU, noise injection, random masking — any aten op torch tags
  ``nondeterministic_seeded`` (``bernoulli_``, ``native_dropout``, ``rrelu_with_noise``,
  ``rand``, ``randn``, ``randperm``, …) run with an effect.

:func:`probe` runs one forward and names the module (its path and class) where each of
these happens, by the op torch runs — not by a list of classes. :func:`neutralise` turns a
model into its *controlled* form: BatchNorm on running statistics (``module.eval()``) and,
while its forward runs, every random draw torch offers replaced by its expected value —
dropout (``F.dropout``, ``dropout1d/2d/3d``, alpha dropout, the dropout inside
``F.multi_head_attention_forward``, ``F.scaled_dot_product_attention`` and between RNN
layers) becomes the identity, RReLU uses its mean slope, ``bernoulli(p)`` gives ``p``,
``rand``/``uniform_`` the middle of their range, ``randn``/``normal_`` the mean, and
``F.batch_norm`` given running statistics normalises with them (``training=False``). That is
what eval mode does for dropout, RReLU and stochastic depth, but gradients still flow
and every other train-mode switch (auxiliary heads, a model's own ``if self.training``)
stays as it is. Draws that have no expected value of their kind (``randint``,
``randperm``, ``multinomial``, …) are left, and the RNG is re-seeded at the start of every
forward so that every replica draws from the same state. Whatever still draws is
reported by :func:`probe` with ``controlled=True``.

Activation checkpointing (``torch.utils.checkpoint``, either flavour; Hugging Face
``gradient_checkpointing_enable()``) runs parts of the forward again during backward. The
controlled model enters the controlled form in every module's forward, so the recompute
draws as the forward did (the expected value) — otherwise it would draw real masks:
torch's ``CheckpointError`` (non-reentrant) or gradients of another forward (reentrant).
A draw written in the checkpointed function itself, outside any module, is not covered.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from gpudiag.runtime.batch import call_model
from gpudiag.runtime.numerics import nondeterministic_alerts


@dataclass(frozen=True)
class Site:
    """Where train-mode behaviour happens: the module's path in the model ("" for the
    model itself), its class, and what it does there (an aten op, or ``batch statistics``)."""

    module: str
    cls: str
    what: str

    def describe(self) -> str:
        return f"{self.cls} at {self.module or '(the model)'!r} ({self.what})"

    def to_json(self) -> dict[str, str]:
        return {"module": self.module, "class": self.cls, "what": self.what}


@dataclass(frozen=True)
class TrainModeSites:
    """What one forward of a model did in train mode (see :func:`probe`)."""

    batch_statistics: tuple[Site, ...]
    random: tuple[Site, ...]
    #: modules whose forward wrote a parameter in place (a data-dependent init, an update
    #: in forward): per-replica state no mode can take away
    state_writes: tuple[Site, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.batch_statistics or self.random)


# -- finding it -----------------------------------------------------------------------------


def probe(
    model: nn.Module, inputs: Any, *, controlled: bool = False, seed: int = 0, given: bool = False
) -> TrainModeSites:
    """Run one forward of ``model`` (in its own mode, on its device) on ``inputs`` and
    return the modules that normalised with batch statistics and those that drew random
    numbers with an effect. With ``controlled``, the model is probed as :func:`neutralise`
    leaves it: what it reports is what controlled mode cannot take away. ``model`` is not
    changed: a copy is probed (a forward in train mode updates BatchNorm statistics) —
    unless ``given``: the caller hands the model over and never uses it again, so it is
    probed itself (one copy of the model less: 0.03–0.1 s for resnet18 here)."""
    if not given:
        model = copy.deepcopy(model)
    if controlled:
        neutralise(model, seed)
    stack: list[str] = []
    paths = {m: n for n, m in model.named_modules()}
    batch_stats: dict[str, Site] = {}
    handles = []

    def enter(module: nn.Module, _args: Any) -> None:
        stack.append(paths[module])
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and (
            module.training or module.running_mean is None
        ):
            name = paths[module]
            batch_stats.setdefault(name, Site(name, type(module).__name__, "batch statistics"))

    def leave(_module: nn.Module, _args: Any, _out: Any) -> None:
        stack.pop()

    for module in paths:
        handles.append(module.register_forward_pre_hook(enter))
        handles.append(module.register_forward_hook(leave, always_call=True))
    draws = _SeededDraws(lambda: stack[-1] if stack else "", _storages(model.parameters()))
    try:
        with torch.enable_grad(), nondeterministic_alerts(), draws:  # (the runs report alerts)
            call_model(model, inputs)
    finally:
        for handle in handles:
            handle.remove()
    classes = {n: type(m).__name__ for m, n in paths.items()}
    for where in draws.batch_statistics:  # batch-norm ops without a BatchNorm module
        batch_stats.setdefault(where, Site(where, classes.get(where, "?"), "batch statistics"))
    random = {(where, op): Site(where, classes.get(where, "?"), op) for where, op in draws.found}
    writes = {
        w: Site(w, classes.get(w, "?"), f"writes a parameter ({op})") for w, op in reversed(draws.writes)
    }
    return TrainModeSites(
        tuple(batch_stats.values()), tuple(random.values()), tuple(reversed(writes.values()))
    )


def _storages(tensors: Any) -> set[int]:
    """The storage addresses of ``tensors`` (those that have a plain storage)."""
    out = set()
    for t in tensors:
        try:
            out.add(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # (sparse, meta, a wrapper subclass)
            continue
    return out


#: Arguments whose value says a seeded op draws nothing (dropout with p 0, not training).
_NO_EFFECT = {"p": 0.0, "dropout_p": 0.0, "train": False, "training": False}


#: aten batch-norm ops; those with a ``training`` argument normalise with batch statistics
#: when it is true, ``_batch_norm_with_update`` always.
_BATCH_NORM_OPS = frozenset(
    {
        "batch_norm",
        "_batch_norm_impl_index",
        "native_batch_norm",
        "_native_batch_norm_legit",
        "_batch_norm_with_update",
        "cudnn_batch_norm",
        "miopen_batch_norm",
    }
)


class _SeededDraws(TorchDispatchMode):
    """Records (module, op) for every aten op tagged ``nondeterministic_seeded`` that runs
    with an effect (an attention kernel with ``dropout_p=0`` draws nothing), and the
    module of every batch-norm op that normalises with batch statistics."""

    def __init__(self, where: Callable[[], str], params: set[int] | None = None):
        super().__init__()
        self.where = where
        self.params = params or set()
        self.found: list[tuple[str, str]] = []
        self.batch_statistics: list[str] = []
        self.writes: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded in func.tags and _draws(func, args, kwargs):
            self.found.append((self.where(), str(func.overloadpacket.__name__)))
        elif _batch_statistics(func, args, kwargs):
            self.batch_statistics.append(self.where())
        elif self.params and _writes(func, args, self.params):
            self.writes.append((self.where(), str(func.overloadpacket.__name__)))
        return func(*args, **kwargs)


def _writes(func: Any, args: Any, params: set[int]) -> bool:
    """Whether ``func`` writes its first argument in place and that is a parameter."""
    schema = getattr(func, "_schema", None)
    first = schema.arguments[0] if schema is not None and schema.arguments else None
    alias = getattr(first, "alias_info", None)
    if alias is None or not alias.is_write or not args or not isinstance(args[0], torch.Tensor):
        return False
    try:
        return args[0].untyped_storage().data_ptr() in params
    except (RuntimeError, NotImplementedError):
        return False


def _batch_statistics(func: Any, args: Any, kwargs: dict[str, Any]) -> bool:
    """A batch-norm op in training mode over more than one sample (instance norm runs it
    on the batch viewed as one sample: statistics per sample, nothing shared)."""
    if str(func.overloadpacket.__name__) not in _BATCH_NORM_OPS:
        return False
    training = True
    schema = getattr(func, "_schema", None)
    for i, argument in enumerate(schema.arguments if schema is not None else ()):
        if argument.name == "training":
            value = kwargs["training"] if "training" in kwargs else args[i] if i < len(args) else True
            training = bool(value)
    source = args[0] if args else kwargs.get("input")
    return training and isinstance(source, torch.Tensor) and source.dim() > 0 and source.size(0) > 1


def _draws(func: Any, args: Any, kwargs: dict[str, Any]) -> bool:
    schema = getattr(func, "_schema", None)
    if schema is None:
        return True
    for i, argument in enumerate(schema.arguments):
        if argument.name in kwargs:
            value = kwargs[argument.name]
        else:
            value = args[i] if i < len(args) else getattr(argument, "default_value", None)
        if argument.name in _NO_EFFECT and value is not None and value == _NO_EFFECT[argument.name]:
            return False
    return True


# -- taking it away -------------------------------------------------------------------------


def neutralise(model: nn.Module, seed: int) -> nn.Module:
    """``model`` in controlled form (in place; returned): BatchNorm modules in eval mode,
    and hooks on the model that run each forward under :class:`ExpectedDraws` after
    ``torch.manual_seed(seed)`` (the CPU and every CUDA generator). The hooks are the
    model's own, so DataParallel replicas and DDP's wrapped module run them too.

    Every submodule gets the hooks too (without the re-seeding): activation
    checkpointing runs modules again during backward, outside the model's forward, and
    torch does not carry a function mode into backward — so a module run there enters
    :class:`ExpectedDraws` itself, and the recompute draws what the forward drew."""
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.eval()
    modes: list[ExpectedDraws | None] = []  # per running forward: the mode it entered

    def enter(_module: nn.Module, _args: Any) -> None:
        if any(m is not None for m in modes):
            modes.append(None)  # inside a forward already under the mode
            return
        modes.append(ExpectedDraws())
        modes[-1].__enter__()  # type: ignore[union-attr]

    def enter_model(module: nn.Module, args: Any) -> None:
        torch.manual_seed(seed)
        enter(module, args)

    def leave(_module: nn.Module, _args: Any, _out: Any) -> None:
        if modes:
            mode = modes.pop()
            if mode is not None:
                mode.__exit__(None, None, None)

    for module in model.modules():
        module.register_forward_pre_hook(enter_model if module is model else enter)
        module.register_forward_hook(leave, always_call=True)
    return model


class ExpectedDraws(TorchFunctionMode):
    """Random draws replaced by their expected value while it is active (see the module's
    docstring for the list). Calls it does not know pass through unchanged."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        rewrite = _REWRITES.get(func)
        if rewrite is None:
            return func(*args, **kwargs)
        return rewrite(func, tuple(args), kwargs)


def _identity(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Dropout in eval mode: the input itself."""
    return args[0] if args else kwargs["input"]


def _with(name: str, value: Any) -> Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]:
    """Call a Python function with one argument (by name) set to ``value``."""

    def rewrite(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        bound = inspect.signature(func).bind(*args, **kwargs)
        bound.arguments[name] = value
        return func(*bound.args, **bound.kwargs)

    return rewrite


def _at(index: int, name: str, value: Any) -> Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]:
    """Call a builtin with the argument at ``index`` (or keyword ``name``) set to ``value``."""

    def rewrite(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if len(args) > index:
            args = (*args[:index], value, *args[index + 1 :])
        else:
            kwargs[name] = value
        return func(*args, **kwargs)

    return rewrite


def _batch_norm(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``F.batch_norm`` given running statistics: normalise with them (as in eval mode);
    without them there is nothing else to normalise with, and it runs as it is."""
    bound = inspect.signature(func).bind(*args, **kwargs)
    given = bound.arguments
    if given.get("running_mean") is not None and given.get("running_var") is not None:
        given["training"] = False
    return func(*bound.args, **bound.kwargs)


def _torch_batch_norm(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``torch.batch_norm(input, weight, bias, running_mean, running_var, training, …)``:
    as :func:`_batch_norm`."""
    if len(args) > 5 and args[3] is not None and args[4] is not None:
        args = (*args[:5], False, *args[6:])
    return func(*args, **kwargs)


def _rnn_without_dropout(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``torch.lstm``/``gru``/``rnn_*``: the dropout between layers (their only float
    argument) set to 0; ``train`` stays (cuDNN's backward needs it)."""
    args = tuple(0.0 if type(a) is float else a for a in args)
    if "dropout" in kwargs:
        kwargs["dropout"] = 0.0
    return func(*args, **kwargs)


def _filled(value: Callable[[tuple[Any, ...], dict[str, Any]], float]) -> Any:
    """A draw into a new tensor, then filled with its expected value."""

    def rewrite(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        out = func(*args, **kwargs)
        with torch.no_grad():
            return out.fill_(value(args, kwargs))

    return rewrite


def _in_place(names: tuple[str, ...], defaults: tuple[Any, ...], mean: Callable[..., Any]) -> Any:
    """``tensor.bernoulli_(p)``/``uniform_(from, to)``/``normal_(mean, std)``: the tensor
    filled with the distribution's mean (parameters by position or by name)."""

    def rewrite(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        tensor, given = args[0], args[1:]
        params = [
            given[i] if i < len(given) else kwargs.get(name, default)
            for i, (name, default) in enumerate(zip(names, defaults, strict=True))
        ]
        expected = mean(*params)
        with torch.no_grad():
            if isinstance(expected, torch.Tensor):
                return tensor.copy_(expected.expand_as(tensor))
            return tensor.fill_(expected)

    return rewrite


def _bernoulli(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``torch.bernoulli(input)`` draws 1 with probability ``input``: expected ``input``;
    with ``p`` given, ``p`` everywhere."""
    source = args[0] if args else kwargs["input"]
    p = args[1] if len(args) > 1 else kwargs.get("p")
    if p is None:
        return source.detach().clone()
    return torch.full_like(source, float(p))


def _normal(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    out = func(*args, **kwargs)
    mean = args[0] if args else kwargs.get("mean", 0.0)
    with torch.no_grad():
        if isinstance(mean, torch.Tensor):
            return out.copy_(mean.expand_as(out))
        return out.fill_(float(mean))


_DROPOUTS = (
    F.dropout,
    F.dropout1d,
    F.dropout2d,
    F.dropout3d,
    F.alpha_dropout,
    F.feature_alpha_dropout,
    torch.dropout,
    torch.alpha_dropout,
    torch.feature_dropout,
    torch.feature_alpha_dropout,
    getattr(torch.Tensor, "dropout", None),
)
_REWRITES: dict[Any, Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]] = {
    **{f: _identity for f in _DROPOUTS if f is not None},
    F.rrelu: _with("training", False),
    F.rrelu_: _with("training", False),
    torch.rrelu: _at(3, "training", False),
    torch.rrelu_: _at(3, "training", False),
    F.multi_head_attention_forward: _with("dropout_p", 0.0),
    F.scaled_dot_product_attention: _at(4, "dropout_p", 0.0),
    torch.lstm: _rnn_without_dropout,
    torch.gru: _rnn_without_dropout,
    torch.rnn_tanh: _rnn_without_dropout,
    torch.rnn_relu: _rnn_without_dropout,
    torch.bernoulli: _bernoulli,
    torch.Tensor.bernoulli: _bernoulli,
    torch.Tensor.bernoulli_: _in_place(("p",), (0.5,), lambda p: p),
    torch.rand: _filled(lambda a, k: 0.5),
    torch.rand_like: _filled(lambda a, k: 0.5),
    torch.Tensor.uniform_: _in_place(("from", "to"), (0.0, 1.0), lambda a, b: (a + b) / 2),
    torch.randn: _filled(lambda a, k: 0.0),
    torch.randn_like: _filled(lambda a, k: 0.0),
    torch.Tensor.normal_: _in_place(("mean", "std"), (0.0, 1.0), lambda m, s: m),
    torch.normal: _normal,
    F.batch_norm: _batch_norm,
    torch.batch_norm: _torch_batch_norm,
}
