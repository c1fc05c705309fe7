"""``gpudiag hang``: which rank is stuck, in which collective, at which line (docs/hang.md)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

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


#: The run ``gpudiag run`` was asked for: (script, args, watchdog), set by the command once
#: its options are checked, run by :func:`run_main` outside click (no handler of gpudiag's
#: around the user's script).
_PLANNED: list[tuple[Path, list[str], Any]] = []


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
    help="How long an operation may be pending before the ranks are asked whether the job is stuck.",
)
@click.option(
    "--confirm",
    type=FiniteFloatRange(0.0, None),
    default=None,
    metavar="SECONDS",
    help="How much longer the stall must hold (no rank outside a collective writing) before the job "
    "is ended  [default: max(10, stall/2)]",
)
@click.option(
    "-o", "out", default="gpudiag-hang", show_default=True, metavar="DIR", help="Where the dumps go."
)
@click.argument("script")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def run_command(
    ctx: click.Context, stall: float, confirm: float | None, out: str, script: str, args: tuple[str, ...]
) -> None:
    """Run SCRIPT ARGS (in each rank, under torchrun) as python would, with a hang
    watchdog: when an operation stays pending past --stall and then --confirm, every rank
    writes its flight record and Python stacks into DIR, the first rank prints the
    verdict and the job ends (exit 1). Otherwise the exit code is the script's."""
    from gpudiag.cli.options import refuse_module, refuse_unknown_option
    from gpudiag.errors import InputError
    from gpudiag.hang.arm import prepare

    if script == "-m":  # (not an option: torchrun's own -m must stay unmatched by ours)
        refuse_module(args[0] if args else "")
    refuse_unknown_option(ctx, script)  # (--stal 5: an option misspelt, not a script)

    path = Path(script)
    if not path.is_file():
        raise InputError(f"{script}: no such script")
    _PLANNED.append((path, list(args), prepare(stall, out, confirm_s=confirm)))


def run_main() -> None:
    """``gpudiag run``: the options checked by click (a bad one: one line, exit 2), then
    the script run as ``python SCRIPT`` runs it — outside click, with none of the command
    line's signal handlers, and left to the interpreter to exit as it does."""
    try:
        cli(prog_name="gpudiag")
    except SystemExit as exc:
        if exc.code not in (0, None) or not _PLANNED:
            raise
    from gpudiag.hang.runner import run_script

    run_script(*_PLANNED.pop())
