"""``gpudiag hang``'s text and Markdown (and JSON: its ``to_json()``), from a
:class:`gpudiag.hang.result.HangResult`: the summary, one row per rank, the findings."""

from __future__ import annotations

from typing import Any, TextIO

from gpudiag.render import jsonout


def _text(result: Any) -> str:
    out = [result.summary, ""]
    header = f"{'rank':>4}  {'group':<14} {'seq':>5}  {'op':<18} {'sizes':<14} {'state':<10} line"
    out.append(header)
    for row in result.rows():
        if row.get("dump") is None:
            first = f"{row['rank']}-{row['through']}" if "through" in row else str(row["rank"])
            out.append(f"{first:>4}  (no dump)")
        elif "op" not in row:
            out.append(f"{row['rank']:>4}  (no collective recorded)")
        else:
            out.append(
                f"{row['rank']:>4}  {str(row['group'])[:14]:<14} {row['seq']:>5}  {row['op'][:18]:<18} "
                f"{str(row['sizes'])[:14]:<14} {row['state']:<10} {row['line'] or '-'}"
            )
    for f in result.findings:
        out.append(f"\n[{f.severity}] {f.code}: {f.message}")
        if f.fix:
            out.append(f"  fix: {f.fix}")
    return "\n".join(out) + "\n"


def _markdown(result: Any) -> str:
    out = [
        f"# gpudiag hang: {result.verdict}",
        "",
        result.summary,
        "",
        "| rank | group | seq | op | state | line |",
    ]
    out.append("|---|---|---|---|---|---|")
    for row in result.rows():
        if "op" not in row:
            first = f"{row['rank']}-{row['through']}" if "through" in row else str(row["rank"])
            out.append(
                f"| {first} | (no dump) | | | | |"
                if row.get("dump") is None
                else f"| {row['rank']} | | | | | |"
            )
        else:
            out.append(
                f"| {row['rank']} | {row['group']} | {row['seq']} | {row['op']} | {row['state']} "
                f"| {row['line'] or ''} |"
            )
    if result.findings:
        out += ["", "## Findings", ""]
        out += [f"- **{f.code}** ({f.severity}): {f.message}" for f in result.findings]
    return "\n".join(out) + "\n"


def text(result: Any, stream: TextIO) -> None:
    stream.write(_text(result))


def markdown(result: Any, stream: TextIO) -> None:
    stream.write(_markdown(result))


def json(result: Any, stream: TextIO) -> None:
    jsonout.write(result.to_json(), stream)
