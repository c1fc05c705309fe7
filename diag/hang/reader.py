"""Read PyTorch flight-recorder dumps: pickle or JSON, any file name that ends in the rank.

The format is torch's (``torch/csrc/distributed/c10d/FlightRecorder.hpp``): a dict with
``version`` (``"2.10"`` from torch 2.11 to 2.15), ``pg_config`` (group name → name, desc,
ranks as text), ``pg_status`` (per-rank group index → last enqueued/started/completed
sequence number), ``entries`` (one dict per collective, oldest first: ``record_id``,
``pg_id``, ``process_group`` = (name, desc), ``collective_seq_id``, ``p2p_seq_id``,
``is_p2p``, ``profiling_name`` = "backend:op", sizes and dtypes, ``state``, ``retired``
and, in pickles, ``frames``). A dump names no rank: the rank is the last number in the
file's name (``nccl_trace_rank_3``, ``fr-3.json``, ``dump.rank3.pkl``), as torch's own
analyzer reads it. The recorder is a ring buffer: a dump whose first ``record_id`` is not
0 has lost its oldest entries (:attr:`Dump.wrapped`).

Dumps come from other machines: a pickle is read by :mod:`gpudiag.hang.dumppickle` (only
dicts, lists, tuples, text, numbers: no global, no call, text keys), within
:data:`MAX_BYTES`; anything else is one :class:`~gpudiag.errors.InputError` naming the file.
What a dump shares (torch's pickle repeats one frame by reference) is read once
(:func:`frames_of`), and every text taken from it is :func:`clean` — control characters and
lone surrogates escaped, cut — so no output format prints a terminal escape or fails to
encode a name.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

from gpudiag.errors import InputError
from gpudiag.hang import dumppickle
from gpudiag.unpickle import TooComplex, one_line

#: Largest dump read, in bytes (a 20,000-entry NCCL buffer with frames is about 60 MB).
MAX_BYTES = 256 * 1024 * 1024
#: Most entries one dump may hold (torch's ring buffer: TORCH_FR_BUFFER_SIZE, 2,000 by default).
MAX_ENTRIES = 200_000
#: Frames of one entry kept (the innermost; torch records up to 64 by default).
MAX_FRAMES = 256
#: Most files one run reads (a folder of one job's dumps, one per rank).
MAX_FILES = 100_000
#: Format versions read: major 2 (torch 2.11 to 2.15 write "2.10"; every 2.x has the fields used).
MAJOR_VERSION = 2
_EXTENSIONS = (".pkl", ".pickle", ".json", ".bin", ".txt", ".dump")
_RANK = re.compile(r"(\d+)\D*$")
_KIND = "flight-recorder dump"


@dataclass(frozen=True)
class Frame:
    """One Python frame of the call that recorded a collective: ``file``, ``line``, function ``name``."""

    file: str
    line: int
    name: str


@dataclass(frozen=True)
class Entry:
    """One recorded collective of one rank. ``group`` is the process group's global name
    (``"0"`` is the world), ``desc`` its description (``default_pg``, a user's
    ``group_desc``, ``undefined``); ``seq`` its collective (or p2p) sequence number in
    that group; ``op`` the operation without the backend (``all_reduce``); ``completed``
    whether this rank saw it finish (state ``completed`` or ``retired``)."""

    record_id: int
    group: str
    desc: str
    pg_id: int
    seq: int
    is_p2p: bool
    op: str
    input_sizes: list[Any]
    input_dtypes: list[str]
    output_sizes: list[Any]
    output_dtypes: list[str]
    state: str
    completed: bool
    frames: tuple[Frame, ...] = ()
    #: the group's running count of every operation (``op_id``; None when absent), and the
    #: backend (``gloo`` of ``gloo:all_reduce``): gloo's ``pg_status`` counts in op_ids,
    #: which a send or recv advances too — gloo records no send or recv as an entry
    op_id: int | None = None
    backend: str = ""
    #: when the rank recorded it (``time_created_ns``, the rank's clock; None when absent)
    created_ns: int | None = None
    #: the collective's timeout (``timeout_ms``; None when absent)
    timeout_ms: int | None = None

    @property
    def status_id(self) -> int:
        """The number ``pg_status``'s last completed one is compared with: the op_id on gloo
        (torch 2.14: without point-to-point it equals ``seq``; with them, only it matches),
        else ``seq``."""
        return self.op_id if self.backend == "gloo" and self.op_id is not None else self.seq


@dataclass
class Dump:
    """One rank's dump: its ``entries`` (oldest first), ``last_completed`` (group index →
    last sequence number completed, from ``pg_status``), the ranks ``pg_config`` lists
    per group name, and ``wrapped`` when the ring buffer dropped its oldest entries."""

    rank: int
    path: str
    version: str
    entries: list[Entry]
    last_completed: dict[int, int] = field(default_factory=dict)
    pg_ranks: dict[str, list[int]] = field(default_factory=dict)
    wrapped: bool = False


class Dumps(list[Dump]):
    """The dumps read, one per rank (a list), and ``skipped``: a note per file of the folder
    that is not a flight-recorder dump (a job's log beside them), which the verdict shows."""

    def __init__(self, dumps: list[Dump] = (), skipped: list[str] | None = None):  # type: ignore[assignment]
        super().__init__(dumps)
        self.skipped: list[str] = skipped or []


#: Longest text kept from a dump (a file name, an op's name); longer is cut with "…".
MAX_TEXT = 4096
#: Numbers a dump's counters (record ids, sequence numbers, lines) may hold.
MAX_NUMBER = 2**63


def clean(text: str, limit: int = MAX_TEXT) -> str:
    """Text from a dump, safe to print in every format: control characters, lone
    surrogates and other unprintable characters escaped (``\\x1b``, ``\\ud800``), cut at
    ``limit`` characters."""
    if text.isprintable() and len(text) <= limit:
        return text
    out = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text[:limit])
    return out + ("…" if len(text) > limit else "")


