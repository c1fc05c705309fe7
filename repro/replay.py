"""``gpudiag replay BUNDLE``: run a bundle's checks here and say what differs.

Each check the reporter ran is run again with its recorded configuration (virtual devices
laid out like the bundle's ``machine.json`` where the reporter used one). Results match
when the status and the finding codes are the same and the numbers agree within
tolerance: gradcheck's per-strategy agreement (and, where both differ, the norm ratio
within :data:`RATIO_SLACK`), nancheck's status and first bad step per run, peer's wrong
copies per direction, topology's link per pair. A check that cannot run here is ``skipped``
with the reason and left out of the verdict. The two environments' differences are listed too.

A bundle is input from someone else. Before anything runs, every recorded configuration is
checked field by field (:func:`check_configs`: wrong types, unknown fields, sizes beyond
:data:`LIMITS` are an :class:`~gpudiag.errors.InputError` naming the field). Code the
bundle names — a ``--model`` that is a Python file or module — runs only with
``trust=True`` (``--trust-bundle``); without it that check is skipped and the reason says
what would run. gpudiag's built-in models and torchvision architectures are gpudiag's or
torchvision's code, not the bundle's, and run (trained weights, which would be
downloaded, are refused as bad input).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from gpudiag.checks.suite import MACHINE_FILE, CheckRun, Here, run_check
from gpudiag.errors import InputError
from gpudiag.progress import note
from gpudiag.repro.report import Bundle

SCHEMA = "gpudiag.replay/1"
#: Relative slack on gradcheck's norm ratio where both runs differ from single.
RATIO_SLACK = 0.05
#: env sections whose differences are worth showing (not compared for the verdict).
ENV_SECTIONS = ("versions", "visibility", "variables", "flags", "iommu", "packages", "gpus")


@dataclass
class CheckReplay:
    name: str
    recorded: CheckRun
    here: CheckRun | None
    differences: list[str] = field(default_factory=list)
    note: str = ""

    @property
    def compared(self) -> bool:
        """Whether the results were compared (the environment is listed, not judged)."""
        return self.name != "env" and self.here is not None and self.here.status != "skipped"

    @property
    def match(self) -> bool:
        return not self.compared or not self.differences

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "recorded": _state(self.recorded),
            "here": None if self.here is None else _state(self.here),
            "compared": self.compared,
            "match": self.match,
            "differences": self.differences,
            "note": self.note,
        }


@dataclass
class ReplayReport:
    bundle: str
    checks: list[CheckReplay]
    environment: list[str]
    trusted: bool = False  # whether code named by the bundle was allowed to run
    rehearsal: str | None = None  # the bundle's faults were injected (its report.json says so)

    @property
    def match(self) -> bool:
        return all(c.match for c in self.checks)

    def exit_code(self) -> int:
        return 0 if self.match else 1

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "bundle": self.bundle,
            "match": self.match,
            "trusted": self.trusted,
            "rehearsal": self.rehearsal,
            "checks": [c.to_json() for c in self.checks],
            "environment_differences": self.environment,
        }


def replay(bundle: Bundle, here: Here | None = None, *, trust: bool = False) -> ReplayReport:
    """Re-run every check the bundle ran (not the ones it skipped) and compare. Every
    configuration is checked first; code named by the bundle runs only with ``trust``."""
    recorded_checks = bundle.checks
    check_configs(bundle)
    if here is None:
        here = Here.detect()
        here.machine = bundle.machine()
        here.machine_source = f"{bundle.path}/machine.json" if here.machine is not None else None
    replays = []
    env_here: CheckRun | None = None
    for recorded in recorded_checks:
        if recorded.status == "skipped" or recorded.config is None:
            replays.append(
                CheckReplay(recorded.name, recorded, None, note="skipped on the reporter's machine")
            )
            continue
        untrusted = None if trust else bundle_code(recorded.config)
        why = cannot_run_here(recorded, here)
        if untrusted is not None:
            now = CheckRun(recorded.name, "skipped", _untrusted_reason(untrusted), recorded.config)
        elif why is not None:
            now = CheckRun(recorded.name, "skipped", why, recorded.config)
        else:
            note(f"replay: {recorded.name}")
            now = run_check(recorded.name, recorded.config, here)
        if recorded.name == "env":
            env_here = now
        item = CheckReplay(recorded.name, recorded, now)
        if untrusted is not None:
            item.note = now.headline
        elif now.status == "skipped":
            item.note = f"cannot run here: {now.headline}"
        elif recorded.name != "env":
            item.differences = compare(recorded, now)
            item.note = _meaning(recorded.status, now.status, item.differences)
        replays.append(item)
    environment = env_differences(bundle.document.get("env"), env_here.result if env_here else None)
    rehearsal = bundle.document.get("rehearsal")
    rehearsal = rehearsal if isinstance(rehearsal, str) else None
    return ReplayReport(bundle.path, replays, environment, trusted=trust, rehearsal=rehearsal)


def _untrusted_reason(what: str) -> str:
    return f"not run: {what} — code the bundle names, not gpudiag's; rerun with --trust-bundle to run it"


def bundle_code(config: dict[str, Any]) -> str | None:
    """What code outside gpudiag and torchvision ``config`` would run (its ``--model``), in
    words; None when it runs only gpudiag's built-in models or a torchvision architecture."""
    from gpudiag.models import BUILTINS

    spec = config.get("model")
    if not isinstance(spec, str):
        return None
    text = spec.partition("?")[0]
    if text in BUILTINS:
        return None
    if text.startswith("torchvision:"):
        return None  # (trained weights, which would be downloaded, are refused by check_configs)
    target, _, attr = text.rpartition(":")
    if target.endswith(".py") or "/" in target:
        return f"--model {spec!r} would run the Python file {target} and call {attr}()"
    return f"--model {spec!r} would import the module {target} and call {target}.{attr}()"


