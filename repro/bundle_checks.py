"""A bundle's recorded configurations and results, checked before replay runs anything:
only the fields ``gpudiag report`` writes, of the right types and within bounds
(:data:`gpudiag.checks.fields.LIMITS`); anything else is one
:class:`~gpudiag.errors.InputError` naming the field (exit 2). The fields of each check are
its registry entry's (``config_fields``, ``required``). Nothing here imports torch until a
check's fields are first needed."""

from __future__ import annotations

from gpudiag.checks import registry
from gpudiag.checks.fields import LIMITS, RESULT_LISTS, result_problem
from gpudiag.errors import InputError
from gpudiag.repro.bundle import Bundle

__all__ = ["LIMITS", "check_configs"]


def check_configs(bundle: Bundle) -> None:
    """Every recorded configuration and result replay reads, checked before anything runs:
    an unknown field, a wrong type or a value beyond :data:`LIMITS` is an
    :class:`InputError` naming the field (``checks[3].config.world_size``)."""
    for i, check in enumerate(bundle.document["checks"]):
        name, config = check["name"], check.get("config")
        entry = registry.get(name)
        fields = entry.config_fields()
        if isinstance(config, dict):
            for key in entry.required:
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
                if key == "machine" and value is not None and value not in bundle.files:
                    raise InputError(f"{bundle.path}: {where} names {value}, which the bundle lacks")
                if key == "dumps" and not any(n.startswith(f"{value}/") for n in bundle.files):
                    raise InputError(f"{bundle.path}: {where} names {value}/, which the bundle lacks")
        result = check.get("result")
        if isinstance(result, dict) and name in RESULT_LISTS:
            problem = result_problem(name, result)
            if problem:
                raise InputError(f"{bundle.path}: checks[{i}].result.{problem}")
