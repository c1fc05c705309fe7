"""Cost of nancheck's watching and diagnosis over the full 8-GPU sweep.

    .venv/bin/python bench/nancheck_sweep.py [--repeats 3]

On CPU virtual devices laid out like the seed machine (diag/examples/seed_8gpu_machine.json):
nancheck's sweep — 8 single-GPU runs and 28 DataParallel pairs, 10 steps each, the
built-in mlp on 3x32x32 inputs, batch 8, every transfer watched, then the conclusion — is
timed against the same 36 training runs back to back with watching off. The two are
alternated --repeats times. Prints the medians and, as its last line, sweep / plain
(target <= 1.25).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpudiag.checks.nancheck import nancheck  # noqa: E402
from gpudiag.hw.machine import load_machine  # noqa: E402
from gpudiag.models import random_batch, resolve_model  # noqa: E402
from gpudiag.runtime import DeviceSet, RunConfig, run  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    machine = load_machine(ROOT / "diag" / "examples" / "seed_8gpu_machine.json")
    factory = resolve_model("mlp", (3, 32, 32), 10)
    x, y = random_batch(factory, 8, (3, 32, 32), 10, "ce", 0)
    base = RunConfig("single", DeviceSet.virtual([0], machine), steps=10, watch=False, keep_state=False)

    def plain() -> None:
        for g in range(8):
            run(factory, x, y, replace(base, devices=DeviceSet.virtual([g], machine)))
        for pair in itertools.combinations(range(8), 2):
            run(factory, x, y, replace(base, strategy="dp", devices=DeviceSet.virtual(list(pair), machine)))

    def sweep() -> None:
        report = nancheck(factory, x, y, machine=machine, steps=10)
        assert report.verdict == "pass" and len(report.pairs) == 28

    times: dict[str, list[float]] = {"sweep": [], "plain": []}
    plain()  # warm-up
    for _ in range(args.repeats):
        for name, fn in (("sweep", sweep), ("plain", plain)):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    s, p = statistics.median(times["sweep"]), statistics.median(times["plain"])
    print(f"nancheck sweep (watched): median {s:.2f} s over {args.repeats} runs")
    print(f"same runs, watching off: median {p:.2f} s")
    print(f"sweep/plain = {s / p:.2f}")


if __name__ == "__main__":
    main()
