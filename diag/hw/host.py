"""Host facts that explain peer-to-peer failures, read through an injected runner.

Every probe goes through a :class:`Runner` — argv lists (never a shell), a timeout, and no
exceptions: a missing tool, a permission problem or a hang becomes "could not collect" with
the reason, and the command goes on. Tests inject canned outputs of real machines.

- IOMMU: ``/proc/cmdline`` (``intel_iommu=``, ``amd_iommu=``, ``iommu=pt``) and
  ``/sys/class/iommu`` (an entry per active IOMMU unit: ``dmar0``, ``ivhd0``);
- kernel log: ``dmesg`` lines with IO_PAGE_FAULT, DMAR, AMD-Vi or NVRM Xid;
- PCIe ACS: ``lspci -vvv`` ``ACSCtl`` lines with ``ReqRedir+``/``CmpltRedir+`` (peer
  traffic redirected through the root complex);
- NCCL settings: ``NCCL_*`` environment variables, ``/etc/nccl.conf``, ``~/.nccl.conf``.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Output:
    """What a probe got: ``text``, or ``None`` with ``reason`` (could not collect)."""

    text: str | None
    reason: str = ""


class Runner:
    """Runs commands and reads files for the probes. Subclass or inject for tests."""

    def __init__(self, timeout: float = 10.0):
        self.timeout = timeout

    def run(self, argv: list[str]) -> Output:
        """``argv``'s stdout; on timeout the whole process group is killed (a tool that
        started children — ``sh -c`` pipelines — cannot keep the pipe open past it)."""
        tool = argv[2].split()[0] if argv[:2] == ["sh", "-c"] and argv[2:] and argv[2].split() else argv[0]
        try:
            proc = subprocess.Popen(
                argv,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                stdin=subprocess.DEVNULL,
                text=True,
                errors="replace",
                start_new_session=True,
            )
        except FileNotFoundError:
            return Output(None, f"{tool} is not installed")
        except OSError as exc:
            return Output(None, f"{tool}: {exc.strerror}")
        try:
            stdout, stderr = proc.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return Output(None, f"{tool} did not answer within {self.timeout:g} s")
        if proc.returncode != 0 and not stdout:
            return Output(None, f"{tool} failed: {(stderr or '').strip()[:120] or proc.returncode}")
        return Output(stdout)

    def read(self, path: str) -> Output:
        try:
            return Output(Path(path).read_text(errors="replace"))
        except FileNotFoundError:
            return Output(None, f"{path} does not exist")
        except OSError as exc:
            return Output(None, f"cannot read {path}: {exc.strerror}")

    def listdir(self, path: str) -> Output:
        try:
            return Output("\n".join(sorted(os.listdir(path))))
        except OSError as exc:
            return Output(None, f"cannot list {path}: {exc.strerror}")


@dataclass
class HostFacts:
    """What the probes found; ``missing`` says what could not be collected and why."""

    cmdline: str | None = None
    iommu_units: list[str] = field(default_factory=list)
    iommu_mode: str = "unknown"  # off | passthrough | translated | unknown
    kernel_lines: list[str] = field(default_factory=list)
    acs_redirect: list[str] = field(default_factory=list)
    nccl: dict[str, str] = field(default_factory=dict)
    nccl_files: dict[str, str] = field(default_factory=dict)  # path → text, or "(none: why)"
    missing: dict[str, str] = field(default_factory=dict)


_KERNEL = re.compile(r"IO_PAGE_FAULT|DMAR|AMD-Vi|NVRM: Xid", re.IGNORECASE)
_BRIDGE = re.compile(r"^([0-9a-fA-F:.]+)\s+(.*)$")
_NCCL_LINE = re.compile(r"^\s*(NCCL_[A-Z0-9_]+)\s*=\s*(\S.*?)\s*$")


def iommu_mode(cmdline: str, units: list[str]) -> str:
    """``off``, ``passthrough`` (iommu=pt: DMA not translated for the host), ``translated``
    (an active IOMMU remaps device DMA — what breaks P2P on bare metal), or ``unknown``."""
    words = cmdline.split()
    if any(w in ("iommu=pt", "iommu.passthrough=1") for w in words):
        return "passthrough"
    if any(w in ("intel_iommu=off", "amd_iommu=off", "iommu=off") for w in words):
        return "off"
    if units:
        return "translated"
    if any(w in ("intel_iommu=on", "amd_iommu=on") for w in words):
        return "translated"
    return "off" if cmdline else "unknown"


def collect(
    runner: Runner | None = None, env: Mapping[str, str] | None = None, home: str | None = None
) -> HostFacts:
    """Run every probe; never raises."""
    runner = runner or Runner()
    env = os.environ if env is None else env
    facts = HostFacts()
    cmdline = runner.read("/proc/cmdline")
    facts.cmdline = cmdline.text.strip() if cmdline.text is not None else None
    if cmdline.text is None:
        facts.missing["cmdline"] = cmdline.reason
    units = runner.listdir("/sys/class/iommu")
    facts.iommu_units = [u for u in (units.text or "").split() if u]
    if units.text is None:
        facts.missing["iommu"] = units.reason
    facts.iommu_mode = iommu_mode(facts.cmdline or "", facts.iommu_units)
    log = runner.run(["dmesg"])
    if log.text is None:
        facts.missing["dmesg"] = log.reason
    else:
        facts.kernel_lines = [line.strip() for line in log.text.splitlines() if _KERNEL.search(line)][-20:]
    lspci = runner.run(["lspci", "-vvv"])
    if lspci.text is None:
        facts.missing["lspci"] = lspci.reason
    else:
        facts.acs_redirect = acs_redirects(lspci.text)
    facts.nccl = {k: v for k, v in env.items() if k.startswith("NCCL_")}
    for path in ("/etc/nccl.conf", os.path.join(home or os.path.expanduser("~"), ".nccl.conf")):
        conf = runner.read(path)
        facts.nccl_files[path] = conf.text if conf.text is not None else f"(none: {conf.reason})"
        for line in (conf.text or "").splitlines():
            match = _NCCL_LINE.match(line)
            if match and match.group(1) not in facts.nccl:
                facts.nccl[match.group(1)] = f"{match.group(2)} ({path})"
    return facts


def acs_redirects(lspci_text: str) -> list[str]:
    """Devices (usually PCIe bridges) whose ACSCtl redirects peer requests or completions."""
    found = []
    device = ""
    for line in lspci_text.splitlines():
        match = _BRIDGE.match(line)
        if match and not line.startswith((" ", "\t")):
            device = f"{match.group(1)} {match.group(2)}"
        if "ACSCtl:" in line and ("ReqRedir+" in line or "CmpltRedir+" in line):
            found.append(f"{device}: {line.strip()}")
    return found
