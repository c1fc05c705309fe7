"""Each check's configuration fields and how each is checked: a bundle is someone else's
input, so replay runs a recorded configuration only once every field is known, of the
right type and within :data:`LIMITS`. Registry entries (:mod:`gpudiag.checks.registry`)
name these as their ``config_fields``; a check's result lists that replay reads are checked
by :func:`result_problem`. Nothing here imports torch until a field's check runs."""

from __future__ import annotations

import functools
import math
from typing import Any

from gpudiag.checks.options import GradcheckOptions, NancheckOptions, specs, validator
from gpudiag.checks.registry import MACHINE_FILE
from gpudiag.errors import InputError

#: Bounds on what a bundle may ask replay to run (a bundle is someone else's input).
LIMITS = {
    "batch_size": 65_536,
    "num_classes": 100_000,
    "input_elements": 1 << 24,  # per sample: the product of input_shape
    "inject": 64,
    "peer_size": 1 << 30,  # bytes per copy
    "nccl_logs": 64,  # NCCL logs one transport check reads (--nccl-log)
}


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _integer(low: int, high: int) -> Any:
    def check(value: Any) -> str | None:
        if not isinstance(value, int) or isinstance(value, bool):
            return f"{_describe(value)} is not an integer (expected {low} to {high})"
        if not low <= value <= high:
            return f"{value} is out of range (expected {low} to {high})"
        return None

    return check


def _one_of(*choices: str) -> Any:
    def check(value: Any) -> str | None:
        if value not in choices:
            return f"{_describe(value)} is not one of {', '.join(choices)}"
        return None

    return check


def _flag(value: Any) -> str | None:
    return None if isinstance(value, bool) else f"{_describe(value)} is not true or false"


def _machine(value: Any) -> str | None:
    return None if value in (None, MACHINE_FILE) else f"{_describe(value)} is not null or {MACHINE_FILE!r}"


def _shape(value: Any) -> str | None:
    if (
        not isinstance(value, list)
        or not 1 <= len(value) <= 8
        or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in value)
    ):
        return f"{_describe(value)} is not a list of 1 to 8 positive integers"
    if math.prod(value) > LIMITS["input_elements"]:
        return f"{value} holds more than {LIMITS['input_elements']} elements per sample"
    return None


def _inject(value: Any) -> str | None:
    from gpudiag.runtime.faults import InjectSpecError, parse_fault

    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        return f"{_describe(value)} is not a list of fault specs"
    if len(value) > LIMITS["inject"]:
        return f"more than {LIMITS['inject']} fault specs"
    for spec in value:
        try:
            parse_fault(spec)
        except InjectSpecError as exc:
            return str(exc).splitlines()[0]
    return None


def _nccl_logs(value: Any) -> str | None:
    """The bundle's NCCL logs a transport check read: ``nccl/NAME`` paths inside the bundle."""
    import re

    if not isinstance(value, list) or not 1 <= len(value) <= LIMITS["nccl_logs"]:
        return f"{_describe(value)} is not a list of 1 to {LIMITS['nccl_logs']} bundle paths"
    for path in value:
        if not isinstance(path, str) or not re.fullmatch(r"nccl/[A-Za-z0-9][A-Za-z0-9._-]{0,199}", path):
            return f"{_describe(path)} is not a bundle path nccl/NAME"
    return None


def _transport_machine(value: Any) -> str | None:
    """The transport check's topology: the bundle's machine.json, or nccl/machine.json (the
    NVML topology a live run's pairs were placed on)."""
    from gpudiag.transport.bundled import MACHINE

    if value == MACHINE:
        return None
    return _machine(value)


def _pairs(value: Any) -> str | None:
    import re

    if not isinstance(value, str) or not re.fullmatch(r"all|\d{1,4}-\d{1,4}(,\d{1,4}-\d{1,4})*", value):
        return f"{_describe(value)} is not all or A-B,C-D"
    return None


def _sizes(value: Any) -> str | None:
    from gpudiag.parsers import parse_sizes

    if not isinstance(value, str) or len(value) > 200:
        return f"{_describe(value)} is not a list of sizes like 4K,1M"
    try:
        sizes = parse_sizes(value)
    except InputError as exc:
        return str(exc)
    if max(sizes) > LIMITS["peer_size"] or len(sizes) > 16:
        return f"{value!r} asks for more than 16 sizes or a copy over {LIMITS['peer_size'] >> 20} MiB"
    return None


def _output(value: Any) -> str | None:
    ok = value is None or (isinstance(value, (int, str)) and not isinstance(value, bool))
    return None if ok else f"{_describe(value)} is not null, an index or a name"


