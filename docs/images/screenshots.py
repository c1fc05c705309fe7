"""``make screenshots``: draw the docs' pictures from real inputs and screenshot them, and
a doctor bundle's REPORT.html, in headless Chromium (docs/reporting.md, "Pictures").

Inputs, all real: the seed machine's capture (diag/examples/seed_8gpu_topo.txt) and two
captures from tests/data/topo; torch flight-recorder dumps of real gloo jobs
(tests/data/fr/gloo); a bench and a gradcheck run here on CPU; ``gpudiag doctor`` on the
seed machine with its planted fault. Writes docs/images/NAME.svg and NAME.png.

    python docs/images/screenshots.py [--chromium chromium] [--out docs/images]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GPUDIAG = [sys.executable, "-m", "gpudiag"]
#: Each gpudiag run or screenshot stops after this many seconds.
STEP_S = 600


def gpudiag_json(*args: str) -> dict:
    """A gpudiag command's JSON (exit 1 is a finding, not a failure)."""
    done = subprocess.run(
        [*GPUDIAG, *args, "--format", "json"], capture_output=True, text=True, timeout=STEP_S, cwd=ROOT
    )
    if done.returncode not in (0, 1):
        sys.exit(
            f"screenshots: gpudiag {' '.join(args)} exited {done.returncode}: {done.stderr.strip()[-400:]}"
        )
    return json.loads(done.stdout)


def shoot(chromium: str, page: Path, png: Path, width: int, height: int) -> None:
    """A screenshot of ``page`` at ``width`` × ``height`` CSS px (scale 1)."""
    with tempfile.TemporaryDirectory(prefix="gpudiag-chromium-") as profile:
        argv = [
            chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
            f"--user-data-dir={profile}", "--force-device-scale-factor=1",
            f"--window-size={width},{height}", f"--screenshot={png}", page.resolve().as_uri(),
        ]  # fmt: skip
        done = subprocess.run(argv, capture_output=True, text=True, timeout=STEP_S)
    if done.returncode != 0 or not png.is_file():
        sys.exit(f"screenshots: {chromium} could not screenshot {page}: {done.stderr.strip()[-400:]}")
    print(f"  {png.relative_to(ROOT) if png.is_relative_to(ROOT) else png} ({width}×{height})")


def size(svg: str) -> tuple[int, int]:
    found = re.search(r'width="(\d+)" height="(\d+)"', svg)
    assert found, "an SVG gpudiag drew has its size"
    return int(found.group(1)), int(found.group(2))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chromium", default="chromium")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images")
    args = parser.parse_args()
    if shutil.which(args.chromium) is None:
        print(f"screenshots: no {args.chromium} here; install Chromium (Debian: apt-get install chromium)")
        return 3
    from gpudiag.render.pictures import picture

    topo = "tests/data/topo"
    drawn = {
        "topology-seed": ("topology", ["topology", "--from-file", "diag/examples/seed_8gpu_topo.txt"]),
        "topology-dgx1": (
            "topology",
            ["topology", "--from-file", f"{topo}/dgx1_v100_nv1nv2_mlx5_spaces.txt"],
        ),
        "topology-h100": ("topology", ["topology", "--from-file", f"{topo}/h100_8gpu_nv18_8nic_spaces.txt"]),
        "topology-p40": (
            "topology",
            ["topology", "--from-file", f"{topo}/p40_8gpu_pix_pxb_soc_legacy_tabs.txt"],
        ),
        "hang-subgroup": ("hang", ["hang", "tests/data/fr/gloo/subgroup/json"]),
        "hang-dead": ("hang", ["hang", "tests/data/fr/gloo/dead/json"]),
        "bench-cnn": ("bench", ["bench", "--model", "cnn", "--steps", "5", "--gpus", "2,4"]),
        "gradcheck-resnet18": ("gradcheck", ["gradcheck", "--model", "torchvision:resnet18?num_classes=10"]),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    for name, (kind, command) in drawn.items():
        print(f"screenshots: gpudiag {' '.join(command)}")
        svg = picture(kind, gpudiag_json(*command))
        path = args.out / f"{name}.svg"
        path.write_text(svg, encoding="utf-8")
        shoot(args.chromium, path, args.out / f"{name}.png", *size(svg))
    with tempfile.TemporaryDirectory(prefix="gpudiag-screenshots-") as scratch:
        bundle = Path(scratch) / "bundle"
        argv = [
            *GPUDIAG, "doctor", "--machine", "diag/examples/seed_8gpu_topo.txt", "--inject", "5->6:nan@3",
            "--pairs", "4-5,5-6", "--output", str(bundle),
        ]  # fmt: skip
        print("screenshots: " + " ".join(argv[2:]))
        subprocess.run(argv, capture_output=True, timeout=STEP_S, cwd=ROOT)
        if not (bundle / "REPORT.html").is_file():
            print("screenshots: the doctor bundle has no REPORT.html")
            return 1
        shoot(args.chromium, bundle / "REPORT.html", args.out / "report-html.png", 1000, 1700)
    return 0


if __name__ == "__main__":
    sys.exit(main())
