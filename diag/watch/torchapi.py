"""What the watcher needs from torch and Python beside tensors: autograd's end-of-backward
queue, a hook on the gradient flowing into an output, which modules a forward hook would
tell nothing about, and the user's frame that a warning points at."""

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gpudiag.errors import CannotRunHere

#: Packages whose frames a warning skips to point at the user's line (``loss.backward()``).
LIBRARIES = ("gpudiag", "torch", "lightning", "pytorch_lightning", "transformers", "accelerate")

#: Activations that make a finite output of a finite input (bounded, or at most |x|): a
#: non-finite value never arises in them, so their forward hooks (what a hook costs is most
#: of what watching costs a small model: torch's slow call path) would name nothing.
CANNOT_ARISE = (
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


def end_of_backward_callback() -> Any:
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


def on_gradient(
    t: torch.Tensor,
    seen: Callable[[torch.Tensor | None], None],
    seen_first: Callable[[tuple[torch.Tensor | None, ...]], None],
) -> Any:
    """Have ``seen`` get the gradient flowing into ``t`` as the backward reaches it: a
    pre-hook on the autograd node that made ``t`` (less than half of what
    ``Tensor.register_hook`` costs, which builds a Python hook dictionary and handle on
    every step's output) — ``seen_first``, given the node's gradients, where ``t`` is its
    node's first output (the usual case: no closure made), else ``seen`` with ``t``'s own
    picked among them; a tensor hook where ``t`` has no node (a leaf) or the node takes no
    pre-hooks. Returns that tensor hook's handle (None for a node's pre-hook, which goes with
    the step's graph): a leaf — a parameter the model returns — outlives the step, and its
    hooks would pile up, one a forward, unless the caller removes them."""
    prehook = getattr(t.grad_fn, "register_prehook", None)
    if prehook is None:
        return t.register_hook(seen)
    if (index := t.output_nr) == 0:
        prehook(seen_first)
    else:
        prehook(lambda grads: seen(grads[index] if index < len(grads) else None))
    return None


def user_stacklevel() -> int:
    """The ``stacklevel`` for a warning raised from inside the watcher that points at the
    first frame outside gpudiag, torch and the training libraries: the user's
    ``loss.backward()`` (or ``trainer.fit``). Python 3.12's ``skip_file_prefixes``, by hand."""
    frame = sys._getframe(1)  # the caller of this function: warnings.warn's caller
    level = 1
    while frame is not None:
        module = str(frame.f_globals.get("__name__", ""))
        if module.partition(".")[0] not in LIBRARIES:
            return level
        frame, level = frame.f_back, level + 1  # type: ignore[assignment]
    return 1


def says_nothing(module: nn.Module) -> bool:
    """Whether a module's forward hook could never name a fault's origin, so it is not
    hooked: an ``nn.Sequential`` (its output is its last child's, its input its first's),
    ``nn.Identity``, and the activations of :data:`CANNOT_ARISE` unless ``inplace`` (an
    in-place one is hooked: it tells a module's output changed by it from one changed by
    other code, :meth:`Seen.changed_since`)."""
    kind = type(module)
    if kind is nn.Sequential or kind is nn.Identity:
        return True
    return kind in CANNOT_ARISE and not getattr(module, "inplace", False)
