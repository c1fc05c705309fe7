"""The one extension point for a check: a :class:`Check` entry per check, which the suite
(``doctor``, ``report``), the CLI's ``--checks``, report bundles, ``replay`` and the
renderers all read. Adding a check is one :func:`register` call with its entry, plus the
check's own module(s) (docs/architecture.md, "Adding a check"). gpudiag's own checks are
registered by :mod:`gpudiag.checks.suite`, which every reader of the registry imports first.

An entry names the check and says, as functions the suite calls:

- ``plan(here, request)`` → ``(config, why)``: the JSON configuration to run it with on this
  machine, or ``None`` and why it cannot run here (and what would make it run);
- ``run(config, here)`` → the check's result (a :class:`gpudiag.result.CheckResult`), from
  that configuration alone, so a bundle's recorded configuration runs it again elsewhere;
- ``headline(result)``: one line for the suite's table when no finding says more;
  ``status(result)`` the suite's status where the verdict is not one (``None``: the
  verdict, or fail/warning/pass by exit code and findings); ``skipped(result)`` the parts
  that could not run here;
- ``formats`` and ``renderer``: the output formats and the module of ``gpudiag.render`` with a
  function per format (``None``: the generic renderers for any CheckResult);
- ``config_fields``: the configuration's fields, each with its check (a function returning
  why a value is wrong, or None), which bundles are validated with before replay runs them;
- ``compare(there, here)``: what differs between two result documents, for replay.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpudiag.errors import GpudiagError
from gpudiag.hw.cuda import cuda_device_count
from gpudiag.result import CheckResult

#: The value of a configuration's ``machine`` field that says "on virtual devices laid out
#: like the bundle's machine file" (the bundle's copy of the machine file).
MACHINE_FILE = "machine.json"

#: A configuration field's check: why the value is wrong, or None.
Validator = Callable[[Any], "str | None"]


@dataclass(frozen=True)
class Request:
    """What the person running the suite asked for, beyond the defaults: the model spec,
    faults to inject (``--inject``), the GPU pairs (``--pairs``) and input settings."""

    model: str | None = None
    inject: tuple[str, ...] = ()
    pairs: str = "all"
    inputs: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Check:
    """One check's entry (see the module's docstring for what each field does)."""

    name: str
    summary: str
    plan: Callable[[Any, Request], tuple[dict[str, Any] | None, str]]
    run: Callable[[dict[str, Any], Any], CheckResult]
    headline: Callable[[Any], str] = lambda result: f"{result.verdict}"
    status: Callable[[Any], str] | None = None
    skipped: Callable[[Any], list[str]] = lambda result: []
    formats: tuple[str, ...] = ("text", "json", "markdown")
    renderer: str | None = None
    config_fields: Callable[[], Mapping[str, Validator]] = dict
    required: tuple[str, ...] = ()
    compare: Callable[[dict[str, Any], dict[str, Any]], list[str]] | None = None
    #: runs in ``doctor`` and ``report`` unless named (False: only with ``--checks NAME``)
    in_suite: bool = True


@dataclass
class Here:
    """What this machine has: CUDA GPUs torch sees, whether NVML answers, and the machine
    (a machine file or capture) to lay virtual devices out like, if one was given; and the
    bundle's input files (``files``)."""

    cuda_gpus: int
    nvml: str | None  # None when NVML works, else why not
    machine: Any = None  # a Topology
    machine_source: str | None = None
    #: files the checks read from the bundle, by their path in it: the NCCL logs given to
    #: ``report --nccl-log`` (``nccl/…``, as bundled), a hang folder ``report --hang DIR``
    #: read (``hang/…``), or a replayed bundle's files
    files: Mapping[str, bytes] = field(default_factory=dict)

    @property
    def gpus(self) -> list[int]:
        """The GPU numbers the checks run on: the machine file's, else torch's CUDA devices."""
        if self.machine is not None:
            return sorted(info.index for info in self.machine.gpus.values())
        return list(range(self.cuda_gpus))

    @classmethod
    def detect(cls, machine: str | None = None) -> Here:
        """Look, without failing: torch's device count, one NVML call, the machine file."""

        from gpudiag.hw.nvml import NvmlBackend

        try:
            with NvmlBackend() as backend:
                backend.driver_version()
            nvml = None
        except GpudiagError as exc:
            nvml = str(exc)
        from gpudiag.hw.sources import read_machine_or_capture

        topology = read_machine_or_capture(machine) if machine else None
        return cls(cuda_device_count(), nvml, topology, machine)


_REGISTRY: dict[str, Check] = {}


def register(check: Check) -> Check:
    """Add ``check`` (and its render kind); a second entry of one name is a programming error."""
    from gpudiag.render import register_kind

    if check.name in _REGISTRY and _REGISTRY[check.name] is not check:
        raise ValueError(f"a check named {check.name!r} is registered already")
    _REGISTRY[check.name] = check
    register_kind(check.name, check.formats, check.renderer)
    return check


def unregister(name: str) -> None:
    """Remove a check (tests that register a throwaway one)."""
    from gpudiag.render import unregister_kind

    _REGISTRY.pop(name, None)
    unregister_kind(name)


def get(name: str) -> Check:
    """The entry of check ``name`` (KeyError names the known ones)."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown check {name!r} (known: {', '.join(_REGISTRY)})") from None


def names(suite_only: bool = False) -> tuple[str, ...]:
    """Every registered check in registration order (the order the suite runs them)."""
    return tuple(name for name, check in _REGISTRY.items() if check.in_suite or not suite_only)
