"""nancheck's report: one training run (:class:`Outcome`) and the whole check's
(:class:`NancheckReport`), with its JSON (schema :data:`SCHEMA`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpudiag.findings import Finding, short_repr
from gpudiag.render.jsonout import losses as losses_json
from gpudiag.runtime import RankFailure
from gpudiag.runtime.faults import rehearsal
from gpudiag.topology.model import Topology

__all__ = ["EXPLOSION_FACTOR", "SCHEMA", "NancheckReport", "Outcome"]


SCHEMA = "gpudiag.nancheck/1"
#: A loss above this multiple of its first value is an explosion.
EXPLOSION_FACTOR = 100.0


@dataclass
class Outcome:
    """One training run: a single GPU or a pair."""

    devices: tuple[int, ...]
    status: str  # ok | diverged | exploded | crashed | hung
    first_bad_step: int | None
    losses: list[float]
    first_bad_transfer: dict[str, Any] | None = None
    error: str | None = None
    recorder: Any = None  # the runtime's record of the run (for --trace)
    failure: RankFailure | None = None  # what crashed or hung, with the rank's traceback

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass
class NancheckReport:
    verdict: str  # pass | fail
    strategy: str
    steps: int
    singles: list[Outcome]
    pairs: list[Outcome]
    links: dict[tuple[int, ...], str | None]
    findings: list[Finding]
    topology: Topology | None
    config: dict[str, Any] = field(default_factory=dict)
    machine_source: str | None = None  # the file virtual devices were laid out like, if known

    def __repr__(self) -> str:
        return short_repr(self, self.verdict, self.findings, singles=len(self.singles), pairs=len(self.pairs))

    def exit_code(self) -> int:
        return 0 if self.verdict == "pass" else 1

    @property
    def simulated(self) -> bool:
        """Whether training ran on CPU virtual devices laid out like a machine, not on GPUs."""
        return self.topology is not None or self.config.get("devices") == "virtual"

    @property
    def simulation(self) -> str | None:
        """What was simulated, in one sentence (None on real GPUs)."""
        if not self.simulated:
            return None
        return (
            f"simulated on CPU virtual devices laid out like {self._source}: "
            "training ran on the CPU, not on the machine's GPUs, and only faults given with --inject "
            "can appear, so a pass says nothing about its GPUs or links"
        )

    @property
    def _source(self) -> str:
        return str(self.machine_source or self.config.get("machine") or "a machine file")

    @property
    def recorders(self) -> dict[str, Any]:
        """Each run's record, named ``GPU5`` or ``GPU5+GPU6`` (for ``--trace``)."""
        runs = [*self.singles, *self.pairs]
        return {"+".join(f"GPU{g}" for g in o.devices): o.recorder for o in runs if o.recorder is not None}

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "verdict": self.verdict,
            "simulated": self.simulated,
            "simulation": self.simulation,
            "rehearsal": rehearsal(self.config.get("inject") or []),
            "strategy": self.strategy,
            "steps": self.steps,
            "explosion_factor": EXPLOSION_FACTOR,
            "config": self.config,
            "singles": [
                {
                    "device": o.devices[0],
                    "status": o.status,
                    "first_bad_step": o.first_bad_step,
                    **losses_json(o.losses),
                    "error": o.error,
                }
                for o in self.singles
            ],
            "pairs": [
                {
                    "a": o.devices[0],
                    "b": o.devices[1],
                    "link": self.links.get(o.devices),
                    "status": o.status,
                    "first_bad_step": o.first_bad_step,
                    "first_bad_transfer": o.first_bad_transfer,
                    **losses_json(o.losses),
                    "error": o.error,
                }
                for o in self.pairs
            ],
            "findings": [f.to_json() for f in self.findings],
        }
