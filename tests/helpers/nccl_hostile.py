"""Hostile NCCL logs, generated (never stored): one 1 MB line aimed at each regular
expression or loop of gpudiag.transport's reader, and a log of many distinct host names.
Used by tests/core/transport/test_transport_bounds.py and bench/transport_hostile.py."""

from __future__ import annotations

from collections.abc import Callable

MIB = 1 << 20


def _times(unit: str) -> str:
    """``unit`` repeated to at least 1 MiB."""
    return unit * (MIB // len(unit) + 1)


#: name → a function returning the text (a line of at least 1 MiB and its line end).
HOSTILE: dict[str, Callable[[], str]] = {
    # the exponential one of issue 44: a graph regex with \d+ inside (...)*
    "ring digits": lambda: "Ring 0 : " + "1" * MIB + "x via P2P/IPC\n",
    "graph numbers": lambda: "Ring 0 : " + _times("1 ") + "x\n",
    # a prefix search that scanned to each colon from every position
    "no prefix before NCCL": lambda: "a" * MIB + " NCCL\n",
    "colons": lambda: _times(":1") + " [0] NCCL INFO\n",
    "marks without hosts": lambda: _times("1:2 [0] NCCL INFO ") + "\n",
    # lazy `.+?\s*$` scans: quadratic in a run of spaces
    "Using network spaces": lambda: "Using network a" + " " * MIB + "b\n",
    "WARN spaces": lambda: "x NCCL WARN a" + " " * MIB + "b\n",
    "env value": lambda: "NCCL_A set by environment to " + "a" * MIB + " b\n",
    # many connection starts, and many records on one line (each cut out once)
    "starts": lambda: _times("Channel 1 : 2 -> ") + "\n",
    "merged records": lambda: _times("h:1:2 [0] NCCL INFO Channel 00 : 0[0] -> 1[1] via P2P/IPC ") + "\n",
    "bracket hex": lambda: "Ring 0 : 1[" + "a" * MIB + "\n",
    "IB devices": lambda: "NET/IB : Using [0]" + "a" * MIB + "\n",
    "escape sequences": lambda: _times("\x1b]") + "\n",
    "docker wrapper": lambda: '{"log":"' + _times("h:1:2 [0] NCCL INFO via ") + '\\n"}\n',
}


def many_hosts(count: int) -> str:
    """A log whose every line comes from another host (``host0`` … ``host<count-1>``)."""
    return "".join(f"host{i}:1:2 [0] NCCL INFO Channel 00 : 0[0] -> 1[1] via P2P/IPC\n" for i in range(count))
