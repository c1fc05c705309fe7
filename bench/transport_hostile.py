"""How long ``gpudiag transport``'s reader takes on hostile input (issue 44.2): one 1 MB line
aimed at each of its regular expressions and loops (``tests/helpers/nccl_hostile.py``), and
a log of 50,000 distinct host names read and anonymised as ``report --nccl-log --anonymize``
bundles it. Last line: the slowest 1 MB case, in seconds (target ≤ 1 s on an idle machine;
the test of the same cases asserts 10 s, a bound against a hang or a quadratic).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # (the generators live in tests/helpers)

from gpudiag.transport.analysis import analyze
from gpudiag.transport.bundled import bundled_logs
from gpudiag.transport.reader import read_log
from tests.helpers.nccl_hostile import HOSTILE, many_hosts


def main() -> None:
    worst = ("", 0.0)
    for name, make in sorted(HOSTILE.items()):
        text = make()
        start = time.perf_counter()
        analyze(read_log([(text, "hostile.log")]))
        seconds = time.perf_counter() - start
        print(f"{name:24s} {len(text) / 2**20:5.2f} MiB  {seconds:.3f} s")
        worst = max(worst, (name, seconds), key=lambda item: item[1])
    text = many_hosts(50_000)
    start = time.perf_counter()
    bundled_logs([(text, "hosts.log")], anonymize=True)
    seconds = time.perf_counter() - start
    print(f"50,000 hosts read, anonymised and redacted ({len(text) / 2**20:.1f} MiB): {seconds:.3f} s")
    print(f"slowest 1 MB line ({worst[0]}): {worst[1]:.3f} s")


if __name__ == "__main__":
    main()
