"""Wall time of `gpudiag gradcheck` against the hand-written comparison the tutorials teach.

    .venv/bin/python bench/gradcheck_wall.py [--repeats 3] [--reference PATH]

Runs, alternately and --repeats times each:

- ours: `gpudiag gradcheck --model torchvision:resnet18?num_classes=10 --input-shape 3,32,32
  --batch-size 8` (single, DataParallel and DDP over gloo with 2 ranks; auto mode, so the
  BatchNorm difference is confirmed by a controlled rerun);
- the reference: `shared/bench/reference_ddp_gradcheck.py` (single, then DDP over gloo
  with 2 ranks started by torch.multiprocessing.spawn; BatchNorm in eval mode, no DP).

Each is a fresh process, so both pay their imports. Prints the medians and, as its last
line, ours / reference (the target is <= 0.5).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OURS = [
    str(Path(sys.executable).parent / "gpudiag"),
    "gradcheck",
    "--model",
    "torchvision:resnet18?num_classes=10",
    "--input-shape",
    "3,32,32",
    "--batch-size",
    "8",
]


def timed(argv: list[str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{argv[0]} failed ({done.returncode}): {done.stderr[-500:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--reference", default=str(ROOT.parent / "shared" / "bench" / "reference_ddp_gradcheck.py")
    )
    args = parser.parse_args()
    if not Path(args.reference).is_file():
        raise SystemExit(f"reference script not found: {args.reference} (pass --reference PATH)")
    reference = [sys.executable, args.reference]
    times: dict[str, list[float]] = {"ours": [], "reference": []}
    for _ in range(args.repeats):
        times["ours"].append(timed(OURS))
        times["reference"].append(timed(reference))
    ours, ref = statistics.median(times["ours"]), statistics.median(times["reference"])
    print(f"ours: median {ours:.2f} s ({', '.join(f'{t:.2f}' for t in times['ours'])})")
    print(f"reference: median {ref:.2f} s ({', '.join(f'{t:.2f}' for t in times['reference'])})")
    print(f"ours/reference = {ours / ref:.2f}")


if __name__ == "__main__":
    main()
