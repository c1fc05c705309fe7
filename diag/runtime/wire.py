"""The wire format of rank results: plain data with tensors → chunks of one byte string
(:func:`pack`) and back (:func:`unpack`), without pickle and without copying tensors;
recorders as plain data."""

from __future__ import annotations

import json
import math
import mmap
from dataclasses import asdict
from typing import Any

import torch

from gpudiag.runtime.record import Bucket, Phase, Recorder, StepRecord, Transfer

_ALIGN = 64  # every tensor's bytes start at a multiple of this (torch.frombuffer needs alignment)


def pack(obj: Any) -> list[bytes | memoryview]:
    """Plain data with tensors in it → the chunks of one byte string, without pickle and
    without copying the tensors: everything but the tensors goes into a JSON header that
    records each tensor's dtype, shape and offset; the tensors' own memory follows.
    Layout: 8-byte little-endian header length, the header (padded), then each tensor's
    bytes, each starting at a multiple of 64. Write the chunks in order (a file's
    ``write`` takes them without copying); read them back with :func:`unpack`."""
    chunks: list[bytes | memoryview] = []
    specs: list[dict[str, Any]] = []
    offset = 0

    def encode(value: Any) -> Any:
        nonlocal offset
        if isinstance(value, torch.Tensor):
            flat = value.detach().cpu().contiguous().reshape(-1)
            raw = flat.view(torch.uint8).numpy().data  # (a memoryview of the tensor's bytes)
            pad = -offset % _ALIGN
            if pad:
                chunks.append(bytes(pad))
            specs.append(
                {
                    "dtype": str(flat.dtype).removeprefix("torch."),
                    "shape": list(value.shape),
                    "at": offset + pad,
                }
            )
            chunks.append(raw)
            offset += pad + raw.nbytes
            return {"__tensor__": len(specs) - 1}
        if isinstance(value, dict):
            return {"__dict__": [[encode(k), encode(v)] for k, v in value.items()]}
        if isinstance(value, (list, tuple)):
            return [encode(v) for v in value]
        if isinstance(value, float) and not math.isfinite(value):
            return {"__float__": repr(value)}
        return value

    tree = encode(obj)
    header = json.dumps({"tensors": specs, "value": tree}).encode()
    header += b" " * (-(8 + len(header)) % _ALIGN)
    return [len(header).to_bytes(8, "little"), header, *chunks]


def unpack(data: bytes | bytearray | memoryview | mmap.mmap) -> Any:
    """The inverse of :func:`pack`, from the concatenated chunks. With a writable buffer
    (a ``bytearray``, a writable ``mmap``) the tensors are views of it, no copy; read-only
    data is copied once."""
    if not isinstance(data, (bytearray, mmap.mmap)):
        data = bytearray(data)
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    base = 8 + size
    tensors = []
    for spec in header["tensors"]:
        dtype = getattr(torch, spec["dtype"])
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"packed data names an unknown dtype {spec['dtype']!r}")
        count = math.prod(spec["shape"])
        if count == 0:
            tensors.append(torch.empty(spec["shape"], dtype=dtype))
        else:
            flat = torch.frombuffer(data, dtype=dtype, count=count, offset=base + spec["at"])
            tensors.append(flat.view(spec["shape"]))

    def decode(value: Any) -> Any:
        if isinstance(value, dict):
            if "__tensor__" in value:
                return tensors[value["__tensor__"]]
            if "__float__" in value:
                return float(value["__float__"])
            return {decode(k): decode(v) for k, v in value["__dict__"]}
        if isinstance(value, list):
            return [decode(v) for v in value]
        return value

    return decode(header["value"])


def recorder_to_data(recorder: Recorder) -> dict[str, Any]:
    return {
        "transfers": [asdict(t) for t in recorder.transfers],
        "buckets": [asdict(b) for b in recorder.buckets],
        "phases": [asdict(p) for p in recorder.phases],
        "steps": [asdict(s) for s in recorder.steps],
    }


def recorder_from_data(recorder: Recorder, data: dict[str, Any]) -> None:
    recorder.transfers += [Transfer(**t) for t in data["transfers"]]
    recorder.buckets += [Bucket(**b) for b in data["buckets"]]
    recorder.phases += [Phase(**p) for p in data["phases"]]
    recorder.steps += [StepRecord(**s) for s in data["steps"]]
