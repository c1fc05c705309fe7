"""``--model SPEC``: how commands find the user's model.

Grammar (shared by ``gradcheck``, ``nancheck`` and ``ckpt``):

- ``torchvision:NAME[?key=value&…]`` — a torchvision model builder, e.g.
  ``torchvision:resnet18?num_classes=10`` (values are Python literals; ``true``/``false``
  and bare words work too);
- ``path/to/file.py:factory[?…]`` — a callable in a Python file;
- ``package.module:factory[?…]`` — a callable in an importable module;
- a built-in small model: ``mlp``, ``mlp-dropout``, ``mlp-unused``, ``cnn``, ``cnn-bn``
  (see :data:`BUILTINS`); they adapt to ``--input-shape`` and ``--num-classes``.

The factory is called with the keyword arguments and must return an ``nn.Module``.
Resolved factories are picklable: DDP ranks in fresh interpreters rebuild them (a file's
module travels by value through cloudpickle, so its classes need not be importable there).
This module imports torch; commands import it only when they run.
A spec that cannot be resolved is an :class:`~gpudiag.errors.InputError` (exit 2) saying
what was tried.
"""

from __future__ import annotations

import ast
import difflib
import importlib
import importlib.util
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gpudiag.defaults import INPUT_SHAPE, NUM_CLASSES
from gpudiag.errors import CannotRunHere, InputError, from_user_code
from gpudiag.gcpause import paused

#: Built-in models: name → what it is (all take the input shape and the class count).
BUILTINS = {
    "mlp": "Flatten → Linear(·, 64) → ReLU → Linear(64, K): no BatchNorm, no dropout",
    "mlp-dropout": "mlp with Dropout(p=0.5) after the ReLU",
    "mlp-unused": "mlp plus a Linear layer forward never uses (DDP needs find_unused_parameters)",
    "cnn": "Conv(·, 8, 3) → ReLU → AdaptiveAvgPool(4) → Flatten → Linear(128, K)",
    "cnn-bn": "cnn with BatchNorm2d(8) after the convolution",
}


def _parse_kwargs(query: str, spec: str) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    for part in filter(None, query.split("&")):
        key, sep, raw = part.partition("=")
        if not sep or not key.isidentifier():
            raise InputError(f"bad --model {spec!r}: expected key=value after '?', got {part!r}")
        lowered = raw.lower()
        if lowered in ("true", "false", "none"):
            kwargs[key] = {"true": True, "false": False, "none": None}[lowered]
            continue
        try:
            kwargs[key] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            kwargs[key] = raw
    return kwargs


@dataclass(frozen=True)
class ModelFactory:
    """A picklable model factory: ``factory()`` builds a fresh ``nn.Module``."""

    spec: str
    kind: str  # "builtin" | "torchvision" | "file" | "module"
    target: str  # builtin name, torchvision name, file path or module name
    attr: str = ""
    kwargs: dict[str, Any] = field(default_factory=dict)
    input_shape: tuple[int, ...] = INPUT_SHAPE
    num_classes: int = 10

    def __call__(self) -> nn.Module:
        if self.kind == "builtin":
            model = _builtin(self.target, self.input_shape, self.num_classes)
        else:
            model = self._callable()(**self.kwargs)
        if not isinstance(model, nn.Module):
            raise InputError(f"--model {self.spec!r} returned {type(model).__name__}, not a torch nn.Module")
        return model

    def _callable(self) -> Any:
        if self.kind == "torchvision":
            return _torchvision().models.get_model_builder(self.target)
        if self.kind == "file":
            return getattr(_load_file(self.target), self.attr)
        return getattr(importlib.import_module(self.target), self.attr)


def _torchvision() -> Any:
    try:
        with paused(freeze=True):  # (torchvision imports torch._dynamo: ~1.4 s of imports)
            return importlib.import_module("torchvision")
    except ImportError as exc:
        raise CannotRunHere("torchvision is not installed: pip install torchvision") from exc


#: Modules loaded from a user's file are named this plus a hash: no other process can
#: import them by that name.
USER_MODULE_PREFIX = "gpudiag_user_model_"


