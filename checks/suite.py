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
from gpudiag.checks import registry
from gpudiag.checks.registry import MACHINE_FILE, Check, Request
from gpudiag.errors import CannotRunHere, GpudiagError
from gpudiag.findings import Finding, short_repr
from gpudiag.hw.cuda import cuda_device_count
from gpudiag.result import CheckResult
from gpudiag.runtime.faults import can_fire

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
__all__ = ["MACHINE_FILE", "STATUSES", "CheckRun", "Here", "command_line", "plan", "run_check"]


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
    """``(check, config, why skipped)`` for each wanted check (default: every check of the
    suite, :func:`gpudiag.checks.registry.names`); config None means it cannot run here and
    ``why`` says why and what would make it run. ``pairs`` limits peer and nancheck to some
    GPU pairs (``0-1,5-6``); ``inputs`` (``input_shape``, ``input_dtype``, ``input_range``)
    replace the defaults of gradcheck's and nancheck's batch."""
    request = Request(model, tuple(inject), pairs, {k: v for k, v in (inputs or {}).items() if v is not None})
    out: list[tuple[str, dict[str, Any] | None, str]] = []
    for name in names or registry.names(suite_only=True):
        try:
            entry = registry.get(name)
        except KeyError as exc:
            raise ValueError(str(exc).strip("'\"")) from None
        config, why = entry.plan(here, request)
        out.append((name, config, why))
    return out


def run_check(name: str, config: dict[str, Any] | None, here: Here, *, why: str = "") -> CheckRun:
    """Run one check from its configuration; never raises for the check's own failures."""
    if config is None:
        return CheckRun(name, "skipped", why or "cannot run here", None)
    start = time.perf_counter()
    try:
        entry = registry.get(name)
        run = _finished(entry, config, entry.run(config, here))
    except CannotRunHere as exc:
        run = CheckRun(name, "skipped", str(exc), config)
    except GpudiagError as exc:
        run = CheckRun(name, "error", str(exc), config)
    except Exception as exc:  # one broken check must not take the others down
        run = CheckRun(name, "error", f"internal error: {type(exc).__name__}: {exc}", config)
    run.seconds = time.perf_counter() - start
    return run


def _machine(config: Mapping[str, Any], here: Here) -> Any:
    """The machine a configuration's ``machine`` field names (None: the real one)."""
    if config.get("machine") is None:
        return None
    if here.machine is None:
        raise CannotRunHere(
            "this check ran on virtual devices laid out like a machine file, and none was given"
        )
    return here.machine


def _finished(entry: Check, config: dict[str, Any], report: Any) -> CheckRun:
    """The CheckRun of a check that ran: its status (the entry's, else the verdict where it
    is a suite status, else fail/warning/pass from the exit code and findings), headline,
    findings and full document."""
    findings = list(report.findings)
    if entry.status is not None:
        status = entry.status(report)
    elif report.verdict in STATUSES:
        status = report.verdict
    else:
        status = "fail" if report.exit_code() else ("warning" if _warns(findings) else "pass")
    fallback = entry.headline(report)
    return CheckRun(
        entry.name,
        status,
        fallback if status == "skipped" else _headline(findings, fallback),
        config,
        findings,
        report.to_json(),
        skipped=entry.skipped(report),
        report=report,
        simulation=getattr(report, "simulation", None),
    )


def _headline(findings: list[Finding], fallback: str) -> str:
    for severity in ("error", "warning"):
        for f in findings:
            if f.severity == severity:
                return f"{f.code}: {f.message}"
    return fallback


# gpudiag's own checks: a planner, a runner and a headline each, registered below.


def _plan_env(here: Here, request: Request) -> tuple[dict[str, Any] | None, str]:
    return {}, ""


def _run_env(config: dict[str, Any], here: Here) -> CheckResult:
    from gpudiag.checks.env import collect_env

    report: CheckResult = collect_env(live_topology=here.machine is None)
    return report


def _env_headline(report: Any) -> str:
    versions = report.sections.get("versions", {})
    summary = f"torch {versions.get('torch')}, CUDA {versions.get('cuda_runtime') or 'none'}"
    summary += f", NCCL {versions.get('nccl_runtime') or 'none'}"
    return summary + f"; {len(report.missing)} item(s) could not be collected"


def _plan_topology(here: Here, request: Request) -> tuple[dict[str, Any] | None, str]:
    if here.machine is not None:
        return {"machine": MACHINE_FILE}, ""
    if here.nvml is None:
        return {"source": "nvml"}, ""
    return None, "NVML is not available here; diagnose a machine from its capture: --machine topo.txt"


def _run_topology(config: dict[str, Any], here: Here) -> CheckResult:
    from gpudiag.hw.sources import read_topology
    from gpudiag.topology.analysis import analyze

    report: CheckResult = analyze(_machine(config, here) if config.get("machine") else read_topology())
    return report


def _topology_headline(report: Any) -> str:
    topo = report.topology
    return f"{len(topo.gpu_labels)} GPU(s) from {topo.source}; {len(report.pairs)} pair(s), no warnings"


def _plan_peer(here: Here, request: Request) -> tuple[dict[str, Any] | None, str]:
    machine = MACHINE_FILE if here.machine is not None else None
    return {"machine": machine, "pairs": request.pairs, "inject": list(request.inject)}, ""


