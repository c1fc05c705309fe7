"""``gpudiag hang``: which rank is stuck, in which collective, at which line (docs/hang.md)."""

from __future__ import annotations

import json
import sys

import click

from gpudiag.cli.group import cli
from gpudiag.cli.options import format_option


@cli.command()
@click.argument("paths", nargs=-1, required=True, metavar="PATH...")
@click.option(
    "--world-size", type=click.IntRange(1, 1_000_000), help="The job's ranks, when no dump tells it."
)
@format_option(("text", "json", "markdown"))
@click.pass_context
def hang(ctx: click.Context, paths: tuple[str, ...], world_size: int | None, fmt: str) -> None:
    """Read flight-recorder dumps (files or folders; pickle or JSON) and name the rank
    that hangs the job, the collective and the user's line. Exit 0 healthy, 1 stuck or
    a rank missing, 2 unreadable input, 3 undecided."""
    from gpudiag.hang.analysis import analyse
    from gpudiag.hang.reader import read_dumps
    from gpudiag.hang.result import judge

    result = judge(analyse(read_dumps(list(paths)), world_size))
    if fmt == "json":
        sys.stdout.write(json.dumps(result.to_json(), indent=2) + "\n")
    elif fmt == "markdown":
        sys.stdout.write(result.to_markdown())
    else:
        sys.stdout.write(result.to_text())
    ctx.exit(result.exit_code())
