"""``gpudiag report``: run the checks and hand over one bundle a maintainer can reproduce.

A bundle is a folder, or a ``.zip`` when its name ends so, holding:

- ``report.json`` (schema ``gpudiag.report/1``): the environment, each check's status,
  findings, full result and exact configuration (model, seeds, world size, devices,
  injected faults) with the equivalent command, the gpudiag and torch versions;
- ``REPORT.md``: ready to paste into a GitHub issue;
- ``repro.py``: when a check failed — a self-contained script (torch only) that reproduces
  each failing check and exits non-zero when the problem shows;
- ``machine.json``: the machine the virtual devices were laid out like (``--machine``);
- ``traces/<check>.json``: what the runtime recorded (Chrome trace format, Perfetto);
- ``logs/<check>/launch<N>-rank<R>.log``: every rank's output (``NCCL_DEBUG=INFO`` for NCCL);
- ``nccl/<i>-<name>``: the NCCL logs the ``transport`` check read — given with ``--nccl-log``,
  or its own ranks' — bounded, host names ``anon-host-N`` with ``--anonymize``
  (:mod:`gpudiag.transport.bundled`); ``nccl/machine.json``: the NVML topology a live run's
  pairs were placed on;
- ``watch/watch-rank<R>.json``: what ``gpudiag.watch`` recorded of the user's own training
  (schema ``gpudiag.watch/1``, from ``$GPUDIAG_WATCH_DIR`` or ``./gpudiag-watch``);
- ``hang/``: with ``--hang DIR``, the job's flight-recorder dumps as JSON
  (``fr_rank<R>.json``), the watchdog's ``stacks/rank<R>.json`` and ``verdict.json``
  (:mod:`gpudiag.hang.bundled`); the ``hang`` check's verdict is in ``report.json``.

Every byte of every file passes through :class:`~gpudiag.redact.Redactor` first, and
the bundle appears at its path only when complete (written beside it, then renamed).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpudiag import __version__
from gpudiag.checks.suite import MACHINE_FILE, CheckRun, Here, plan, run_check
from gpudiag.fileio import check_target, write_folder
from gpudiag.redact import Redactor

SCHEMA = "gpudiag.report/1"
SCHEMA_VERSION = 1
DOCTOR_SCHEMA = "gpudiag.doctor/1"
#: Called with (check name, "start" | "done", the CheckRun when done) as checks run.
Progress = Callable[[str, str, CheckRun | None], None]


@dataclass
class Report:
    """The checks that ran (or were skipped) and everything needed to write the bundle."""

    checks: list[CheckRun]
    here: Here
    created: str
    argv: list[str]
    anonymize: bool = False
    files: dict[str, bytes] = field(default_factory=dict)  # logs and traces, by bundle path
    bundle_path: str | None = None  # where the bundle was written

    def __repr__(self) -> str:
        statuses = ", ".join(f"{c.name} {c.status}" for c in self.checks)
        return f"<Report {statuses}{' · ' + self.bundle_path if self.bundle_path else ''}>"

    @property
    def failed(self) -> list[CheckRun]:
        return [c for c in self.checks if c.status == "fail"]

    @property
    def reproducible(self) -> list[CheckRun]:
        """The failed checks ``repro.py`` reproduces with torch alone (gradcheck, nancheck,
        peer; not one that read a log, as transport does)."""
        from gpudiag.repro.scripts import reproducible

        return [c for c in self.failed if reproducible(c.name)]

    def file_names(self) -> list[str]:
        """Every file the bundle holds."""
        from gpudiag.render.pictures import HTML_NAME, PICTURES

        names = ["report.json", "REPORT.md", HTML_NAME]
        names += [f"{c.name}.svg" for c in self.checks if c.name in PICTURES and isinstance(c.result, dict)]
        names += ["repro.py"] if self.reproducible else []
        names += [MACHINE_FILE] if self.here.machine is not None else []
        return names + sorted(self.files)

    def exit_code(self) -> int:
        return 1 if any(c.status in ("fail", "error") for c in self.checks) else 0

    @property
    def injected(self) -> list[str]:
        """The faults injected with ``--inject`` (a rehearsal), from the checks' configurations."""
        specs: list[str] = []
        for c in self.checks:
            specs += [s for s in (c.config or {}).get("inject") or [] if s not in specs]
        return specs

    @property
    def rehearsal(self) -> str | None:
        """One sentence saying faults were injected and which, or None."""
        from gpudiag.runtime.faults import rehearsal

        return rehearsal(self.injected)

    @property
    def simulation(self) -> str | None:
        """One sentence naming the checks that ran on CPU virtual devices, or None."""
        names = [c.name for c in self.checks if c.simulated]
        if not names:
            return None
        listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
        like = f" laid out like {self.here.machine_source}" if self.here.machine is not None else ""
        return (
            f"simulated: {listed} ran on CPU virtual devices{like}, not on GPUs; a pass there shows the "
            "checks work, not that the machine's GPUs and links do"
        )

    def doctor_json(self) -> dict[str, Any]:
        """``gpudiag doctor --format json``: schema ``gpudiag.doctor/1``."""
        full = self.to_json()
        return {
            "schema": DOCTOR_SCHEMA,
            "here": full["here"],
            "injected_faults": full["injected_faults"],
            "rehearsal": full["rehearsal"],
            "simulation": full["simulation"],
            "checks": [
                {
                    "name": c.name,
                    "status": c.status,
                    "simulated": c.simulated,
                    "simulation": c.simulation,
                    "headline": c.headline,
                    "findings": [f.to_json() for f in c.findings],
                    "skipped": c.skipped,
                    "seconds": round(c.seconds, 3),
                }
                for c in self.checks
            ],
            "bundle": self.bundle_path,
        }

    def to_json(self) -> dict[str, Any]:
        import torch

        env = next((c.result for c in self.checks if c.name == "env" and c.result), None)
        return {
            "schema": SCHEMA,
            "created": self.created,
            "gpudiag": __version__,
            "torch": torch.__version__,
            "command": self.argv,
            "injected_faults": self.injected,
            "rehearsal": self.rehearsal,
            "simulation": self.simulation,
            "anonymized": self.anonymize,
            "here": {
                "cuda_gpus": self.here.cuda_gpus,
                "nvml": "ok" if self.here.nvml is None else self.here.nvml,
                "machine": MACHINE_FILE if self.here.machine is not None else None,
                "machine_source": self.here.machine_source,
            },
            "env": env,
            "checks": [c.to_json() for c in self.checks],
            "files": self.file_names(),
        }


