"""``gpudiag hang``: which rank is stuck, in which collective, at which line (docs/hang.md)."""

from __future__ import annotations

import sys

import click

from gpudiag.cli.group import cli
from gpudiag.cli.options import FiniteFloatRange, format_option


@cli.command()
@click.argument("paths", nargs=-1, required=True, metavar="PATH...")
@click.option("--world-size", type=click.IntRange(1, 100_000), help="The job's ranks, when no dump tells it.")
@format_option(("text", "json", "markdown"))
@click.pass_context
def hang(ctx: click.Context, paths: tuple[str, ...], world_size: int | None, fmt: str) -> None:
    """Read flight-recorder dumps (files or folders; pickle or JSON) and name the rank
    that hangs the job, the collective and the user's line. Exit 0 healthy, 1 stuck or
    a rank missing, 2 unreadable input, 3 undecided."""
    from pathlib import Path

    from gpudiag.hang.analysis import analyse
    from gpudiag.hang.reader import read_dumps
    from gpudiag.hang.result import judge

    stacks = [Path(p) / "stacks" for p in paths if (Path(p) / "stacks").is_dir()]  # gpudiag run's
    result = judge(analyse(read_dumps(list(paths)), world_size), stacks_dir=stacks[0] if stacks else None)
    from gpudiag.render import render

    render("hang", result, fmt, sys.stdout)
    ctx.exit(result.exit_code())


@cli.command(
    "run",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@click.option(
    "--stall",
    type=FiniteFloatRange(0.1, None),
    default=300.0,
    show_default=True,
    metavar="SECONDS",
    help="How long a collective may be pending before every rank dumps and the job ends.",
)
@click.option(
    "-o", "out", default="gpudiag-hang", show_default=True, metavar="DIR", help="Where the dumps go."
)
@click.argument("script")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def run_command(ctx: click.Context, stall: float, out: str, script: str, args: tuple[str, ...]) -> None:
    """Run SCRIPT ARGS (in each rank, under torchrun) with a hang watchdog: when a
    collective stalls, every rank writes its flight record and Python stacks into DIR,
    the first rank prints the verdict and the job ends (exit 1)."""
    from pathlib import Path

    from gpudiag.cli.options import refuse_module, refuse_unknown_option

    if script == "-m":  # (not an option: torchrun's own -m must stay unmatched by ours)
        refuse_module(args[0] if args else "")
    refuse_unknown_option(ctx, script)  # (--stal 5: an option misspelt, not a script)

    from gpudiag.hang.runner import run_script

    ctx.exit(run_script(script, list(args), stall, Path(out)))
