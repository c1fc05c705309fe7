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


def _split_top(text: str) -> list[str]:
    """Split on commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise InputError(f"node list {text!r}: unbalanced ']'")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise InputError(f"node list {text!r}: unbalanced '['")
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _expand_one(item: str) -> list[str]:
    match = re.search(r"\[([^\[\]]*)\]", item)
    if match is None:
        return [item]
    head, tail = item[: match.start()], item[match.end() :]
    out: list[str] = []
    for piece in match.group(1).split(","):
        piece = piece.strip()
        bounds = re.fullmatch(r"([0-9]+)(?:-([0-9]+))?", piece)
        if bounds is None:
            raise InputError(f"node list item {item!r}: bad range {piece!r} (expected N or N-M)")
        lo, hi = bounds.group(1), bounds.group(2) or bounds.group(1)
        if int(hi) < int(lo):
            raise InputError(f"node list item {item!r}: range {piece!r} runs backwards")
        if int(hi) - int(lo) > _MAX_HOSTS:
            raise InputError(f"node list item {item!r}: more than {_MAX_HOSTS} hosts")
        width = len(lo) if lo.startswith("0") else 0
        for n in range(int(lo), int(hi) + 1):
            out += _expand_one(f"{head}{n:0{width}d}{tail}")  # (a second bracket group)
    return out


def expand_nodelist(text: str) -> list[str]:
    """Slurm's compressed host list → host names, in order, each once. Host names are
    case-insensitive (DNS): ``node1,NODE1`` is one host, kept as first spelt."""
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
