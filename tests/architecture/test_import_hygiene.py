"""``import gpudiag`` and ``gpudiag --help`` import neither torch nor pynvml."""

from __future__ import annotations

import subprocess
import sys

import pytest

CHECK = """
import sys
{code}
heavy = sorted(m for m in ("torch", "pynvml", "torchvision", "rich") if m in sys.modules)
print("HEAVY=" + ",".join(heavy))
"""


@pytest.mark.parametrize(
    "code",
    [
        "import gpudiag",
        "import gpudiag.cli, gpudiag.topology, gpudiag.hw, gpudiag.checks, gpudiag.repro",
        "from gpudiag.cli import cli\ntry:\n    cli(['--help'])\nexcept SystemExit:\n    pass",
        "from gpudiag.cli import cli\ntry:\n    cli(['topology', '--help'])\nexcept SystemExit:\n    pass",
        "import gpudiag.checks.suite, gpudiag.repro.report, gpudiag.repro.replay, gpudiag.checks.env, "
        "gpudiag.redact, gpudiag.repro.scripts, gpudiag.render.report_markdown, gpudiag.hw.sources",
        "from gpudiag.cli import cli\ntry:\n    cli(['doctor', '--checks', 'env', '--help'])\n"
        "except SystemExit:\n    pass",
        # options are parsed (and --inject checked) before the command imports torch
        "from gpudiag.cli import cli\ntry:\n    cli(['gradcheck', '--model', 'mlp', '--inject', '0=1:nan'])\n"
        "except SystemExit:\n    pass",
        "import gpudiag.runtime.faults, gpudiag.runtime",
    ],
)
def test_no_heavy_imports(code: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", CHECK.format(code=code)], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip().split("\n")[-1] == "HEAVY="


def test_python_dash_m_works() -> None:
    out = subprocess.run([sys.executable, "-m", "gpudiag", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    assert "topology" in out.stdout
