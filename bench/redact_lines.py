"""How long the redactor (every byte of a bundle passes through it) and the sweep's node
list reader take on one adversarial 1 MiB line: a short unit repeated, each unit aimed at
one pattern's worst case (a run of name characters, ``NAME=`` chains, URL schemes without
``@``, colons and hex for IPv6, dotted quads after package names, unclosed brackets under
a secret key, PEM lines without an END…). Issue 44: one 300 KB hex line took 94 s.

Prints each unit's time (``Redactor.bytes`` with ``--anonymize``, every pattern on; best of
``--repeats``) and, as its last line, the worst: target ≤ 1 s on an idle machine. The test
``tests/repro/test_linear_time.py`` asserts a generous bound on a subset.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import time

from gpudiag.errors import InputError
from gpudiag.redact import Redactor
from gpudiag.repro.sweep.hosts import expand_nodelist

#: One unit per pattern's worst case (the linear-time design: diag/redact_text.py).
UNITS = [
    "0123456789abcdef", "a", "a-", "a.", "a_", "a=", "a:", "a: ", "Z:", "a:a", "--a ", "-a ",
    "TOKEN=", "TOKEN:", "--token ", "password: ", '"a":', '{"password": ', '{"password": [',
    "'password': '", "a://", "://", "a:b@", "a@b:", "http://a:b/", "hf_", "sk-sk-", "eyJ", "eyJa.",
    "Bearer ", "GPU-", "AKIA", "xoxb-", "::", "a::", "1:2::", "fe80::1%", "0:", "1.", "1.2.",
    "1.2.3.4 ", "v1.2.3.", "nvidia-a 1.2.3.4 ", "/home/", "<redacted", "-----BEGIN PRIVATE KEY-----",
    "-----END RSA PRIVATE KEY----- ", "b3BlbnNzaC1rZXktdjE", "\\", '"', "'",
]  # fmt: skip
#: Node lists (``--expect-hosts``, ``SLURM_JOB_NODELIST``) that are hostile in their own way.
NODE_LISTS = ["a,", "[", "a[1]", "a[1-1]b", "[[]]"]


#: Seconds 1,000,000 trivial regex calls take on the idle 2-core VM (the load of other
#: sessions makes everything here several times slower; the scaled figure undoes that).
IDLE_CALIBRATION = 0.2


def calibrate() -> float:
    """Seconds this machine takes for 1,000,000 trivial regex matches now."""
    pattern = re.compile("a")
    start = time.perf_counter()
    for _ in range(1_000_000):
        pattern.match("a")
    return time.perf_counter() - start


def line(unit: str, size: int) -> str:
    return (unit * (size // len(unit) + 1))[:size]


def best(work, repeats: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", type=int, default=1 << 20, help="bytes of each line (1 MiB)")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    before = calibrate()
    print(f"this machine: 1,000,000 trivial regex calls in {before:.2f} s (idle 2-core VM: ~0.2 s)")
    redactor = Redactor(
        {"HF_TOKEN": "hf_0123456789abcdefghij"}, anonymize=True, hostname="gpu-box-3.lab", user="alice"
    )
    figures: list[tuple[float, str]] = []
    for unit in UNITS:
        data = line(unit, args.size).encode()
        seconds = best(lambda: redactor.bytes(data), args.repeats)  # noqa: B023
        figures.append((seconds, f"redact {unit!r}"))
        print(f"redact {unit!r:34} {seconds:7.3f} s", flush=True)
    for unit in NODE_LISTS:
        text = line(unit, args.size)

        def expand() -> None:
            with contextlib.suppress(InputError):  # (refused with a reason: timed is how soon)
                expand_nodelist(text)  # noqa: B023

        seconds = best(expand, args.repeats)
        figures.append((seconds, f"node list {unit!r}"))
        print(f"node list {unit!r:31} {seconds:7.3f} s", flush=True)
    after = calibrate()
    print(f"this machine: 1,000,000 trivial regex calls in {after:.2f} s (at the end)")
    worst, what = max(figures)
    idle = worst * IDLE_CALIBRATION / ((before + after) / 2)
    print(f"worst 1 MiB line: {worst:.3f} s ({what}); scaled to the idle machine's speed: {idle:.2f} s")


if __name__ == "__main__":
    main()
