"""A hang folder in a report bundle (``gpudiag report --hang DIR``; docs/reporting.md).

:func:`collect` reads a folder that ``gpudiag run -o DIR`` or
``gpudiag.watch(hang_timeout=…)`` wrote (or any folder of dumps ``gpudiag hang`` reads)
into the bundle's files under :data:`FOLDER`:

- ``hang/fr_rank<R>.json`` — each rank's dump, read as ``gpudiag hang`` reads it (a pickle
  only through the bounded, restricted unpickler, never ``pickle.load``) and written as
  JSON, frames included: text, so the bundle's :class:`~gpudiag.redact.Redactor` can scrub
  it like every other file without breaking it (a pickle's strings carry their lengths);
- ``hang/stacks/rank<R>.json`` — the Python stacks the watchdog wrote, where readable
  (JSON in UTF-8, as the watchdog writes it: no other encoding escapes the redactor);
- ``hang/verdict.json`` — the verdict the watchdog printed, as it wrote it, where there is one.

:func:`judge_files` judges the job again from those files alone: the ``hang`` check reads
them there, in ``gpudiag report`` and in ``gpudiag replay``. Sizes are bounded
(:data:`MAX_DUMP_BYTES`, :data:`MAX_BYTES`) so the bundle stays within what replay reads.
"""

from __future__ import annotations

import json
import re
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gpudiag.errors import InputError
from gpudiag.hang.reader import dump_files, dumps_in, load_tree, parse_dump, rank_of
from gpudiag.hang.result import MAX_STACKS_BYTES, HangResult, judge
from gpudiag.render.jsonout import TooLarge, dumps_bounded
from gpudiag.unpickle import check_tree

#: The folder inside the bundle.
FOLDER = "hang"
#: Largest dump once written as JSON, and all of a folder's files together, in bytes
#: (a bundle holds at most 64 MiB a file and 256 MiB in all: repro/bundle.py).
MAX_DUMP_BYTES = 48 << 20
MAX_BYTES = 160 << 20
_STACKS = re.compile(r"rank(\d{1,7})\.json")
#: Most objects one dump's tree may hold when written out, a shared object once per
#: reference (JSON repeats it): 20,000 entries of 64 frames (7 objects a frame) and more.
MAX_NODES = 16_000_000


def _regular(path: Path, limit: int) -> bytes | None:
    """A regular file's bytes (not a link, FIFO or device), when it holds at most ``limit``."""
    try:
        info = path.lstat()
        if not stat.S_ISREG(info.st_mode) or info.st_size > limit:
            return None
        with open(path, "rb") as stream:
            data = stream.read(limit + 1)
    except OSError:
        return None
    return data if len(data) <= limit else None


def _too_large(folder: str, what: str) -> InputError:
    return InputError(
        f"{folder}: {what}, too large for a report bundle (at most {MAX_DUMP_BYTES >> 20} MiB a "
        f"dump, {MAX_BYTES >> 20} MiB in all): run `gpudiag hang {folder} --format json` and attach that"
    )


def collect(folder: str) -> dict[str, bytes]:
    """The bundle files of hang folder ``folder`` (module docstring); InputError when it
    holds no dump, a dump ``gpudiag hang`` cannot read, or more than fits a bundle."""
    root = Path(folder)
    if not root.is_dir():
        raise InputError(f"--hang {folder}: not a folder (the one gpudiag run -o or hang_dir= wrote)")
    files: dict[str, bytes] = {}
    total = 0
    from gpudiag.hang.analysis import MAX_WORLD

    for path in dump_files([folder]):
        rank = rank_of(path)
        if rank >= MAX_WORLD:
            raise InputError(f"{path}: rank {rank}, more than the {MAX_WORLD:,} ranks gpudiag hang judges")
        tree = load_tree(path)
        parse_dump(tree, path, rank)  # (what gpudiag hang could not read is refused here)
        # written whole, a shared string or frame once per reference: bounded before it is
        check_tree(tree, str(path), "flight-recorder dump", max_text=MAX_BYTES, max_nodes=MAX_NODES)
        try:  # (its size counted as it is written: a pickle's memo cannot make gigabytes)
            data = dumps_bounded(tree, MAX_DUMP_BYTES)
        except TooLarge:
            raise _too_large(folder, f"{path.name} is more than {MAX_DUMP_BYTES} bytes as JSON") from None
        except ValueError as exc:
            raise InputError(f"{path}: cannot be written as JSON ({exc})") from None
        total += len(data)
        if total > MAX_BYTES:
            raise _too_large(folder, "its dumps hold more together")
        name = f"{FOLDER}/fr_rank{rank}.json"
        if name in files:
            raise InputError(f"{path}: a second dump of rank {rank}")
        files[name] = data
    stacks = root / "stacks"
    for path in sorted(stacks.iterdir()) if stacks.is_dir() and not stacks.is_symlink() else ():
        stack = _regular(path, MAX_STACKS_BYTES) if _STACKS.fullmatch(path.name) else None
        if stack is not None and isinstance(_json(stack), dict) and total + len(stack) <= MAX_BYTES:
            files[f"{FOLDER}/stacks/{path.name}"] = stack
            total += len(stack)
    verdict = _regular(root / "verdict.json", 1 << 20)
    if verdict is not None and isinstance(_json(verdict), dict):
        files[f"{FOLDER}/verdict.json"] = verdict
    return files


def _json(data: bytes) -> Any:
    """The JSON document ``data`` holds in UTF-8 (None: none). Only UTF-8: ``json.loads``
    reads UTF-16 and UTF-32 bytes too, which the bundle's redactor would scrub as text —
    a token spelt in UTF-16 would reach the bundle unredacted."""
    try:
        return json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError):  # (UnicodeDecodeError is a ValueError)
        return None


def world_size(files: Mapping[str, bytes]) -> int | None:
    """The job's world size the watchdog's ``verdict.json`` states (None: none, or not a
    whole number from 1 to :data:`~gpudiag.hang.analysis.MAX_WORLD`): it knows ranks that
    left no dump."""
    from gpudiag.hang.analysis import MAX_WORLD

    document = _json(files.get(f"{FOLDER}/verdict.json", b""))
    value = document.get("world_size") if isinstance(document, dict) else None
    ok = isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_WORLD
    return value if ok else None


def dump_names(files: Mapping[str, bytes], folder: str = FOLDER) -> list[str]:
    """The dump files directly in ``folder`` of a bundle's files."""
    prefix = f"{folder}/"
    return sorted(
        n
        for n in files
        if n.startswith(prefix) and "/" not in n[len(prefix) :] and n != f"{prefix}verdict.json"
    )


def judge_files(files: Mapping[str, bytes], world: int | None = None, folder: str = FOLDER) -> HangResult:
    """The verdict from a bundle's hang files alone (dumps, and stacks where there are)."""
    from gpudiag.hang.analysis import analyse

    names = dump_names(files, folder)
    if not names:
        raise InputError(f"the bundle holds no flight-recorder dump under {folder}/")
    dumps = dumps_in({n: files[n] for n in names})
    stacks = {}
    for name, data in files.items():
        found = _STACKS.fullmatch(name.rpartition("/")[2]) if name.startswith(f"{folder}/stacks/") else None
        if found:
            stacks[int(found.group(1))] = data
    return judge(analyse(dumps, world), stacks=stacks)
