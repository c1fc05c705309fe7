"""``gpudiag env``: everything a PyTorch or NCCL maintainer asks for, in one place.

What ``python -m torch.utils.collect_env`` reports (its collectors are reused, fed through
our :class:`~gpudiag.hw.host.Runner` so every command has a timeout) plus what it does not
know: the GPUs with the torch ↔ nvidia-smi ↔ PCI mapping, the NCCL runtime version, the
topology, ``CUDA_VISIBLE_DEVICES``/``CUDA_DEVICE_ORDER``, every ``NCCL_*``/``TORCH_*``/
``CUDA_*`` variable, ``/etc/nccl.conf`` and ``~/.nccl.conf``, determinism and TF32 flags,
the IOMMU state and ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``.

Each collector runs on its own and never fails the command: what it could not read is
listed under ``missing`` with the reason ("could not collect"). Every value passes through a
:class:`~gpudiag.redact.Redactor` before it is returned.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpudiag import __version__
from gpudiag.findings import Finding
from gpudiag.hw.host import HostFacts, Runner
from gpudiag.hw.host import collect as collect_host
from gpudiag.redact import Redactor, flagged_settings

SCHEMA = "gpudiag.env/1"
#: Variables shown in full (after redaction): the ones that change how CUDA, NCCL and torch behave.
VARIABLE_PREFIXES = ("NCCL_", "TORCH_", "CUDA_", "PYTORCH_", "CUBLAS_", "CUDNN_")
#: Launcher variables that say how the ranks were started (their values may be anonymized).
LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "OMP_NUM_THREADS")
#: Installed distributions worth listing (collect_env's pip filter, plus the NVML binding
#: and the NCCL wheel that decides which libnccl torch loads).
PACKAGES = re.compile(
    r"^(torch|torchvision|torchaudio|numpy|triton|nvidia-.*|pytorch-lightning|lightning|accelerate|"
    r"deepspeed|transformers|safetensors|apex|onnx.*|mypy|gpudiag)$",
    re.IGNORECASE,
)


@dataclass
class EnvReport:
    """``sections``: name → {field: value}; ``missing``: collector → why it could not collect."""

    sections: dict[str, dict[str, Any]]
    missing: dict[str, str] = field(default_factory=dict)
    host: HostFacts | None = None  # raw probes, for peer's conclusions

    def __repr__(self) -> str:
        return f"<EnvReport sections {len(self.sections)} · not collected {len(self.missing)}>"

    @property
    def findings(self) -> list[Finding]:
        """``weights-only-load-off`` when ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` is set."""
        warning = self.sections.get("security", {}).get("warning")
        if not warning:
            return []
        return [
            Finding("weights-only-load-off", "warning", warning, {"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "set"})
        ]

    @property
    def verdict(self) -> str:
        """``warning`` when a finding was drawn, else ``pass``."""
        return "warning" if self.findings else "pass"

    @property
    def simulated(self) -> bool:
        return False

    def exit_code(self) -> int:
        """0: the environment is reported, never judged a failure."""
        return 0

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "sections": self.sections, "missing": self.missing}


class _TorchCollectEnv:
    """``torch.utils.collect_env``'s ``run_lambda`` on top of a :class:`Runner`: its
    commands are fixed shell strings (pipes included), run with our timeout."""

    def __init__(self, runner: Runner):
        self.runner = runner

    def __call__(self, command: str | list[str]) -> tuple[int, str, str]:
        argv = ["sh", "-c", command] if isinstance(command, str) else list(command)
        out = self.runner.run(argv)
        if out.text is None:
            return 1, "", out.reason
        return 0, out.text.strip(), ""


def collect_env(
    runner: Runner | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    redactor: Redactor | None = None,
    home: str | None = None,
    live_topology: bool = True,
) -> EnvReport:
    """Run every collector; never raises. ``environ`` defaults to ``os.environ``."""
    runner = runner or Runner()
    environ = dict(os.environ if environ is None else environ)
    redactor = redactor or Redactor(environ)
    missing: dict[str, str] = {}
    sections: dict[str, dict[str, Any]] = {}

    def section(name: str, collector: Callable[[], dict[str, Any]]) -> None:
        try:
            sections[name] = collector()
        except Exception as exc:  # a collector must never fail the command
            missing[name] = f"could not collect: {type(exc).__name__}: {exc}"

    host = collect_host(runner, environ, home)
    torch_env = _TorchCollectEnv(runner)
    section("versions", lambda: _versions(torch_env, missing))
    section("gpus", lambda: _gpus(environ, missing, live_topology))
    section("visibility", lambda: _visibility(environ))
    section("variables", lambda: _variables(environ, redactor))
    section("nccl_config", lambda: dict(host.nccl_files))
    section("flags", _flags)
    section("iommu", lambda: _iommu(host))
    section("security", lambda: _security(environ))
    section("packages", _packages)
    section("system", lambda: _system(torch_env))
    for probe, reason in host.missing.items():
        missing.setdefault(f"host.{probe}", f"could not collect: {reason}")
    return EnvReport(redactor.data(sections), redactor.data(missing), host)


def _versions(run: _TorchCollectEnv, missing: dict[str, str]) -> dict[str, Any]:
    import torch
    import torch.backends.xnnpack
    import torch.utils.collect_env as ce

    fields: dict[str, Callable[[], Any]] = {
        "gpudiag": lambda: __version__,
        "python": lambda: f"{platform.python_version()} ({sys.maxsize.bit_length() + 1}-bit)",
        "torch": lambda: torch.__version__,
        "torch_debug_build": lambda: torch.version.debug,
        "cuda_used_to_build_torch": lambda: torch.version.cuda,
        "hip_used_to_build_torch": lambda: torch.version.hip,
        "cuda_available": torch.cuda.is_available,
        "cuda_runtime": lambda: ce.get_running_cuda_version(run),
        "nvidia_driver": lambda: ce.get_nvidia_driver_version(run),
        "cudnn": lambda: _cudnn(torch, ce, run),
        "nccl_runtime": lambda: _nccl_runtime(torch),
        "gpu_models": lambda: ce.get_gpu_info(run),
        "cuda_module_loading": lambda: _cuda_module_loading(torch),
        "xnnpack_available": lambda: getattr(torch.backends.xnnpack, "enabled", None),
        "caching_allocator_config": ce.get_cachingallocator_config,
    }
    out: dict[str, Any] = {}
    for key, read in fields.items():  # one field that cannot be read leaves the others
        try:
            out[key] = read()
        except Exception as exc:
            out[key] = None
            missing[f"versions.{key}"] = f"could not collect: {type(exc).__name__}: {exc}"
    tools = {"cuda_runtime": "nvcc", "nvidia_driver": "nvidia-smi", "gpu_models": "nvidia-smi"}
    for key, tool in tools.items():
        if out[key] is None:
            missing.setdefault(f"versions.{key}", f"could not collect: {tool} not found or failed")
    return out


def _cudnn(torch: Any, ce: Any, run: _TorchCollectEnv) -> Any:
    if torch.backends.cudnn.is_available():
        return torch.backends.cudnn.version()
    return ce.get_cudnn_version(run)


def _cuda_module_loading(torch: Any) -> str:
    """``CUDA_MODULE_LOADING`` as CUDA will read it: torch sets ``LAZY`` when it creates
    its CUDA context, unless set. Read from the environment, not through
    ``collect_env.get_cuda_module_loading_config``, which initialises CUDA for it: a parent
    with a CUDA context can no longer fork its ranks (each then starts a fresh interpreter,
    1.5 s more) and holds memory on GPU 0."""
    if not torch.cuda.is_available():
        return "N/A"
    return os.environ.get("CUDA_MODULE_LOADING") or "LAZY (not set; torch's default)"


def _nccl_runtime(torch: Any) -> str | None:
    """The NCCL torch actually loaded (``torch.cuda.nccl.version()``), not the wheel's."""
    if not torch.cuda.is_available():
        return None
    version = torch.cuda.nccl.version()
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _gpus(environ: Mapping[str, str], missing: dict[str, str], live: bool) -> dict[str, Any]:
    """Every GPU NVML sees with its nvidia-smi index, torch index and bus id (UUIDs left out)."""
    if not live:
        return {"source": "not read (a machine file or capture was given)"}
    from gpudiag.hw.machine import to_json as machine_json
    from gpudiag.hw.nvml import NvmlBackend
    from gpudiag.topology.analysis import analyze

    try:
        with NvmlBackend(env=dict(environ)) as backend:
            driver = backend.driver_version()
            topo = backend.topology()
    except Exception as exc:
        missing["gpus"] = f"could not collect: {exc}"
        return {"source": "NVML unavailable"}
    report = analyze(topo)
    return {
        "source": "NVML",
        "driver": driver,
        "count": len(topo.gpus),
        "devices": [
            {
                "nvidia_smi_index": g.index,
                "torch_index": g.torch_index,
                "name": g.name,
                "pci_bus_id": g.pci_bus_id,
                "memory_total_mib": g.memory_total_mib,
                "cpu_affinity": g.cpu_affinity,
                "numa_affinity": g.numa_affinity,
            }
            for g in sorted(topo.gpus.values(), key=lambda g: g.index)
        ],
        "topology": machine_json(topo, "gpudiag env"),
        "topology_warnings": [f.message for f in report.warnings],
    }


def _visibility(environ: Mapping[str, str]) -> dict[str, Any]:
    return {name: environ.get(name) for name in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")}


def _variables(environ: Mapping[str, str], redactor: Redactor) -> dict[str, Any]:
    names = sorted(n for n in environ if n.startswith(VARIABLE_PREFIXES) or n in LAUNCH_VARIABLES)
    return {name: redactor.env_value(name, environ[name]) for name in names}


def _flags() -> dict[str, Any]:
    """Determinism and TF32 switches as this process sees them (torch's defaults unless the
    environment changes them: ``CUBLAS_WORKSPACE_CONFIG``, ``NVIDIA_TF32_OVERRIDE``)."""
    import torch

    def legacy(read: Callable[[], Any]) -> Any:
        # torch raises on its legacy TF32 getters when the per-operator settings disagree
        # (cuDNN conv vs RNN, CUDA vs mkldnn matmul): that is the fact to report
        try:
            return read()
        except RuntimeError:
            return "mixed: the per-operator fp32_precision settings disagree"

    return {
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "tf32_matmul": legacy(lambda: torch.backends.cuda.matmul.allow_tf32),
        "tf32_cudnn": legacy(lambda: torch.backends.cudnn.allow_tf32),
        "float32_matmul_precision": legacy(torch.get_float32_matmul_precision),
    }


def _iommu(host: HostFacts) -> dict[str, Any]:
    return {
        "mode": host.iommu_mode,
        "units": host.iommu_units,
        "kernel_cmdline": host.cmdline,
        "acs_redirect": host.acs_redirect,
        "kernel_log": host.kernel_lines,
    }


def _security(environ: Mapping[str, str]) -> dict[str, Any]:
    flagged = flagged_settings(environ)
    names = ("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    out: dict[str, Any] = {name: flagged.get(name) for name in names}
    if out["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] not in (None, "", "0"):
        out["warning"] = (
            "torch.load unpickles arbitrary objects again (weights_only is off): a checkpoint can run code"
        )
    return out


def _packages() -> dict[str, Any]:
    found = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"] or ""
        if PACKAGES.match(name):
            found[name] = dist.version
    return dict(sorted(found.items(), key=lambda kv: kv[0].lower()))


def _system(run: _TorchCollectEnv) -> dict[str, Any]:
    import torch.utils.collect_env as ce

    return {
        "os": ce.get_os(run),
        "libc": ce.get_libc_version(),
        "python_platform": ce.get_python_platform(),
        "gcc": ce.get_gcc_version(run),
        "clang": ce.get_clang_version(run),
        "cmake": ce.get_cmake_version(run),
        "cpu": ce.get_cpu_info(run),
        "conda_packages": ce.get_conda_packages(run),
    }