def cannot_run_here(recorded: CheckRun, here: Here) -> str | None:
    """Why ``recorded`` cannot be run the same way here (None: it can): NVML that is not
    here, or CUDA GPUs the reporter used that this machine lacks."""
    config, result = recorded.config or {}, recorded.result or {}
    if recorded.name == "topology" and config.get("machine") is None and here.nvml is not None:
        return f"the reporter read the topology from NVML, which is not available here ({here.nvml})"
    if recorded.name in ("peer", "nancheck") and config.get("machine") is None:
        if recorded.name == "peer":
            used = {p[k] for p in result.get("pairs", []) for k in ("src", "dst")}
        else:
            used = {s["device"] for s in result.get("singles", [])}
            used |= {p[k] for p in result.get("pairs", []) for k in ("a", "b")}
        if any(not 0 <= g < here.cuda_gpus for g in used):
            gpus = ", ".join(map(str, sorted(used)))
            return (
                f"the reporter ran {recorded.name} on CUDA GPU(s) {gpus}; here {here.cuda_gpus} CUDA GPU(s)"
            )
    if recorded.name == "gradcheck":
        run_config = result.get("config")
        devices = run_config.get("devices") if isinstance(run_config, dict) else None
        ids = devices.get("ids") if isinstance(devices, dict) else None
        if (
            isinstance(devices, dict)
            and devices.get("kind") == "cuda"
            and isinstance(ids, list)
            and len(ids) > here.cuda_gpus
        ):
            return (
                f"the reporter ran gradcheck on {len(ids)} CUDA GPU(s); here {here.cuda_gpus} "
                "(CPU virtual devices would not be the same run)"
            )
    return None


#: Bounds on what a bundle may ask replay to run (a bundle is someone else's input).
LIMITS = {
    "world_size": 64,
    "steps": 10_000,
    "batch_size": 65_536,
    "num_classes": 100_000,
    "input_elements": 1 << 24,  # per sample: the product of input_shape
    "inject": 64,
    "peer_size": 1 << 30,  # bytes per copy
}


def check_configs(bundle: Bundle) -> None:
    """Every recorded configuration and result replay reads, checked before anything runs:
    an unknown field, a wrong type or a value beyond :data:`LIMITS` is an
    :class:`InputError` naming the field (``checks[3].config.world_size``)."""
    for i, check in enumerate(bundle.document["checks"]):
        name, config = check["name"], check.get("config")
        fields = _FIELDS[name]
        if isinstance(config, dict):
            for key in _REQUIRED.get(name, ()):
                if key not in config:
                    raise InputError(f"{bundle.path}: checks[{i}].config.{key}: missing (a {name} needs it)")
            for key, value in config.items():
                where = f"checks[{i}].config.{key}"
                if key not in fields:
                    known = ", ".join(fields) or "none"
                    raise InputError(f"{bundle.path}: {where}: unknown field of {name} (fields: {known})")
                problem = fields[key](value)
                if problem:
                    raise InputError(f"{bundle.path}: {where}: {problem}")
                if key == "machine" and value is not None and MACHINE_FILE not in bundle.files:
                    raise InputError(f"{bundle.path}: {where} names {MACHINE_FILE}, which the bundle lacks")
        result = check.get("result")
        if isinstance(result, dict) and name in _RESULT_LISTS:
            problem = _result_problem(name, result)
            if problem:
                raise InputError(f"{bundle.path}: checks[{i}].result.{problem}")


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


