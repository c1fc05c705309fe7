"""What a hang analysis is made of: :class:`GroupHang` (one hung process group at its
pending collective), :class:`Analysis` (every group of one job), and the words for ranks
and groups (:func:`span`, :func:`mesh_dim`, :func:`is_rooted`). :mod:`.analysis` builds
them; :mod:`.causes` decides between them; :mod:`.result` and :mod:`.blame` say them."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from gpudiag.hang.reader import Dump, Entry, Frame

ABSENT = "(not in a collective)"
#: Collectives with a root (``src``/``dst``): a completion on one rank proves nothing about
#: the others (torch's names; NCCL's out-of-place variants too).
ROOTED = frozenset({"broadcast", "scatter", "gather", "reduce", "_broadcast_oop", "_reduce_oop"})


def is_rooted(op: str) -> bool:
    """Whether ``op`` (``broadcast``, ``gather``…) is a collective with a root."""
    return op.split(" ", 1)[0] in ROOTED


def span(ranks: list[int] | set[int]) -> str:
    """``0-3, 7, 9-12``: ranks as runs of consecutive numbers (huge worlds stay one line)."""
    out: list[str] = []
    ordered = sorted(ranks)
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        first, last = ordered[i], ordered[j]
        out.append(
            str(first) if first == last else f"{first}, {last}" if last == first + 1 else f"{first}-{last}"
        )
        i = j + 1
    return ", ".join(out)


def mesh_dim(desc: str) -> str | None:
    """The DeviceMesh dimension a group description names (``mesh_tp`` → ``tp``), if any."""
    if desc.startswith("mesh_") and desc not in ("mesh_default",) and len(desc) > 5:
        return desc[5:]
    return None


@dataclass
class GroupHang:
    """Group ``group`` (``desc``) waits at collective ``seq``: ``states`` maps each member
    with a dump to its op at ``seq`` or :data:`ABSENT`; ``finished`` the members that
    completed their own part of it (a rooted op); ``expected`` is the majority's (None on
    a tie); ``culprits`` the ranks that caused it; ``missing`` members without a dump;
    ``cause`` the root group it waits for (None: a root); ``how`` what named the culprits
    (``majority``, ``outside`` — the only members in no collective —, ``program`` — the
    rank whose sequence of collectives left the others' —, ``subgroup``, or ``tie``)."""

    group: str
    desc: str
    members: list[int]
    seq: int
    states: dict[int, str]
    entries: dict[int, Entry]
    expected: str | None
    culprits: list[int]
    missing: list[int]
    cause: str | None = None
    finished: list[int] = field(default_factory=list)
    how: str = "majority"
    #: what showed the culprits, in words, where more than the group's own states did
    evidence: str = ""

    @property
    def label(self) -> str:
        """``tail (ranks 1-3)``, ``mesh dimension tp (ranks 2, 3)``, ``group 4 (ranks 0, 2)``;
        the world group by its description alone (``default_pg``: every rank)."""
        if self.group == "0":
            return self.name
        dim = mesh_dim(self.desc)
        if dim is not None:
            name = f"mesh dimension {dim}"
        else:
            name = self.desc if self.desc and self.desc != "undefined" else f"group {self.group}"
        return f"{name} (ranks {span(self.members)})"

    @property
    def name(self) -> str:
        """The group's description (``default_pg``, ``mesh_tp``), else its name."""
        return self.desc if self.desc and self.desc != "undefined" else self.group

    @property
    def op(self) -> str | None:
        """The operation the group waits in: the expected one, else the one most members are in."""
        if self.expected not in (None, ABSENT):
            return self.expected
        ops = Counter(s for s in self.states.values() if s != ABSENT).most_common(1)
        return ops[0][0] if ops else None

    def ranks_in(self) -> list[int]:
        """Members still in the collective (not those that finished their part of it)."""
        op = self.op
        done = set(self.finished)
        return sorted(r for r, s in self.states.items() if s == op and r not in done)

    def absent(self) -> list[int]:
        return sorted(r for r, s in self.states.items() if s == ABSENT)


@dataclass
class Analysis:
    """What :func:`analyse` found: ``world_size``, the dumps, every hung group (roots
    first), each rank's pending entry (``blocked``), the mismatched sizes of completed
    collectives, and the groups where every member entered the same pending collective."""

    world_size: int
    dumps: dict[int, Dump]
    hangs: list[GroupHang]
    blocked: dict[int, Entry]
    missing: list[int]
    mismatches: list[tuple[str, str, int, dict[int, str]]] = field(default_factory=list)
    all_entered: list[tuple[str, int, str]] = field(default_factory=list)
    #: rank → the user's line in its main thread's stack (``gpudiag run`` wrote it), if any
    stacks: dict[int, Frame] = field(default_factory=dict)
    #: rank → operations its gloo groups ran that no entry lists (:func:`unrecorded`)
    unrecorded: dict[int, int] = field(default_factory=dict)
    #: rank → its last recorded operation, when that is a send or recv not completed
    p2p_pending: dict[int, Entry] = field(default_factory=dict)
    #: files read but not judged, each with the reason (not a dump; another job's dump)
    skipped: list[str] = field(default_factory=list)

    @property
    def roots(self) -> list[GroupHang]:
        return [h for h in self.hangs if h.cause is None]
