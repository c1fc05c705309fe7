"""``gpudiag ckpt convert DIR OUT.pt|OUT.safetensors``: a DCP folder into one file, streamed.

The result is what ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` gives —
the nested state dict rebuilt from ``planner_data`` in ``.metadata`` order (a string step
makes a dict, an integer a list), every tensor contiguous in its saved dtype, every object
entry as it was pickled — but written tensor by tensor: a tensor stored in one chunk is
copied from its byte range straight into the output's record (its CRC-32 checked against
the chunk's as it is copied); one stored in several chunks is assembled in one buffer of
its size from the chunks' byte ranges (each chunk's CRC-32 checked) and written. Memory
stays about the largest tensor, torch is not imported, and the folder is only read.

Before anything is written the folder is checked (:mod:`.dcp_check`): a missing or
truncated file or a coverage gap refuses the conversion (exit 2), naming the first problem.
The output is written atomically (temporary file, fsync, rename); a ``.pt`` is then read
back — its zip directory, and its pickle by the rules of ``torch.load(weights_only=True)``,
every tensor's storage, dtype, shape and stride compared with what was meant; a
``.safetensors`` has its header and bytes read back and compared. ``--only GROUP`` keeps one
top-level group (``model``); ``--keys auto`` removes wrapper segments (``_orig_mod.``,
``_checkpoint_wrapped_module.``, ``_fsdp_wrapped_module.`` at any depth, a leading
``module.`` that every key of the group carries) from keys and parameter names alike.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import zlib
from pathlib import Path
from typing import Any, BinaryIO

from gpudiag.errors import InputError
from gpudiag.fileio import atomic_output
from gpudiag.repro.checkpoint import dcp_check, dcp_read, pickles, torchzip, verify
from gpudiag.repro.checkpoint.converting import ConvertResult
from gpudiag.repro.checkpoint.dcp_metadata import Entry, Metadata, read_metadata
from gpudiag.repro.checkpoint.safetensors_io import DTYPES, _header_bytes
from gpudiag.unpickle import one_line

#: dtype name → the storage class torch.save names for it.
_STORAGE_OF = {dtype: name for name, (dtype, _) in pickles.STORAGE_TYPES.items()}
#: The small records torch.save writes beside data.pkl and the storages (torch 2.11 to 2.14).
_SMALL = ((".format_version", b"1"), (".storage_alignment", b"64"), ("byteorder", b"little"))
_DATE = (1980, 1, 1, 0, 0, 0)


def convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    only: str | None = None,
    keys: str = "auto",
    to: str | None = None,
    force: bool = False,
) -> ConvertResult:
    """Convert the DCP folder ``src`` into ``dst`` (``.pt`` or ``.safetensors``)."""
    src, dst = Path(src), Path(dst)
    if keys not in ("auto", "keep"):
        raise InputError(f"--keys must be auto or keep, not {keys!r}")
    fmt = to or ("safetensors" if dst.suffix == ".safetensors" else "pt")
    if fmt not in ("pt", "safetensors"):
        raise InputError(f"--to must be pt or safetensors, not {fmt!r}")
    if not src.is_dir():
        raise InputError(f"{src} is not a DCP folder")
    if dst.resolve().parent == src.resolve() or src.resolve() in dst.resolve().parents:
        raise InputError(
            f"{dst} is inside the checkpoint folder {src}: write OUT elsewhere (IN is never changed)"
        )
    meta = read_metadata(src)
    _refuse_damaged(meta)
    entries = _select(meta, only)
    renames, notes = _renames(entries, keys)
    result = ConvertResult(str(src), str(dst), "dcp", fmt, False, [], notes)
    paths = [tuple(_rename_path(e.path, renames)) for e in entries]
    _refuse_collisions(entries, paths)
    moved = [i for i, (e, p) in enumerate(zip(entries, paths, strict=True)) if e.path != p]
    changed = len(moved)
    first, last = (moved[0], moved[-1]) if moved else (0, len(entries) - 1)  # show renamed keys
    result.mappings.append(
        {
            "state_dict": f"[{only!r}]" if only else "(root)",
            "keys": len(entries),
            "changed": changed,
            "strip": sorted({s + "." for _, removed in renames.values() for s in removed}),
            "add": "",
            "first": [entries[first].key, _flat(paths[first], only)],
            "last": [entries[last].key, _flat(paths[last], only)],
        }
    )
    with contextlib.ExitStack() as stack:
        handles: dict[str, BinaryIO] = {}

        def handle(name: str) -> BinaryIO:
            if name not in handles:
                try:
                    handles[name] = stack.enter_context(open(meta.folder / name, "rb"))
                except OSError as exc:
                    raise InputError(f"cannot read {meta.folder / name}: {exc.strerror or exc}") from None
            return handles[name]

        if fmt == "pt":
            refused = _write_pt(meta, entries, paths, only, dst, force, handle)
            if refused:
                notes.append(refused)
            result.verified = refused is None
        else:
            result.sidecar = _write_safetensors(entries, paths, only, dst, force, handle, notes)
            result.verified = True
    return result


def _flat(path: tuple[Any, ...], only: str | None) -> str:
    """The key an output entry has: its path joined by dots, within ``only``'s group."""
    return ".".join(map(str, path[1:] if only else path))


