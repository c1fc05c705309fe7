"""``gpudiag hang``'s text and Markdown (and JSON: its ``to_json()``), from a
:class:`gpudiag.hang.result.HangResult`: the summary, one row per rank, the findings."""

from __future__ import annotations

from typing import Any, TextIO


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


def _fits(text: str, stream: TextIO) -> bool:
    """Whether ``stream``'s encoding (an ASCII terminal's, ``PYTHONIOENCODING``) can write ``text``."""
    try:
        text.encode(getattr(stream, "encoding", None) or "utf-8")
    except (UnicodeEncodeError, LookupError):
        return False
    return True


def _write(text: str, stream: TextIO) -> None:
    """Write the whole of ``text`` in one go, names the stream cannot encode escaped
    (``tr\\xe1in.py``): nothing is half-written (a dump's names are the user's, any script)."""
    if not _fits(text, stream):
        text = text.encode("ascii", "backslashreplace").decode("ascii")
    stream.write(text)


def text(result: Any, stream: TextIO) -> None:
    _write(_text(result), stream)


def markdown(result: Any, stream: TextIO) -> None:
    _write(_markdown(result), stream)


def json(result: Any, stream: TextIO) -> None:
    """The verdict's ``to_json()``, made whole before it is written; ``\\u`` escapes where
    the stream cannot encode a name (still the same JSON)."""
    import json as _json

    document = result.to_json()
    out = _json.dumps(document, indent=2, ensure_ascii=False) + "\n"
    if not _fits(out, stream):
        out = _json.dumps(document, indent=2, ensure_ascii=True) + "\n"
    stream.write(out)
