"""``gpudiag transport``: which path NCCL chose for every GPU pair, and whether it should have."""

from __future__ import annotations

import sys

import click

from gpudiag.cli.group import cli
from gpudiag.cli.options import format_option, machine_option


@cli.command()
@click.option(
    "--from-log",
    "from_log",
    multiple=True,
    metavar="FILE|-",
    help="Read a saved NCCL_DEBUG=INFO log (repeatable: one file per rank or node); - is stdin.",
)
@machine_option("machine", "Put beside each pair what this capture or machine file says the GPUs offer.")
@format_option(("text", "json", "markdown"))
@click.pass_context
def transport(ctx: click.Context, from_log: tuple[str, ...], machine: str | None, fmt: str) -> None:
    """Which transport NCCL used for each GPU pair (P2P, SHM, NET) and whether it should have.

    Exit 1 when a pair took a slower path than the log and the topology show it could.
    Without --from-log it runs NCCL on this machine's GPUs (two or more needed).
    """
    from gpudiag.render import render
    from gpudiag.transport.run import refuse_live, transport_report

    if not from_log:
        from gpudiag.hw.cuda import cuda_device_count
        from gpudiag.transport.live import live_report

        gpus = cuda_device_count()
        refuse_live(gpus)
        result = live_report(machine, gpus)
    else:
        result = transport_report(list(from_log), machine)
    render("transport", result, fmt, sys.stdout)
    ctx.exit(result.exit_code())
