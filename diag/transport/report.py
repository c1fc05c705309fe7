"""``gpudiag transport``'s result: one directed pair and its transport (:class:`Pair`), and
the whole report (:class:`TransportReport`) with its JSON (schema :data:`SCHEMA`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpudiag.errors import EXIT_OK, EXIT_PROBLEM
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
    offers: str | None = None  # the topology's cell for the pair, e.g. "NV4", "SYS"
    p2p: str | None = None  # the topology's P2P status for the pair, e.g. "OK", "GNS"

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
        return "slow-path" if self.exit_code() == EXIT_PROBLEM else ("no-pairs" if not self.pairs else "ok")

    @property
    def simulated(self) -> bool:
        """False: a log is what NCCL did, read, not a simulation."""
        return False

    @property
    def unread(self) -> list[Unread]:
        return self.log.unread

    def exit_code(self) -> int:
        """1 when a pair took a slower path than it should (a warning), else 0."""
        return EXIT_PROBLEM if any(f.severity != "info" for f in self.findings) else EXIT_OK

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
            "notes": [*self.host_notes, *self.notes],
            "findings": [f.to_json() for f in self.findings],
        }
