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

from gpudiag.checks import builtin, registry
from gpudiag.checks.registry import MACHINE_FILE, Check, Here, Request
from gpudiag.errors import CannotRunHere, GpudiagError
from gpudiag.findings import Finding, short_repr

STATUSES = ("pass", "explained", "warning", "fail", "skipped", "error")
__all__ = ["MACHINE_FILE", "STATUSES", "CheckRun", "Here", "builtin", "command_line", "plan", "run_check"]


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


def _warns(findings: list[Finding]) -> bool:
    return any(f.severity == "warning" for f in findings)


def _headline(findings: list[Finding], fallback: str) -> str:
    for severity in ("error", "warning"):
        for f in findings:
            if f.severity == severity:
                return f"{f.code}: {f.message}"
    return fallback


def command_line(name: str, config: Mapping[str, Any] | None) -> str:
    """The equivalent ``gpudiag`` command: each config key is the option of the same name
    (``machine`` → ``--machine machine.json``, the bundle's copy); ``source`` is not an option;
    a key in :data:`POSITIONAL` is the command's argument (``gpudiag hang hang/``), last."""
    argv = ["gpudiag", name]
    positional: list[str] = []
    for key, value in (config or {}).items():
        if key == "source" or value is None or value is False or value == []:
            continue
        if key in POSITIONAL:
            positional += [str(v) for v in value] if isinstance(value, list) else [str(value)]
            continue
        flag = "--model-output" if key == "output" else "--" + key.replace("_", "-")
        if key in ("inject", "from_log"):
            for spec in value:
                argv += [flag, spec]
        elif isinstance(value, list):
            argv += [flag, ",".join(map(str, value))]
        elif value is True:
            argv.append(flag)
        else:
            argv += [flag, str(value)]
    return shlex.join([*argv, *(["--"] if any(p.startswith("-") for p in positional) else []), *positional])


#: Configuration keys that are a command's arguments, not options (``hang``'s dump folder).
POSITIONAL = frozenset({"dumps"})