def _refuse_damaged(meta: Metadata) -> None:
    findings, _ = dcp_check.file_findings(meta)
    findings += dcp_check.coverage_findings(meta)
    if findings:
        more = (
            f" ({len(findings)} problems; `gpudiag ckpt verify {meta.folder}` lists them)"
            if len(findings) > 1
            else ""
        )
        raise InputError(f"{findings[0].code}: {findings[0].message}{more}")


def _select(meta: Metadata, only: str | None) -> list[Entry]:
    if only is None:
        return list(meta.entries)
    chosen = [e for e in meta.entries if len(e.path) > 1 and str(e.path[0]) == only]
    if not chosen:
        groups = sorted({str(e.path[0]) for e in meta.entries if len(e.path) > 1})
        raise InputError(
            f"--only {only}: no such top-level group (the checkpoint has {', '.join(groups) or 'none'})"
        )
    return chosen


Renames = dict[str, tuple[str, tuple[str, ...]]]  # name → (new name, segments removed)


def _renames(entries: list[Entry], keys: str) -> tuple[Renames, list[str]]:
    """For ``--keys auto``: every name (a path step, a parameter name in ``params`` lists)
    that carries wrapper segments → its name without them; a leading ``module.`` only where
    every key of its group has it (as the single-file convert peels it)."""
    if keys == "keep":
        return {}, []
    names = {p for e in entries for p in e.path[1:] if isinstance(p, str)}
    by_group: dict[Any, list[str]] = {}
    for e in entries:
        if e.is_tensor and len(e.path) == 2 and isinstance(e.path[1], str):
            by_group.setdefault(e.path[0], []).append(e.path[1])
    module_everywhere = bool(by_group) and all(
        all(k.startswith("module.") for k in ks) for ks in by_group.values()
    )
    out: Renames = {}
    for name in names:
        new = dcp_check.strip_wrappers(name)
        if name.startswith("module.") and not module_everywhere:
            new = "module." + dcp_check.strip_wrappers(name.removeprefix("module.")) if new != name else name
        if new != name:
            removed = tuple(s for s in dcp_check.wrapper_segments([name]))
            out[name] = (new, removed)
    notes = []
    if out:
        segments = sorted({s for _, removed in out.values() for s in removed})
        notes.append(
            f"--keys auto: removed wrapper segments {', '.join(s + '.' for s in segments)} "
            f"from {len(out)} names"
        )
    return out, notes


def _rename_path(path: tuple[Any, ...], renames: Renames) -> list[Any]:
    return [renames[p][0] if isinstance(p, str) and p in renames else p for p in path]


