"""What every check's result is, whatever the check: the protocol renderers, the suite,
report bundles and replay are written against.

A result has a ``verdict`` (the check's own word: ``pass``, ``fail``, ``explained``,
``warning``, ``skipped`` …), its ``findings`` (:class:`gpudiag.findings.Finding`, each with a
registered code), whether it is ``simulated`` (ran on CPU virtual devices or a machine file,
so it says the check works, not that the machine's GPUs do), its JSON document
(``to_json()``, with a ``"schema": "gpudiag.X/1"`` field) and its exit code (``exit_code()``:
0 nothing wrong, 1 a problem found; docs/architecture.md, "Exit codes").
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from gpudiag.findings import Finding


@runtime_checkable
class CheckResult(Protocol):
    """The result of one check (structural: any class with these members is one)."""

    @property
    def verdict(self) -> str: ...

    @property
    def findings(self) -> list[Finding]: ...

    @property
    def simulated(self) -> bool: ...

    def to_json(self) -> dict[str, Any]: ...

    def exit_code(self) -> int: ...
