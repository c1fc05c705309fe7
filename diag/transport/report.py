"""``gpudiag transport``'s result: one directed pair and its transport (:class:`Pair`), and
the whole report (:class:`TransportReport`) with its JSON (schema :data:`SCHEMA`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpudiag.errors import EXIT_CANNOT_RUN, EXIT_OK, EXIT_PROBLEM
from gpudiag.findings import Finding, short_repr
from gpudiag.transport.reader import NcclLog, Unread

__all__ = ["SCHEMA", "Pair", "TransportReport"]


SCHEMA = "gpudiag.transport/1"


@dataclass
class Pair:
    """One directed pair and the transport family it used."""

    from_rank: int
    to_rank: int
    from_device: int | None
    to_device: int | None
    from_busid: str | None
    to_busid: str | None
    from_host: str | None
    to_host: str | None
    transport: str
    raw: str
    channels: list[int]
    lines: list[int]
    conns: list[int] = field(default_factory=list)
    pids: list[int] = field(
        default_factory=list
    )  # processes that printed its lines  # connection indexes (`Channel NN/MM`'s MM; 0 when not printed)
    #: the transport texts each end printed (``send``/``receive``; ``""`` where no side was
    #: printed): two ends of one connection may disagree (``NET/IB/0`` and ``NET/IB/0/GDRDMA``)
    sides: dict[str, list[str]] = field(default_factory=dict)
    #: (log, host) of the processes that printed its lines
    origins: list[tuple[str | None, str | None]] = field(default_factory=list, repr=False)
    offers: str | None = None  # the topology's cell for the pair, e.g. "NV4", "SYS"
    p2p: str | None = None  # the topology's P2P status for the pair, e.g. "OK", "GNS"

    @property
    def shown_raw(self) -> str:
        """``raw``, or each end's text where the two ends printed different ones
        (``send NET/IB/0 · receive NET/IB/0/GDRDMA``)."""
        texts = {raw for raws in self.sides.values() for raw in raws}
        if len(texts) <= 1:
            return self.raw
        return " · ".join(f"{side or 'logged'} {'/'.join(raws)}" for side, raws in sorted(self.sides.items()))

    @property
    def same_host(self) -> bool | None:
        """True/False when both hosts are known, else None (NET pairs); P2P/SHM: True."""
        if not self.transport.startswith("NET/"):
            return True
        if self.from_host is None or self.to_host is None:
            return None
        return self.from_host == self.to_host

    def to_json(self) -> dict[str, Any]:
        return {
            "from_rank": self.from_rank,
            "to_rank": self.to_rank,
            "from_device": self.from_device,
            "to_device": self.to_device,
            "from_busid": self.from_busid,
            "to_busid": self.to_busid,
            "from_host": self.from_host,
            "to_host": self.to_host,
            "transport": self.transport,
            "raw": self.raw,
            "raw_by_side": {side or "unknown": list(raws) for side, raws in self.sides.items()},
            "channels": list(self.channels),
            "channel_count": len(self.channels),
            "offers": self.offers,
            "p2p": self.p2p,
            "lines": self.lines[:20],
        }


@dataclass
class TransportReport:
    """``gpudiag transport``'s result: the log's facts, pairs, unread lines and findings."""

    log: NcclLog
    pairs: list[Pair]
    findings: list[Finding]
    topology_source: str | None = None
    host_notes: list[str] = field(default_factory=list)
    #: what else the reader of the result must know (a log bundled only in part)
    notes: list[str] = field(default_factory=list)
    #: ``(name, text)`` of the logs read, where a report bundle keeps them (not in the JSON)
    nccl_logs: list[tuple[str, str]] = field(default_factory=list, repr=False)
    #: the Topology the pairs were placed on, or None (a report bundle keeps it)
    topology: Any = field(default=None, repr=False)

    def __repr__(self) -> str:
        return short_repr(
            self, self.verdict, self.findings, pairs=len(self.pairs), unread=len(self.log.unread)
        )

    @property
    def verdict(self) -> str:
        """``slow-path`` (a warning), ``needs-topology`` (pairs only a topology can judge,
        nothing else found), ``no-pairs`` or ``ok``."""
        code = self.exit_code()
        if code == EXIT_PROBLEM:
            return "slow-path"
        if code == EXIT_CANNOT_RUN:
            return "needs-topology"
        return "no-pairs" if not self.pairs else "ok"

    @property
    def unjudged(self) -> bool:
        """Whether some pairs could not be judged without a topology."""
        return any(f.code == "nccl-needs-topology" for f in self.findings)

    @property
    def simulated(self) -> bool:
        """False: a log is what NCCL did, read, not a simulation."""
        return False

    @property
    def unread(self) -> list[Unread]:
        return self.log.unread

    def exit_code(self) -> int:
        """1 when a pair took a slower path than it should or NCCL logged an error (a
        warning); 3 when nothing was found but some pairs need the topology to be judged
        (no all-clear the log alone cannot give); else 0."""
        if any(f.severity != "info" for f in self.findings):
            return EXIT_PROBLEM
        return EXIT_CANNOT_RUN if self.unjudged else EXIT_OK

    def to_json(self) -> dict[str, Any]:
        """The ``gpudiag.transport/1`` document (see ``docs/transport.md``)."""
        log = self.log
        return {
            "schema": SCHEMA,
            "verdict": self.verdict,
            "sources": list(log.sources),
            "nccl_version": log.versions[0] if log.versions else None,
            "nccl_versions": list(log.versions),
            "hosts": list(log.hosts),
            "bracket": log.bracket_kind,
            "env": {name: list(values) for name, values in log.env.items()},
            "ib_devices": list(log.ib_devices),
            "networks": list(log.networks),
            "topology": self.topology_source,
            "lines": log.lines,
            "connection_lines": len(log.connections),
            "pairs": [pair.to_json() for pair in self.pairs],
            "unread": [u.to_json() for u in log.unread],
            "nccl_warnings": list(log.warnings),
            "nccl_warn_lines": log.warn_lines,
            "gdr_lines": list(log.gdr_lines),
            "collnet_nvls": list(log.collnet_nvls),
            "notes": [*log.notes, *self.host_notes, *self.notes],
            "findings": [f.to_json() for f in self.findings],
        }