def _refuse_collisions(entries: list[Entry], paths: list[tuple[Any, ...]]) -> None:
    seen: dict[tuple[Any, ...], str] = {}
    for entry, path in zip(entries, paths, strict=True):
        if path in seen:
            raise InputError(
                f"refusing to rename: {one_line(seen[path], 100)!r} and {one_line(entry.key, 100)!r} "
                "would both "
                f"become {'.'.join(map(str, path))!r} (pass --keys keep)"
            )
        seen[path] = entry.key


def _set_element(root: dict[Any, Any], path: tuple[Any, ...], value: Any) -> None:
    """Place ``value`` at ``path`` as DCP's own loader does: a string step makes a dict, an
    integer step a list padded with None."""
    cur: Any = root
    for prev, key in itertools.pairwise(path):
        fresh: Any = {} if type(key) is str else []
        if isinstance(cur, dict):
            cur = cur.setdefault(prev, fresh)
        else:
            cur.extend([None] * (prev + 1 - len(cur)))
            if cur[prev] is None:
                cur[prev] = fresh
            cur = cur[prev]
    last = path[-1]
    if type(last) is int:
        cur.extend([None] * (last + 1 - len(cur)))
    cur[last] = value


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= max(n, 1)
    return tuple(reversed(out))


def _object(entry: Entry, handle: Any, renames: Renames) -> Any:
    chunk = entry.chunks[0]
    try:
        value = dcp_read.read_object(handle(chunk.file), entry, chunk)
    except dcp_read.UnsafeObject as exc:
        raise InputError(f"{exc}; not converted (--only GROUP leaves it out)") from None
    if renames and entry.path[-1] == "params" and isinstance(value, list):
        value = [renames[v][0] if isinstance(v, str) and v in renames else v for v in value]
    return value


def _write_pt(
    meta: Metadata,
    entries: list[Entry],
    paths: list[tuple[Any, ...]],
    only: str | None,
    dst: Path,
    force: bool,
    handle: Any,
) -> str | None:
    """The torch zip: pickle of the tree (placeholders), then one record per tensor."""
    renames: Renames = {}  # params lists follow the renamed keys
    for entry, path in zip(entries, paths, strict=True):
        for old, new in zip(entry.path, path, strict=True):
            if old != new:
                renames[old] = (new, ())
    tree: dict[Any, Any] = {}
    tensors: list[tuple[Entry, str]] = []
    for entry, path in zip(entries, paths, strict=True):
        where = path[1:] if only else path
        if entry.is_tensor:
            if entry.dtype not in _STORAGE_OF:
                raise InputError(
                    f"tensor {one_line(entry.key, 100)}: a {entry.dtype} tensor "
                    "(not written by this converter)"
                )
            key = str(len(tensors))
            storage = pickles.StorageRef(_STORAGE_OF[entry.dtype], key, "cpu", entry.numel)
            value: Any = pickles.TensorRef(storage, 0, entry.shape, _contiguous_stride(entry.shape))
            tensors.append((entry, key))
        else:
            value = _object(entry, handle, renames)
        _set_element(tree, tuple(where), value)
    data = pickles.dumps(tree)
    expected = verify.tensor_map(tree)
    prefix = "archive/"
    crcs: dict[str, tuple[int, int]] = {}
    with atomic_output(dst, force=force) as out:
        writer = torchzip._Writer(out)
        copier, scratch = torchzip._Copier(), Scratch()
        writer.add(prefix + "data.pkl", len(data), zlib.crc32(data), _DATE, lambda f: f.write(data))
        for name, small in _SMALL:
            writer.add(prefix + name, len(small), zlib.crc32(small), _DATE, lambda f, b=small: f.write(b))
        for entry, key in tensors:
            crc, write = _tensor_record(entry, handle, copier, scratch)
            writer.add(f"{prefix}data/{key}", entry.nbytes, crc, _DATE, write)
            crcs[f"{prefix}data/{key}"] = (entry.nbytes, crc)
            del write  # its buffer, before the next tensor's is made
        writer.add(prefix + "version", 2, zlib.crc32(b"3\n"), _DATE, lambda f: f.write(b"3\n"))
        writer.finish()
        out.flush()
        written = torchzip.open_archive(Path(out.name), str(dst))
        back = {r.name: (r.size, r.crc) for r in written.records if r.name in crcs}
        if back != crcs:
            raise InputError(f"{dst}: verification failed: the written records differ from what was meant")
        return verify.read_back(written.pickle, data, expected, dst)