def _number(value: Any) -> str | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return None if ok else f"{_describe(value)} is not a finite number"


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


def _strategies(value: Any) -> str | None:
    choices = ("single", "dp", "ddp")
    if not isinstance(value, list) or not value or not all(v in choices for v in value):
        return f"{_describe(value)} is not a list of {', '.join(choices)}"
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


def _pairs(value: Any) -> str | None:
    import re

    if not isinstance(value, str) or not re.fullmatch(r"all|\d{1,4}-\d{1,4}(,\d{1,4}-\d{1,4})*", value):
        return f"{_describe(value)} is not all or A-B,C-D"
    return None


def _sizes(value: Any) -> str | None:
    from gpudiag.checks.peer import parse_sizes

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


def _fields() -> dict[str, dict[str, Any]]:
    from gpudiag.runtime.config import LOSSES

    model = {
        "model": _model,
        "input_shape": _shape,
        "num_classes": _integer(1, LIMITS["num_classes"]),
        "batch_size": _integer(1, LIMITS["batch_size"]),
        "steps": _integer(1, LIMITS["steps"]),
        "lr": _number,
        "seed": _integer(0, 2**63 - 1),
        "inject": _inject,
        "input_dtype": _one_of("float", "long", "int"),
        "input_range": _input_range,
    }
    return {
        "env": {},
        "topology": {"machine": _machine, "source": _one_of("nvml")},
        "peer": {"machine": _machine, "pairs": _pairs, "inject": _inject, "sizes": _sizes},
        "gradcheck": {
            **model,
            "loss": _one_of(*LOSSES),
            "strategies": _strategies,
            "world_size": _integer(1, LIMITS["world_size"]),
            "optimizer": _one_of("sgd", "adam", "none"),
            "dtype": _one_of("fp32", "bf16", "fp16"),
            "mode": _one_of("auto", "as-is", "controlled"),
            "output": _output,
            "sync_batchnorm": _flag,
        },
        "nancheck": {
            **model,
            "machine": _machine,
            "pairs": _pairs,
            "strategy": _one_of("dp", "ddp"),
            "loss": _one_of(*LOSSES),
        },
    }


#: Fields a check cannot run without (the others have defaults).
_REQUIRED = {"gradcheck": ("model",)}


class _LazyFields(dict):  # type: ignore[type-arg]
    """:func:`_fields`, built on first use (it imports the runtime)."""

    def __missing__(self, name: str) -> dict[str, Any]:
        self.update(_fields())
        return dict.__getitem__(self, name)


_FIELDS: dict[str, dict[str, Any]] = _LazyFields()

#: The lists of each check's result that replay compares, and the fields of their items.
_RESULT_LISTS = {
    "gradcheck": {"comparisons": ("strategy", "mode", "ok", "rel_norm_err", "norm_ratio")},
    "nancheck": {
        "singles": ("device", "status", "first_bad_step"),
        "pairs": ("a", "b", "status", "first_bad_step"),
    },
    "peer": {"pairs": ("src", "dst")},
    "topology": {"pairs": ("a", "b", "link")},
}


_GPU_FIELDS = ("device", "a", "b", "src", "dst")


def _result_problem(name: str, result: dict[str, Any]) -> str | None:
    """The first field of ``result`` that :func:`compare` could not read, named."""
    for key, fields in _RESULT_LISTS[name].items():
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


def _state(run: CheckRun) -> dict[str, Any]:
    return {"status": run.status, "simulated": run.simulated, "codes": _codes(run)}


def _codes(run: CheckRun) -> list[str]:
    return sorted({f.code for f in run.findings if f.severity != "info"})


def _meaning(recorded: str, here: str, differences: list[str]) -> str:
    bad = ("fail", "error")
    if not differences:
        return "same result"
    if recorded in bad and here not in bad:
        return "fails on the reporter's machine, passes here: hardware-specific (or see the environment)"
    if here in bad and recorded not in bad:
        return "passes on the reporter's machine, fails here"
    return "different result"


def compare(recorded: CheckRun, here: CheckRun) -> list[str]:
    """What differs between the recorded run of a check and this one (empty: they match)."""
    out = []
    if recorded.status != here.status:
        out.append(f"status: {recorded.status} there, {here.status} here")
    was, now = set(_codes(recorded)), set(_codes(here))
    if was - now:
        out.append(f"findings only there: {', '.join(sorted(was - now))}")
    if now - was:
        out.append(f"findings only here: {', '.join(sorted(now - was))}")
    numbers = _NUMBERS.get(recorded.name)
    if numbers is not None and recorded.result and here.result:
        out += numbers(recorded.result, here.result)
    return out


