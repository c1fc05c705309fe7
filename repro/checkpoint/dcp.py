"""``gpudiag ckpt inspect|verify DIR`` for a torch.distributed.checkpoint folder.

:func:`inspect` reads ``.metadata`` (restricted and bounded: :mod:`.dcp_metadata`) and the
data files' sizes: the top-level groups, every tensor (global shape, dtype, chunks), the
files (name, saving rank, bytes), the world size that saved it, wrapper segments in the
keys, and the findings (:mod:`.dcp_check`). :func:`verify` also reads every byte range
(:mod:`.dcp_read`): each chunk must be the ``torch.save`` archive the metadata points to,
its values must match the zip's CRC-32, and float values are counted for NaN/Inf. With
``model`` both compare the keys, shapes and dtypes with the model's state dict. Nothing in
the folder is written; torch.distributed is never initialised.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpudiag.errors import InputError
from gpudiag.findings import Finding, short_repr
from gpudiag.repro.checkpoint import dcp_check, dcp_read
from gpudiag.repro.checkpoint.dcp_metadata import Entry, Metadata, read_metadata, saving_rank
from gpudiag.unpickle import one_line

SCHEMA = "gpudiag.ckpt/1"
_FLOATS = {"float32", "float64", "float16", "bfloat16", "complex64", "complex128"}


@dataclass
class DcpReport:
    """What ``ckpt inspect|verify`` found in a DCP folder (``to_json``: ``gpudiag.ckpt/1``)."""

    path: str
    command: str
    meta: Metadata = field(repr=False)
    sizes: dict[str, int | None]
    findings: list[Finding]
    model: dict[str, Any] | None = None
    verified_bytes: int = 0

    def __repr__(self) -> str:
        return short_repr(
            self, self.command, self.findings, tensors=sum(e.is_tensor for e in self.meta.entries)
        )

    @property
    def format(self) -> str:
        return "dcp"

    def exit_code(self) -> int:
        """1 when a finding of severity warning or error was made, else 0."""
        return 1 if any(f.severity in ("warning", "error") for f in self.findings) else 0

    def to_json(self) -> dict[str, Any]:
        entries = self.meta.entries
        groups: dict[str, dict[str, int]] = {}
        for e in entries:
            g = groups.setdefault(
                str(e.path[0]) if len(e.path) > 1 else "", {"tensors": 0, "objects": 0, "bytes": 0}
            )
            g["tensors" if e.is_tensor else "objects"] += 1
            g["bytes"] += e.nbytes
        ranks = {saving_rank(f)[0] for f in self.sizes} - {None}
        return {
            "schema": SCHEMA,
            "format": "dcp",
            "command": self.command,
            "path": self.path,
            "version": self.meta.version,
            "world_size": max(ranks) + 1 if ranks else None,
            "files": [
                {"name": name, "rank": saving_rank(name)[0], "bytes": size, "present": size is not None}
                for name, size in self.sizes.items()
            ],
            "groups": [{"name": k, **v} for k, v in groups.items()],
            "tensors": [
                {
                    "key": e.key,
                    "shape": list(e.shape),
                    "dtype": e.dtype,
                    "chunks": [
                        {
                            "offsets": list(c.offsets),
                            "sizes": list(c.sizes),
                            "file": c.file,
                            "begin": c.begin,
                            "length": c.length,
                        }
                        for c in e.chunks
                    ],
                }
                for e in entries
                if e.is_tensor
            ],
            "objects": [e.key for e in entries if not e.is_tensor],
            "wrappers": dcp_check.wrapper_segments(e.key for e in entries),
            "model": self.model,
            "verified_bytes": self.verified_bytes if self.command == "verify" else None,
            "findings": [f.to_json() for f in self.findings],
        }


def _check_folder(path: Path) -> None:
    if not path.exists():
        raise InputError(f"{path} does not exist")
    if not path.is_dir():
        raise InputError(
            f"{path} is not a folder (a DCP checkpoint is a folder of .metadata and .distcp files)"
        )


def inspect(path: str | os.PathLike[str], *, model: str | None = None) -> DcpReport:
    """The structure of a DCP folder and what is wrong with it, without reading tensor data."""
    return _report(Path(path), "inspect", model)


def verify(path: str | os.PathLike[str], *, model: str | None = None) -> DcpReport:
    """:func:`inspect`, then every byte range read, checked and decoded."""
    return _report(Path(path), "verify", model)


def _report(path: Path, command: str, model: str | None) -> DcpReport:
    _check_folder(path)
    meta = read_metadata(path)
    findings, sizes = dcp_check.file_findings(meta)
    findings += dcp_check.coverage_findings(meta)
    report = DcpReport(str(path), command, meta, sizes, findings)
    params = None
    if command == "verify":
        params = _read_everything(report)
    report.findings += dcp_check.optimizer_findings(meta, params)
    if model is not None:
        target = dcp_check.model_state(model)
        group, state = dcp_check.choose_group(meta, target)
        found, report.model = dcp_check.model_findings(state, target, group, model)
        report.findings += found
    return report


def _usable(report: DcpReport, entry: Entry) -> list[Any]:
    sizes = report.sizes
    return [
        c
        for c in entry.chunks
        if c.file is not None and sizes.get(c.file) is not None and c.begin + c.length <= (sizes[c.file] or 0)
    ]


def _read_everything(report: DcpReport) -> dict[str, list[str]]:
    """Read every byte range of the files that are there (missing and truncated ones are
    findings already): damaged pieces and non-finite values become findings. Returns the
    parameters each optimizer group's ``param_groups`` lists."""
    meta = report.meta
    handles: dict[str, Any] = {}
    nonfinite: list[tuple[str, int, int]] = []
    params: dict[str, list[str]] = {}
    with contextlib.ExitStack() as stack:
        for entry in meta.entries:
            bad = 0
            for chunk in _usable(report, entry):
                handle = handles.get(chunk.file or "")
                if handle is None:
                    try:
                        handle = stack.enter_context(open(meta.folder / (chunk.file or ""), "rb"))
                    except OSError as exc:
                        raise InputError(
                            f"cannot read {meta.folder / (chunk.file or '')}: {exc.strerror or exc}"
                        ) from None
                    handles[chunk.file or ""] = handle
                try:
                    if entry.is_tensor:
                        piece = dcp_read.open_piece(handle, entry, chunk)
                        data = dcp_read.read_bytes(handle, piece)
                        report.verified_bytes += piece.nbytes
                        if entry.dtype in _FLOATS:
                            bad += _count_nonfinite(data, piece)
                    else:
                        value = dcp_read.read_object(handle, entry, chunk)
                        path = entry.path
                        listed = isinstance(value, list) and all(isinstance(v, str) for v in value)
                        if listed and len(path) >= 4 and path[1] == "param_groups" and path[-1] == "params":
                            params.setdefault(str(path[0]), []).extend(value)
                except dcp_read.UnsafeObject as exc:
                    report.findings.append(_unsafe(entry, chunk, exc))
                except InputError as exc:
                    report.findings.append(_damaged(entry, chunk, exc))
            if bad:
                nonfinite.append((entry.key, bad, entry.numel))
    if nonfinite:
        shown = ", ".join(f"{one_line(k, 100)} ({n} of {total})" for k, n, total in nonfinite[:5])
        report.findings.append(
            Finding(
                "nonfinite-in-checkpoint",
                "error",
                f"{len(nonfinite)} tensors hold NaN or Inf: {shown}" + (" …" if len(nonfinite) > 5 else ""),
                {"tensors": {k: n for k, n, _ in nonfinite}},
                cause="training diverged before the save (loss spike, overflow in fp16/bf16)",
                fix="resume from an earlier checkpoint; `gpudiag nancheck` finds where values break",
            )
        )
    return params


