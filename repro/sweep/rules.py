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
- ``min_nodes``: fewer nodes with a figure than this and no outlier is judged for it
  (SUMMARY.md's notes say so; at most :data:`MAX_MIN_NODES`);
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
import math
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
#: The largest ``min_nodes`` accepted: as many hosts as a node list may name (hosts.py);
#: a fleet smaller than ``min_nodes`` has the figure left unjudged, said in SUMMARY.md.
MAX_MIN_NODES = 100_000

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


def _number(value: Any) -> bool:
    """A JSON number that is finite (``json`` reads ``NaN`` and ``Infinity`` too)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _fraction(value: Any, where: str) -> float:
    if not _number(value) or not 0 < value <= 1:
        raise InputError(f"{where}: expected a fraction in (0, 1], got {value!r}")
    return float(value)


def _document(data: Any, name: str, schema: str, known: Any, *, schema_required: bool) -> dict[str, Any]:
    """``data`` as one of the sweep's small JSON files — an object whose ``schema`` is
    ``schema`` (a file that omits it is taken as one unless ``schema_required``) and whose
    keys are all in ``known``; :class:`InputError` (exit 2) naming what is wrong. Shared
    by the rules and the baseline, and by every object nested in them (``where``)."""
    if not isinstance(data, dict):
        raise InputError(f"{name}: expected a JSON object, got {type(data).__name__}")
    if "schema" not in data and schema_required:
        raise InputError(f'{name}: no schema; expected "schema": "{schema}"')
    if data.get("schema", schema) != schema:
        raise InputError(f"{name}: schema {data.get('schema')!r}, expected {schema}")
    return _known_keys(data, name, known)


def _known_keys(data: dict[str, Any], where: str, known: Any) -> dict[str, Any]:
    unknown = sorted(str(k) for k in set(data) - set(known))
    if unknown:
        raise InputError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(known)}")
    return data


def check_rules(data: Any, name: str = "rules") -> dict[str, Any]:
    """The defaults overlaid with ``data``, each value checked; :class:`InputError` (exit 2)
    naming the bad key otherwise."""
    _document(data, name, RULES_SCHEMA, DEFAULT_RULES, schema_required=False)
    rules = copy.deepcopy(DEFAULT_RULES)
    figures = data.get("figures", {})
    if not isinstance(figures, dict):
        raise InputError(f"{name}: figures must be an object")
    _known_keys(figures, f"{name}: figures", FIGURES)
    for figure, limits in figures.items():
        if not isinstance(limits, dict):
            raise InputError(
                f'{name}: figures.{figure}: expected an object {{"min_fraction_of_median": FRACTION}}, '
                f"got {type(limits).__name__}"
            )
        _known_keys(limits, f"{name}: figures.{figure}", ("min_fraction_of_median",))
        for key, value in limits.items():
            rules["figures"][figure][key] = _fraction(value, f"{name}: figures.{figure}.{key}")
    if "judge_simulated_figures" in data:
        if not isinstance(data["judge_simulated_figures"], bool):
            raise InputError(f"{name}: judge_simulated_figures: expected true or false")
        rules["judge_simulated_figures"] = data["judge_simulated_figures"]
    if "min_nodes" in data:
        value = data["min_nodes"]
        if isinstance(value, bool) or not isinstance(value, int) or not 2 <= value <= MAX_MIN_NODES:
            raise InputError(f"{name}: min_nodes: an integer from 2 to {MAX_MIN_NODES}, got {value!r}")
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
    """``{machine type: {figure: GB/s}}`` from a baseline document, checked as strictly as
    the rules (:func:`_document`: the schema tag is required here — a baseline is a file
    of its own, never a subset of defaults); figures finite and > 0."""
    _document(data, name, BASELINE_SCHEMA, ("schema", "machine_types"), schema_required=True)
    types = data.get("machine_types")
    if not isinstance(types, dict):
        raise InputError(f"{name}: machine_types: expected an object {{TYPE: {{FIGURE: GB/s}}}}")
    out: dict[str, dict[str, float]] = {}
    for kind, figures in types.items():
        where = f"{name}: machine_types.{kind}"
        if not isinstance(figures, dict):
            raise InputError(f"{where}: expected an object of figures, got {type(figures).__name__}")
        _known_keys(figures, where, FIGURES)
        for figure, value in figures.items():
            if not _number(value) or value <= 0:
                raise InputError(f"{where}.{figure}: expected a finite number > 0 (GB/s), got {value!r}")
        out[str(kind)] = {k: float(v) for k, v in figures.items()}
    return out


def _read_json(path: str | Path, what: str) -> Any:
    """The JSON document of a small input file: read bounded (64 MiB,
    :func:`~gpudiag.fileio.read_bounded`), UTF-8; anything else is one line, exit 2."""
    from gpudiag.fileio import read_bounded

    return parse_json(read_bounded(path, what), f"{what} {path}")


def parse_json(data: bytes, where: str) -> Any:
    """``data`` parsed as UTF-8 JSON, or :class:`InputError` naming ``where``: not UTF-8,
    not JSON, or nested too deep for Python's parser (RecursionError, as the bundle and
    checkpoint readers catch it)."""
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise InputError(f"{where}: not UTF-8 text (byte {exc.start})") from None
    except RecursionError:
        raise InputError(f"{where}: not JSON (nested too deep)") from None
    except ValueError as exc:
        raise InputError(f"{where}: not JSON ({exc})") from None


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
