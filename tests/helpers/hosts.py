"""Hosts described by canned outputs, for the host probes (``gpudiag.hw.host``) that read
``/proc/cmdline``, ``/sys/class/iommu``, ``dmesg``, ``lspci`` and ``nccl.conf``: the machine's
own kernel and PCI tree are the hardware boundary the tests fake."""

from __future__ import annotations

from gpudiag.hw.host import Output, Runner

LSPCI = """\
00:01.1 PCI bridge: Advanced Micro Devices, Inc. [AMD] Starship/Matisse GPP Bridge
\tCapabilities: [2a0 v1] Access Control Services
\t\tACSCap:\tSrcValid+ TransBlk+ ReqRedir+ CmpltRedir+ UpstreamFwd+ EgressCtrl- DirectTrans+
\t\tACSCtl:\tSrcValid+ TransBlk- ReqRedir+ CmpltRedir+ UpstreamFwd+ EgressCtrl- DirectTrans-
01:00.0 VGA compatible controller: NVIDIA Corporation AD102 [GeForce RTX 4090]
\t\tACSCtl:\tSrcValid- TransBlk- ReqRedir- CmpltRedir- UpstreamFwd- EgressCtrl- DirectTrans-
"""
DMESG = """\
[    0.512] AMD-Vi: Interrupt remapping enabled
[ 1234.5] nvidia 0000:41:00.0: AMD-Vi: Event logged [IO_PAGE_FAULT domain=0x0019 flags=0x0020]
[ 1300.1] NVRM: Xid (PCI:0000:41:00): 79, GPU has fallen off the bus.
[ 1301.0] usb 1-1: new high-speed USB device
"""


class Canned(Runner):
    """A host described by canned outputs (None: the tool or file is missing)."""

    def __init__(
        self, commands: dict[str, str | None], files: dict[str, str | None], dirs: dict[str, str | None]
    ):
        super().__init__()
        self.commands, self.files, self.dirs = commands, files, dirs

    def run(self, argv: list[str]) -> Output:
        text = self.commands.get(argv[0])
        return Output(text, "" if text is not None else f"{argv[0]} is not installed")

    def read(self, path: str) -> Output:
        text = self.files.get(path)
        return Output(text, "" if text is not None else f"{path} does not exist")

    def listdir(self, path: str) -> Output:
        text = self.dirs.get(path)
        return Output(text, "" if text is not None else f"cannot list {path}")


def epyc_host() -> Canned:
    return Canned(
        {"dmesg": DMESG, "lspci": LSPCI},
        {
            "/proc/cmdline": "BOOT_IMAGE=/vmlinuz root=/dev/nvme0n1p2 ro quiet amd_iommu=on",
            "/etc/nccl.conf": "NCCL_P2P_LEVEL=SYS\n# comment\n",
        },
        {"/sys/class/iommu": "ivhd0\nivhd1"},
    )
