"""Write safetensors: rename a safetensors file, or turn a torch checkpoint's model state
dict into one, one tensor at a time (memory bounded by the largest storage record)."""

from __future__ import annotations

import json
import struct
import zipfile
from pathlib import Path
from typing import Any

from gpudiag.errors import InputError
from gpudiag.fileio import atomic_output
from gpudiag.repro.checkpoint import keys as K
from gpudiag.repro.checkpoint import pickles, torchzip

#: torch dtype name → safetensors dtype code.
DTYPES = {
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "float64": "F64",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}


def _header_bytes(header: dict[str, Any]) -> bytes:
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * ((-len(raw)) % 8)  # the data section starts 8-byte aligned, as safetensors writes
    return struct.pack("<Q", len(raw)) + raw


def write_safetensors(loaded: Any, tree: Any, plans: list[K.Plan], dst: Path, force: bool) -> str | None:
    """Write ``dst``; returns the JSON sidecar's path when non-tensor entries were kept."""
    if loaded.format == "safetensors":
        _rename_safetensors(loaded, tree, dst, force)
        return None
    where = plans[0].path
    state = _at(tree, where)
    sidecar = _sidecar(tree, where, dst, force)
    if loaded.archive is not None and not loaded.trusted:
        _refs_to_safetensors(loaded.archive, state, dst, force)
    else:
        _tensors_to_safetensors(state, dst, force)
    return sidecar


def _at(tree: Any, path: K.Path) -> Any:
    for k in path:
        tree = tree[k]
    return tree


def _rename_safetensors(loaded: Any, renamed: dict[str, Any], dst: Path, force: bool) -> None:
    header: dict[str, Any] = {}
    if loaded.safetensors_meta:
        header["__metadata__"] = loaded.safetensors_meta
    for key, ref in renamed.items():
        header[key] = {"dtype": ref.dtype, "shape": list(ref.shape), "data_offsets": [ref.begin, ref.end]}
    size = Path(loaded.path).stat().st_size - loaded.data_start
    with atomic_output(dst, force=force) as out, open(loaded.path, "rb") as src:
        out.write(_header_bytes(header))
        out_start = out.tell()
        copied = torchzip._copy_range(src, out, loaded.data_start, size)  # CRC-32 of what was written
        out.flush()
        if torchzip.crc_of(Path(out.name), out_start, size) != copied:
            raise InputError(f"{dst}: verification failed: the data section differs from the input's")


def _contiguous_bytes(archive: torchzip.Archive, ref: Any, cache: dict[str, Any]) -> bytes:
    """The bytes of one tensor laid out contiguously, from its storage record."""
    import torch

    if isinstance(ref, pickles.ParamRef):
        ref = ref.data
    key = ref.storage.key
    if cache.get("key") != key:
        with zipfile.ZipFile(archive.path) as zf:
            cache["data"] = torchzip.read_record(zf, f"{archive.prefix}data/{key}", str(archive.path))
        cache["key"] = key
    dtype = getattr(torch, ref.dtype)
    storage = (
        torch.frombuffer(bytearray(cache["data"]), dtype=dtype)
        if cache["data"]
        else torch.empty(0, dtype=dtype)
    )
    view = torch.as_strided(storage, ref.size, ref.stride, ref.offset)
    return (
        view.contiguous().numpy().tobytes()
        if dtype != torch.bfloat16
        else view.contiguous().view(torch.int16).numpy().tobytes()
    )


def _refs_to_safetensors(archive: torchzip.Archive, state: dict[str, Any], dst: Path, force: bool) -> None:
    header: dict[str, Any] = {}
    offset = 0
    for key, ref in state.items():
        if not pickles.is_tensor(ref):
            continue
        if ref.dtype not in DTYPES:
            raise InputError(f"safetensors cannot hold {key} ({ref.dtype})")
        header[key] = {
            "dtype": DTYPES[ref.dtype],
            "shape": list(ref.shape),
            "data_offsets": [offset, offset + ref.nbytes],
        }
        offset += ref.nbytes
    cache: dict[str, Any] = {}
    with atomic_output(dst, force=force) as out:
        out.write(_header_bytes(header))
        for key in header:
            out.write(_contiguous_bytes(archive, state[key], cache))
        out.flush()
        _verify_against(Path(out.name), lambda k: _contiguous_bytes(archive, state[k], cache), header, dst)


def _tensors_to_safetensors(state: dict[str, Any], dst: Path, force: bool) -> None:
    from safetensors.torch import save

    tensors = {k: v.detach().cpu().contiguous().clone() for k, v in state.items() if pickles.is_tensor(v)}
    with atomic_output(dst, force=force) as out:
        out.write(save(tensors))
        out.flush()
        from safetensors.torch import load_file

        back = load_file(out.name)
        import torch

        if back.keys() != tensors.keys() or not all(torch.equal(back[k], tensors[k]) for k in tensors):
            raise InputError(f"{dst}: verification failed: the tensors read back differ from the input's")


def _verify_against(path: Path, source: Any, header: dict[str, Any], dst: Path) -> None:
    with open(path, "rb") as handle:
        n = struct.unpack("<Q", handle.read(8))[0]
        written = json.loads(handle.read(n))
        start = 8 + n
        for key, entry in header.items():
            if written.get(key) != entry:
                raise InputError(f"{dst}: verification failed: header entry {key} differs")
            begin, end = entry["data_offsets"]
            handle.seek(start + begin)
            if handle.read(end - begin) != source(key):
                raise InputError(f"{dst}: verification failed: tensor {key} differs from the input's")


def _sidecar(tree: Any, where: K.Path, dst: Path, force: bool) -> str | None:
    """Everything but the model state dict, as JSON next to ``dst`` (tensors named, not kept)."""

    def plain(value: Any) -> Any:
        if pickles.is_tensor(value):
            return f"<tensor {getattr(value, 'dtype', '?')} {list(value.shape)}: not carried>"
        if isinstance(value, dict):
            return {str(k): plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple, set)):
            return [plain(v) for v in value]
        if isinstance(value, (int, float, str, bool)) or value is None:
            return value
        return repr(value)

    rest = K.replace_at(tree, where, "<model state dict: in the safetensors file>") if where else None
    if rest is None or (isinstance(rest, dict) and len(rest) == 1):
        return None
    path = dst.with_name(dst.name + ".json")
    with atomic_output(path, force=force) as out:
        out.write(json.dumps(plain(rest), indent=1).encode())
    return str(path)
