"""The checks as one suite: what applies here, how to run each one from a JSON configuration,
and what each concluded in one status and one headline.

``report``, ``replay`` and ``doctor`` all go through here, so a bundle's recorded
configuration is exactly what :func:`run_check` needs to run the check again elsewhere.

Statuses: ``pass``; ``explained`` (gradcheck: differences with known causes); ``warning``
(the check found something to look at); ``fail`` (a problem: exit 1); ``skipped`` (cannot
run here, with the reason); ``error`` (the check itself broke — a gpudiag bug or bad input).
A check that ran on CPU virtual devices is ``simulated`` whatever its status: it says the
check works, not that the machine's GPUs do (:attr:`CheckRun.simulation` says what ran).
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpudiag import defaults as D
from gpudiag.errors import CannotRunHere, GpudiagError
from gpudiag.findings import Finding, short_repr
from gpudiag.hw.cuda import cuda_device_count
from gpudiag.runtime.faults import can_fire

#: Every check, in the order they run (cheapest and most basic first).
CHECKS = ("env", "topology", "peer", "gradcheck", "nancheck")
STATUSES = ("pass", "explained", "warning", "fail", "skipped", "error")
#: What the suite runs when nobody says otherwise: small, quick, and telling.
_BATCH = {
    "model": "mlp",
    "input_shape": list(D.INPUT_SHAPE),
    "num_classes": D.NUM_CLASSES,
    "batch_size": D.BATCH_SIZE,
}
DEFAULT_GRADCHECK = {
    **_BATCH,
    "loss": "ce",
    "strategies": ["single", "dp", "ddp"],
    "world_size": D.WORLD_SIZE,
    "steps": 1,
    "lr": D.LR,
    "optimizer": "sgd",
    "dtype": "fp32",
    "mode": "auto",
    "seed": D.SEED,
    "inject": [],
}
DEFAULT_NANCHECK = {
    **_BATCH,
    "pairs": "all",
    "strategy": "dp",
    "steps": D.NANCHECK_STEPS,
    "lr": D.LR,
    "seed": D.SEED,
    "inject": [],
}
#: The config key that says "on virtual devices laid out like the bundle's machine file".
MACHINE_FILE = "machine.json"


@dataclass
class CheckRun:
    """One check's outcome: status, headline, findings and its full result document."""

    name: str
    status: str
    headline: str
    config: dict[str, Any] | None
    findings: list[Finding] = field(default_factory=list)
    result: dict[str, Any] | None = None
    skipped: list[str] = field(default_factory=list)
    seconds: float = 0.0
    report: Any = None  # the check's own report object (traces, repro scripts); not serialised
    #: what was simulated (ran on CPU virtual devices, not on GPUs), one sentence; None: real
    simulation: str | None = None

    def __repr__(self) -> str:
        return short_repr(self, f"{self.name} {self.status}", self.findings)

    @property
    def simulated(self) -> bool:
        return self.simulation is not None

    @property
    def shown_status(self) -> str:
        """The status as people read it: ``pass (simulated)`` for a simulated result."""
        return f"{self.status} (simulated)" if self.simulated and self.status != "skipped" else self.status

    @property
    def command(self) -> str:
        """The ``gpudiag`` command line that runs this check alone."""
        return command_line(self.name, self.config)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": self.status,
            "simulated": self.simulated,
            "simulation": self.simulation,
            "headline": self.headline,
            "command": self.command if self.config is not None else None,
            "config": self.config,
            "findings": [f.to_json() for f in self.findings],
            "skipped": self.skipped,
            "seconds": round(self.seconds, 3),
            "result": self.result,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CheckRun:
        return cls(
            name=str(data["name"]),
            status=str(data["status"]),
            headline=str(data.get("headline", "")),
            config=data.get("config"),
            findings=[Finding.from_json(f) for f in data.get("findings", [])],
            result=data.get("result"),
            skipped=list(data.get("skipped", [])),
            seconds=float(data.get("seconds", 0.0)),
            simulation=data.get("simulation") if isinstance(data.get("simulation"), str) else None,
        )


@dataclass
class Here:
    """What this machine has: CUDA GPUs torch sees, whether NVML answers, and the machine
    (a machine file or capture) to lay virtual devices out like, if one was given."""

    cuda_gpus: int
    nvml: str | None  # None when NVML works, else why not
    machine: Any = None  # a Topology
    machine_source: str | None = None

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


