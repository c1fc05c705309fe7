"""gpudiag's own checks as registry entries: env, topology, peer, gradcheck, nancheck — a
planner, a runner and the lines of the suite's table each (the checks themselves live in
their own modules, imported when they run). Importing this module registers them, in the
order the suite runs them: cheapest and most basic first."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpudiag import defaults as D
from gpudiag.checks import registry
from gpudiag.checks.options import GradcheckOptions, NancheckOptions, suite_defaults
from gpudiag.checks.registry import MACHINE_FILE, Check, Here, Request
from gpudiag.errors import CannotRunHere
from gpudiag.findings import Finding
from gpudiag.result import CheckResult
from gpudiag.runtime.faults import can_fire

#: What the suite runs when nobody says otherwise: small, quick, and telling.
_BATCH = {
    "model": "mlp",
    "input_shape": list(D.INPUT_SHAPE),
    "num_classes": D.NUM_CLASSES,
    "batch_size": D.BATCH_SIZE,
}
DEFAULT_GRADCHECK = {
    **_BATCH,
    **suite_defaults(
        GradcheckOptions,
        ("loss", "strategies", "world_size", "steps", "lr", "optimizer", "dtype", "mode", "seed"),
    ),
    "inject": [],
}
DEFAULT_NANCHECK = {
    **_BATCH,
    "pairs": "all",
    **suite_defaults(NancheckOptions, ("strategy", "steps", "lr", "seed")),
    "inject": [],
}


def _machine(config: Mapping[str, Any], here: Here) -> Any:
    """The machine a configuration's ``machine`` field names (None: the real one)."""
    if config.get("machine") is None:
        return None
    if here.machine is None:
        raise CannotRunHere(
            "this check ran on virtual devices laid out like a machine file, and none was given"
        )
    return here.machine


def _plan_env(here: Here, request: Request) -> tuple[dict[str, Any] | None, str]:
    return {}, ""


def _run_env(config: dict[str, Any], here: Here) -> CheckResult:
    from gpudiag.checks.env import collect_env

    report: CheckResult = collect_env(live_topology=here.machine is None)
    return report


def _env_headline(report: Any) -> str:
    versions = report.sections.get("versions", {})
    summary = f"torch {versions.get('torch')}, CUDA {versions.get('cuda_runtime') or 'none'}"
    summary += f", NCCL {versions.get('nccl_runtime') or 'none'}"
    return summary + f"; {len(report.missing)} item(s) could not be collected"


def _plan_topology(here: Here, request: Request) -> tuple[dict[str, Any] | None, str]:
    if here.machine is not None:
        return {"machine": MACHINE_FILE}, ""
    if here.nvml is None:
        return {"source": "nvml"}, ""
    return None, "NVML is not available here; diagnose a machine from its capture: --machine topo.txt"


def _run_topology(config: dict[str, Any], here: Here) -> CheckResult:
    from gpudiag.hw.sources import read_topology
    from gpudiag.topology.analysis import analyze

    report: CheckResult = analyze(_machine(config, here) if config.get("machine") else read_topology())
    return report


def _topology_headline(report: Any) -> str:
    topo = report.topology
    return f"{len(topo.gpu_labels)} GPU(s) from {topo.source}; {len(report.pairs)} pair(s), no warnings"


def _plan_peer(here: Here, request: Request) -> tuple[dict[str, Any] | None, str]:
    machine = MACHINE_FILE if here.machine is not None else None
    return {"machine": machine, "pairs": request.pairs, "inject": list(request.inject)}, ""


def _run_peer(config: dict[str, Any], here: Here) -> CheckResult:
    from gpudiag.checks.peer import peer
    from gpudiag.parsers import parse_sizes

    sizes = config.get("sizes")
    report: CheckResult = peer(
        machine=_machine(config, here),
        pairs=config.get("pairs", "all"),
        sizes=parse_sizes(sizes) if sizes else None,
        inject=tuple(config.get("inject", ())),
        machine_source=here.machine_source,
    )
    return report


def _peer_status(report: Any) -> str:
    """skipped (no pair to test here: the host probes' findings still count), fail, or
    warning/pass by the findings."""
    if report.verdict in ("skipped", "fail"):
        return str(report.verdict)
    return "warning" if _warns(report.findings) else "pass"


def _peer_headline(report: Any) -> str:
    if report.verdict == "skipped":
        return str(report.reason)
    return f"{len(report.pairs)} direction(s) verified on " + (
        "CPU virtual devices, not the GPUs" if report.simulated else f"{report.devices} devices"
    )


def _peer_skipped(report: Any) -> list[str]:
    return (
        [s for s in report.skipped if s != report.reason]
        if report.verdict == "skipped"
        else list(report.skipped)
    )


def _plan_gradcheck(here: Here, request: Request) -> tuple[dict[str, Any] | None, str]:
    config = {**DEFAULT_GRADCHECK, **request.inputs}
    ranks = [tuple(range(config["world_size"]))]  # (faults meant for another check stay out)
    config["inject"] = [s for s in request.inject if can_fire(s, ranks, config["steps"])]
    if request.model:
        config["model"] = request.model
    return config, ""