def run_report(
    here: Here,
    names: list[str] | tuple[str, ...] | None = None,
    *,
    model: str | None = None,
    inject: tuple[str, ...] = (),
    pairs: str = "all",
    anonymize: bool = False,
    progress: Progress | None = None,
    argv: list[str] | None = None,
    inputs: dict[str, Any] | None = None,
    nccl_logs: list[tuple[str, str]] | None = None,
) -> Report:
    """Run each planned check (recording rank logs and traces) and collect the results.
    ``nccl_logs``: ``(text, name)`` of NCCL logs (``--nccl-log``) the transport check reads
    as the bundle holds them (:func:`gpudiag.transport.bundled.bundled_logs`)."""
    from gpudiag.runtime.launch import rank_logs

    runs: list[CheckRun] = []
    files: dict[str, bytes] = {}
    cut: list[str] = []
    if nccl_logs:
        from gpudiag.transport.bundled import bundled_logs

        kept, cut = bundled_logs(list(nccl_logs), anonymize=anonymize)
        given = {name: text.encode("utf-8", "surrogateescape") for text, name in kept}
        files.update(given)
        here = dataclasses.replace(here, files={**here.files, **given})
    with tempfile.TemporaryDirectory(prefix="gpudiag-report-") as scratch:
        for name, config, why in plan(here, names, model=model, inject=inject, pairs=pairs, inputs=inputs):
            if progress is not None:
                progress(name, "start", None)
            with rank_logs(Path(scratch) / name) as logs:
                run = run_check(name, config, here, why=why)
                for path in sorted(logs.glob("*.log")):
                    files[f"logs/{name}/{path.name}"] = path.read_bytes()
            _nccl_files(run, files, cut, anonymize)
            trace = _trace(run)
            if trace is not None:
                files[f"traces/{name}.json"] = trace
            runs.append(run)
            if progress is not None:
                progress(name, "done", run)
    from gpudiag.watch.record import read_records

    # gpudiag.watch's records of the user's own training ($GPUDIAG_WATCH_DIR or ./gpudiag-watch)
    files.update({f"watch/{name}": data for name, data in read_records().items()})
    files.update(here.files)  # a hang folder's dumps, stacks and verdict (gpudiag report --hang)
    created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return Report(runs, here, created, argv or ["gpudiag", *sys.argv[1:]], anonymize, files)


def _nccl_files(run: CheckRun, files: dict[str, bytes], cut: list[str], anonymize: bool) -> None:
    """The NCCL logs a check's report read (``nccl_logs``). Those given with ``--nccl-log``
    are bundled already; the notes on what of them was cut join the check's result. A live
    transport run's rank logs go in as ``--nccl-log`` ones do (:func:`bundled_logs`), with
    the NVML topology its pairs were placed on (``nccl/machine.json``), and its recorded
    configuration becomes the reading of them, so replay re-reads what was judged here."""
    from gpudiag.transport.bundled import MACHINE, bundled_logs

    report = run.report
    logs = getattr(report, "nccl_logs", None)
    if not logs or run.config is None:
        return
    if run.config.get("from_log"):
        if cut:
            report.notes.extend(cut)
            run.result = report.to_json()
        return
    kept, notes = bundled_logs([(text, log_name) for log_name, text in logs], anonymize=anonymize)
    files.update({name: text.encode("utf-8", "surrogateescape") for text, name in kept})
    run.config = {"from_log": [name for _, name in kept], "machine": None}
    if report.topology is not None:
        from gpudiag.hw.machine import to_json

        document = to_json(report.topology, "the topology gpudiag transport's live run was judged on")
        files[MACHINE] = (json.dumps(document, indent=1) + "\n").encode()
        run.config["machine"] = MACHINE
    if notes:
        report.notes.extend(notes)
        run.result = report.to_json()


