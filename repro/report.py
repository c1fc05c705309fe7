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
- ``logs/<check>/launch<N>-rank<R>.log``: every rank's output (``NCCL_DEBUG=INFO`` for NCCL).

Every byte of every file passes through :class:`~gpudiag.repro.redact.Redactor` first, and
the bundle appears at its path only when complete (written beside it, then renamed).
"""

from __future__ import annotations

import datetime
import io
import json
import os
import shutil
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpudiag import __version__
from gpudiag.checks.suite import MACHINE_FILE, CheckRun, Here, plan, run_check
from gpudiag.errors import InputError
from gpudiag.fileio import check_target
from gpudiag.repro.redact import Redactor

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

    @property
    def failed(self) -> list[CheckRun]:
        return [c for c in self.checks if c.status == "fail"]

    def file_names(self) -> list[str]:
        """Every file the bundle holds."""
        names = ["report.json", "REPORT.md"]
        names += ["repro.py"] if self.failed else []
        names += [MACHINE_FILE] if self.here.machine is not None else []
        return names + sorted(self.files)

    def exit_code(self) -> int:
        return 1 if any(c.status in ("fail", "error") for c in self.checks) else 0

    def doctor_json(self) -> dict[str, Any]:
        """``gpudiag doctor --format json``: schema ``gpudiag.doctor/1``."""
        full = self.to_json()
        return {
            "schema": DOCTOR_SCHEMA,
            "here": full["here"],
            "checks": [
                {
                    "name": c.name,
                    "status": c.status,
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
) -> Report:
    """Run each planned check (recording rank logs and traces) and collect the results."""
    from gpudiag.runtime.launch import rank_logs

    runs: list[CheckRun] = []
    files: dict[str, bytes] = {}
    with tempfile.TemporaryDirectory(prefix="gpudiag-report-") as scratch:
        for name, config, why in plan(here, names, model=model, inject=inject, pairs=pairs):
            if progress is not None:
                progress(name, "start", None)
            with rank_logs(Path(scratch) / name) as logs:
                run = run_check(name, config, here, why=why)
                for path in sorted(logs.glob("*.log")):
                    files[f"logs/{name}/{path.name}"] = path.read_bytes()
            trace = _trace(run)
            if trace is not None:
                files[f"traces/{name}.json"] = trace
            runs.append(run)
            if progress is not None:
                progress(name, "done", run)
    created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return Report(runs, here, created, argv or ["gpudiag", *sys.argv[1:]], anonymize, files)


def _trace(run: CheckRun) -> bytes | None:
    from gpudiag.runtime.record import chrome_trace

    recorders = getattr(run.report, "recorders", None)
    if not recorders:
        return None
    return json.dumps(chrome_trace(recorders)).encode()


def bundle_files(report: Report) -> dict[str, bytes]:
    """Every file of the bundle by its path inside it, not yet redacted."""
    from gpudiag.hw.machine import to_json as machine_json
    from gpudiag.repro.markdown import report_markdown
    from gpudiag.repro.scripts import repro_script

    files = {"report.json": (json.dumps(report.to_json(), indent=2) + "\n").encode()}
    files["REPORT.md"] = report_markdown(report).encode()
    if report.failed:
        files["repro.py"] = repro_script(report.failed).encode()
    if report.here.machine is not None:
        document = machine_json(report.here.machine, f"the machine of {report.here.machine_source}")
        files[MACHINE_FILE] = (json.dumps(document, indent=1) + "\n").encode()
    files.update(report.files)
    return files


def check_destination(path: str | os.PathLike[str], force: bool) -> Path:
    """Refuse a bundle path that exists (unless ``force``) or whose folder does not:
    before any check runs, not after. A ``.zip`` path is a file, any other a folder."""
    return check_target(path, force=force, folder=Path(path).suffix != ".zip")


def write_bundle(
    report: Report, path: str | os.PathLike[str], *, redactor: Redactor, force: bool = False
) -> Path:
    """Write the bundle (a folder, or a zip for ``*.zip``), every file redacted; atomic."""
    target = check_destination(path, force)
    files = {name: redactor.bytes(data) for name, data in bundle_files(report).items()}
    if target.suffix == ".zip":
        from gpudiag.fileio import atomic_output

        with atomic_output(target, force=force) as out, zipfile.ZipFile(out, "w") as archive:
            for name, data in sorted(files.items()):
                archive.writestr(_zip_info(name, name == "repro.py"), data)
        return target
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        for name, data in files.items():
            dest = staging / name
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(data)
            if name == "repro.py":
                dest.chmod(0o755)
        staging.chmod(0o755)
        if target.exists():  # force: move the old bundle aside only once the new one is complete
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
            os.replace(target, old / "bundle")
            os.replace(staging, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def _zip_info(name: str, executable: bool) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_DEFLATED
    info.external_attr = (0o755 if executable else 0o644) << 16
    return info


@dataclass
class Bundle:
    """A bundle read back: its ``report.json`` and the other files by path."""

    path: str
    document: dict[str, Any]
    files: dict[str, bytes]

    @property
    def checks(self) -> list[CheckRun]:
        return [CheckRun.from_json(c) for c in self.document["checks"]]

    def machine(self) -> Any:
        """The machine its virtual devices were laid out like, or None."""
        if MACHINE_FILE not in self.files:
            return None
        from gpudiag.hw.machine import from_json

        return from_json(
            _json(self.files[MACHINE_FILE], MACHINE_FILE, self.path), f"{self.path}/{MACHINE_FILE}"
        )


def read_bundle(path: str | os.PathLike[str]) -> Bundle:
    """Read a bundle folder or zip; damaged or from a newer schema → :class:`InputError`."""
    source = Path(path)
    files: dict[str, bytes] = {}
    if source.is_dir():
        for file in sorted(source.rglob("*")):
            if file.is_file():
                files[file.relative_to(source).as_posix()] = file.read_bytes()
    elif source.is_file():
        try:
            with zipfile.ZipFile(io.BytesIO(source.read_bytes())) as archive:
                for info in archive.infolist():
                    if not info.is_dir():
                        files[info.filename] = archive.read(info)
        except (zipfile.BadZipFile, OSError, EOFError) as exc:
            raise InputError(f"{source}: not a gpudiag bundle (a damaged zip: {exc})") from exc
    else:
        raise InputError(f"{source} does not exist")
    if "report.json" not in files:
        raise InputError(f"{source}: not a gpudiag bundle (no report.json)")
    document = _json(files["report.json"], "report.json", str(source))
    schema = document.get("schema") if isinstance(document, dict) else None
    if not isinstance(schema, str) or not schema.startswith("gpudiag.report/"):
        raise InputError(f"{source}: report.json is not a gpudiag report (schema {schema!r})")
    version = schema.rpartition("/")[2]
    if not version.isdigit() or int(version) > SCHEMA_VERSION:
        raise InputError(
            f"{source}: written by a newer gpudiag (schema {schema}; this one reads up to {SCHEMA}): "
            "upgrade gpudiag"
        )
    if not isinstance(document.get("checks"), list) or not all(
        isinstance(c, dict) and "name" in c and "status" in c for c in document["checks"]
    ):
        raise InputError(f"{source}: report.json is damaged (no valid checks list)")
    return Bundle(str(source), document, files)


def _json(data: bytes, name: str, bundle: str) -> Any:
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InputError(f"{bundle}: {name} is damaged ({exc})") from exc
