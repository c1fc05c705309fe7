"""``repro.py``: the minimal, self-contained reproduction maintainers ask for.

The script is :mod:`gpudiag.repro.repro_template` (a torch-only program, linted and
tested like the rest of gpudiag) with two literals filled in: ``CHECKS`` — each failing
check's exact configuration and what was observed — and ``MODEL_SOURCES`` — the source of
the model (gpudiag's built-ins, or the user's model file) so the script needs nothing else.
"""

from __future__ import annotations

import inspect
import pprint
from pathlib import Path
from typing import Any

from gpudiag.checks.suite import CheckRun

_CHECKS_LINE = "CHECKS: dict[str, Any] = {}"
_SOURCES_LINE = "MODEL_SOURCES: dict[str, str] = {}"


def repro_script(failed: list[CheckRun]) -> str:
    """The text of ``repro.py`` for the failing checks (gradcheck, nancheck, peer)."""
    from gpudiag.repro import repro_template

    checks: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for run in failed:
        build = _BUILDERS.get(run.name)
        if build is not None and run.config is not None:
            checks[run.name] = build(run, sources)
    template = inspect.getsource(repro_template)
    for line in (_CHECKS_LINE, _SOURCES_LINE):
        if template.count(line) != 1:
            raise AssertionError(f"repro template lost its {line!r} line")
    text = template.replace(_CHECKS_LINE, f"CHECKS: dict[str, Any] = {pprint.pformat(checks, width=100)}")
    return text.replace(
        _SOURCES_LINE, f"MODEL_SOURCES: dict[str, str] = {pprint.pformat(sources, width=100)}"
    )


def _faults(specs: list[str] | tuple[str, ...]) -> list[dict[str, Any]]:
    from gpudiag.runtime.faults import parse_fault, quoted

    return [
        {
            "src": f.src,
            "dst": f.dst,
            "kind": f.kind,
            "step": f.step,
            "count": f.count,
            "factor": f.factor,
            "spec": quoted(f.text),  # (as the script prints it: ready for a shell)
        }
        for f in map(parse_fault, specs)
    ]


def _model(spec: str, input_shape: list[int], num_classes: int, sources: dict[str, str]) -> dict[str, Any]:
    """How the script builds the model, and its source where the script must carry it."""
    from gpudiag import models

    factory = models.resolve_model(spec, tuple(input_shape), num_classes)
    target = factory.target
    if factory.kind == "builtin":
        sources["builtin"] = (
            inspect.getsource(models.PassThrough) + "\n\n" + inspect.getsource(models._builtin)
        )
    elif factory.kind == "file":  # carried by name: the reporter's folders stay at home
        target = Path(factory.target).name
        sources[target] = Path(factory.target).read_text()
        spec = f"{target}:{factory.attr}" + (f"?{spec.partition('?')[2]}" if "?" in spec else "")
    return {
        "spec": spec,
        "kind": factory.kind,
        "target": target,
        "attr": factory.attr,
        "kwargs": factory.kwargs,
    }


def _observed(run: CheckRun) -> str:
    errors = [f for f in run.findings if f.severity == "error"]
    return f"{errors[0].code}: {errors[0].message}" if errors else run.headline


def _training(run: CheckRun, sources: dict[str, str]) -> dict[str, Any]:
    """What every training check's script needs: the model, the batch, the steps."""
    config = run.config or {}
    return {
        "observed": _observed(run),
        "model": _model(config["model"], config["input_shape"], config["num_classes"], sources),
        "input_shape": list(config["input_shape"]),
        "num_classes": config["num_classes"],
        "batch_size": config["batch_size"],
        "steps": config["steps"],
        "lr": config["lr"],
        "seed": config["seed"],
    }


def _gradcheck(run: CheckRun, sources: dict[str, str]) -> dict[str, Any]:
    config, result = run.config or {}, run.result or {}
    unused = any(c.get("options", {}).get("find_unused_parameters") for c in result.get("comparisons", []))
    return {
        **_training(run, sources),
        "loss": config["loss"],
        "strategies": list(config["strategies"]),
        "world_size": config["world_size"],
        "optimizer": config["optimizer"],
        "dtype": config["dtype"],
        "mode": "controlled" if config.get("mode") == "controlled" else "as-is",
        "devices": result.get("config", {}).get("devices", {}).get("kind", "virtual"),
        "tolerance": result.get("tolerance", {}).get("rel_norm_err", 1.3e-5),
        "find_unused_parameters": unused,
        "faults": _faults(config.get("inject", [])),
    }


def _nancheck(run: CheckRun, sources: dict[str, str]) -> dict[str, Any]:
    from gpudiag.runtime.faults import for_devices

    config, result = run.config or {}, run.result or {}
    strategy = config.get("strategy", "dp")
    bad = [p for p in result.get("pairs", []) if p["status"] != "ok"]
    specs = tuple(config.get("inject", ()))
    return {
        **_training(run, sources),
        "loss": "ce",
        "optimizer": "sgd",
        "strategy": strategy,
        "devices": "virtual" if config.get("machine") else "cuda",
        "pairs": [
            {
                "devices": [p["a"], p["b"]],
                "link": p.get("link"),
                "faults": _faults(for_devices(specs, (p["a"], p["b"]), to_ranks=strategy == "ddp")),
            }
            for p in bad
        ],
    }


def _peer(run: CheckRun, sources: dict[str, str]) -> dict[str, Any]:
    from gpudiag.runtime.faults import for_devices

    config, result = run.config or {}, run.result or {}
    specs = tuple(config.get("inject", ()))
    directions = [
        {
            "src": pair["src"],
            "dst": pair["dst"],
            "faults": _faults(for_devices(specs, (pair["src"], pair["dst"]), to_ranks=False)),
            "copies": [{"bytes": c["bytes"], "dtype": c["dtype"]} for c in pair.get("copies", [])],
        }
        for pair in result.get("pairs", [])
        if any(c.get("wrong") for c in pair.get("copies", []))
    ]
    return {"observed": _observed(run), "devices": result.get("devices", "virtual"), "directions": directions}


_BUILDERS = {"gradcheck": _gradcheck, "nancheck": _nancheck, "peer": _peer}


def reproducible(name: str) -> bool:
    """Whether ``repro.py`` can reproduce check ``name``."""
    return name in _BUILDERS