def _run_peer(config: dict[str, Any], here: Here) -> CheckResult:
    from gpudiag.checks.peer import peer
    from gpudiag.parsers import parse_sizes

    sizes = config.get("sizes")
    report: CheckResult = peer(
        machine=_machine(config, here),
        pairs=config.get("pairs", "all"),
        sizes=parse_sizes(sizes) if sizes else None,
        inject=tuple(config.get("inject", ())),
        machine_source=here.machine_source,
    )
    return report


def _peer_status(report: Any) -> str:
    """skipped (no pair to test here: the host probes' findings still count), fail, or
    warning/pass by the findings."""
    if report.verdict in ("skipped", "fail"):
        return str(report.verdict)
    return "warning" if _warns(report.findings) else "pass"


def _peer_headline(report: Any) -> str:
    if report.verdict == "skipped":
        return str(report.reason)
    return f"{len(report.pairs)} direction(s) verified on " + (
        "CPU virtual devices, not the GPUs" if report.simulated else f"{report.devices} devices"
    )


def _peer_skipped(report: Any) -> list[str]:
    return (
        [s for s in report.skipped if s != report.reason]
        if report.verdict == "skipped"
        else list(report.skipped)
    )


def _plan_gradcheck(here: Here, request: Request) -> tuple[dict[str, Any] | None, str]:
    config = {**DEFAULT_GRADCHECK, **request.inputs}
    ranks = [tuple(range(config["world_size"]))]  # (faults meant for another check stay out)
    config["inject"] = [s for s in request.inject if can_fire(s, ranks, config["steps"])]
    if request.model:
        config["model"] = request.model
    return config, ""


def _run_gradcheck(config: dict[str, Any], here: Here) -> CheckResult:
    from gpudiag.checks.gradcheck import gradcheck_spec

    options = dict(config)
    options["input_shape"] = tuple(options.get("input_shape", D.INPUT_SHAPE))
    options["strategies"] = tuple(options.get("strategies", ("single", "dp", "ddp")))
    options["inject"] = tuple(options.get("inject", ()))
    report: CheckResult = gradcheck_spec(**options)
    return report


def _gradcheck_headline(report: Any) -> str:
    if report.verdict == "explained":
        return "differences, all explained: " + ", ".join(
            f.code for f in report.findings if f.severity == "warning"
        )
    others = ", ".join(s for s in report.config["strategies"] if s != "single")
    headline = f"{others} agree with single (tolerance {report.tolerance['rel_norm_err']:.3g})"
    return headline + (" on CPU virtual devices" if report.simulated else "")


def _gradcheck_skipped(report: Any) -> list[str]:
    return [f.message for f in report.findings if f.code == "syncbn-skipped"]


def _plan_nancheck(here: Here, request: Request) -> tuple[dict[str, Any] | None, str]:
    virtual = here.machine is not None
    if not virtual and here.cuda_gpus < 1:
        return None, "no CUDA GPU here; train on virtual devices laid out like a machine: --machine topo.txt"
    config = {**DEFAULT_NANCHECK, **request.inputs, "machine": MACHINE_FILE if virtual else None}
    config.update({"inject": list(request.inject), "pairs": request.pairs})
    if request.model:
        config["model"] = request.model
    return config, ""


def _run_nancheck(config: dict[str, Any], here: Here) -> CheckResult:
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
    result: CheckResult = report
    return result


def _nancheck_headline(report: Any) -> str:
    headline = f"{len(report.singles)} GPU(s) alone and {len(report.pairs)} pair(s) train without NaN"
    return headline + (" on CPU virtual devices, not the GPUs" if report.simulated else "")


def _warns(findings: list[Finding]) -> bool:
    return any(f.severity == "warning" for f in findings)


def _fields(name: str) -> Any:
    def fields() -> Any:
        from gpudiag.checks.fields import config_fields

        return config_fields()[name]

    return fields


def _compare(name: str) -> Any:
    def compare(there: dict[str, Any], here: dict[str, Any]) -> list[str]:
        from gpudiag.checks import compare_results

        return compare_results.NUMBERS[name](there, here)

    return compare


# The order of registration is the order the suite runs them: cheapest and most basic first.
registry.register(
    Check(
        "env",
        "versions, GPU numbering, NCCL settings, IOMMU",
        _plan_env,
        _run_env,
        _env_headline,
        config_fields=_fields("env"),
    )
)
registry.register(
    Check(
        "topology",
        "how the GPUs are connected",
        _plan_topology,
        _run_topology,
        _topology_headline,
        formats=("text", "json", "markdown", "dot"),
        config_fields=_fields("topology"),
        compare=_compare("topology"),
    )
)
registry.register(
    Check(
        "peer",
        "peer-to-peer copies and all-reduce per GPU pair",
        _plan_peer,
        _run_peer,
        _peer_headline,
        status=_peer_status,
        skipped=_peer_skipped,
        config_fields=_fields("peer"),
        compare=_compare("peer"),
    )
)
registry.register(
    Check(
        "gradcheck",
        "single, DataParallel and DDP gradients compared",
        _plan_gradcheck,
        _run_gradcheck,
        _gradcheck_headline,
        skipped=_gradcheck_skipped,
        config_fields=_fields("gradcheck"),
        required=("model",),
        compare=_compare("gradcheck"),
    )
)
registry.register(
    Check(
        "nancheck",
        "the GPU pair or link where training goes NaN",
        _plan_nancheck,
        _run_nancheck,
        _nancheck_headline,
        config_fields=_fields("nancheck"),
        compare=_compare("nancheck"),
    )
)


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
