"""``gpudiag sweep``: every node of a cluster checked in one torchrun job (docs/sweep.md)."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from gpudiag.cli.group import cli
from gpudiag.cli.options import (
    ChecksOption,
    FiniteFloatRange,
    check_names,
    format_option,
    inject_option,
    machine_option,
)


def _render(verdict: Any, records: Any, run: Any, fmt: str) -> None:
    from gpudiag.render import first_rank
    from gpudiag.repro.sweep.results import summary_markdown, summary_text

    if not first_rank():
        return
    if fmt == "json":
        sys.stdout.write(json.dumps(verdict.to_json(), indent=2) + "\n")
    elif fmt == "markdown":
        sys.stdout.write(summary_markdown(verdict, records, run))
    else:
        sys.stdout.write(summary_text(verdict))


#: What ``--summary`` honours (it judges a folder again); every other option is the run's.
SUMMARY_OPTIONS = frozenset({"summary", "rules", "baseline", "expect_hosts", "fmt"})


def _refuse_run_options(ctx: click.Context) -> None:
    """``--summary`` with an option only a run uses (``--quick``, ``--machine``, ``-o``…):
    exit 2 naming it, rather than ignore it silently."""
    from click.core import ParameterSource

    from gpudiag.errors import InputError

    for param in ctx.command.params:
        if param.name in SUMMARY_OPTIONS or param.name is None:
            continue
        if ctx.get_parameter_source(param.name) not in (None, ParameterSource.DEFAULT):
            flag = max(param.opts, key=len)
            raise InputError(
                f"{flag} does not apply to --summary, which judges a sweep folder again and runs nothing "
                "(it takes --rules, --baseline, --expect-hosts, --format)"
            )


@cli.command()
@click.option(
    "-o",
    "--output",
    default="sweep",
    show_default=True,
    metavar="FOLDER",
    help="Where rank 0 writes the results.",
)
@click.option("--force", is_flag=True, help="Replace an earlier sweep folder at FOLDER.")
@click.option(
    "--summary",
    "summary",
    metavar="FOLDER",
    help="Judge a sweep folder (or results.jsonl) again; run nothing.",
)
@click.option(
    "--expect-hosts",
    metavar="LIST",
    help="Hosts that must answer: node0,node1 or node[01-16] (default: Slurm's SLURM_JOB_NODELIST).",
)
@click.option(
    "--rules",
    metavar="FILE",
    help="Rules file (JSON) with the thresholds; the defaults are in every sweep's rules.json.",
)
@click.option("--baseline", metavar="FILE", help="Expected figures per machine type (JSON).")
@click.option(
    "--quick",
    is_flag=True,
    help="Small checks and messages, short deadlines: aims at 60 s a node (Slurm prolog).",
)
@click.option(
    "--checks",
    cls=ChecksOption,
    callback=check_names,
    metavar="LIST",
    help="The node's own checks, of {checks} (default: env, topology, peer, nancheck).",
)
@machine_option(
    "machine", "This node's machine file or capture: its checks run on CPU virtual devices laid out like it."
)
@click.option(
    "--backend",
    type=click.Choice(["auto", "gloo", "nccl"]),
    default="auto",
    show_default=True,
    help="Between nodes: nccl with GPUs, gloo on CPUs.",
)
@click.option(
    "--timeout",
    type=FiniteFloatRange(min=0, min_open=True),
    metavar="SECONDS",
    help="Deadline per phase and collective (default 300, 45 with --quick).",
)
@click.option(
    "--size-mib",
    type=FiniteFloatRange(min=0, min_open=True),
    metavar="MIB",
    help="All-reduce size of the bandwidth tests (default 64, 1 with --quick).",
)
@click.option(
    "--iters",
    type=click.IntRange(min=1),
    help="Timed all-reduces per bandwidth test (default 10, 3 with --quick).",
)
@click.option(
    "--anonymize",
    is_flag=True,
    help="Also mask host names, IPs and user names in the node bundles and in every value of the "
    "results (paths in NCCL_* variables, the command); each node's own host name still names it.",
)
@inject_option(
    "Rehearse a fault on this node: SRC->DST:KIND (GPUs in its own checks, node numbers between "
    "nodes; it corrupts what this node receives)."
)
@click.option(
    "--inject-delay",
    "delay",
    type=FiniteFloatRange(min=0),
    default=0.0,
    metavar="SECONDS",
    help="Rehearse a slow node: wait this long before each of its transfers.",
)
@click.option(
    "--inject-stall",
    "stall",
    metavar="COLLECTIVE",
    help="Rehearse a hang: this node never enters COLLECTIVE (e.g. allreduce-all).",
)
@format_option(("text", "json", "markdown"))
@click.pass_context
def sweep(ctx: click.Context, summary: str | None, fmt: str, **options: Any) -> None:
    """Check every node of a cluster in one torchrun job and name the bad node.

    Run on every node: torchrun --nnodes N --nproc-per-node 1 ... -m gpudiag sweep -o sweep/.
    Each node runs its own checks; then the nodes all-reduce together and test links in
    pairs; rank 0 writes sweep/results.jsonl, SUMMARY.md and each node's bundle. Exit 0
    when every node is healthy, 1 for a problem or a missing node.
    """
    if summary is not None:
        _refuse_run_options(ctx)
        from gpudiag.repro.sweep.run import rejudge

        verdict, data = rejudge(
            summary,
            rules=options["rules"],
            baseline=options["baseline"],
            expect_hosts=options["expect_hosts"],
        )
        from gpudiag.gcpause import paused

        with paused():
            _render(verdict, data.records, data.run, fmt)
        ctx.exit(verdict.exit_code)
    from gpudiag.repro.sweep.run import LOCAL_CHECKS, SweepOptions
    from gpudiag.repro.sweep.run import sweep as run_sweep

    options["checks"] = tuple(options["checks"] or LOCAL_CHECKS)
    options["inject"] = tuple(options["inject"])
    result = run_sweep(SweepOptions(**options, argv=["gpudiag", "sweep", *sys.argv[2:]]))
    if result.verdict is not None:
        _render(result.verdict, result.records, result.run, fmt)
    ctx.exit(result.exit_code)
