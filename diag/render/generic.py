"""Renderers for any :class:`gpudiag.result.CheckResult`: a check registered without its
own renderer module is shown by these (its verdict, whether it was simulated, its findings
with cause and fix; JSON is its ``to_json()``)."""

from __future__ import annotations

from typing import TextIO

from gpudiag.render import jsonout
from gpudiag.render.markdown import finding_lines
from gpudiag.result import CheckResult


def _name(result: CheckResult) -> str:
    schema = str(result.to_json().get("schema", ""))
    return schema.removeprefix("gpudiag.").partition("/")[0] or type(result).__name__


def text(result: CheckResult, stream: TextIO) -> None:
    """Plain lines: ``NAME VERDICT (simulated)``, then one block per finding."""
    mark = " (simulated)" if result.simulated else ""
    lines = [f"{_name(result)} {result.verdict.upper()}{mark}"]
    for f in result.findings:
        lines.append(f"  {f.severity}: {f.code}: {f.message}")
        lines += [f"      {label}: {value}" for label, value in (("cause", f.cause), ("fix", f.fix)) if value]
    stream.write("\n".join(lines) + "\n")


def json(result: CheckResult, stream: TextIO) -> None:
    jsonout.write(result.to_json(), stream)


def markdown(result: CheckResult, stream: TextIO) -> None:
    mark = " (simulated)" if result.simulated else ""
    lines = [f"## {_name(result)}: **{result.verdict}**{mark}", ""]
    for f in result.findings:
        lines += finding_lines(f, severity=True)
    stream.write("\n".join(lines) + "\n")