def _load_file(path: str) -> Any:
    name = f"{USER_MODULE_PREFIX}{abs(hash(path))}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise InputError(f"cannot load {path} as Python")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:
        del sys.modules[name]
        raise from_user_code(exc, f"importing {path}") from exc
    # No other process can import it by that name: its functions and classes (a model
    # built from it, sent to DDP ranks) are pickled by value.
    import cloudpickle

    cloudpickle.register_pickle_by_value(module)
    return module


def load_function(spec: str, flag: str) -> Any:
    """The callable ``NAME`` of a Python file ``FILE.py:NAME`` (``flag`` names the option in
    errors: exit 2 for a missing file or name). Loaded as ``--model`` files are, so DDP
    ranks receive it by value."""
    target, sep, attr = spec.rpartition(":")
    if not sep or not target.endswith(".py") or not attr.isidentifier():
        raise InputError(f"bad {flag} {spec!r}: expected FILE.py:NAME")
    path = Path(target)
    if not path.is_file():
        raise InputError(f"{flag} {spec!r}: file {target} does not exist")
    found = getattr(_load_file(str(path.resolve())), attr, None)
    if not callable(found):
        raise InputError(f"{flag} {spec!r}: {target} has no callable {attr!r}")
    return found


def resolve_model(
    spec: str, input_shape: tuple[int, ...] = INPUT_SHAPE, num_classes: int = NUM_CLASSES
) -> ModelFactory:
    """Check ``spec`` and return its factory (nothing is built yet)."""
    text, _, query = spec.partition("?")
    kwargs = _parse_kwargs(query, spec)
    common: dict[str, Any] = {"kwargs": kwargs, "input_shape": tuple(input_shape), "num_classes": num_classes}
    if text in BUILTINS:
        if kwargs:
            raise InputError(f"built-in model {text!r} takes no arguments (use --input-shape/--num-classes)")
        return ModelFactory(spec, "builtin", text, **common)
    if text.startswith("torchvision:"):
        name = text.removeprefix("torchvision:")
        names = _torchvision().models.list_models()
        if name not in names:
            close = difflib.get_close_matches(name, names, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise InputError(f"torchvision has no model {name!r}{hint}")
        trained = [
            k for k in ("weights", "weights_backbone", "pretrained") if kwargs.get(k) not in (None, False)
        ]
        if trained:
            raise InputError(
                f"--model {spec!r}: {trained[0]}= would download trained weights; gpudiag never downloads, "
                "and comparing strategies needs none (random weights exercise the same arithmetic): drop it"
            )
        return ModelFactory(spec, "torchvision", name, **common)
    target, sep, attr = text.rpartition(":")
    if not sep or not attr.isidentifier() or not target:
        known = ", ".join(BUILTINS)
        raise InputError(
            f"bad --model {spec!r}: expected torchvision:NAME, path/to/file.py:factory, "
            f"package.module:factory or a built-in ({known}){_did_you_mean(text)}"
        )
    if not (target.endswith(".py") or "/" in target) and not importable_name(target):
        raise InputError(
            f"--model {spec!r}: {target!r} is not a module name (package.module) nor a .py file; "
            f"a file is path/to/file.py:{attr}"
        )
    here = Path(target.replace(".", "/") + ".py")
    if not (target.endswith(".py") or "/" in target) and here.is_file() and not _importable(target):
        target = str(here)  # (mymodel:build beside mymodel.py: the file, as python -m would find it)
    if target.endswith(".py") or "/" in target:
        path = Path(target)
        if not path.is_file():
            raise InputError(f"--model {spec!r}: file {target} does not exist")
        module = _load_file(str(path.resolve()))
        if not callable(getattr(module, attr, None)):
            raise InputError(f"--model {spec!r}: {target} has no callable {attr!r}")
        return ModelFactory(spec, "file", str(path.resolve()), attr, **common)
    try:
        module = importlib.import_module(target)
    except ImportError as exc:
        raise InputError(
            f"--model {spec!r}: cannot import module {target!r} ({exc}); a file is path/to/file.py:{attr}"
        ) from exc
    if not callable(getattr(module, attr, None)):
        raise InputError(f"--model {spec!r}: module {target} has no callable {attr!r}")
    return ModelFactory(spec, "module", target, attr, **common)


#: The folder of a bug-report bundle that carries a ``--model`` file's source (``model/NAME.py``):
#: ``gpudiag replay --trust-bundle`` runs that copy, from whatever folder it runs in.
BUNDLE_MODEL_FOLDER = "model"


def bundle_files(factory: ModelFactory) -> dict[str, bytes]:
    """What a bundle carries for a resolved ``--model``: a Python file's source under
    :data:`BUNDLE_MODEL_FOLDER` (nothing for built-ins, torchvision and importable modules,
    which a replaying machine has by name)."""
    if factory.kind != "file":
        return {}
    path = Path(factory.target)
    return {f"{BUNDLE_MODEL_FOLDER}/{path.name}": path.read_bytes()}


def importable_name(name: str) -> bool:
    """Whether ``name`` is spelt as an absolute module name (``pkg.mod``; not ``..``, ``.x``)."""
    return all(part.isidentifier() for part in name.split("."))


def _importable(name: str) -> bool:
    """Whether ``import name`` would find something (without importing it)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _did_you_mean(text: str) -> str:
    """A hint for a spec without ``:``: a torchvision name, a built-in, or a file missing its factory."""
    if text.endswith(".py"):
        return f"; a file needs its factory: {text}:build (the function that returns the model)"
    close = difflib.get_close_matches(text, list(BUILTINS), n=1)
    if close:
        return f"; did you mean {close[0]}?"
    try:
        names = _torchvision().models.list_models()
    except CannotRunHere:
        return ""
    if text in names:
        return f"; did you mean torchvision:{text}?"
    close = difflib.get_close_matches(text, names, n=1)
    return f"; did you mean torchvision:{close[0]}?" if close else ""


class PassThrough(nn.Linear):
    """A layer that sits in the model with parameters but passes its input through:
    its parameters never get a gradient (what ``find_unused_parameters`` is for)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _builtin(name: str, input_shape: tuple[int, ...], classes: int) -> nn.Module:
    features = math.prod(input_shape)
    if name.startswith("mlp"):
        layers: list[nn.Module] = [nn.Flatten(), nn.Linear(features, 64), nn.ReLU()]
        if name == "mlp-dropout":
            layers.append(nn.Dropout(0.5))
        layers.append(nn.Linear(64, classes))
        if name == "mlp-unused":
            layers.append(PassThrough(classes, classes))
        return nn.Sequential(*layers)
    if len(input_shape) != 3:
        raise InputError(
            f"built-in {name!r} needs --input-shape C,H,W, got {','.join(map(str, input_shape))}"
        )
    layers = [nn.Conv2d(input_shape[0], 8, 3, padding=1)]
    if name == "cnn-bn":
        layers.append(nn.BatchNorm2d(8))
    layers += [nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(8 * 16, classes)]
    return nn.Sequential(*layers)


#: ``--input-dtype``: the dtype of generated inputs (``long`` for token ids).
INPUT_DTYPES = {"float": torch.float32, "long": torch.int64, "int": torch.int32}


def check_input_range(dtype: str, value_range: tuple[float, float] | None) -> None:
    """Refuse a dtype/range pair that cannot make inputs (exit 2), before anything runs."""
    if dtype not in INPUT_DTYPES:
        raise InputError(f"--input-dtype {dtype!r}: expected one of {', '.join(INPUT_DTYPES)}")
    if value_range is None:
        if dtype != "float":
            raise InputError(
                f"--input-dtype {dtype} needs --input-range LO,HI: the values to draw from "
                "(e.g. 0,30522 for token ids of a 30522-word vocabulary)"
            )
        return
    lo, hi = value_range
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise InputError(f"--input-range {lo:g},{hi:g}: expected finite LO < HI")
    if dtype != "float" and (lo != int(lo) or hi != int(hi) or hi - lo < 1):
        raise InputError(f"--input-range {lo:g},{hi:g}: integer inputs need whole numbers LO < HI")


def random_inputs(
    generator: torch.Generator,
    batch_size: int,
    input_shape: tuple[int, ...],
    dtype: str = "float",
    value_range: tuple[float, float] | None = None,
) -> torch.Tensor:
    """Inputs of ``(batch_size, *input_shape)``: standard normal floats by default; with
    ``value_range`` (LO, HI), floats uniform in [LO, HI) or integers LO ≤ x < HI
    (``torch.randint``) for the integer dtypes."""
    check_input_range(dtype, value_range)
    shape = (batch_size, *input_shape)
    if value_range is None:
        return torch.randn(*shape, generator=generator)
    lo, hi = value_range
    if dtype == "float":
        return torch.rand(*shape, generator=generator) * (hi - lo) + lo
    return torch.randint(int(lo), int(hi), shape, generator=generator, dtype=INPUT_DTYPES[dtype])


def random_batch(
    factory: Any,
    batch_size: int,
    input_shape: tuple[int, ...],
    num_classes: int,
    loss: str,
    seed: int = 0,
    output: int | str | None = None,
    input_dtype: str = "float",
    input_range: tuple[float, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A seeded random batch: inputs of ``(batch_size, *input_shape)`` (see
    :func:`random_inputs`) and targets for them (:func:`random_targets`)."""
    generator = torch.Generator().manual_seed(seed)
    inputs = random_inputs(generator, batch_size, input_shape, input_dtype, input_range)
    return inputs, random_targets(factory, inputs, num_classes, loss, generator, seed, output)


def random_targets(
    factory: Any,
    inputs: Any,
    num_classes: int,
    loss: str,
    generator: torch.Generator,
    seed: int = 0,
    output: int | str | None = None,
) -> torch.Tensor:
    """Targets for ``inputs`` (a tensor, a tuple of tensors or a dict of tensors): class
    indices below ``num_classes`` for ``ce`` losses, standard-normal values shaped like the
    model's output for ``mse`` losses (read from one forward pass in eval mode)."""
    from gpudiag.runtime.batch import batch_size, call_model, select_output, split

    rows = batch_size(inputs)
    if loss.startswith("ce"):
        return torch.randint(0, num_classes, (rows,), generator=generator)
    torch.manual_seed(seed)
    probe = factory().eval()
    first = split(inputs, (rows + 1) // 2)[0]  # two samples (one if there is one)
    try:
        with torch.no_grad():
            out = call_model(probe, first)
    except (Exception, SystemExit) as exc:
        raise from_user_code(exc, "the model, on the inputs,") from exc
    out = select_output(out, output)  # the part the loss takes (tuple, dict, .logits)
    return torch.randn(rows, *out.shape[1:], generator=generator)


def load_inputs(path: str) -> Any:
    """The batch in a file written with ``torch.save``: a tensor, a tuple (or list) of
    tensors, or a dict of tensors, all with the same first (batch) dimension. Read with
    ``weights_only=True``: the file runs no code. Bad files are an :class:`InputError`."""
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError as exc:
        raise InputError(f"--inputs {path}: no such file") from exc
    except Exception as exc:  # a damaged file, or one that is not torch.save's
        why = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
        raise InputError(f"--inputs {path}: not a file of tensors torch.save wrote ({why})") from exc
    if isinstance(loaded, dict):
        parts = list(loaded.values())
    else:
        parts = list(loaded) if isinstance(loaded, (tuple, list)) else [loaded]
    if not parts or not all(isinstance(t, torch.Tensor) and t.dim() >= 1 for t in parts):
        raise InputError(
            f"--inputs {path}: expected a tensor, a tuple of tensors or a dict of tensors, "
            "each with a batch dimension"
        )
    rows = sorted({t.shape[0] for t in parts})
    if len(rows) != 1:
        raise InputError(f"--inputs {path}: the tensors' first (batch) dimensions differ: {rows}")
    return tuple(loaded) if isinstance(loaded, list) else loaded


#: Wrappers whose state-dict keys gain a prefix: DataParallel/DDP (``module.``) and
#: ``torch.compile`` (``_orig_mod.``).
WRAPPER_ATTRS = (("module", ("DataParallel", "DistributedDataParallel")), ("_orig_mod", ("OptimizedModule",)))


def unwrap(model: nn.Module) -> tuple[nn.Module, list[str]]:
    """The model inside DataParallel / DDP / ``torch.compile`` wrappers (any depth), and
    the prefixes peeled off (``["module."]``)."""
    peeled = []
    while True:
        for attr, names in WRAPPER_ATTRS:
            if type(model).__name__ in names and isinstance(getattr(model, attr, None), nn.Module):
                model = getattr(model, attr)
                peeled.append(attr + ".")
                break
        else:
            return model, peeled