class Scratch:
    """One buffer for assembling tensors, grown to the largest and reused (every byte of it
    is overwritten: the chunks were checked to tile the tensor)."""

    def __init__(self) -> None:
        self.buffer = bytearray()

    def __call__(self, size: int) -> memoryview:
        if len(self.buffer) < size:
            self.buffer = bytearray()  # the old one freed first
            self.buffer = bytearray(size)
        return memoryview(self.buffer)[:size]


def _tensor_record(entry: Entry, handle: Any, copier: Any, scratch: Scratch) -> tuple[int, Any]:
    """(CRC-32 of the tensor's contiguous bytes, a function writing them to the output).

    When every chunk is one contiguous run of the tensor (the whole tensor, or rows of a
    dim-0 shard as FSDP2 saves them), the record is the chunks' byte ranges one after the
    other: copied straight from the files through one small buffer, each chunk's CRC-32
    (from its archive) checked on the bytes written, the record's CRC-32 combined from
    them. Otherwise (column shards, strided storages) the tensor is assembled in one
    buffer of its size."""
    runs = []
    for chunk in entry.chunks:
        source = handle(chunk.file)
        piece = dcp_read.open_piece(source, entry, chunk)
        runs.append((_layout(entry, chunk), chunk, piece, source))
    if all(layout[2] == 1 and piece.contiguous for layout, _, piece, _ in runs):
        ordered = sorted(runs, key=lambda r: r[0][0])
        crc = 0
        for _, _, piece, _ in ordered:
            crc = dcp_read.crc32_combine(crc, piece.crc, piece.nbytes)

        def copy(out: BinaryIO) -> None:
            for _, _, piece, source in ordered:
                if torchzip._copy_range(source, out, piece.begin, piece.nbytes, copier) != piece.crc:
                    raise InputError(
                        f"{piece.file} bytes {piece.begin}-{piece.begin + piece.nbytes} (tensor "
                        f"{one_line(entry.key, 100)}): the values do not match their CRC-32 (damaged)"
                    )

        return crc, copy
    buffer = scratch(entry.nbytes)
    for layout, chunk, piece, source in runs:
        _place(buffer, entry, chunk, layout, piece, source)
    crc = zlib.crc32(buffer)

    def write(out: BinaryIO) -> None:
        out.write(buffer)
        out.flush()
        copier.written(out.fileno(), out.tell())  # start writing back, as a copied record does

    return crc, write


def _layout(entry: Entry, chunk: Any) -> tuple[int, int, int, int]:
    """Where a chunk's values go in the tensor's row-major bytes: (byte offset of its first
    run, bytes per run, number of runs, the first dimension its runs do not span). The
    chunk's trailing dimensions that span the whole tensor make one contiguous run."""
    item = entry.itemsize
    shape, sizes, offsets = entry.shape, chunk.sizes, chunk.offsets
    if not shape:
        return 0, item, 1, 0
    full = len(shape) - 1
    while full > 0 and sizes[full] == shape[full]:
        full -= 1
    inner = 1
    for n in shape[full + 1 :]:
        inner *= n
    count = 1
    for n in sizes[:full]:
        count *= n
    strides = _contiguous_stride(shape)
    start = sum(o * s for o, s in zip(offsets, strides, strict=True)) * item
    return start, sizes[full] * inner * item, count, full


