"""What :func:`gpudiag.watch` says about the first non-finite value: the report, the
error and the JSON record (schema ``gpudiag.watch/1``) that ``gpudiag report`` bundles.

Torch-free: ``gpudiag report`` reads records without importing torch.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

SCHEMA = "gpudiag.watch/1"
#: Where records go when neither ``record_dir=`` nor this variable says otherwise: ``./gpudiag-watch``.
DIR_VARIABLE = "GPUDIAG_WATCH_DIR"
DEFAULT_DIR = "gpudiag-watch"
#: The phases a first non-finite value can arise in.
PHASES = ("input", "forward", "backward", "all-reduce", "optimizer", "transfer")
_RECORD_LIMIT = 1 << 20


@dataclass
class Transfer:
    """A copy between devices that made or carried the value (DataParallel): ``kind`` is
    scatter, replicate, gather, gather-grad or reduce; ``link`` the topology's link code
    (``NV4``, ``NODE``, ``SYS``…) when known; ``corrupted``: finite when sent, non-finite
    when it arrived (the copy itself changed the data)."""

    kind: str
    src: str
    dst: str
    link: str | None = None
    corrupted: bool = False
    name: str = ""

    def text(self) -> str:
        link = f" over {self.link}" if self.link else ""
        what = "corrupted" if self.corrupted else "carried"
        tensor = f" ({self.name})" if self.name else ""
        return f"the {self.kind} copy {self.src} → {self.dst}{link}{tensor} {what} it"


@dataclass
class NonFiniteReport:
    """The first non-finite value, as every rank reports it.

    ``step``: backward passes completed before the one it arose in (0 = the first
    iteration); ``rank``/``device``: where it arose; ``module``: the first module (its path
    in the model, ``""`` for the model itself) whose forward output or gradient was
    non-finite, or ``<input>``/``<loss>`` when it came from the batch or from the loss
    outside the model; ``phase``: one of :data:`PHASES`; ``detail``: one sentence of what
    was seen (counts, tensor names); ``this_rank``: the rank that wrote this report;
    ``arrived``: on this rank the value arrived through the all-reduce from ``rank``;
    ``transfer``: the DataParallel copy that made or carried it; ``kind``: ``fault``, or
    ``scaler-skip`` for a gradient overflow a GradScaler skips (not a fault);
    ``blind``: what the watcher could not see in this placement; ``run``: the name every
    rank of one training run gives its records (the first rank's)."""

    step: int
    rank: int
    device: str
    module: str
    phase: str
    detail: str = ""
    this_rank: int = 0
    world_size: int = 1
    arrived: bool = False
    placement: str = "single"
    transfer: Transfer | None = None
    kind: str = "fault"
    also: list[int] = field(default_factory=list)
    blind: list[str] = field(default_factory=list)
    ranks: list[dict[str, Any]] = field(default_factory=list)
    run: str = ""

    @property
    def where(self) -> str:
        if self.module in ("<input>", "<loss>", "<parameters>"):
            return self.module
        return self.module or "(the model itself)"

    def message(self) -> str:
        """One paragraph: where, when, how it got here."""
        head = (
            "gradient overflow skipped by the GradScaler"
            if self.kind == "scaler-skip"
            else "non-finite value"
        )
        text = (
            f"{head} at step {self.step}: arose on rank {self.rank} ({self.device}) in {self.where}, "
            f"phase {self.phase}"
        )
        if self.detail:
            text += f" — {self.detail}"
        if self.transfer is not None:
            text += f"; {self.transfer.text()}"
        if self.arrived:
            text += f"; on rank {self.this_rank} it arrived through the all-reduce from rank {self.rank}"
        if self.also:
            text += f"; rank(s) {', '.join(map(str, self.also))} went non-finite at the same step too"
        return text

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["where"] = self.where
        data["message"] = self.message()
        return {"schema": SCHEMA, **data}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> NonFiniteReport:
        fields = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        if isinstance(fields.get("transfer"), dict):
            fields["transfer"] = Transfer(**fields["transfer"])
        return cls(**fields)


class NonFiniteError(FloatingPointError):
    """Raised by a watcher with ``on_nonfinite="raise"`` on every rank at the step the first
    non-finite value arose; ``report`` is the :class:`NonFiniteReport`."""

    def __init__(self, report: NonFiniteReport):
        super().__init__(report.message())
        self.report = report


class NonFiniteWarning(RuntimeWarning):
    """Warned by a watcher with ``on_nonfinite="warn"``; ``report`` as for the error."""

    def __init__(self, report: NonFiniteReport):
        super().__init__(report.message())
        self.report = report


def record_dir(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The folder records go to: ``explicit``, else ``$GPUDIAG_WATCH_DIR``, else ``./gpudiag-watch``."""
    if explicit is not None:
        return Path(explicit)
    return Path(os.environ.get(DIR_VARIABLE) or DEFAULT_DIR)


def write_record(report: NonFiniteReport, folder: Path) -> Path:
    """``folder/watch-rank<R>.json`` (replacing an earlier run's record, a regular file),
    atomically, with the time it was written (``written``, UTC, ISO 8601). Never through a
    link: a record path or a folder that is a symbolic link, or a record path that is a
    FIFO, device or folder, is refused (:class:`gpudiag.errors.InputError`, from
    :func:`gpudiag.fileio.check_target`); the watcher warns and training goes on."""
    from gpudiag.errors import InputError
    from gpudiag.fileio import atomic_write

    if folder.is_symlink():
        raise InputError(f"{folder} is a symbolic link: gpudiag writes only into real folders")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"watch-rank{report.this_rank}.json"
    data = {**report.to_json(), "written": datetime.now(timezone.utc).isoformat(timespec="microseconds")}
    return atomic_write(path, json.dumps(data, indent=1) + "\n", force=True)


def read_records(folder: str | os.PathLike[str] | None = None) -> dict[str, bytes]:
    """The latest run's records in ``folder`` (default :func:`record_dir`) by file name:
    regular files ``watch-rank*.json`` whose JSON names the ``gpudiag.watch/`` schema and
    whose ``run`` is the one written last — a rank's record that an earlier run (of more
    ranks, say) left there is not taken for this run's. Others are ignored."""
    base = record_dir(folder)
    runs: dict[str, dict[str, bytes]] = {}
    latest: dict[str, str] = {}
    if not base.is_dir():
        return {}
    for path in sorted(base.glob("watch-rank*.json")):
        try:
            if path.is_symlink() or not path.is_file() or path.stat().st_size > _RECORD_LIMIT:
                continue
            data = path.read_bytes()
            record = json.loads(data)
            schema = record.get("schema")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(schema, str) and schema.startswith("gpudiag.watch/"):
            run, written = str(record.get("run", "")), str(record.get("written", ""))
            runs.setdefault(run, {})[path.name] = data
            latest[run] = max(latest.get(run, ""), written)
    if not runs:
        return {}
    return runs[max(latest, key=lambda run: latest[run])]