def _damaged(entry: Entry, chunk: Any, exc: InputError) -> Finding:
    return Finding(
        "dcp-chunk-damaged",
        "error",
        one_line(str(exc), 400),
        {
            "key": entry.key,
            "file": chunk.file,
            "rank": saving_rank(chunk.file or "")[0],
            "begin": chunk.begin,
            "length": chunk.length,
        },
        cause="bytes changed on disk or in a copy, or a .metadata from another save",
        fix="copy the file again from where the job saved it",
    )


def _unsafe(entry: Entry, chunk: Any, exc: InputError) -> Finding:
    return Finding(
        "dcp-object-unsafe",
        "warning",
        one_line(str(exc), 400),
        {"key": entry.key, "file": chunk.file, "begin": chunk.begin, "length": chunk.length},
        cause="the job saved an object of its own classes (a dataclass, a config) in the state dict",
        fix="load it only if you trust the checkpoint; `ckpt convert --only GROUP` leaves it out",
    )


def _count_nonfinite(data: memoryview, piece: dcp_read.Piece) -> int:
    """NaN and Inf among the chunk's values (its view of the storage)."""
    import torch

    if not piece.nbytes:
        return 0
    dtype = getattr(torch, piece.dtype)
    storage = torch.frombuffer(data, dtype=dtype)
    values = storage.as_strided(piece.sizes, piece.strides, piece.offset)
    return int((~torch.isfinite(values)).sum())


def bundle_files(path: str | os.PathLike[str]) -> dict[str, bytes]:
    """A DCP folder's inspection for a report bundle (``gpudiag report --checkpoint DIR``):
    ``checkpoint/inspect.json`` and ``checkpoint/inspect.txt`` — structure and findings,
    never tensor values."""
    import json

    from gpudiag.render.ckpt_lines import dcp_lines

    doc = inspect(path).to_json()
    return {
        "checkpoint/inspect.json": json.dumps(doc, indent=1).encode(),
        "checkpoint/inspect.txt": ("\n".join(dcp_lines(doc)) + "\n").encode(),
    }