def _model(value: Any) -> str | None:
    from gpudiag.models import BUILTINS

    if not isinstance(value, str) or not value or len(value) > 1000:
        return f"{_describe(value)} is not a model spec"
    text, _, query = value.partition("?")
    if text.startswith("torchvision:"):
        pairs = [part.partition("=") for part in query.split("&")]
        trained = [
            key
            for key, _, raw in pairs
            if key.strip() in ("weights", "weights_backbone", "pretrained")
            and raw.strip().lower() not in ("none", "false")
        ]
        if trained:
            return f"{_describe(value)} asks for trained weights, which gpudiag never downloads"
        return None
    if text in BUILTINS:
        return None
    target, sep, attr = text.rpartition(":")
    if not sep or not target or not attr.isidentifier():
        return (
            f"{_describe(value)} is not a model spec (torchvision:NAME, path/to/file.py:factory, "
            f"package.module:factory or one of {', '.join(BUILTINS)})"
        )
    return None


def _input_range(value: Any) -> str | None:
    """None (standard normal inputs) or [LO, HI] with finite LO < HI."""
    if value is None:
        return None
    numbers = isinstance(value, list) and len(value) == 2
    numbers = numbers and all(type(v) in (int, float) and math.isfinite(v) for v in value)
    return None if numbers and value[0] < value[1] else f"{_describe(value)} is not [LO, HI] with LO < HI"


def _declared(options: type) -> dict[str, Any]:
    return {name: validator(spec) for name, (_, spec) in specs(options).items() if spec.recorded}


@functools.cache
def config_fields() -> dict[str, dict[str, Any]]:
    """check name → field → its check (imports the runtime: call when needed). The options
    a check declares (:mod:`gpudiag.checks.options`) are checked by their declaration."""
    model = {
        "model": _model,
        "input_shape": _shape,
        "num_classes": _integer(1, LIMITS["num_classes"]),
        "batch_size": _integer(1, LIMITS["batch_size"]),
        "inject": _inject,
        "input_dtype": _one_of("float", "long", "int"),
        "input_range": _input_range,
    }
    return {
        "env": {},
        "topology": {"machine": _machine, "source": _one_of("nvml")},
        "peer": {"machine": _machine, "pairs": _pairs, "inject": _inject, "sizes": _sizes},
        "gradcheck": {**model, **_declared(GradcheckOptions), "output": _output, "sync_batchnorm": _flag},
        "nancheck": {**model, **_declared(NancheckOptions), "machine": _machine, "pairs": _pairs},
        "transport": {"from_log": _nccl_logs, "machine": _transport_machine},
        "hang": {"dumps": _one_of("hang"), "world_size": _integer(1, 100_000)},
    }


#: The lists of each check's result that replay compares, and the fields of their items.
RESULT_LISTS: dict[str, dict[str, tuple[str, ...]]] = {
    "gradcheck": {"comparisons": ("strategy", "mode", "ok", "rel_norm_err", "norm_ratio")},
    "nancheck": {
        "singles": ("device", "status", "first_bad_step"),
        "pairs": ("a", "b", "status", "first_bad_step"),
    },
    "peer": {"pairs": ("src", "dst")},
    "topology": {"pairs": ("a", "b", "link")},
    "transport": {"pairs": ("from_rank", "to_rank", "transport")},
}


_GPU_FIELDS = ("device", "a", "b", "src", "dst")


def result_problem(name: str, result: dict[str, Any]) -> str | None:
    """The first field of ``result`` that :func:`compare` could not read, named."""
    for key, fields in RESULT_LISTS[name].items():
        items = result.get(key, [])
        if not isinstance(items, list):
            return f"{key} is not a list"
        for j, item in enumerate(items):
            if not isinstance(item, dict) or any(f not in item for f in fields):
                return f"{key}[{j}] lacks one of {', '.join(fields)}"
            if name == "gradcheck" and not (
                isinstance(item["strategy"], str)
                and isinstance(item["mode"], str)
                and isinstance(item["ok"], bool)
                and isinstance(item.get("options", {}), dict)
            ):
                return f"{key}[{j}]: strategy and mode are strings, ok true or false, options an object"
            ids = [item[f] for f in fields if f in _GPU_FIELDS]
            if not all(isinstance(g, int) and not isinstance(g, bool) for g in ids):
                return f"{key}[{j}]: a GPU number that is not an integer"
            if name == "peer" and not isinstance(item.get("copies", []), list):
                return f"{key}[{j}].copies is not a list"
            if name == "peer" and not all(isinstance(c, dict) for c in item.get("copies", [])):
                return f"{key}[{j}].copies holds something other than objects"
    return None
