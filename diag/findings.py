"""Findings: what a check or an analysis concluded, with a stable public code.

A :class:`Finding` code is kebab-case, registered in :mod:`gpudiag.codes` and documented in
``docs/findings.md``; codes are public API and never renamed. Severity is ``info`` (advice),
``warning`` or ``error``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpudiag.codes import CODES, Severity, lookup

__all__ = ["Finding", "Severity", "short_repr"]


@dataclass(frozen=True)
class Finding:
    """One conclusion: ``code`` (stable), ``message`` (one line), the ``evidence`` behind
    it (JSON-serialisable), and where known the likely ``cause`` and the ``fix``.

    The code must be registered (:func:`gpudiag.codes.lookup` raises ``UnknownCode``), except
    for a ``foreign`` finding read back from a file another gpudiag version wrote."""

    code: str
    severity: Severity
    message: str
    evidence: dict[str, Any] = field(default_factory=dict)
    cause: str | None = None
    fix: str | None = None
    foreign: bool = field(default=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.foreign:
            lookup(self.code)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "code": self.code,
            "severity": self.severity,
            "message": self.message,
            "evidence": self.evidence,
        }
        if self.cause:
            out["cause"] = self.cause
        if self.fix:
            out["fix"] = self.fix
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Finding:
        code = str(data["code"])
        return cls(
            code=code,
            foreign=code not in CODES,
            severity=data.get("severity", "warning"),
            message=str(data["message"]),
            evidence=dict(data.get("evidence") or {}),
            cause=data.get("cause"),
            fix=data.get("fix"),
        )


def short_repr(result: object, verdict: str, findings: list[Finding], **counts: int) -> str:
    """A result's repr in one short line — its class, verdict, counts and finding codes —
    instead of the dataclass default that prints every tensor and record it holds:
    ``<GradcheckReport explained · comparisons 4 · batchnorm-per-replica>``."""
    parts = [f"{type(result).__name__} {verdict}", *(f"{name} {n}" for name, n in counts.items())]
    codes = list(dict.fromkeys(f.code for f in findings))
    if codes:
        parts.append(", ".join(codes[:5]) + (f" and {len(codes) - 5} more" if len(codes) > 5 else ""))
    return "<" + " · ".join(parts) + ">"
