"""The commands that train or copy through the runtime: ``gradcheck``, ``nancheck``,
``peer``, ``bench``."""

from __future__ import annotations

import sys
from typing import Any

import click

from gpudiag import defaults as D
from gpudiag.checks.options import BenchOptions, GradcheckOptions, NancheckOptions
from gpudiag.cli.group import cli
from gpudiag.cli.options import (
    check_trace,
    data_source,
    declared_options,
    device_list,
    format_option,
    gpu_counts,
    inject_option,
    input_options,
    input_shape_option,
    machine_option,
    output_key,
    pairs_option,
    runtime_options,
)


@cli.command()
@click.option(
    "--model",
    "model",
    required=True,
    metavar="SPEC",
    help="torchvision:NAME[?k=v], path/file.py:factory, package.module:factory, or a built-in "
    "(mlp, mlp-dropout, mlp-unused, cnn, cnn-bn).",
)
@input_shape_option()
@input_options
@click.option(
    "--inputs",
    "inputs_file",
    metavar="FILE",
    help="The batch from a file torch.save wrote (a tensor, tuple or dict of tensors; read with "
    "weights_only): for models no generated input fits. Targets are generated.",
)
@click.option(
    "--num-classes",
    default=D.NUM_CLASSES,
    show_default=True,
    type=click.IntRange(1),
    help="Classes for ce losses.",
)
@click.option(
    "--batch-size", default=D.BATCH_SIZE, show_default=True, type=click.IntRange(1), help="Global batch size."
)
@declared_options(
    GradcheckOptions, "loss", "strategies", "world_size", "steps", "lr", "optimizer", "dtype", "mode"
)
@click.option(
    "--model-output",
    "output",
    default=None,
    callback=output_key,
    metavar="KEY",
    help="The part of the model's output the loss takes: an index into a tuple, or a dict key / "
    "attribute (default: the tensor, .logits, 'out', or a tuple's first element).",
)
@click.option(
    "--output",
    "old_output",
    default=None,
    callback=output_key,
    hidden=True,
    help="Deprecated spelling of --model-output (-o/--output is an output file or folder elsewhere).",
)
@declared_options(GradcheckOptions, "seed")
@click.option(
    "--sync-batchnorm",
    is_flag=True,
    help="Convert BatchNorm to SyncBatchNorm under ddp (CUDA only; on CPU the run says it skipped it).",
)
@runtime_options
@click.option(
    "--strict", is_flag=True, help="Exit 1 when differences are explained, not only when they fail."
)
@format_option(("text", "json", "markdown"))
@click.pass_context
def gradcheck(ctx: click.Context, strict: bool, fmt: str, trace: str | None, **options: Any) -> None:
    """Do single-GPU, DataParallel and DDP compute the same gradients? If not, why?

    Exit 0 for pass or explained (1 with --strict), 1 for fail.
    """
    old = options.pop("old_output")
    if old is not None:
        if options["output"] is not None:
            raise click.UsageError("--output is the old spelling of --model-output: give one")
        click.echo("gpudiag: note: --output KEY is now --model-output KEY (--output still works)", err=True)
        options["output"] = old
    from gpudiag.gcpause import paused
    from gpudiag.progress import shown

    with paused(freeze=True):  # (imports torch: see gpudiag.gcpause)
        from gpudiag.checks.gradcheck import gradcheck_spec

    check_trace(trace)
    with shown():
        report = gradcheck_spec(**options)
    from gpudiag.render import render
    from gpudiag.runtime.record import write_trace

    if trace:
        write_trace(trace, report.recorders, force=True)
    render("gradcheck", report, fmt, sys.stdout)
    ctx.exit(report.exit_code(strict))


@cli.command()
@pairs_option("GPU pairs to train on.")
@declared_options(NancheckOptions, "strategy", "steps")
@click.option("--model", default="mlp", show_default=True, metavar="SPEC", help="As for gradcheck.")
@input_shape_option()
@input_options
@click.option(
    "--inputs",
    "inputs_file",
    metavar="FILE",
    help="The batch from a file torch.save wrote, as for gradcheck (targets are generated).",
)
@click.option("--num-classes", default=D.NUM_CLASSES, show_default=True, type=click.IntRange(1))
@click.option("--batch-size", default=D.BATCH_SIZE, show_default=True, type=click.IntRange(1))
@declared_options(NancheckOptions, "loss", "lr", "seed")
@machine_option("machine_file")
@runtime_options
@format_option(("text", "json", "markdown"))
@click.pass_context
def nancheck(ctx: click.Context, fmt: str, trace: str | None, **options: Any) -> None:
    """Find the GPU pair, the link and the step where training goes NaN.

    Trains on every GPU alone and on every pair, and names a link-corruption, a
    device-fault, a numeric-divergence or a loss-explosion. Exit 0 pass, 1 fail.
    """
    from gpudiag.gcpause import paused
    from gpudiag.progress import shown

    with paused(freeze=True):  # (imports torch: see gpudiag.gcpause)
        from gpudiag.checks.nancheck import nancheck_spec
    from gpudiag.render import render
    from gpudiag.runtime.record import write_trace

    check_trace(trace)
    options["inject"] = tuple(options["inject"])
    with shown():
        report = nancheck_spec(**options)
    if trace:
        write_trace(trace, report.recorders, force=True)
    render("nancheck", report, fmt, sys.stdout)
    ctx.exit(report.exit_code())


