"""A bundle read back (``gpudiag replay``): :func:`read_bundle` reads a folder or a zip
within limits checked before anything is read, and checks the report's schema and shape;
the result is a :class:`Bundle` (its ``report.json`` and the other files by path)."""

from __future__ import annotations

import json
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpudiag.checks.suite import MACHINE_FILE, CheckRun
from gpudiag.errors import InputError
from gpudiag.repro.report import SCHEMA, SCHEMA_VERSION


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

        document = _json(self.files[MACHINE_FILE], MACHINE_FILE, self.path)
        try:
            return from_json(document, f"{self.path}/{MACHINE_FILE}")
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            raise InputError(f"{self.path}: {MACHINE_FILE} is damaged ({type(exc).__name__}: {exc})") from exc


#: What a bundle may hold before :func:`read_bundle` refuses it (a real one holds a few MB:
#: report.json, REPORT.md, repro.py, traces, one log per rank per launch).
MAX_FILES = 2000
MAX_FILE_BYTES = 64 << 20
MAX_TOTAL_BYTES = 256 << 20
#: Uncompressed / compressed size of one zip member over 1 MiB (JSON traces and rank logs
#: compress 10-50 times; a zip bomb a thousand times and more).
MAX_RATIO = 200


def read_bundle(path: str | os.PathLike[str]) -> Bundle:
    """Read a bundle folder or zip within :data:`MAX_FILES`, :data:`MAX_FILE_BYTES`,
    :data:`MAX_TOTAL_BYTES` and :data:`MAX_RATIO` (sizes checked before anything is read,
    reads bounded); damaged, too large, or from a newer schema → :class:`InputError`."""
    source = Path(path)
    if source.is_dir():
        files = _read_folder(source)
    elif source.is_file():
        files = _read_zip(source)
    elif source.exists():
        raise InputError(f"{source}: not a gpudiag bundle (neither a folder nor a file)")
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
    problem = _damaged(document)
    if problem:
        raise InputError(f"{source}: report.json is damaged ({problem})")
    return Bundle(str(source), document, files)


def _too_large(source: Path, what: str) -> InputError:
    return InputError(
        f"{source}: refused, {what} (a bundle holds at most {MAX_FILES} files, "
        f"{MAX_FILE_BYTES >> 20} MiB each, {MAX_TOTAL_BYTES >> 20} MiB in all)"
    )


def _read_folder(source: Path) -> dict[str, bytes]:
    """Regular files only (no links, FIFOs or devices), sizes checked before reading."""
    import stat

    found: list[tuple[str, Path, int]] = []
    total = 0
    for root, dirs, names in os.walk(source):  # (os.walk does not follow links to folders)
        dirs.sort()
        for name in sorted(names):
            file = Path(root) / name
            try:
                info = file.lstat()
            except OSError:
                continue
            if not stat.S_ISREG(info.st_mode):
                continue
            relative = file.relative_to(source).as_posix()
            total += info.st_size
            if len(found) >= MAX_FILES:
                raise _too_large(source, f"more than {MAX_FILES} files")
            if info.st_size > MAX_FILE_BYTES:
                raise _too_large(source, f"{relative} holds {info.st_size} bytes")
            if total > MAX_TOTAL_BYTES:
                raise _too_large(source, f"its files hold more than {MAX_TOTAL_BYTES} bytes")
            found.append((relative, file, info.st_size))
    files = {}
    for relative, file, size in found:
        try:
            with open(file, "rb") as stream:
                files[relative] = stream.read(size + 1)
        except OSError as exc:
            raise InputError(f"{source}: cannot read {relative} ({exc.strerror or exc})") from exc
        if len(files[relative]) > size:
            raise InputError(f"{source}: {relative} grew while it was read")
    return files


#: What a damaged, encrypted or unsupported zip raises while it is listed or read.
_ZIP_ERRORS = (
    zipfile.BadZipFile,
    zipfile.LargeZipFile,
    OSError,
    EOFError,
    RuntimeError,
    NotImplementedError,
    ValueError,
    KeyError,
    IndexError,
    OverflowError,
)


def _read_zip(source: Path) -> dict[str, bytes]:
    """Every member's declared size is checked before any is read; each read is bounded
    by it (zipfile stops there and checks the CRC)."""
    files: dict[str, bytes] = {}
    try:
        with zipfile.ZipFile(source) as archive:
            members = [info for info in archive.infolist() if not info.is_dir()]
            if len(members) > MAX_FILES:
                raise _too_large(source, f"it holds {len(members)} files")
            total = 0
            for info in members:
                total += info.file_size
                if info.file_size > MAX_FILE_BYTES:
                    raise _too_large(source, f"{info.filename} unpacks to {info.file_size} bytes")
                if total > MAX_TOTAL_BYTES:
                    raise _too_large(source, f"its files unpack to more than {MAX_TOTAL_BYTES} bytes")
                if info.file_size > 1 << 20 and info.file_size > MAX_RATIO * max(info.compress_size, 1):
                    raise _too_large(
                        source,
                        f"{info.filename} unpacks {info.file_size // max(info.compress_size, 1)} times "
                        f"its packed size (a zip bomb? at most {MAX_RATIO})",
                    )
            for info in members:
                with archive.open(info) as stream:
                    data = stream.read(info.file_size + 1)
                if len(data) > info.file_size:
                    raise InputError(f"{source}: {info.filename} unpacks past its declared size")
                files[info.filename] = data
    except InputError:
        raise
    except _ZIP_ERRORS as exc:
        raise InputError(f"{source}: not a gpudiag bundle (a damaged zip: {exc})") from exc
    return files


def _damaged(document: dict[str, Any]) -> str | None:
    """What in ``report.json`` has the wrong type for replay to read it, naming the field."""
    from gpudiag.checks.registry import names
    from gpudiag.checks.suite import STATUSES

    known = names()

    env = document.get("env")
    if env is not None and not isinstance(env, dict):
        return "env is not an object"
    if isinstance(env, dict):
        sections = env.get("sections", {})
        if not isinstance(sections, dict) or not all(
            v is None or isinstance(v, dict) for v in sections.values()
        ):
            return "env.sections is not an object of objects"
    for i, check in enumerate(document["checks"]):
        where = f"checks[{i}]"
        if check["name"] not in known:
            return f"{where}.name: unknown check {check['name']!r} (known: {', '.join(known)})"
        if check["status"] not in STATUSES:
            return f"{where}.status: {check['status']!r} is not one of {', '.join(STATUSES)}"
        for key, kinds, what in (
            ("headline", (str,), "a string"),
            ("config", (dict, type(None)), "an object or null"),
            ("result", (dict, type(None)), "an object or null"),
            ("findings", (list,), "a list"),
            ("skipped", (list,), "a list"),
            ("seconds", (int, float), "a number"),
        ):
            if key in check and not isinstance(check[key], kinds):
                return f"{where}.{key} is not {what}"
        for j, finding in enumerate(check.get("findings", [])):
            if not (
                isinstance(finding, dict)
                and isinstance(finding.get("code"), str)
                and isinstance(finding.get("message"), str)
                and isinstance(finding.get("evidence") or {}, dict)
            ):
                return f"{where}.findings[{j}] is not a finding (code, message, evidence)"
    return None


def _json(data: bytes, name: str, bundle: str) -> Any:
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise InputError(f"{bundle}: {name} is damaged ({exc})") from exc
