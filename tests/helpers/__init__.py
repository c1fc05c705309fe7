"""What the tests share: the repository's paths, the one ``codes()`` and the one way to run
gpudiag's command line in this process. The small models ranks import by name live beside
it (``tests.helpers.models``, ``tests.helpers.held_out_models``), and so does the /proc
reader for tests that check nothing was left behind (``tests.helpers.procfs``).

Tests import from here, never from one another's modules, so a test file can move to the
folder of the layer it tests without breaking another."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from click.testing import Result

#: The repository's root (the folder of pyproject.toml), however deep the test that asks.
ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
#: Real captures and logs the tests read (``tests/data/*/SOURCES.md`` names where each came from).
DATA = TESTS / "data"
TOPO = DATA / "topo"
NVML = DATA / "nvml"
NCCL = DATA / "nccl"
FR = DATA / "fr"
#: Golden text output; ``GPUDIAG_UPDATE_GOLDEN=1`` rewrites it (review the diff, commit).
GOLDEN = TESTS / "golden"
#: The examples shipped with the package (found by name from any folder, as ``--machine NAME``).
EXAMPLES = ROOT / "diag" / "examples"
SEED_MACHINE = EXAMPLES / "seed_8gpu_machine.json"
SEED_TOPO = EXAMPLES / "seed_8gpu_topo.txt"


#: A wall-clock bound in a test is a guard against a hang, never the test of a deadline (that is
#: tested by its mechanism: the budget reached, the process stopped and reaped, the note
#: written): it is this many times what the test measured on an idle machine, since CI and
#: users' machines are shared and loaded (issue 51: ``took < 3`` failed at load 10).
SLACK = 10


def within(idle_s: float) -> float:
    """The bound, in seconds, for what took ``idle_s`` seconds on an idle 2-core machine."""
    return SLACK * idle_s


def fuzz_examples(default: int) -> int:
    """How many examples a property test draws: ``default`` in ``make test``; ``FUZZ_EXAMPLES``
    where set (``make fuzz`` sets it). Which examples is the hypothesis profile's choice
    (tests/conftest.py)."""
    return int(os.environ.get("FUZZ_EXAMPLES", default))


def capture(name: str) -> str:
    """The text of a capture in ``tests/data/topo`` (copied from ``shared/fixtures/topo``)."""
    return (TOPO / name).read_text(encoding="utf-8")


def codes(found: Any) -> list[str]:
    """The finding codes, in order, of a report object (its ``findings``), a JSON document
    (its ``"findings"``), a sweep node (its ``problems``) or a list of any of these findings."""
    if isinstance(found, Mapping):
        found = found["findings"]
    elif hasattr(found, "findings"):
        found = found.findings
    elif hasattr(found, "problems"):
        found = found.problems
    items: Iterable[Any] = found
    return [item["code"] if isinstance(item, Mapping) else item.code for item in items]


def invoke(
    args: Sequence[str],
    *,
    env: Mapping[str, str | None] | None = None,
    input: str | bytes | None = None,  # (click's own name for stdin)
    catch_exceptions: bool = True,
) -> Result:
    """``gpudiag ARGS`` in this process through click's CliRunner: exit code, stdout and
    stderr apart. (gpudiag.cli is imported here, at the first call, not at import.)"""
    from click.testing import CliRunner

    from gpudiag.cli import cli

    return CliRunner().invoke(cli, list(args), env=env, input=input, catch_exceptions=catch_exceptions)


def json_of(result: Result) -> dict[str, Any]:
    """The JSON document a command printed on stdout, or ``{}`` where it printed none."""
    out = result.stdout
    return json.loads(out) if out.lstrip().startswith("{") else {}


def invoke_json(*args: str) -> tuple[int, dict[str, Any]]:
    """``gpudiag ARGS --format json``: its exit code and its document (``{}`` where it printed
    none); an exception inside the command is raised, not hidden in the result."""
    result = invoke([*args, "--format", "json"], catch_exceptions=False)
    return result.exit_code, json_of(result)


#: A float at rounding level (below 1e-05 in e-notation, e.g. the relative error of two
#: correct reduction orders): its digits depend on the CPU's kernels and thread count.
ROUNDING = re.compile(r"\b\d\.\d+e-(?:0[6-9]|[1-9]\d+)\b")


def mask_rounding(text: str) -> str:
    """``text`` with every rounding-level float written ``<1.0e-05`` (as wide as ``9.04e-08``)."""
    return ROUNDING.sub("<1.0e-05", text)


def assert_golden(name: str, text: str) -> None:
    """``text`` equals ``tests/golden/NAME``. With ``GPUDIAG_UPDATE_GOLDEN=1`` the file is
    rewritten first: regenerate, review the diff, commit."""
    path = GOLDEN / name
    if os.environ.get("GPUDIAG_UPDATE_GOLDEN"):
        path.write_text(text, encoding="utf-8")
    assert text == path.read_text(encoding="utf-8"), f"{path} differs (GPUDIAG_UPDATE_GOLDEN=1 rewrites it)"
