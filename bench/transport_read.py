"""How long ``gpudiag transport`` takes to read and analyse a 100,000-line NCCL log.

Two mixes of the real logs of ``tests/data/nccl``, each repeated line by line to ``--lines``
lines: ``mix`` (every line: connection lines, graphs, Init lines, damaged lines) and
``dense`` (the connection lines alone, as a log of many ranks is). Last line: the slower
mix's best of ``--repeats`` timings of read + analyse, in seconds (target ≤ 1 s, issues 34
and 45).
"""

from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path

from gpudiag.transport.analysis import analyze
from gpudiag.transport.reader import read_log

DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "nccl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lines", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    source = [line for p in sorted(DATA.glob("*.log")) for line in p.read_text(encoding="utf-8").splitlines()]
    mixes = {"mix": source, "dense": [line for line in source if " via " in line and "->" in line]}
    slowest = ("", 0.0)
    for name, lines in mixes.items():
        text = "\n".join(itertools.islice(itertools.cycle(lines), args.lines)) + "\n"
        best = float("inf")
        for _ in range(args.repeats):
            start = time.perf_counter()
            report = analyze(read_log([(text, "bench")]))
            best = min(best, time.perf_counter() - start)
        log = report.log
        print(
            f"{name}: {args.lines} lines, {len(text) / 2**20:.1f} MiB, from {len(lines)} real lines; "
            f"{len(log.connections)} connection lines, {len(report.pairs)} pairs, {len(log.unread)} unread; "
            f"{best:.3f} s"
        )
        slowest = max(slowest, (name, best), key=lambda item: item[1])
    print(f"read + analyse {args.lines} lines ({slowest[0]}, the slower mix): {slowest[1]:.3f} s")


if __name__ == "__main__":
    main()
