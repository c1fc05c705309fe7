"""What the watcher keeps of a forward call and what it found: one module call's inputs and
output (:class:`Seen`), a rank's first non-finite value (:class:`Local`), and the order of a
step's phases that ranks the ranks' findings."""

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from gpudiag.watch.witness import float_tensors, tensor_version

#: Where in a step each phase comes (the order a fault's consequences follow it in).
PHASE_ORDER = {"input": 0, "transfer": 1, "forward": 1, "backward": 2, "all-reduce": 3, "optimizer": 4}


@dataclass(slots=True)
class Seen:
    """One module's forward call: what it got and gave (references, not copies)."""

    path: str
    module: nn.Module
    inputs: Any
    output: Any
    replica: int | None  # VirtualDataParallel: the virtual device running this replica
    versions: tuple[int, ...] = ()  # the output tensors' in-place versions when returned

    def changed_since(self, later: list["Seen"]) -> bool:
        """Whether the output was modified in place after the module returned it by code
        that is not a watched module (ResNet's ``out += identity``): its values then are not
        what the module produced. A watched in-place module that took it next (``ReLU(inplace=
        True)``: the same tensor, one version on) changed nothing that matters here."""
        now = tuple(tensor_version(t) for t in float_tensors(self.output))
        if not self.versions or now == self.versions:
            return False
        for i, seen in enumerate(later):
            if seen.output is self.output:
                return seen.versions != tuple(v + 1 for v in self.versions) or seen.changed_since(
                    later[i + 1 :]
                )
        return True


@dataclass
class Local:
    """What this rank saw go non-finite first (sent to the other ranks on a fault)."""

    step: int
    phase: str
    module: str
    device: str
    detail: str
    rank: int
    transfer: dict[str, Any] | None = None
    kind: str = "fault"
    blind: list[str] = field(default_factory=list)


def asdict_local(local: Local | None) -> dict[str, Any] | None:
    if local is None:
        return None
    from dataclasses import asdict

    return asdict(local)


def transfer_json(t: Any, corrupted: bool) -> dict[str, Any]:
    return {
        "kind": t.phase,
        "src": f"GPU{t.src}",
        "dst": f"GPU{t.dst}",
        "link": t.link,
        "corrupted": corrupted,
        "name": t.name,
    }