def plan(
    here: Here,
    names: list[str] | tuple[str, ...] | None = None,
    *,
    model: str | None = None,
    inject: tuple[str, ...] = (),
    pairs: str = "all",
    inputs: dict[str, Any] | None = None,
) -> list[tuple[str, dict[str, Any] | None, str]]:
    """``(check, config, why skipped)`` for each wanted check (default: all); config None
    means it cannot run here and ``why`` says why and what would make it run. ``pairs``
    limits peer and nancheck to some GPU pairs (``0-1,5-6``); ``inputs`` (``input_shape``,
    ``input_dtype``, ``input_range``) replace the defaults of gradcheck's and nancheck's batch."""
    inputs = {k: v for k, v in (inputs or {}).items() if v is not None}
    virtual = here.machine is not None
    out: list[tuple[str, dict[str, Any] | None, str]] = []
    for name in names or CHECKS:
        config: dict[str, Any] | None = None
        why = ""
        if name == "env":
            config = {}
        elif name == "topology":
            if virtual:
                config = {"machine": MACHINE_FILE}
            elif here.nvml is None:
                config = {"source": "nvml"}
            else:
                why = "NVML is not available here; diagnose a machine from its capture: --machine topo.txt"
        elif name == "peer":
            config = {"machine": MACHINE_FILE if virtual else None, "pairs": pairs, "inject": list(inject)}
        elif name == "gradcheck":
            config = {**DEFAULT_GRADCHECK, **inputs}
            ranks = [tuple(range(config["world_size"]))]  # (faults meant for another check stay out)
            config["inject"] = [s for s in inject if can_fire(s, ranks, config["steps"])]
            if model:
                config["model"] = model
        elif name == "nancheck":
            if virtual or here.cuda_gpus >= 1:
                config = {**DEFAULT_NANCHECK, **inputs, "machine": MACHINE_FILE if virtual else None}
                config.update({"inject": list(inject), "pairs": pairs})
                if model:
                    config["model"] = model
            else:
                why = "no CUDA GPU here; train on virtual devices laid out like a machine: --machine topo.txt"
        else:
            raise ValueError(f"unknown check {name!r}")
        out.append((name, config, why))
    return out


def run_check(name: str, config: dict[str, Any] | None, here: Here, *, why: str = "") -> CheckRun:
    """Run one check from its configuration; never raises for the check's own failures."""
    if config is None:
        return CheckRun(name, "skipped", why or "cannot run here", None)
    start = time.perf_counter()
    try:
        run = _RUNNERS[name](config, here)
    except CannotRunHere as exc:
        run = CheckRun(name, "skipped", str(exc), config)
    except GpudiagError as exc:
        run = CheckRun(name, "error", str(exc), config)
    except Exception as exc:  # one broken check must not take the others down
        run = CheckRun(name, "error", f"internal error: {type(exc).__name__}: {exc}", config)
    run.seconds = time.perf_counter() - start
    return run


def _machine(config: Mapping[str, Any], here: Here) -> Any:
    if config.get("machine") is None:
        return None
    if here.machine is None:
        raise CannotRunHere(
            "this check ran on virtual devices laid out like a machine file, and none was given"
        )
    return here.machine


def _finished(
    name: str,
    status: str,
    config: dict[str, Any],
    report: Any,
    fallback: str,
    skipped: list[str] | None = None,
) -> CheckRun:
    """The CheckRun of a check that ran: its report's findings, headline and full document."""
    findings = list(report.findings)
    return CheckRun(
        name,
        status,
        _headline(findings, fallback),
        config,
        findings,
        report.to_json(),
        skipped=skipped or [],
        report=report,
        simulation=getattr(report, "simulation", None),
    )


def _headline(findings: list[Finding], fallback: str) -> str:
    for severity in ("error", "warning"):
        for f in findings:
            if f.severity == severity:
                return f"{f.code}: {f.message}"
    return fallback


def _env(config: dict[str, Any], here: Here) -> CheckRun:
    from gpudiag.checks.env import collect_env

    report = collect_env(live_topology=here.machine is None)
    versions = report.sections.get("versions", {})
    summary = f"torch {versions.get('torch')}, CUDA {versions.get('cuda_runtime') or 'none'}"
    summary += f", NCCL {versions.get('nccl_runtime') or 'none'}"
    summary += f"; {len(report.missing)} item(s) could not be collected"
    return _finished("env", "warning" if report.findings else "pass", config, report, summary)