@cli.command()
@pairs_option("GPU pairs to copy between.")
@click.option(
    "--sizes", metavar="4K,1M,…", help="Copy sizes (default 4K..256M on GPUs, 4K..1M on virtual devices)."
)
@machine_option("machine_file")
@inject_option("Break copies and collectives: SRC->DST:KIND[@STEP][xCOUNT] (repeatable).")
@format_option(("text", "json", "markdown"))
@click.pass_context
def peer(
    ctx: click.Context,
    pairs: str,
    sizes: str | None,
    machine_file: str | None,
    inject: tuple[str, ...],
    fmt: str,
) -> None:
    """Prove each GPU pair's peer-to-peer path: verified copies, bandwidth, exact all-reduce, host facts.

    Exit 0 when nothing is broken, 1 when a copy or collective is wrong or hangs, 3 when
    there are not two GPUs to test (the host probes still run and are shown). With
    --machine the result is simulated on CPU virtual devices.
    """
    from gpudiag.gcpause import paused

    with paused(freeze=True):  # (imports torch: see gpudiag.gcpause)
        from gpudiag.checks.peer import peer as run_peer
    from gpudiag.hw.sources import read_machine_or_capture
    from gpudiag.parsers import parse_sizes
    from gpudiag.render import render

    machine = read_machine_or_capture(machine_file) if machine_file else None
    report = run_peer(
        machine=machine,
        pairs=pairs,
        sizes=parse_sizes(sizes) if sizes else None,
        inject=inject,
        machine_source=machine_file,
    )
    render("peer", report, fmt, sys.stdout)
    ctx.exit(report.exit_code())


@cli.command()
@click.option("--model", metavar="SPEC", help="As for gradcheck (required unless --compare).")
@input_shape_option()
@input_options
@click.option("--num-classes", default=D.NUM_CLASSES, show_default=True, type=click.IntRange(1))
@declared_options(BenchOptions, "batch_size")
@click.option(
    "--per-gpu/--global",
    "per_gpu",
    default=True,
    show_default=True,
    help="--batch-size per GPU (the global batch grows with the GPUs) or in total (split over them).",
)
@declared_options(BenchOptions, "strategies")
@click.option(
    "--gpus",
    default=None,
    callback=gpu_counts,
    metavar="N,…",
    help="GPU counts for dp/ddp (default: 2,4,8 up to what there is).",
)
@declared_options(BenchOptions, "dtypes")
@click.option(
    "--data",
    default="synthetic",
    show_default=True,
    callback=data_source,
    metavar="synthetic|loader[:WORKERS]",
    help="Synthetic tensors on the device, or a real DataLoader with WORKERS worker processes (default 2).",
)
@click.option(
    "--devices",
    default=None,
    callback=device_list,
    metavar="ID,…",
    help="The GPUs to run on (torch indices; a machine's GPU numbers); the first N for N GPUs. "
    "Default: the best-connected GPUs of a --machine, else the first.",
)
@declared_options(BenchOptions, "epoch_samples", "steps", "warmup")
@machine_option("machine")
@declared_options(BenchOptions, "timeout")
@click.option(
    "-o",
    "--output",
    "output",
    metavar="FILE",
    help="Also write the result as JSON (gpudiag.bench/1) to FILE.",
)
@click.option("--force", is_flag=True, help="Replace an existing -o FILE.")
@click.option("--compare", nargs=2, metavar="BEFORE AFTER", help="Compare two -o files instead of measuring.")
@format_option(("text", "json", "markdown"))
@click.pass_context
def bench(
    ctx: click.Context,
    fmt: str,
    output: str | None,
    force: bool,
    compare: tuple[str, str] | None,
    per_gpu: bool,
    **options: Any,
) -> None:
    """Measure samples/s, step time and phases of single, DataParallel and DDP, and say why
    one is slower than it should be. On CPU virtual devices the figures are simulated.

    Exit 0 measured (findings are warnings), 1 a case failed, 2 bad input.
    """
    from gpudiag.render import render

    if output == "":
        raise click.UsageError("-o needs a file name")
    if compare:
        if options["model"] or output:
            raise click.UsageError("--compare reads two results: it takes no --model and no -o")
        from gpudiag.checks.bench import compare_files

        render("bench", compare_files(*compare), fmt, sys.stdout)
        return
    if not options["model"]:
        raise click.UsageError("--model is required (or --compare BEFORE AFTER)")
    from gpudiag.render import first_rank

    # Under torchrun every process measures; the ranks' figures are gathered and rank 0 speaks.
    # Every rank checks -o first, so a bad one stops them all alike, before any rendezvous.
    speaks = first_rank()
    if output:
        from gpudiag.fileio import check_target

        check_target(output, force=force)
    from gpudiag.gcpause import paused
    from gpudiag.progress import shown

    with paused(freeze=True):  # (imports torch: see gpudiag.gcpause)
        from gpudiag.checks.bench import bench as run_bench

    with shown():
        result = run_bench(options.pop("model"), convention="per_gpu" if per_gpu else "global", **options)
    if not speaks:
        ctx.exit(result.exit_code())
    if output:
        import json

        from gpudiag.fileio import atomic_write

        atomic_write(output, json.dumps(result.to_json(), indent=2) + "\n", force=force)
    render("bench", result, fmt, sys.stdout)
    ctx.exit(result.exit_code())


@cli.command(
    "watch",
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    add_help_option=False,
)
@click.pass_context
def watch_command(ctx: click.Context) -> None:
    """Not a command: gpudiag.watch(model) goes in your training script (docs/watch.md)."""
    click.echo(
        "gpudiag: error: watch is not a command but a Python call in your training script:\n"
        "    import gpudiag\n"
        "    model = gpudiag.watch(model)   # names the rank, module, step and phase of the first NaN/Inf\n"
        "see docs/watch.md; for a job that hangs: torchrun ... -m gpudiag run --stall 300 train.py",
        err=True,
    )
    ctx.exit(2)