def _run_gradcheck(config: dict[str, Any], here: Here) -> CheckResult:
    from gpudiag.checks.gradcheck import gradcheck_spec

    options = dict(config)
    options["input_shape"] = tuple(options.get("input_shape", D.INPUT_SHAPE))
    options["strategies"] = tuple(options.get("strategies", ("single", "dp", "ddp")))
    options["inject"] = tuple(options.get("inject", ()))
    report: CheckResult = gradcheck_spec(**options)
    return report


def _gradcheck_headline(report: Any) -> str:
    if report.verdict == "explained":
        return "differences, all explained: " + ", ".join(
            f.code for f in report.findings if f.severity == "warning"
        )
    others = ", ".join(s for s in report.config["strategies"] if s != "single")
    headline = f"{others} agree with single (tolerance {report.tolerance['rel_norm_err']:.3g})"
    return headline + (" on CPU virtual devices" if report.simulated else "")


def _gradcheck_skipped(report: Any) -> list[str]:
    return [f.message for f in report.findings if f.code == "syncbn-skipped"]


def _plan_nancheck(here: Here, request: Request) -> tuple[dict[str, Any] | None, str]:
    virtual = here.machine is not None
    if not virtual and here.cuda_gpus < 1:
        return None, "no CUDA GPU here; train on virtual devices laid out like a machine: --machine topo.txt"
    config = {**DEFAULT_NANCHECK, **request.inputs, "machine": MACHINE_FILE if virtual else None}
    config.update({"inject": list(request.inject), "pairs": request.pairs})
    if request.model:
        config["model"] = request.model
    return config, ""


def _run_nancheck(config: dict[str, Any], here: Here) -> CheckResult:
    from gpudiag.checks.nancheck import nancheck_spec

    machine = _machine(config, here)
    if machine is None and here.cuda_gpus < 1:
        raise CannotRunHere("no CUDA GPU here (nancheck can run on virtual devices with --machine)")
    options = {k: v for k, v in config.items() if k != "machine"}
    options["input_shape"] = tuple(options.get("input_shape", D.INPUT_SHAPE))
    options["inject"] = tuple(options.get("inject", ()))
    report = nancheck_spec(machine=machine, **options)
    report.config["machine"] = config.get("machine")
    report.machine_source = here.machine_source
    result: CheckResult = report
    return result


def _nancheck_headline(report: Any) -> str:
    headline = f"{len(report.singles)} GPU(s) alone and {len(report.pairs)} pair(s) train without NaN"
    return headline + (" on CPU virtual devices, not the GPUs" if report.simulated else "")


def _plan_transport(here: Here, request: Request) -> tuple[dict[str, Any] | None, str]:
    logs = sorted(name for name in here.files if name.startswith("nccl/"))
    if logs:  # (report --nccl-log: the logs as the bundle holds them, on the machine's topology)
        return {"from_log": logs, "machine": MACHINE_FILE if here.machine is not None else None}, ""
    if here.machine is None and here.cuda_gpus >= 2:
        return {}, ""
    why = "fewer than 2 CUDA GPUs here" if here.machine is None else "a machine file cannot run NCCL"
    return None, f"{why}; read a saved NCCL_DEBUG=INFO log: gpudiag transport --from-log FILE"


def _run_transport(config: dict[str, Any], here: Here) -> CheckResult:
    from gpudiag.transport.live import live_report
    from gpudiag.transport.run import refuse_live

    if config.get("from_log"):
        return _transport_from_bundle(config, here)
    refuse_live(here.cuda_gpus)
    report: CheckResult = live_report(None, here.cuda_gpus)
    return report


#: Where a report bundle keeps the topology a live transport run was judged on
#: (gpudiag.transport.bundled.MACHINE).
NCCL_MACHINE = "nccl/machine.json"


def _transport_from_bundle(config: dict[str, Any], here: Here) -> CheckResult:
    """The logs a bundle holds (``nccl/…``) read again, on the bundle's machine if it had one."""
    from gpudiag.errors import InputError
    from gpudiag.transport.analysis import analyze
    from gpudiag.transport.reader import read_log

    wanted = [*config["from_log"], *([NCCL_MACHINE] if config.get("machine") == NCCL_MACHINE else [])]
    missing = [name for name in wanted if name not in here.files]
    if missing:
        raise InputError(f"{missing[0]}, which the transport check read, is not in the bundle")
    texts = [(here.files[name].decode("utf-8", "replace"), name) for name in config["from_log"]]
    if config.get("machine") == NCCL_MACHINE:  # (the NVML topology of a live run, bundled)
        import json

        from gpudiag.hw.machine import from_json

        try:
            topology = from_json(json.loads(here.files[NCCL_MACHINE]), NCCL_MACHINE)
        except (ValueError, TypeError, KeyError, AttributeError, IndexError) as exc:
            raise InputError(f"{NCCL_MACHINE} is damaged ({type(exc).__name__}: {exc})") from None
    else:
        topology = _machine(config, here)
    report = analyze(read_log(texts), topology)
    report.nccl_logs = [(name, text) for text, name in texts]
    result: CheckResult = report
    return result


