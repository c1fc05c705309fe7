"""The NCCL log reader runs in time linear in its input (issue 44.2): hostile lines of 1 MB
— each aimed at one of its regular expressions or loops — and a log of 50,000 distinct host
names are read, analysed and (for ``report --nccl-log``) bundled in bounded time.

Measured on the 2-core VM (bench/transport_hostile.py) at load average 5: each 1 MB case
0.06–0.9 s (the slowest, 17,000 records merged on one line); at load average 14, 0.16–5.8 s.
Before the fix the 51-byte ``Ring 0 : <22 digits>x`` line alone took 0.7 s and doubled with
each digit; a quadratic scan of 1 MB takes minutes. The bounds below are more than 10x the
figures at load 5: they catch a hang or a quadratic, not a slow machine.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpudiag.cli import cli
from gpudiag.transport.analysis import analyze
from gpudiag.transport.bundled import bundled_logs
from gpudiag.transport.reader import read_log
from tests.helpers import within
from tests.helpers.nccl_hostile import HOSTILE, MIB, many_hosts

#: Seconds one hostile 1 MB input may take to be read and analysed (measured ≤ 0.9 s at load 5).
BOUND = within(idle_s=2.0)  # (5.8 s at most at load 14)


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_hostile_megabyte_line_is_read_in_bounded_time(name: str) -> None:
    text = HOSTILE[name]()
    assert len(text) >= MIB
    start = time.perf_counter()
    report = analyze(read_log([(text, "hostile.log")]))
    seconds = time.perf_counter() - start
    assert seconds < BOUND, f"{name}: {seconds:.1f} s"
    assert report.exit_code() in (0, 1, 3)


def test_the_exponential_line_of_issue_44_is_linear() -> None:
    """`Ring 0 : <digits>x via P2P/IPC`: 22 digits took 0.7 s and each one more doubled it."""
    start = time.perf_counter()
    for digits in (22, 30, 40, 1000):
        log = read_log([(f"Ring 0 : {'1' * digits}x via P2P/IPC\n", "x")])
        assert log.connections == []
    assert time.perf_counter() - start < within(idle_s=0.1)  # (measured 0.3 ms; 22 digits took 0.7 s before)


def test_many_distinct_hosts_are_read_and_anonymised_in_bounded_time() -> None:
    """20,000 host names (50,000 took 49 s before; the bench reads 50,000): each name's
    first-seen check and its pseudonym are O(1); the anonymiser looks at each distinct word
    once."""
    text = many_hosts(20_000)
    start = time.perf_counter()
    log = read_log([(text, "hosts.log")])
    assert len(log.hosts) == 20_000
    ((bundled, _),), notes = bundled_logs([(text, "hosts.log")], anonymize=True)
    assert "host19999" not in bundled and "anon-host-20000" in bundled and notes == []
    assert time.perf_counter() - start < within(idle_s=12.0)  # (measured 12 s at load 14)


def test_report_reads_a_hostile_log_in_bounded_time(tmp_path: Path) -> None:
    """`report --nccl-log`'s path: bundle (cut, redacted) and the check re-reading it."""
    log = tmp_path / "hostile.log"
    log.write_text(HOSTILE["merged records"](), encoding="utf-8")
    start = time.perf_counter()
    result = CliRunner().invoke(
        cli, ["report", "--checks", "transport", "-o", str(tmp_path / "b"), "--nccl-log", str(log)]
    )
    seconds = time.perf_counter() - start
    assert result.exit_code in (0, 1), result.output
    assert seconds < within(idle_s=6.0), seconds  # (4.6 s at load 14, most of it the redactor's)
