"""What gradcheck reports: one comparison per strategy and mode, findings, a verdict.

Verdict: ``pass`` (every comparison within tolerance, nothing to explain), ``explained``
(differences, every one attributed to a confirmed cause), ``fail`` (anything else: an
error finding). JSON schema ``gpudiag.gradcheck/1`` (docs/gradcheck.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpudiag.findings import Finding, short_repr
from gpudiag.render.jsonout import number as _number
from gpudiag.runtime.faults import rehearsal
from gpudiag.runtime.record import Recorder

SCHEMA = "gpudiag.gradcheck/1"

#: Codes that account for a difference (their presence as a warning makes the verdict
#: "explained").
EXPLAINS = (
    "batchnorm-per-replica",
    "dropout-active",
    "random-in-forward",
    "nondeterministic-op",
    "loss-scale-world-size",
    "uneven-shards",
    "unused-parameters",
)


@dataclass
class ParamDiff:
    name: str
    max_abs_err: float
    max_rel_err: float
    rel_norm_err: float


@dataclass
class Comparison:
    """One strategy against ``single``."""

    strategy: str
    world_size: int
    mode: str
    ok: bool
    rel_norm_err: float
    cosine: float
    norm_ratio: float
    max_abs_err: float
    max_rel_err: float
    worst_param: str | None
    first_bad_param: str | None
    params: list[ParamDiff] = field(default_factory=list)
    update_rel_err: float | None = None  # after K > 1 steps: the parameter updates
    options: dict[str, Any] = field(default_factory=dict)  # e.g. a retry's find_unused_parameters
    #: a near miss judged against a float64 single run (confirm.against_float64): single's
    #: and this strategy's distance from it, the measured tolerance, whether it is closer
    float64: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "world_size": self.world_size,
            "mode": self.mode,
            "ok": self.ok,
            "rel_norm_err": _number(self.rel_norm_err),
            "cosine": _number(self.cosine),
            "norm_ratio": _number(self.norm_ratio),
            "max_abs_err": _number(self.max_abs_err),
            "max_rel_err": _number(self.max_rel_err),
            "worst_param": self.worst_param,
            "first_bad_param": self.first_bad_param,
            "update_rel_err": None if self.update_rel_err is None else _number(self.update_rel_err),
            "options": self.options,
            "float64": None
            if self.float64 is None
            else {k: v if isinstance(v, bool) else _number(v) for k, v in self.float64.items()},
            "params": [
                {
                    "name": p.name,
                    "max_abs_err": _number(p.max_abs_err),
                    "max_rel_err": _number(p.max_rel_err),
                    "rel_norm_err": _number(p.rel_norm_err),
                }
                for p in self.params
            ],
        }


@dataclass
class GradcheckReport:
    verdict: str  # pass | explained | fail
    tolerance: dict[str, Any]
    settings: dict[str, Any]
    comparisons: list[Comparison]
    findings: list[Finding]
    config: dict[str, Any]
    recorders: dict[str, Recorder] = field(default_factory=dict)  # per run, for --trace
    #: the numeric settings each process computed under: "single", "dp", "ddp rank 0", …
    numerics: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: what train mode switches on in the model (trainmode.probe), as JSON
    train_mode: dict[str, Any] = field(default_factory=dict)

    def __repr__(self) -> str:
        return short_repr(self, self.verdict, self.findings, comparisons=len(self.comparisons))

    def summary(self) -> str:
        """One line per comparison and finding, for assertion messages and logs."""
        lines = [f"gradcheck verdict: {self.verdict}"]
        for c in self.comparisons:
            options = "".join(f", {k}={v}" for k, v in c.options.items())
            lines.append(
                f"  {c.strategy} ({c.mode}{options}): "
                f"{'ok' if c.ok else 'DIFFERS'} rel_norm_err={c.rel_norm_err:.3g} cosine={c.cosine:.6f} "
                f"norm_ratio={c.norm_ratio:.4g} first_bad_param={c.first_bad_param}"
            )
        lines += [f"  [{f.severity}] {f.code}: {f.message}" for f in self.findings]
        return "\n".join(lines)

    @property
    def simulated(self) -> bool:
        """Whether the strategies ran on CPU virtual devices (DDP over gloo), not on GPUs."""
        devices = self.config.get("devices")
        return isinstance(devices, dict) and devices.get("kind") == "virtual"

    @property
    def simulation(self) -> str | None:
        """What was simulated, in one sentence (None on real GPUs)."""
        if not self.simulated:
            return None
        return (
            "simulated on CPU virtual devices (DDP over gloo), not on GPUs: it compares the "
            "strategies' arithmetic for this model; CUDA kernels, NCCL and TF32 were not exercised"
        )

    def exit_code(self, strict: bool = False) -> int:
        if self.verdict == "fail" or (strict and self.verdict == "explained"):
            return 1
        return 0

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "verdict": self.verdict,
            "simulated": self.simulated,
            "simulation": self.simulation,
            "rehearsal": rehearsal(self.config.get("inject") or []),
            "reference": "single",
            "tolerance": self.tolerance,
            "settings": self.settings,
            "numerics": self.numerics,
            "train_mode": self.train_mode,
            "config": self.config,
            "comparisons": [c.to_json() for c in self.comparisons],
            "findings": [f.to_json() for f in self.findings],
        }


def has_errors(findings: list[Finding]) -> bool:
    return any(f.severity == "error" for f in findings)


def verdict(comparisons: list[Comparison], findings: list[Finding]) -> str:
    if has_errors(findings):
        return "fail"
    explained = any(f.code in EXPLAINS and f.severity == "warning" for f in findings)
    if all(c.ok for c in comparisons) and not explained:
        return "pass"
    return "explained"
