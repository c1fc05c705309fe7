"""The one extension point for a check (gpudiag.checks.registry): a throwaway check added
through the registry alone is run by ``doctor``, rendered in every format, written into a
bundle and replayed, with no other code knowing its name."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import gpudiag.checks.suite  # noqa: F401  (registers gpudiag's own checks)
from gpudiag.checks import registry
from gpudiag.checks.registry import Check, Request
from gpudiag.findings import Finding
from gpudiag.result import CheckResult
from tests.helpers import FR, invoke


@dataclass
class CoinResult:
    """A made-up check's result: flips a configured number of coins, all heads."""

    flips: int
    findings: list[Finding] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        return "warning" if any(f.severity != "info" for f in self.findings) else "pass"

    @property
    def simulated(self) -> bool:
        return False

    def to_json(self) -> dict[str, Any]:
        return {"schema": "gpudiag.coin/1", "flips": self.flips, "heads": self.flips}

    def exit_code(self) -> int:
        return 0


def _plan(here: Any, request: Request) -> tuple[dict[str, Any] | None, str]:
    return {"flips": 3}, ""


def _run(config: dict[str, Any], here: Any) -> CheckResult:
    return CoinResult(config["flips"], [Finding("best-gpu-groups", "info", "heads, always")])


def _flips(value: Any) -> str | None:
    return None if isinstance(value, int) and 0 < value <= 10 else f"{value!r} is not 1 to 10 flips"


@pytest.fixture
def coin() -> Iterator[Check]:
    entry = registry.register(
        Check(
            "coin",
            "flips coins",
            _plan,
            _run,
            headline=lambda result: f"{result.flips} heads",
            config_fields=lambda: {"flips": _flips},
            compare=lambda there, here: [] if there["heads"] == here["heads"] else ["heads differ"],
        )
    )
    yield entry
    registry.unregister("coin")


def test_a_check_registered_alone_runs_in_doctor_renders_bundles_and_replays(
    coin: Check, tmp_path: Path
) -> None:
    bundle = tmp_path / "bundle"
    done = invoke(["doctor", "--checks", "coin,env", "-o", str(bundle), "--format", "json"])
    assert done.exit_code == 0, done.output
    checks = {c["name"]: c for c in json.loads(done.stdout)["checks"]}
    assert checks["coin"]["status"] == "pass" and checks["coin"]["headline"] == "3 heads"
    recorded = {c["name"]: c for c in json.loads((bundle / "report.json").read_text())["checks"]}
    assert recorded["coin"]["config"] == {"flips": 3}
    assert recorded["coin"]["result"] == {"schema": "gpudiag.coin/1", "flips": 3, "heads": 3}
    markdown = invoke(["doctor", "--checks", "coin", "--no-bundle", "--format", "markdown"])
    assert markdown.exit_code == 0 and "coin" in markdown.stdout and "3 heads" in markdown.stdout
    replayed = invoke(["replay", str(bundle), "--format", "json"])
    assert replayed.exit_code == 0, replayed.output
    coin_replay = [c for c in json.loads(replayed.stdout)["checks"] if c["name"] == "coin"]
    assert [(c["compared"], c["match"]) for c in coin_replay] == [(True, True)]
    document = json.loads((bundle / "report.json").read_text())  # the reporter saw 2 heads
    next(c for c in document["checks"] if c["name"] == "coin")["result"]["heads"] = 2
    (bundle / "report.json").write_text(json.dumps(document))
    differs = invoke(["replay", str(bundle), "--format", "json"])
    assert differs.exit_code == 1, differs.output
    coin_replay = [c for c in json.loads(differs.stdout)["checks"] if c["name"] == "coin"]
    assert coin_replay[0]["differences"] == ["heads differ"]


def test_a_bundle_is_checked_by_the_entrys_fields(coin: Check, tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    assert invoke(["report", "--checks", "coin", "-o", str(bundle)]).exit_code == 0
    document = json.loads((bundle / "report.json").read_text())
    document["checks"][0]["config"]["flips"] = 1000
    (bundle / "report.json").write_text(json.dumps(document))
    refused = invoke(["replay", str(bundle)])
    assert refused.exit_code == 2 and "checks[0].config.flips: 1000 is not 1 to 10 flips" in refused.output


def test_the_generic_renderers_show_any_check_result(coin: Check) -> None:
    import io

    from gpudiag.render import render

    result = _run({"flips": 2}, None)
    for fmt, expected in (("text", "coin PASS"), ("markdown", "## coin: **pass**"), ("json", '"heads": 2')):
        out = io.StringIO()
        render("coin", result, fmt, out)
        assert (expected in out.getvalue() and "best-gpu-groups" in out.getvalue()) or fmt == "json"


def test_gpudiags_own_checks_are_registered_with_the_renderers_formats() -> None:
    from gpudiag.render import FORMATS

    assert registry.names(suite_only=True) == (
        "env",
        "topology",
        "peer",
        "gradcheck",
        "nancheck",
        "transport",
    )
    for name in registry.names():
        assert FORMATS[name] == registry.get(name).formats, name
    with pytest.raises(ValueError, match="registered already"):
        registry.register(Check("env", "again", _plan, _run))


def test_transport_came_in_through_the_registry(no_gpu: None) -> None:
    """Issue 34's check, added as one entry: doctor lists it, and without two GPUs says why
    it skipped and what reads a saved log instead."""
    done = invoke(["doctor", "--checks", "transport", "--no-bundle", "--format", "json"])
    assert done.exit_code == 0, done.output
    (run,) = json.loads(done.stdout)["checks"]
    assert run["name"] == "transport" and run["status"] == "skipped"
    assert "gpudiag transport --from-log FILE" in run["headline"]


def test_hang_came_in_through_the_registry() -> None:
    """Issue 33's check, one entry: kept out of doctor's default run (its inputs are a job's
    dumps), and when named it says what it needs."""
    assert "hang" in registry.names() and "hang" not in registry.names(suite_only=True)
    done = invoke(["doctor", "--checks", "hang", "--no-bundle", "--format", "json"])
    assert done.exit_code == 0, done.output
    (run,) = json.loads(done.stdout)["checks"]
    assert run["status"] == "skipped" and "gpudiag report --hang DIR" in run["headline"]
    from gpudiag.hang.bundled import collect

    here = registry.Here(0, "no NVML (test)", files=collect(str(FR_GLOO / "skip" / "pickle")))
    config, _ = registry.get("hang").plan(here, Request())
    assert config == {"dumps": "hang"}
    result = registry.get("hang").run(config, here)
    assert isinstance(result, CheckResult) and result.to_json()["culprit_ranks"] == [2]


FR_GLOO = FR / "gloo"