def _transport_headline(report: Any) -> str:
    families = sorted({pair.transport for pair in report.pairs})
    unjudged = (
        " (some not judged: they need the topology, --machine)" if report.verdict == "needs-topology" else ""
    )
    return (
        f"{len(report.pairs)} pair(s) read from NCCL's log"
        + (f": {', '.join(families)}" if families else "")
        + unjudged
    )


def _transport_status(report: Any) -> str:
    """fail (a slower path or an NCCL error), warning (pairs only a topology can judge:
    no all-clear), or pass."""
    if report.verdict == "slow-path":
        return "fail"
    return "warning" if report.verdict == "needs-topology" or _warns(report.findings) else "pass"


def _plan_hang(here: Here, request: Request) -> tuple[dict[str, Any] | None, str]:
    from gpudiag.hang.bundled import FOLDER, dump_names, world_size

    if not dump_names(here.files):
        return None, (
            "needs the job's flight-recorder dumps: gpudiag report --hang DIR, or gpudiag hang PATH… "
            "(run the job under `torchrun … -m gpudiag run SCRIPT`, which writes them when a "
            "collective stalls)"
        )
    config: dict[str, Any] = {"dumps": FOLDER}
    world = world_size(here.files)
    if world is not None:
        config["world_size"] = world
    return config, ""


def _run_hang(config: dict[str, Any], here: Here) -> CheckResult:
    from gpudiag.hang.bundled import judge_files

    result: CheckResult = judge_files(here.files, config.get("world_size"), config["dumps"])
    return result


def _compare_hang(there: dict[str, Any], here: dict[str, Any]) -> list[str]:
    """The verdict's fields that differ (the rank, the collective, who is stuck or missing)."""
    keys = ("verdict", "culprit_ranks", "stuck_ranks", "missing_ranks", "collective", "lines")
    return [f"{k}: {there.get(k)!r} there, {here.get(k)!r} here" for k in keys if there.get(k) != here.get(k)]


def _warns(findings: list[Finding]) -> bool:
    return any(f.severity == "warning" for f in findings)


def _fields(name: str) -> Any:
    def fields() -> Any:
        from gpudiag.checks.fields import config_fields

        return config_fields()[name]

    return fields


def _compare(name: str) -> Any:
    def compare(there: dict[str, Any], here: dict[str, Any]) -> list[str]:
        from gpudiag.checks import compare_results

        return compare_results.NUMBERS[name](there, here)

    return compare


# The order of registration is the order the suite runs them: cheapest and most basic first.
registry.register(
    Check(
        "env",
        "versions, GPU numbering, NCCL settings, IOMMU",
        _plan_env,
        _run_env,
        _env_headline,
        config_fields=_fields("env"),
    )
)
registry.register(
    Check(
        "topology",
        "how the GPUs are connected",
        _plan_topology,
        _run_topology,
        _topology_headline,
        formats=("text", "json", "markdown", "dot"),
        config_fields=_fields("topology"),
        compare=_compare("topology"),
    )
)
registry.register(
    Check(
        "peer",
        "peer-to-peer copies and all-reduce per GPU pair",
        _plan_peer,
        _run_peer,
        _peer_headline,
        status=_peer_status,
        skipped=_peer_skipped,
        config_fields=_fields("peer"),
        compare=_compare("peer"),
    )
)
registry.register(
    Check(
        "gradcheck",
        "single, DataParallel and DDP gradients compared",
        _plan_gradcheck,
        _run_gradcheck,
        _gradcheck_headline,
        skipped=_gradcheck_skipped,
        config_fields=_fields("gradcheck"),
        required=("model",),
        compare=_compare("gradcheck"),
    )
)
registry.register(
    Check(
        "nancheck",
        "the GPU pair or link where training goes NaN",
        _plan_nancheck,
        _run_nancheck,
        _nancheck_headline,
        config_fields=_fields("nancheck"),
        compare=_compare("nancheck"),
    )
)
registry.register(
    Check(
        "transport",
        "the path NCCL chose for every GPU pair (P2P, SHM, NET) and whether it should have",
        _plan_transport,
        _run_transport,
        _transport_headline,
        status=_transport_status,
        config_fields=_fields("transport"),
        compare=_compare("transport"),
    )
)
registry.register(
    Check(
        "hang",
        "which rank hangs the job, in which collective, at which line (from flight-recorder dumps)",
        _plan_hang,
        _run_hang,
        lambda result: str(result.summary),
        config_fields=_fields("hang"),
        required=("dumps",),
        compare=_compare_hang,
        # its input is a hang folder (gpudiag report --hang DIR), bundled under hang/
        in_suite=False,
    )
)
