"""Which hosts a sweep expects: ``--expect-hosts``, or Slurm's node list.

``SLURM_JOB_NODELIST`` (``scontrol show hostnames`` expands it the same way) is compressed:
``node[01-03,07],gpu-a[1-2]`` names node01 node02 node03 node07 gpu-a1 gpu-a2; zero
padding is kept (``[08-10]`` → 08 09 10).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from gpudiag.errors import InputError

_MAX_HOSTS = 100_000
#: The longest node list read (Slurm's own are kilobytes) and the most characters of host
#: names it may expand to: the work a list can cause is bounded before it is done.
_MAX_LIST_CHARS = 1 << 20
_MAX_HOST_CHARS = 16 << 20
#: Bracket groups in one item at most (Slurm writes one or two: ``rack[1-2]-node[01-16]``).
_MAX_GROUPS = 16
_BRACKETS = re.compile(r"\[([^\[\]]*)\]")
_RANGE = re.compile(r"([0-9]{1,18})(?:-([0-9]{1,18}))?")


def _split_top(text: str) -> list[str]:
    """Split on commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise InputError(f"node list {_short(text)}: unbalanced ']'")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise InputError(f"node list {_short(text)}: unbalanced '['")
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _expand_one(item: str) -> list[str]:
    """The hosts one item names: each bracket group expanded, left to right (a product),
    never more than :data:`_MAX_HOSTS` of them or :data:`_MAX_HOST_CHARS` characters."""
    hosts = [""]
    pos = 0
    for count, match in enumerate(_BRACKETS.finditer(item)):
        if count >= _MAX_GROUPS:
            raise InputError(f"node list item {_short(item)}: more than {_MAX_GROUPS} bracket groups")
        numbers = _numbers(item, match.group(1))
        text = item[pos : match.start()]
        if len(hosts) * len(numbers) > _MAX_HOSTS:
            raise InputError(f"node list item {_short(item)}: more than {_MAX_HOSTS} hosts")
        hosts = [f"{h}{text}{n}" for h in hosts for n in numbers]
        pos = match.end()
        if sum(map(len, hosts)) > _MAX_HOST_CHARS:
            raise InputError(
                f"node list item {_short(item)}: more than {_MAX_HOST_CHARS >> 20} MiB of host names"
            )
    tail = item[pos:]
    return [f"{h}{tail}" for h in hosts]


def _numbers(item: str, ranges: str) -> list[str]:
    """The numbers of one bracket group (``01-03,07`` → 01 02 03 07), zero padding kept."""
    out: list[str] = []
    for piece in ranges.split(","):
        piece = piece.strip()
        bounds = _RANGE.fullmatch(piece)
        if bounds is None:
            raise InputError(f"node list item {_short(item)}: bad range {_short(piece)} (expected N or N-M)")
        lo, hi = bounds.group(1), bounds.group(2) or bounds.group(1)
        if int(hi) < int(lo):
            raise InputError(f"node list item {_short(item)}: range {piece!r} runs backwards")
        if int(hi) - int(lo) + len(out) >= _MAX_HOSTS:
            raise InputError(f"node list item {_short(item)}: more than {_MAX_HOSTS} hosts")
        width = len(lo) if lo.startswith("0") else 0
        out += [f"{n:0{width}d}" for n in range(int(lo), int(hi) + 1)]
    return out


def _short(text: str) -> str:
    """``text`` quoted for an error line, cut to 80 characters."""
    return repr(text) if len(text) <= 80 else repr(text[:77] + "...")


def expand_nodelist(text: str) -> list[str]:
    """Slurm's compressed host list → host names, in order, each once. Host names are
    case-insensitive (DNS): ``node1,NODE1`` is one host, kept as first spelt."""
    if len(text) > _MAX_LIST_CHARS:
        raise InputError(f"node list of {len(text)} characters: longer than {_MAX_LIST_CHARS >> 20} MiB")
    hosts: list[str] = []
    for item in _split_top(text):
        hosts += _expand_one(item)
        if len(hosts) > _MAX_HOSTS:
            raise InputError(f"node list names more than {_MAX_HOSTS} hosts")
    first: dict[str, str] = {}
    for host in hosts:
        first.setdefault(host_key(host), host)
    return list(first.values())


def host_key(host: str) -> str:
    """The form host names are compared in: case folded (``Node1`` is ``node1``)."""
    return host.casefold()


def expected_hosts(option: str | None, environ: Mapping[str, str]) -> tuple[list[str], str | None]:
    """The hosts a sweep expects and where the list came from: ``--expect-hosts`` (the same
    compressed syntax), else ``SLURM_JOB_NODELIST``; none when neither is given (then the
    launcher's own count is all there is: torchrun's group has every node that joined)."""
    if option is not None:
        hosts = expand_nodelist(option)
        if not hosts:
            raise InputError(f"--expect-hosts {option!r} names no host")
        spaced = [h for h in hosts if not h.strip() or any(c.isspace() for c in h)]
        if spaced:
            raise InputError(
                f"--expect-hosts: {spaced[0]!r} is not a host name (separate hosts with commas: node0,node1)"
            )
        return hosts, "--expect-hosts"
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if nodelist:
        return expand_nodelist(nodelist), "SLURM_JOB_NODELIST"
    return [], None
