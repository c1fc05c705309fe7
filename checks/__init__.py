"""Diagnoses: one module (or package) per check, each returning a
:class:`gpudiag.result.CheckResult` and registered in :mod:`gpudiag.checks.registry`."""
