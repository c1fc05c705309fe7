"""The thresholds ``gpudiag sweep`` judges nodes by, and the optional baseline of expected
figures per machine type.

Both are small JSON files a user can change. The defaults (:data:`DEFAULT_RULES`) are
written next to every sweep's results as ``rules.json``, so ``gpudiag sweep --summary
sweep/ --rules sweep/rules.json`` re-judges after an edit.

Rules (``gpudiag.sweep-rules/1``; every key optional, missing keys take the default):

- ``figures``: per figure (``intra_busbw_gbps``: the node's own all-reduce bus bandwidth
  across its GPUs; ``pair_busbw_gbps``: the bus bandwidth of its between-node pair test),
  ``min_fraction_of_median``: a node whose figure is below this fraction of the median of
  the *other* nodes is an outlier (``node-figure-low``);
- ``min_nodes``: fewer nodes with a figure than this and no outlier is judged for it;
- ``versions``: the version fields that must match the majority (``node-version-differs``);
- ``host``: the host facts that must match the majority (``node-host-differs``): ``iommu``
  (the IOMMU mode), ``acs_redirect`` (PCIe ACS redirecting peer traffic), ``nccl_env``
  (the ``NCCL_*`` variables set, with their values);
- ``topology_must_match``, ``gpus_must_match``: a topology different from the majority's
  (``node-topology-differs``), fewer GPUs than the most common count (``node-fewer-gpus``);
- ``pair_slow_fraction``: in the pairwise link test a pair below this fraction of the
  median pair is slow;
- ``baseline_fraction``: a figure below this fraction of the baseline's is
  ``node-below-baseline``.

Baseline (``gpudiag.sweep-baseline/1``): ``{"machine_types": {TYPE: {FIGURE: value}}}``, where
TYPE is a node's ``machine_type`` as results.jsonl shows it (``8x NVIDIA H100 80GB HBM3``).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from gpudiag.errors import InputError

RULES_SCHEMA = "gpudiag.sweep-rules/1"
BASELINE_SCHEMA = "gpudiag.sweep-baseline/1"
#: The figures a node record carries, in GB/s (10^9 bytes per second), higher is better.
FIGURES = ("intra_busbw_gbps", "pair_busbw_gbps")
VERSION_FIELDS = ("nvidia_driver", "cuda_runtime", "nccl_runtime", "torch", "gpudiag")
#: Host facts (from ``gpudiag env``) that must match the majority: the IOMMU mode, whether
#: PCIe ACS redirects peer traffic, the NCCL_* variables set.
HOST_FIELDS = ("iommu", "acs_redirect", "nccl_env")

DEFAULT_RULES: dict[str, Any] = {
    "schema": RULES_SCHEMA,
    "figures": {name: {"min_fraction_of_median": 0.8} for name in FIGURES},
    "min_nodes": 2,
    "versions": list(VERSION_FIELDS),
    "topology_must_match": True,
    "gpus_must_match": True,
    "host": list(HOST_FIELDS),
    "pair_slow_fraction": 0.8,
    "baseline_fraction": 0.8,
    # figures measured on CPU virtual devices swing many-fold between processes: not judged
    # unless asked (the local rehearsals ask, with loose fractions)
    "judge_simulated_figures": False,
}


def _fraction(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise InputError(f"{where}: expected a fraction in (0, 1], got {value!r}")
    return float(value)


def check_rules(data: Any, name: str = "rules") -> dict[str, Any]:
    """The defaults overlaid with ``data``, each value checked; :class:`InputError` (exit 2)
    naming the bad key otherwise."""
    if not isinstance(data, dict):
        raise InputError(f"{name}: expected a JSON object")
    if data.get("schema", RULES_SCHEMA) != RULES_SCHEMA:
        raise InputError(f"{name}: schema {data.get('schema')!r}, expected {RULES_SCHEMA}")
    unknown = sorted(set(data) - set(DEFAULT_RULES))
    if unknown:
        raise InputError(f"{name}: unknown key(s) {', '.join(unknown)}; known: {', '.join(DEFAULT_RULES)}")
    rules = copy.deepcopy(DEFAULT_RULES)
    figures = data.get("figures", {})
    if not isinstance(figures, dict):
        raise InputError(f"{name}: figures must be an object")
    for figure, limits in figures.items():
        if figure not in FIGURES or not isinstance(limits, dict) or set(limits) - {"min_fraction_of_median"}:
            raise InputError(
                f"{name}: figures.{figure}: expected one of {', '.join(FIGURES)} with min_fraction_of_median"
            )
        for key, value in limits.items():
            rules["figures"][figure][key] = _fraction(value, f"{name}: figures.{figure}.{key}")
    if "judge_simulated_figures" in data:
        if not isinstance(data["judge_simulated_figures"], bool):
            raise InputError(f"{name}: judge_simulated_figures: expected true or false")
        rules["judge_simulated_figures"] = data["judge_simulated_figures"]
    if "min_nodes" in data:
        value = data["min_nodes"]
        if isinstance(value, bool) or not isinstance(value, int) or value < 2:
            raise InputError(f"{name}: min_nodes: expected an integer ≥ 2, got {value!r}")
        rules["min_nodes"] = value
    for key, known in (("versions", VERSION_FIELDS), ("host", HOST_FIELDS)):
        if key in data:
            value = data[key]
            if not isinstance(value, list) or any(v not in known for v in value):
                raise InputError(f"{name}: {key}: expected a list drawn from {', '.join(known)}")
            rules[key] = list(value)
    for key in ("topology_must_match", "gpus_must_match"):
        if key in data:
            if not isinstance(data[key], bool):
                raise InputError(f"{name}: {key}: expected true or false")
            rules[key] = data[key]
    for key in ("pair_slow_fraction", "baseline_fraction"):
        if key in data:
            rules[key] = _fraction(data[key], f"{name}: {key}")
    return rules


def check_baseline(data: Any, name: str = "baseline") -> dict[str, dict[str, float]]:
    """``{machine type: {figure: GB/s}}`` from a baseline document, checked."""
    if not isinstance(data, dict) or data.get("schema", BASELINE_SCHEMA) != BASELINE_SCHEMA:
        raise InputError(f"{name}: expected a {BASELINE_SCHEMA} JSON object")
    types = data.get("machine_types")
    if not isinstance(types, dict):
        raise InputError(f"{name}: expected machine_types: {{TYPE: {{FIGURE: value}}}}")
    out: dict[str, dict[str, float]] = {}
    for kind, figures in types.items():
        if not isinstance(figures, dict):
            raise InputError(f"{name}: machine_types.{kind}: expected an object of figures")
        for figure, value in figures.items():
            if figure not in FIGURES:
                raise InputError(
                    f"{name}: machine_types.{kind}.{figure}: unknown figure; known: {', '.join(FIGURES)}"
                )
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise InputError(f"{name}: machine_types.{kind}.{figure}: expected a positive number")
        out[str(kind)] = {k: float(v) for k, v in figures.items()}
    return out


def _read_json(path: str | Path, what: str) -> Any:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise InputError(f"{what} {path}: cannot read it ({exc.strerror or exc})") from None
    try:
        return json.loads(text)
    except ValueError as exc:
        raise InputError(f"{what} {path}: not JSON ({exc})") from None


def load_rules(path: str | Path | None) -> dict[str, Any]:
    """The rules of ``path`` over the defaults; the defaults when ``path`` is None."""
    if path is None:
        return copy.deepcopy(DEFAULT_RULES)
    return check_rules(_read_json(path, "rules file"), f"rules file {path}")


def load_baseline(path: str | Path | None) -> dict[str, dict[str, float]]:
    """The baseline of ``path`` (empty when None)."""
    if path is None:
        return {}
    return check_baseline(_read_json(path, "baseline file"), f"baseline file {path}")