def _topology(config: dict[str, Any], here: Here) -> CheckRun:
    from gpudiag.hw.sources import read_topology
    from gpudiag.topology.analysis import analyze

    topo = _machine(config, here) if config.get("machine") else read_topology()
    report = analyze(topo)
    fallback = f"{len(topo.gpu_labels)} GPU(s) from {topo.source}; {len(report.pairs)} pair(s), no warnings"
    return _finished("topology", "warning" if report.warnings else "pass", config, report, fallback)


def _peer(config: dict[str, Any], here: Here) -> CheckRun:
    from gpudiag.checks.peer import peer
    from gpudiag.parsers import parse_sizes

    sizes = config.get("sizes")
    report = peer(
        machine=_machine(config, here),
        pairs=config.get("pairs", "all"),
        sizes=parse_sizes(sizes) if sizes else None,
        inject=tuple(config.get("inject", ())),
        machine_source=here.machine_source,
    )
    if report.verdict == "skipped":  # not enough GPUs: the host probes' findings still count
        run = _finished("peer", "skipped", config, report, "")
        run.headline = str(report.reason)
        run.skipped = [s for s in report.skipped if s != report.reason]
        return run
    status = (
        report.verdict if report.verdict == "fail" else ("warning" if _warns(report.findings) else "pass")
    )
    fallback = f"{len(report.pairs)} direction(s) verified on " + (
        "CPU virtual devices, not the GPUs" if report.simulated else f"{report.devices} devices"
    )
    return _finished("peer", status, config, report, fallback, list(report.skipped))


def _gradcheck(config: dict[str, Any], here: Here) -> CheckRun:
    from gpudiag.checks.gradcheck import gradcheck_spec

    options = dict(config)
    options["input_shape"] = tuple(options.get("input_shape", D.INPUT_SHAPE))
    options["strategies"] = tuple(options.get("strategies", ("single", "dp", "ddp")))
    options["inject"] = tuple(options.get("inject", ()))
    report = gradcheck_spec(**options)
    others = ", ".join(s for s in report.config["strategies"] if s != "single")
    fallback = f"{others} agree with single (tolerance {report.tolerance['rel_norm_err']:.3g})"
    if report.simulated:
        fallback += " on CPU virtual devices"
    if report.verdict == "explained":
        fallback = "differences, all explained: " + ", ".join(
            f.code for f in report.findings if f.severity == "warning"
        )
    skipped = [f.message for f in report.findings if f.code == "syncbn-skipped"]
    return _finished("gradcheck", report.verdict, config, report, fallback, skipped)


def _nancheck(config: dict[str, Any], here: Here) -> CheckRun:
    from gpudiag.checks.nancheck import nancheck_spec

    machine = _machine(config, here)
    if machine is None and here.cuda_gpus < 1:
        raise CannotRunHere("no CUDA GPU here (nancheck can run on virtual devices with --machine)")
    options = {k: v for k, v in config.items() if k != "machine"}
    options["input_shape"] = tuple(options.get("input_shape", D.INPUT_SHAPE))
    options["inject"] = tuple(options.get("inject", ()))
    report = nancheck_spec(machine=machine, **options)
    report.config["machine"] = config.get("machine")
    report.machine_source = here.machine_source
    fallback = f"{len(report.singles)} GPU(s) alone and {len(report.pairs)} pair(s) train without NaN"
    if report.simulated:
        fallback += " on CPU virtual devices, not the GPUs"
    return _finished("nancheck", report.verdict, config, report, fallback)


def _warns(findings: list[Finding]) -> bool:
    return any(f.severity == "warning" for f in findings)


_RUNNERS = {"env": _env, "topology": _topology, "peer": _peer, "gradcheck": _gradcheck, "nancheck": _nancheck}


def command_line(name: str, config: Mapping[str, Any] | None) -> str:
    """The equivalent ``gpudiag`` command: each config key is the option of the same name
    (``machine`` → ``--machine machine.json``, the bundle's copy); ``source`` is not an option."""
    argv = ["gpudiag", name]
    for key, value in (config or {}).items():
        if key == "source" or value is None or value is False or value == []:
            continue
        flag = "--" + key.replace("_", "-")
        if key == "inject":
            for spec in value:
                argv += [flag, spec]
        elif isinstance(value, list):
            argv += [flag, ",".join(map(str, value))]
        elif value is True:
            argv.append(flag)
        else:
            argv += [flag, str(value)]
    return shlex.join(argv)
