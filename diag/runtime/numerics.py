"""The numeric settings a run computes under, set the same way in every process.

Two processes running the same model on the same data agree bit for bit only if they
compute with the same kernels: TF32 or full fp32 matmuls and convolutions, cuDNN
autotuning on or off, deterministic algorithms, the default dtype. These are
per-process flags, so a comparison must set them in the reference process *and* in
every rank, and report what each one actually ran with.

:class:`Numerics` names one such set. ``Numerics.comparison()`` is what ``gradcheck``
uses: every fp32 precision ``ieee`` (no TF32, no bf16 emulation; the
``NVIDIA_TF32_OVERRIDE=0`` of the CUDA libraries, set from torch), cuDNN autotuning off
and deterministic. ``Numerics.observe()`` reads the current process; ``applied()`` sets
a set for the length of a block and restores the previous flags after.

The settings are made through torch's ``fp32_precision`` interface
(``torch.backends.cuda.matmul``, ``cudnn.conv``, ``cudnn.rnn``, ``mkldnn.matmul/conv/rnn``;
torch ≥ 2.9). The legacy interface must keep reading true, since models, training scripts
and libraries read it: torch keeps the legacy cuDNN switch (``torch.backends.cudnn.allow_tf32``)
apart from the per-operator values and raises on reading it when they disagree ("cuDNN conv
and cuDNN RNN have different TF32 flags", torch 2.14, even with both at ``ieee``). So where
conv and RNN agree, that switch is set to match *before* them (setting it after would reset
them to ``none``). The matmul switch (``torch.backends.cuda.matmul.allow_tf32``,
``get_float32_matmul_precision()``) is kept the same way, through
``set_float32_matmul_precision`` before the per-backend values.

A torch older than 2.9 has only the legacy interface: there each field is read from, and
set through, the switch that governs it (:data:`LEGACY_SWITCHES`: ``cuda_matmul`` from
``torch.backends.cuda.matmul.allow_tf32``, ``cudnn_conv``/``cudnn_rnn`` from
``torch.backends.cudnn.allow_tf32``: ``tf32`` when on, ``ieee`` when off), and the mkldnn
fields, which that torch has no switch for, are ``ieee`` (its mkldnn computes fp32 in full
precision). Reading the new interface's absence as a setting was a false
``numerics-changed`` on torch 2.6 (issue 52).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import torch

#: The ``fp32_precision`` knobs: field name → (backend module path under torch.backends).
PRECISION_KNOBS = {
    "cuda_matmul": "cuda.matmul",
    "cudnn_conv": "cudnn.conv",
    "cudnn_rnn": "cudnn.rnn",
    "mkldnn_matmul": "mkldnn.matmul",
    "mkldnn_conv": "mkldnn.conv",
    "mkldnn_rnn": "mkldnn.rnn",
}


#: What :meth:`Numerics.observe` records for a knob this torch does not have.
ABSENT = "absent"

#: Where a torch without ``fp32_precision`` (< 2.9) keeps each field: the legacy switch
#: (``torch.backends.<path>.allow_tf32``), or None for the mkldnn fields, which it cannot set.
LEGACY_SWITCHES: dict[str, str | None] = {
    "cuda_matmul": "cuda.matmul",
    "cudnn_conv": "cudnn",
    "cudnn_rnn": "cudnn",
    "mkldnn_matmul": None,
    "mkldnn_conv": None,
    "mkldnn_rnn": None,
}


def _new_interface() -> bool:
    """Whether this torch has the ``fp32_precision`` interface (2.9 and newer; its matmul
    knob is on every build)."""
    return _backend("cuda.matmul") is not None


def _legacy_switch(path: str) -> Any:
    """``torch.backends.<path>`` if it has an ``allow_tf32`` switch, else None."""
    obj: Any = torch.backends
    for part in path.split("."):
        obj = getattr(obj, part, None)
    return obj if obj is not None and hasattr(obj, "allow_tf32") else None


def _legacy_precision(name: str) -> str:
    """The ``fp32_precision`` value the legacy interface means for field ``name``: ``tf32``
    where its ``allow_tf32`` switch is on, ``ieee`` where it is off or where this torch has
    no switch for it (mkldnn: full fp32), :data:`ABSENT` where the switch is missing."""
    path = LEGACY_SWITCHES[name]
    if path is None:
        return "ieee"
    switch = _legacy_switch(path)
    if switch is None:
        return ABSENT
    return "tf32" if bool(switch.allow_tf32) else "ieee"


def _set_legacy(name: str, value: str) -> None:
    """Field ``name`` set to ``value`` through the legacy switch (``none``, the backend's
    default, is TF32 for cuDNN and full fp32 for matmuls); nothing where there is none."""
    path = LEGACY_SWITCHES[name]
    switch = _legacy_switch(path) if path is not None else None
    if switch is None or value == ABSENT:
        return
    default_tf32 = path == "cudnn"
    switch.allow_tf32 = value == "tf32" or (value == "none" and default_tf32)


def _backend(path: str) -> Any:
    """``torch.backends.<path>``, or None where this torch build lacks it."""
    obj: Any = torch.backends
    for part in path.split("."):
        obj = getattr(obj, part, None)
    return obj if obj is not None and hasattr(obj, "fp32_precision") else None


@dataclass(frozen=True)
class Numerics:
    """One process's numeric settings.

    The ``*_matmul``/``*_conv``/``*_rnn`` fields are torch's ``fp32_precision`` values for
    that backend: ``ieee`` (full fp32), ``tf32``, ``bf16`` (mkldnn only) or ``none`` (the
    backend's default; cuDNN convolutions default to TF32). ``cudnn_benchmark`` /
    ``cudnn_deterministic`` are ``torch.backends.cudnn.benchmark`` / ``.deterministic``;
    ``deterministic_algorithms`` is ``off``, ``warn`` or ``on``
    (``torch.use_deterministic_algorithms``); ``default_dtype`` is
    ``torch.get_default_dtype()`` without the ``torch.`` prefix. A backend this torch
    build lacks is observed as ``absent`` and skipped when applying.
    """

    cuda_matmul: str = "ieee"
    cudnn_conv: str = "ieee"
    cudnn_rnn: str = "ieee"
    mkldnn_matmul: str = "ieee"
    mkldnn_conv: str = "ieee"
    mkldnn_rnn: str = "ieee"
    cudnn_benchmark: bool = False
    cudnn_deterministic: bool = True
    deterministic_algorithms: str = "warn"
    default_dtype: str = "float32"

    @classmethod
    def comparison(cls) -> Numerics:
        """The settings gradients are compared under: full fp32 everywhere (no TF32),
        cuDNN autotuning off and deterministic, deterministic algorithms where torch has
        them and a warning where it has not (:func:`nondeterministic_alerts` hears it),
        fp32 default dtype."""
        return cls()

    @classmethod
    def observe(cls) -> Numerics:
        """This process's settings now."""
        precisions = {}
        for name, path in PRECISION_KNOBS.items():
            backend = _backend(path)
            if backend is not None:
                precisions[name] = str(backend.fp32_precision)
            else:  # (a build without this one backend; or a torch without the interface at all)
                precisions[name] = ABSENT if _new_interface() else _legacy_precision(name)
        if not torch.are_deterministic_algorithms_enabled():
            algorithms = "off"
        elif torch.is_deterministic_algorithms_warn_only_enabled():
            algorithms = "warn"
        else:
            algorithms = "on"
        return cls(
            **precisions,
            cudnn_benchmark=bool(torch.backends.cudnn.benchmark),
            cudnn_deterministic=bool(torch.backends.cudnn.deterministic),
            deterministic_algorithms=algorithms,
            default_dtype=str(torch.get_default_dtype()).removeprefix("torch."),
        )

    def apply(self) -> None:
        """Set these settings in this process (for good: see :meth:`applied`)."""
        self._align_legacy_switches()
        for name, path in PRECISION_KNOBS.items():
            backend, value = _backend(path), getattr(self, name)
            if backend is None:
                if not _new_interface():
                    _set_legacy(name, value)
            elif value != ABSENT:
                backend.fp32_precision = value
        torch.backends.cudnn.benchmark = self.cudnn_benchmark
        torch.backends.cudnn.deterministic = self.cudnn_deterministic
        torch.use_deterministic_algorithms(
            self.deterministic_algorithms != "off", warn_only=self.deterministic_algorithms == "warn"
        )
        dtype = getattr(torch, self.default_dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown default dtype {self.default_dtype!r}")
        torch.set_default_dtype(dtype)

    def _align_legacy_switches(self) -> None:
        """The legacy switches set to what the per-backend values will say, so that reading
        them neither raises nor lies; done before those values, as the legacy setters reset
        them. ``torch.backends.cudnn.allow_tf32``: when ``cudnn_conv`` and ``cudnn_rnn`` agree
        on ``ieee`` or ``tf32`` (where they differ torch's getter raises by design, and the
        switch is left alone). ``set_float32_matmul_precision``: ``high`` for a ``tf32``
        ``cuda_matmul``, else ``highest``."""
        conv, rnn = self.cudnn_conv, self.cudnn_rnn
        if conv == rnn and conv in ("ieee", "tf32") and _backend("cudnn.conv") is not None:
            torch.backends.cudnn.allow_tf32 = conv == "tf32"
        if self.cuda_matmul in ("ieee", "tf32", "none") and _backend("cuda.matmul") is not None:
            torch.set_float32_matmul_precision("high" if self.cuda_matmul == "tf32" else "highest")

    @contextlib.contextmanager
    def applied(self) -> Iterator[Numerics]:
        """These settings for the length of the block; the previous ones after it."""
        saved = Numerics.observe()
        self.apply()
        try:
            yield self
        finally:
            saved.apply()

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Numerics:
        known = {f.name for f in fields(cls)}
        return replace(cls(), **{k: v for k, v in data.items() if k in known})

    def differences(self, other: Numerics) -> dict[str, tuple[Any, Any]]:
        """``{field: (self's value, other's value)}`` for every field that differs."""
        return {
            f.name: (getattr(self, f.name), getattr(other, f.name))
            for f in fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        }

    def summary(self) -> str:
        """One line for reports: ``fp32 ieee everywhere, cuDNN deterministic, …``."""
        precisions = {name.replace("_", " "): getattr(self, name) for name in PRECISION_KNOBS}
        distinct = set(precisions.values())
        fp32 = (
            f"fp32 {distinct.pop()} everywhere"
            if len(distinct) == 1
            else "fp32 " + ", ".join(f"{name} {value}" for name, value in precisions.items())
        )
        return (
            f"{fp32}; cuDNN benchmark {'on' if self.cudnn_benchmark else 'off'}, "
            f"deterministic {'on' if self.cudnn_deterministic else 'off'}; "
            f"deterministic algorithms {self.deterministic_algorithms}; default dtype {self.default_dtype}"
        )


#: How torch's alert for an op without a deterministic implementation reads (warn-only).
_ALERT = " does not have a deterministic implementation"


@contextlib.contextmanager
def nondeterministic_alerts() -> Iterator[list[str]]:
    """Collect, in the yielded list, the ops torch reported while the block ran as having
    no deterministic implementation (``adaptive_avg_pool2d_backward_cuda``,
    ``_histc_cuda``, …; heard only under
    ``torch.use_deterministic_algorithms(True, warn_only=True)``). Each op once, in the
    order first reported; every other warning is passed on."""
    found: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield found
    passed: set[tuple[str, type]] = set()
    for warning in caught:
        text = str(warning.message)
        if _ALERT in text:
            op = text.split(_ALERT)[0].strip()
        else:
            if (text, warning.category) not in passed:
                passed.add((text, warning.category))
                warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
            continue
        if op not in found:
            found.append(op)
