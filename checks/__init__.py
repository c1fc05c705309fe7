"""Diagnoses: one module per check, each returning a CheckResult."""