class NotADump(InputError):
    """The file is no flight-recorder dump at all (a log, another JSON document): in a
    folder, skipped with a note; named alone, refused."""


def rank_of(path: Path) -> int:
    """The rank a dump file's name ends in (extensions such as ``.pkl`` ignored)."""
    name = path.name
    for ext in _EXTENSIONS:
        if name.lower().endswith(ext):
            name = name[: -len(ext)]
            break
    found = _RANK.search(name)
    if not found or len(found.group(1)) > 7:
        raise InputError(
            f"{path}: cannot tell the rank from the file name (it must end in the rank, as nccl_trace_rank_3)"
        )
    return int(found.group(1))


def _named(path: Path) -> bool:
    try:
        rank_of(path)
    except InputError:
        return False
    return True


def dump_files(paths: list[str]) -> list[Path]:
    """The dump files named, folders replaced by the files in them whose name ends in a
    rank (hidden files and others — a verdict, a log — skipped)."""
    files: list[Path] = []
    for each in paths:
        path = Path(each)
        if path.is_dir():
            inside = sorted(
                p for p in path.iterdir() if p.is_file() and not p.name.startswith(".") and _named(p)
            )
            if not inside:
                raise InputError(f"{path}: no dump files in this folder (none is named with a rank)")
            files.extend(inside)
        elif path.is_file():
            files.append(path)
        else:
            raise InputError(f"{path}: no such file or folder")
        if len(files) > MAX_FILES:
            raise InputError(f"{each}: more than {MAX_FILES} files")
    return files


def load_tree(path: Path) -> Any:
    """The object a dump file holds, pickle or JSON; bounded (module docstring)."""
    try:
        size = path.stat().st_size
        if size > MAX_BYTES:
            raise InputError(f"{path}: {size} bytes, more than a flight-recorder dump holds ({MAX_BYTES})")
        data = path.read_bytes()
    except OSError as exc:
        raise InputError(f"{path}: cannot read it ({exc.strerror or exc})") from exc
    return tree_of(data, str(path))


def tree_of(data: bytes, source: str) -> Any:
    """The object a dump's bytes hold, pickle or JSON (``source`` names it in errors)."""
    path = source
    if len(data) > MAX_BYTES:
        raise InputError(f"{path}: {len(data)} bytes, more than a flight-recorder dump holds ({MAX_BYTES})")
    head = data.lstrip()[:1]
    if head in (b"{", b"["):
        try:
            tree = json.loads(data)
        except RecursionError as exc:
            raise TooComplex(source, "nested too deep", _KIND) from exc
        except (ValueError, UnicodeDecodeError) as exc:
            raise InputError(
                f"{path}: not a flight-recorder dump (damaged JSON: {one_line(str(exc))})"
            ) from exc
    elif data[:1] == b"\x80":
        tree = dumppickle.loads(data, source, _KIND)
    else:
        raise NotADump(f"{path}: not a flight-recorder dump (neither a pickle nor JSON)")
    return tree


def _int(value: Any, what: str, path: Path) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise InputError(f"{path}: {what} is not a number")
    if isinstance(value, str) and len(value) > 30:
        raise InputError(f"{path}: {what} is not a number")
    try:
        number = int(value)
    except ValueError as exc:
        raise InputError(f"{path}: {what} is not a number") from exc
    if not -MAX_NUMBER < number < MAX_NUMBER:
        raise InputError(f"{path}: {what} is out of range (more than 2**63)")
    return number


