"""``gpudiag topology`` and ``gpudiag env``: what the machine is."""

from __future__ import annotations

import sys

import click

from gpudiag.cli.group import cli
from gpudiag.cli.options import format_option, machine_option


@cli.command()
@click.option(
    "--from-file",
    "from_file",
    metavar="PATH|-",
    help="Read an `nvidia-smi topo -m` capture (may be followed by `topo -p2p rw`); - is stdin.",
)
@machine_option(
    "machine", "Read a machine file (as --save-machine writes) or a capture; bundled examples by name."
)
@click.option(
    "--save-machine",
    metavar="FILE",
    help="Also write what was read as a machine file.",
)
@click.option("--force", is_flag=True, help="Overwrite an existing --save-machine file.")
@format_option(("text", "json", "markdown", "dot"))
def topology(
    from_file: str | None, machine: str | None, save_machine: str | None, force: bool, fmt: str
) -> None:
    """Show which GPUs are joined by NVLink or PCIe, P2P status, and how to group them.

    Reads live NVML unless --from-file or --machine is given. GPU numbers are
    nvidia-smi's (PCI bus order).
    """
    from gpudiag.hw.machine import save_machine as write_machine
    from gpudiag.hw.sources import read_topology
    from gpudiag.render import render
    from gpudiag.topology.analysis import analyze

    topo = read_topology(from_file=from_file, machine=machine)
    if save_machine:
        write_machine(topo, save_machine, force=force)
    render("topology", analyze(topo), fmt, sys.stdout)


@cli.command()
@click.option(
    "--anonymize", is_flag=True, help="Also mask host names, IP addresses, user names, MASTER_ADDR."
)
@format_option(("text", "json", "markdown"))
def env(anonymize: bool, fmt: str) -> None:
    """What maintainers ask for: versions, GPUs and their numbering, topology, NCCL settings.

    Everything `python -m torch.utils.collect_env` reports plus topology, the torch/NVML/PCI
    mapping, NCCL/TORCH/CUDA variables and config files, TF32/determinism flags and the
    IOMMU. Secrets are replaced by a marker; anything that cannot be read says why.
    """
    from gpudiag.checks.env import collect_env
    from gpudiag.redact import Redactor
    from gpudiag.render import render

    render("env", collect_env(redactor=Redactor(anonymize=anonymize)), fmt, sys.stdout)