def _trace(run: CheckRun) -> bytes | None:
    from gpudiag.runtime.record import chrome_trace

    recorders = getattr(run.report, "recorders", None)
    if not recorders:
        return None
    return json.dumps(chrome_trace(recorders)).encode()


def bundle_files(report: Report) -> dict[str, bytes]:
    """Every file of the bundle by its path inside it, not yet redacted."""
    from gpudiag.hw.machine import to_json as machine_json
    from gpudiag.render import printable
    from gpudiag.render.report_markdown import report_markdown
    from gpudiag.repro.scripts import repro_script

    files = {"report.json": (json.dumps(report.to_json(), indent=2) + "\n").encode()}
    files["REPORT.md"] = printable(report_markdown(report)).encode()
    if report.reproducible:
        files["repro.py"] = repro_script(report.reproducible).encode("utf-8", "backslashreplace")
    if report.here.machine is not None:
        document = machine_json(report.here.machine, f"the machine of {report.here.machine_source}")
        files[MACHINE_FILE] = (json.dumps(document, indent=1) + "\n").encode()
    files.update(report.files)
    return files


def check_destination(path: str | os.PathLike[str], force: bool) -> Path:
    """Refuse a bundle path that exists (unless ``force`` and it is an earlier bundle) or
    whose folder does not: before any check runs, not after. A ``.zip`` path is a file,
    any other a folder."""
    return check_target(path, force=force, folder=Path(path).suffix != ".zip", replaceable=not_a_bundle)


def not_a_bundle(path: Path) -> str | None:
    """None when ``path`` is a bundle gpudiag wrote (its ``report.json`` — the bundle's
    manifest — names a ``gpudiag.report/`` schema), else why it is not one."""
    limit = 64 << 20
    try:
        if path.is_dir():
            manifest = path / "report.json"
            if manifest.is_symlink() or not manifest.is_file() or manifest.stat().st_size > limit:
                return "not a gpudiag bundle (no report.json)"
            data = manifest.read_bytes()
        else:
            with zipfile.ZipFile(path) as archive:
                info = archive.getinfo("report.json")
                if info.file_size > limit:
                    return "not a gpudiag bundle (report.json too large)"
                data = archive.read(info)
        schema = json.loads(data).get("schema")
    except (OSError, KeyError, ValueError, AttributeError, zipfile.BadZipFile, EOFError):
        return "not a gpudiag bundle (no readable report.json)"
    if not (isinstance(schema, str) and schema.startswith("gpudiag.report/")):
        return "not a gpudiag bundle (report.json has no gpudiag schema)"
    return None


def write_bundle(
    report: Report, path: str | os.PathLike[str], *, redactor: Redactor, force: bool = False
) -> Path:
    """Write the bundle (a folder, or a zip for ``*.zip``), every file redacted; atomic."""
    from gpudiag.render.pictures import bundle_pictures

    target = check_destination(path, force)
    files = {_encodable(name): redactor.bytes(data) for name, data in bundle_files(report).items()}
    # <check>.svg and REPORT.html (issue 47), drawn from the redacted report (escaped into HTML
    # a secret could pass the redactor unseen) and redacted again
    drawn = bundle_pictures(json.loads(files["report.json"]), files["REPORT.md"].decode("utf-8", "replace"))
    files.update({name: redactor.bytes(data) for name, data in drawn.items()})
    if target.suffix == ".zip":
        from gpudiag.fileio import atomic_output

        with atomic_output(target, force=force) as out, zipfile.ZipFile(out, "w") as archive:
            for name, data in sorted(files.items()):
                archive.writestr(_zip_info(name, name == "repro.py"), data)
        return target
    return write_folder(target, files, executable=frozenset({"repro.py"}))


def _encodable(name: str) -> str:
    """A bundle path every file system and zip can hold: one that UTF-8 cannot encode (a
    lone surrogate from a log's undecodable file name) with those characters escaped."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return name.encode("utf-8", "backslashreplace").decode("ascii", "backslashreplace")
    return name


def _zip_info(name: str, executable: bool) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_DEFLATED
    info.external_attr = (0o755 if executable else 0o644) << 16
    return info


def doctor(
    machine: str | None = None,
    checks: list[str] | tuple[str, ...] | None = None,
    *,
    model: str | None = None,
    pairs: str = "all",
    inject: tuple[str, ...] = (),
    inputs: dict[str, Any] | None = None,
) -> Report:
    """The checks ``gpudiag doctor`` runs, as a :class:`Report` (no bundle is written;
    :func:`write_bundle` writes one). ``machine``: a capture or machine file to lay virtual
    devices out like; ``checks``: names from :data:`gpudiag.checks.suite.CHECKS`; ``inputs``:
    see :func:`gpudiag.checks.suite.plan`."""
    here = Here.detect(machine)
    return run_report(here, checks, model=model, inject=tuple(inject), pairs=pairs, inputs=inputs)