def _small(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and -MAX_NUMBER < value < MAX_NUMBER


def _ranks(text: Any) -> list[int]:
    """``"[0, 1, 2]"`` (pg_config's ranks) → [0, 1, 2]; [] when unreadable."""
    if isinstance(text, list):
        return [r for r in text[:100_000] if _small(r) and 0 <= r < 10**7]
    if not isinstance(text, str):
        return []
    return [int(x) for x in re.findall(r"\d+", text[:100_000]) if len(x) <= 7]


def frames_of(value: Any, seen: dict[Any, Any] | None = None) -> tuple[Frame, ...]:
    """Frames from a list of {filename, line, name} dicts (the recorder's and gpudiag run's).
    ``seen`` (id → (object, result)) makes a frame, or a list of frames, that the dump
    shares between entries (torch's pickle does) cost once: per reference, a small dump
    could make the work grow as the product of two lists' lengths."""
    if not isinstance(value, list):
        return ()
    seen = {} if seen is None else seen
    same = ("frames", *map(id, value[:MAX_FRAMES]))  # (another list of the same shared frames)
    known = seen.get(id(value)) or seen.get(same)
    if known is not None and (known[0] is value or known[0] == same):
        return known[1]
    out = []
    for f in value[:MAX_FRAMES]:
        done = seen.get(id(f))
        if done is not None and done[0] is f:
            out.append(done[1])
        elif isinstance(f, dict) and isinstance(f.get("filename"), str):
            line = f.get("line")
            name = f.get("name")
            frame = Frame(
                clean(f["filename"]),
                line if _small(line) and line >= 0 else 0,
                clean(name) if isinstance(name, str) else "?",
            )
            seen[id(f)] = (f, frame)
            out.append(frame)
    result = tuple(out)
    seen[id(value)] = (value, result)
    seen[same] = (same, result)
    return result


def _strings(value: Any) -> list[str]:
    return (
        [clean(v, 200) if isinstance(v, str) else _shown(v) for v in value[:1000]]
        if isinstance(value, list)
        else []
    )


def _shown(value: Any) -> str:
    """A value of any type as short, printable text (never formats a huge number)."""
    if isinstance(value, int) and not _small(value):
        return "(a number past 2**63)"
    if isinstance(value, (int, float, bool)) or value is None:
        return str(value)
    if isinstance(value, str):
        return clean(value, 200)
    return f"({type(value).__name__})"


def _sizes(value: Any) -> list[Any]:
    """``input_sizes``: a list of shapes (lists of whole numbers); anything else shown as text."""
    out: list[Any] = []
    for shape in value[:1000] if isinstance(value, list) else ():
        if (
            type(shape) is list
            and len(shape) <= 64
            and all(type(n) is int and -MAX_NUMBER < n < MAX_NUMBER for n in shape)
        ):
            out.append(list(shape))
        elif isinstance(shape, list):
            out.append([n if _small(n) else _shown(n) for n in shape[:64]])
        else:
            out.append(_shown(shape))
    return out


def _entry(raw: Any, path: Path, index: int, seen: dict[Any, Any]) -> Entry:
    known = seen.get(id(raw))
    if known is not None and known[0] is raw:  # (one entry listed again: the same Entry)
        return known[1]
    entry = _new_entry(raw, path, index, seen)
    seen[id(raw)] = (raw, entry)
    return entry


def _new_entry(raw: Any, path: Path, index: int, seen: dict[Any, Any]) -> Entry:
    where = f"entry {index}"
    if not isinstance(raw, dict):
        raise InputError(f"{path}: {where} is not a record")
    for key in ("process_group", "collective_seq_id", "profiling_name"):
        if key not in raw:
            raise InputError(f"{path}: {where} has no {key!r} (not a flight-recorder dump?)")
    group = raw["process_group"]
    if not isinstance(group, (list, tuple)) or len(group) != 2 or not all(isinstance(g, str) for g in group):
        raise InputError(f"{path}: {where}: process_group is not (name, desc)")
    group = (clean(group[0], 200), clean(group[1], 200))
    name = raw["profiling_name"]
    if not isinstance(name, str):
        raise InputError(f"{path}: {where}: profiling_name is not text")
    name = clean(name, 200)
    is_p2p = bool(raw.get("is_p2p", False))
    seq = _int(raw.get("p2p_seq_id" if is_p2p else "collective_seq_id"), f"{where}'s sequence number", path)
    state = _shown(raw.get("state", ""))
    op_id = raw.get("op_id")
    created = raw.get("time_created_ns")
    return Entry(
        record_id=_int(raw.get("record_id", index), f"{where}'s record_id", path),
        group=group[0],
        desc=group[1],
        pg_id=_int(raw.get("pg_id", -1), f"{where}'s pg_id", path),
        seq=seq,
        is_p2p=is_p2p,
        op=name.split(":", 1)[1] if ":" in name else name,
        input_sizes=_sizes(raw.get("input_sizes")),
        input_dtypes=_strings(raw.get("input_dtypes")),
        output_sizes=_sizes(raw.get("output_sizes")),
        output_dtypes=_strings(raw.get("output_dtypes")),
        state=state,
        completed=state == "completed" or raw.get("retired") is True,
        frames=frames_of(raw.get("frames"), seen),
        op_id=op_id if _small(op_id) else None,
        backend=name.split(":", 1)[0] if ":" in name else "",
        created_ns=created if _small(created) else None,
        timeout_ms=timeout if _small(timeout := raw.get("timeout_ms")) and timeout >= 0 else None,
    )


def parse_dump(tree: Any, path: Path, rank: int) -> Dump:
    """A :class:`Dump` from the object a file held; InputError when it is not one."""
    if not isinstance(tree, dict) or ("entries" not in tree and "version" not in tree):
        raise NotADump(f"{path}: not a flight-recorder dump (no 'version' and 'entries')")
    version = tree.get("version")
    major = str(version).split(".", 1)[0]
    if not isinstance(version, str) or major != str(MAJOR_VERSION):
        raise InputError(
            f"{path}: flight-recorder format version {one_line(str(version), 20)} "
            "is not one gpudiag reads (2.x)"
        )
    raw_entries = tree.get("entries", [])  # (absent when the recorder had none)
    if not isinstance(raw_entries, list):
        raise InputError(f"{path}: 'entries' is not a list")
    if len(raw_entries) > MAX_ENTRIES:
        raise InputError(
            f"{path}: {len(raw_entries)} entries, more than a flight recorder keeps ({MAX_ENTRIES})"
        )
    seen: dict[Any, Any] = {}
    entries = [_entry(raw, path, i, seen) for i, raw in enumerate(raw_entries)]
    last_completed: dict[int, int] = {}
    status = tree.get("pg_status")
    for key, value in status.items() if isinstance(status, dict) else ():
        if isinstance(value, dict) and "last_completed_collective" in value:
            number = value["last_completed_collective"]
            if isinstance(key, (str, int)) and not isinstance(key, bool) and _small(number):
                try:
                    last_completed[_int(key, "a pg_status key", path)] = int(number)
                except InputError:
                    continue
    pg_ranks: dict[str, list[int]] = {}
    config = tree.get("pg_config")
    for key, value in config.items() if isinstance(config, dict) else ():
        if isinstance(key, str) and isinstance(value, dict):
            pg_ranks[clean(key, 200)] = _ranks(value.get("ranks"))
    wrapped = bool(entries) and entries[0].record_id > 0
    return Dump(rank, clean(str(path)), clean(version, 20), entries, last_completed, pg_ranks, wrapped)


def dumps_in(files: Mapping[str, bytes]) -> list[Dump]:
    """Every dump held in memory (a bundle's), by file name (the rank last in it), sorted by rank."""
    dumps: dict[int, Dump] = {}
    for name, data in sorted(files.items()):
        rank = rank_of(Path(name))
        if rank in dumps:
            raise InputError(f"{name}: a second dump of rank {rank} (the first: {dumps[rank].path})")
        dumps[rank] = parse_dump(tree_of(data, name), Path(name), rank)
    return [dumps[r] for r in sorted(dumps)]


def _head(path: Path) -> bytes:
    """The first bytes of a file (empty when unreadable: the full read says why)."""
    try:
        with open(path, "rb") as stream:
            return stream.read(64)
    except OSError:
        return b""


def read_dumps(paths: list[str]) -> Dumps:
    """Every dump named (files or folders), one per rank, sorted by rank. A file found in a
    folder that is no dump at all (``slurm-1234.out``) is skipped with a note (``skipped``);
    one named alone is refused."""
    dumps: dict[int, Dump] = {}
    skipped: list[str] = []
    named = {Path(p) for p in paths}
    for path in dump_files(paths):
        rank = rank_of(path)
        alone = path in named
        head = _head(path).lstrip()[:1]
        if not alone and head and head not in (b"\x80", b"{", b"["):
            skipped.append(f"{clean(path.name, 200)}: not a flight-recorder dump (neither a pickle nor JSON)")
            continue
        try:
            dump = parse_dump(load_tree(path), path, rank)
        except NotADump as exc:
            if alone:
                raise
            skipped.append(f"{clean(path.name, 200)}: {str(exc).split(': ', 1)[-1]}")
            continue
        if rank in dumps:
            raise InputError(f"{path}: a second dump of rank {rank} (the first: {dumps[rank].path})")
        dumps[rank] = dump
    if not dumps:
        raise InputError(clean(f"{', '.join(paths)}: no flight-recorder dump ({'; '.join(skipped)})", 300))
    return Dumps([dumps[r] for r in sorted(dumps)], skipped)