def _place(
    buffer: memoryview,
    entry: Entry,
    chunk: Any,
    layout: tuple[int, int, int, int],
    piece: dcp_read.Piece,
    source: BinaryIO,
) -> None:
    """Copy one chunk's values into the tensor's buffer, run by run."""
    item = entry.itemsize
    _, run, count, full = layout
    data = dcp_read.read_bytes(source, piece)
    if not piece.contiguous:
        data = _gather(data, piece, item)
    shape, sizes, offsets = entry.shape, chunk.sizes, chunk.offsets
    strides = _contiguous_stride(shape)
    outer = sizes[:full]
    for i in range(count):
        index, rest = [], i
        for n in reversed(outer):
            index.append(rest % n)
            rest //= n
        index.reverse()
        start = sum((o + x) * s for o, x, s in zip(offsets[:full], index, strides[:full], strict=True))
        start = (start + (offsets[full] * strides[full] if shape else 0)) * item
        buffer[start : start + run] = data[i * run : (i + 1) * run]


def _gather(data: memoryview, piece: dcp_read.Piece, item: int) -> memoryview:
    """A strided chunk (a view of a larger storage) made contiguous, element by element run."""
    out = bytearray()
    sizes, strides = piece.sizes, piece.strides
    count = 1
    for n in sizes:
        count *= n
    for i in range(count):
        rest, at = i, piece.offset
        for n, s in zip(reversed(sizes), reversed(strides), strict=True):
            at += (rest % n) * s
            rest //= n
        out += data[at * item : (at + 1) * item]
    return memoryview(out)


def _write_safetensors(
    entries: list[Entry],
    paths: list[tuple[Any, ...]],
    only: str | None,
    dst: Path,
    force: bool,
    handle: Any,
    notes: list[str],
) -> str | None:
    """Tensors under their flat keys (within ``only``'s group when given); objects in a
    JSON sidecar ``OUT.json``."""
    header: dict[str, Any] = {}
    offset = 0
    chosen = []
    objects: dict[str, Any] = {}
    for entry, path in zip(entries, paths, strict=True):
        key = _flat(path, only)
        if not entry.is_tensor:
            objects[key] = entry
            continue
        if entry.dtype not in DTYPES:
            raise InputError(f"safetensors cannot hold {one_line(entry.key, 100)} ({entry.dtype})")
        header[key] = {
            "dtype": DTYPES[entry.dtype],
            "shape": list(entry.shape),
            "data_offsets": [offset, offset + entry.nbytes],
        }
        offset += entry.nbytes
        chosen.append(entry)
    sidecar = None
    if objects:
        plain = {k: _plain(_object(e, handle, {})) for k, e in objects.items()}
        sidecar = str(dst.with_name(dst.name + ".json"))
        notes.append(
            f"safetensors holds tensors only: {len(objects)} objects (optimizer settings…) "
            f"are in {Path(sidecar).name}"
        )
    copier, scratch = torchzip._Copier(), Scratch()
    crcs = []
    with atomic_output(dst, force=force) as out:
        out.write(_header_bytes(header))
        start = out.tell()
        for entry in chosen:
            crc, write = _tensor_record(entry, handle, copier, scratch)
            write(out)
            crcs.append(crc)
            del write  # its buffer, before the next tensor's is made
        out.flush()
        with open(out.name, "rb") as back:
            n = int.from_bytes(back.read(8), "little")
            if json.loads(back.read(n)) != header:
                raise InputError(f"{dst}: verification failed: the header read back differs")
        for (key, item), crc in zip(header.items(), crcs, strict=True):
            begin, end = item["data_offsets"]
            if torchzip.crc_of(Path(out.name), start + begin, end - begin) != crc:
                raise InputError(f"{dst}: verification failed: tensor {one_line(key, 100)} differs")
        if sidecar is not None:
            with atomic_output(sidecar, force=force) as side:
                side.write(json.dumps(plain, indent=1).encode())
    return sidecar


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_plain(v) for v in value]
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    return repr(value)
