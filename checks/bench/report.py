"""The result of ``gpudiag bench``: :class:`BenchResult` (JSON ``gpudiag.bench/1``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpudiag.errors import InputError
from gpudiag.findings import Finding, short_repr

from .figures import Case

SCHEMA = "gpudiag.bench/1"


@dataclass
class BenchResult:
    """Every measured case, the findings about them and how they were measured.

    ``config``: model, input shape, ``batch_size`` and its ``convention`` (``per_gpu``:
    every GPU gets ``batch_size``, the global batch grows with the GPUs; ``global``: the
    global batch is ``batch_size`` whatever the GPUs), steps, warm-up, data, device kind.
    ``simulated``: measured on CPU virtual devices — the figures test the machinery, they
    say nothing about a GPU."""

    cases: list[Case]
    findings: list[Finding]
    config: dict[str, Any] = field(default_factory=dict)
    simulated: bool = False
    skipped: list[dict[str, Any]] = field(default_factory=list)  # {"case": label, "reason": why}
    #: what NCCL chose per GPU pair in the DDP case ``transport_case`` (a
    #: gpudiag.transport.report.TransportReport; None without NCCL), and a note on its log
    transport: Any = None
    transport_case: str | None = None
    transport_note: str | None = None

    def __repr__(self) -> str:
        return short_repr(self, self.verdict, self.findings, cases=len(self.cases))

    @property
    def verdict(self) -> str:
        """``fail`` when a case could not be measured, ``warn`` with warnings, else ``ok``."""
        if any(c.error for c in self.cases):
            return "fail"
        if any(f.severity != "info" for f in self.findings):
            return "warn"
        return "ok"

    def exit_code(self) -> int:
        return 1 if self.verdict == "fail" else 0

    @property
    def epoch_samples(self) -> int:
        """The samples of an epoch the time per epoch is given for (``--epoch-samples``)."""
        return int(self.config.get("epoch_samples") or 50_000)

    @property
    def simulation(self) -> str | None:
        if not self.simulated:
            return None
        return (
            "simulated on CPU virtual devices: every device is the same CPU, so these figures test "
            "the measuring, not a GPU; speedups and phase shares say nothing about real GPUs"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "verdict": self.verdict,
            "simulated": self.simulated,
            "config": self.config,
            "cases": [
                {
                    **c.to_json(),
                    "epoch_s": c.epoch_time(self.epoch_samples) if c.steps and not c.error else None,
                }
                for c in self.cases
            ],
            "skipped": self.skipped,
            "findings": [f.to_json() for f in self.findings],
            "transport": self.transport.to_json() if self.transport is not None else None,
            "transport_case": self.transport_case,
            "transport_note": self.transport_note,
        }

    @classmethod
    def from_json(cls, data: Any, source: str = "the file") -> BenchResult:
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            raise InputError(f"{source} is not a gpudiag bench result (expected schema {SCHEMA!r})")
        try:
            return cls(
                cases=[Case.from_json(c) for c in data["cases"]],
                findings=[Finding.from_json(f) for f in data.get("findings", [])],
                config=dict(data.get("config") or {}),
                simulated=bool(data.get("simulated")),
                skipped=list(data.get("skipped") or []),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise InputError(f"{source}: a damaged bench result ({type(exc).__name__}: {exc})") from None
