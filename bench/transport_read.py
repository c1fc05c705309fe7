"""How long ``gpudiag transport`` takes to read and analyse a 100,000-line NCCL log.

The log is the real logs of ``tests/data/nccl`` (connection lines, graphs, Init lines,
damaged lines) repeated, line by line, to ``--lines`` lines. Last line: the best of
``--repeats`` timings of read + analyse, in seconds (target ≤ 1 s, issue 34).
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
    text = "\n".join(itertools.islice(itertools.cycle(source), args.lines)) + "\n"
    print(f"{args.lines} lines, {len(text) / 2**20:.1f} MiB, from {len(source)} real lines")
    best = float("inf")
    for _ in range(args.repeats):
        start = time.perf_counter()
        report = analyze(read_log([(text, "bench")]))
        best = min(best, time.perf_counter() - start)
    log = report.log
    print(f"{len(log.connections)} connection lines, {len(report.pairs)} pairs, {len(log.unread)} unread")
    print(f"read + analyse {args.lines} lines: {best:.3f} s")


if __name__ == "__main__":
    main()