def _gradcheck_numbers(there: dict[str, Any], here: dict[str, Any]) -> list[str]:
    def key(c: dict[str, Any]) -> tuple[str, str, str]:
        return (c["strategy"], c["mode"], str(sorted(c.get("options", {}).items())))

    out = []
    theirs = {key(c): c for c in there.get("comparisons", [])}
    ours = {key(c): c for c in here.get("comparisons", [])}
    for k in sorted(theirs.keys() | ours.keys()):
        a, b = theirs.get(k), ours.get(k)
        label = f"{k[0]} ({k[1]})"
        if a is None or b is None:
            out.append(f"{label}: compared {'there' if a else 'here'} only")
        elif a["ok"] != b["ok"]:
            out.append(
                f"{label}: {'agrees' if a['ok'] else 'differs'} there (rel_norm_err {a['rel_norm_err']}), "
                f"{'agrees' if b['ok'] else 'differs'} here (rel_norm_err {b['rel_norm_err']})"
            )
        elif not a["ok"] and not _close(a["norm_ratio"], b["norm_ratio"]):
            out.append(f"{label}: norm ratio {a['norm_ratio']} there, {b['norm_ratio']} here")
    return out


def _close(a: Any, b: Any) -> bool:
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
        return str(a) == str(b)  # "nan"/"inf" as JSON strings
    if not (math.isfinite(a) and math.isfinite(b)):
        return a == b
    return abs(a - b) <= RATIO_SLACK * max(abs(a), abs(b), 1e-12)


def _differing(theirs: dict[str, Any], ours: dict[str, Any], describe: Any) -> list[str]:
    """``name: <there> there, <here> here`` for each name whose value differs."""
    return [
        f"{name}: {describe(theirs.get(name))} there, {describe(ours.get(name))} here"
        for name in sorted(theirs.keys() | ours.keys())
        if theirs.get(name) != ours.get(name)
    ]


def _nancheck_numbers(there: dict[str, Any], here: dict[str, Any]) -> list[str]:
    """Each run's status and first bad step."""

    def runs(doc: dict[str, Any]) -> dict[str, tuple[str, Any]]:
        out = {f"GPU {s['device']} alone": (s["status"], s["first_bad_step"]) for s in doc.get("singles", [])}
        out.update(
            {f"pair ({p['a']},{p['b']})": (p["status"], p["first_bad_step"]) for p in doc.get("pairs", [])}
        )
        return out

    def describe(run: tuple[str, Any] | None) -> str:
        if run is None:
            return "not run"
        return run[0] if run[1] is None else f"{run[0]} (step {run[1]})"

    return _differing(runs(there), runs(here), describe)


def _peer_numbers(there: dict[str, Any], here: dict[str, Any]) -> list[str]:
    """The number of wrong copies per direction."""

    def wrong(doc: dict[str, Any]) -> dict[str, int]:
        return {
            f"{p['src']}->{p['dst']}": sum(1 for c in p.get("copies", []) if c.get("wrong"))
            for p in doc.get("pairs", [])
        }

    def describe(count: int | None) -> str:
        return "not tested" if count is None else f"{count} wrong copies"

    return _differing(wrong(there), wrong(here), describe)


def _topology_numbers(there: dict[str, Any], here: dict[str, Any]) -> list[str]:
    """The link of each GPU pair."""

    def links(doc: dict[str, Any]) -> dict[str, Any]:
        return {f"pair ({p['a']},{p['b']})": p["link"] for p in doc.get("pairs", [])}

    return _differing(links(there), links(here), str)


_NUMBERS = {
    "gradcheck": _gradcheck_numbers,
    "nancheck": _nancheck_numbers,
    "peer": _peer_numbers,
    "topology": _topology_numbers,
}


def env_differences(there: dict[str, Any] | None, here: dict[str, Any] | None) -> list[str]:
    """``section.field: value there → value here`` for what differs between two env documents."""
    if not there or not here:
        return [] if there == here else ["environment: recorded on one side only"]
    out = []
    for section in ENV_SECTIONS:
        a = there.get("sections", {}).get(section, {}) or {}
        b = here.get("sections", {}).get(section, {}) or {}
        for name in sorted(a.keys() | b.keys()):
            if a.get(name) != b.get(name):
                out.append(f"{section}.{name}: {_short(a.get(name))} there, {_short(b.get(name))} here")
    return out


def _short(value: Any) -> str:
    text = "unset" if value is None else str(value)
    return text if len(text) <= 60 else text[:57] + "..."
