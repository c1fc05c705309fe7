"""Python's cyclic garbage collector, paused where it only costs time.

A collection of the oldest generation walks every object alive. Importing torch and
torchvision (which imports ``torch._dynamo``) creates about 340,000 objects and, with the
collector on, triggers several such walks on the way; every later full collection walks
them again — in this process and in each forked rank process. None of them is garbage:
imported modules live as long as the process.

:func:`paused` turns the collector off for a block — imports, a model build, a fleet's
records read and judged (they make no cycles; with the collector on, 10× the nodes took
21× the time, off 11×) — and, with ``freeze=True``, moves everything alive at its end into
the permanent generation (:func:`gc.freeze`), which later collections skip. Objects
are still freed by reference counting as usual; only reference cycles among frozen
objects are never collected (modules, classes and a built model's template: none is
meant to go). The user's own code never runs inside a pause: the collector is on again
when the block ends.

Freezing is for processes gpudiag owns — its command line (:func:`own`, called by
``gpudiag.cli.main``) and the rank processes it starts. In a user's own process (the
Python API: ``gpudiag.gradcheck_spec("torchvision:…")``) ``freeze=True`` only pauses:
:func:`gc.freeze` would move the user's objects alive at that moment into the permanent
generation, and a reference cycle among them would then never be collected.

Measured 2026-11-27 on the 2-core development VM, torch 2.14.1: ``python -c "import torch,
torchvision.models"`` median 4.19 s, with ``gc.disable()`` first 3.59 s (5 paired runs);
``bench/gradcheck_wall.py`` 0.54 before (bb16a09), 0.43 with the pause (5372d3f).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

#: Whether gpudiag owns this process (:func:`own`): only then does ``paused(freeze=True)`` freeze.
_owned = False


def own() -> None:
    """Mark this process as gpudiag's own (its command line, a rank it started): from now
    on ``paused(freeze=True)`` freezes. Never called in a user's process."""
    global _owned
    _owned = True


@contextlib.contextmanager
def paused(*, freeze: bool = False) -> Iterator[None]:
    """The collector off inside the block (as it was after); ``freeze``: in a process
    gpudiag owns (:func:`own`), what is alive at the end is frozen (:func:`gc.freeze`), so
    later collections do not walk it again."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if freeze and _owned:
            gc.freeze()
        if was:
            gc.enable()
