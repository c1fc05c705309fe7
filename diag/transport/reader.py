"""Reading an ``NCCL_DEBUG=INFO`` log: which connection NCCL set up between which ranks.

NCCL 2.x logs one line per connection and channel, in three forms over its versions::

    host:pid:tid [3] NCCL INFO Ring 00 : 3[3] -> 4[4] via P2P/IPC              (2.3-2.4)
    host:pid:tid [3] NCCL INFO Channel 00 : 11[3e000] -> 9[1b000] via P2P/direct pointer
    host:pid:tid [3] NCCL INFO Channel 07/0 : 3[3] -> 4[4] via P2P/CUMEM/read  (2.12 on)

The number in brackets is the CUDA device (most versions) or the PCI bus id as NCCL
prints it (``3e000`` = bus 0x3e; 2.5-2.18). Network connections are logged by both ends
(``[send]`` by the sender, ``[receive]`` by the receiver): one connection, counted once.
Ring and tree *graphs* (``Channel 00/24 :  0 1 2 3``, ``Ring 00 : 7 -> 0 -> 1``, ``Trees``)
and ``Connected all rings`` are not connections and are never read as pairs.

Pasted logs are damaged: lines of two processes merged, prefixes stripped or replaced by a
logging framework's, line numbers or terminal borders added, host names anonymised, the
last line cut off. :func:`read_log` reads what it can and lists every line that looked like
a connection but could not be read (:class:`Unread`, with its line number and why); it
never makes up a pair. Besides connections it reads the NCCL version, host names, the
``NCCL_*`` settings the log shows, the InfiniBand devices NCCL found, and each rank's
device and bus id from its ``Init`` line.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

#: The body of a connection line, found anywhere in a line (prefixes vary).
_CONNECTION = re.compile(
    r"\b(?P<form>Ring|Channel)\s+(?P<channel>\d+)(?:/(?P<conn>\d+))?\s*:\s*"
    r"(?P<a>\d+)(?:\[(?P<abr>[0-9a-fA-F]+)\])?\s*->\s*"
    r"(?P<b>\d+)(?:\[(?P<bbr>[0-9a-fA-F]+)\])?\s*"
    r"(?:\[(?P<side>send|receive)\]\s*)?"
    r"via\s+(?P<via>.*)$"
)
#: Where a connection line starts (to split two merged lines and to spot damaged ones).
_START = re.compile(r"\b(?:Ring|Channel)\s+\d+(?:/\d+)?\s*:\s*\d+(?:\[[0-9a-fA-F]*\]?)?\s*->")
#: A graph line: numbers (and arrows) only, never a connection.
_GRAPH = re.compile(r"\b(?:Ring|Channel)\s+\d+(?:/\d+)?\s*:\s*(?:\d+|->|\s)*$")
#: NCCL's own prefix: ``host:pid:tid [dev] NCCL INFO``.
_PREFIX = re.compile(
    r"(?P<host>[^\s:]*):(?P<pid>\d+):(?P<tid>\d+)\s+\[(?P<dev>\d+)\]\s+NCCL\s+(?:INFO|WARN)\b"
)
#: A second line's prefix glued into a first one.
_GLUED = re.compile(r":\d+:\d+\s+\[\d+\]\s+NCCL\b|\bNCCL\s+(?:INFO|WARN)\b")

#: Transport texts as NCCL prints them after ``via``.
_P2P = re.compile(r"P2P/(?P<mode>IPC|CUMEM|direct pointer)(?P<ext>(?:/(?:read|CE))*)")
_SHM = re.compile(r"SHM(?:/(?:direct|CE)/(?:direct|CE))?|direct shared memory")
#: SHM with modes this reader has not seen printed (still shared memory; never "complete").
_SHM_OTHER = re.compile(r"SHM(?:/[A-Za-z]+){1,2}")
_NET = re.compile(
    r"NET/(?P<name>[A-Za-z][A-Za-z0-9_ ]*?)/(?P<dev>\d+)(?:\(\d+\))?(?P<ext>(?:/(?:GDRDMA|Shared))*)"
)

_VERSION = re.compile(r"NCCL version (?P<v>\d+\.\d+\.\d+)")
_INIT = re.compile(
    r"\bcomm 0x[0-9a-fA-F]+ rank (?P<rank>\d+) nranks (?P<nranks>\d+) cudaDev (?P<dev>\d+)"
    r"(?: nvmlDev (?P<nvml>\d+))? busId (?P<busid>[0-9a-fA-F]+)"
)
_NNODES = re.compile(r"\brank (?P<rank>\d+) nRanks (?P<nranks>\d+) nNodes (?P<nnodes>\d+)")
_ENV = re.compile(r"\b(?P<name>NCCL_[A-Z0-9_]+) set by environment to (?P<value>\S*?)\.?\s*$")
_ENV_SHELL = re.compile(r"^\s*(?:export\s+|-x\s+)?(?P<name>NCCL_[A-Z0-9_]+)=(?P<value>\S*)\s*$")
_IB_USING = re.compile(r"NET/IB\w*\s*:\s*Using\b(?P<rest>.*)")
_IB_DEVICE = re.compile(r"\[\d+\](?P<dev>[\w.-]+:\d+/(?:IB|RoCE|ETH)\w*)")
_IB_NONE = re.compile(r"NET/IB\w*\s*:\s*No device found")
_NETWORK = re.compile(r"\bUsing network (?P<name>.+?)\s*$")
_WARN = re.compile(r"\bNCCL WARN\s+(?P<msg>.+?)\s*$")
#: A last line holding only the start of NCCL's prefix (``host:921``, ``host:1:2 [1] NCCL``).
_CUT_PREFIX = re.compile(r"^[^\s:]*:\d+(?::\d*)?(?:\s+\[\d*\]?)?(?:\s+NCCL)?(?:\s+INFO)?\s*$")
_BORDERS = "│┃|║"


@dataclass(frozen=True)
class Connection:
    """One connection line: ``from_rank`` sends to ``to_rank`` on ``channel``.

    ``from_bracket``/``to_bracket`` are the bracket texts as printed (device or bus id:
    told apart for the whole log by :func:`read_log`); ``side`` is ``send``/``receive``
    for network lines; ``raw`` is the text after ``via``; ``transport`` its family
    (:func:`transport_family`); ``host``/``pid`` those of the process that printed it.
    """

    line: int
    form: str  # "ring" | "channel" | "channel/conn"
    channel: int
    conn: int | None
    from_rank: int
    to_rank: int
    from_bracket: str | None
    to_bracket: str | None
    side: str | None
    raw: str
    transport: str
    host: str | None
    pid: int | None

    @property
    def printer_rank(self) -> int:
        """The rank whose process printed the line (the receiver for ``[receive]``)."""
        return self.to_rank if self.side == "receive" else self.from_rank


@dataclass(frozen=True)
class Unread:
    """A line that looked like a connection but could not be read: ``line`` (1-based,
    in log ``source``), ``why`` in words, and the start of its ``text``."""

    line: int
    why: str
    text: str
    source: str | None = None  # the log's name when several were read

    def to_json(self) -> dict[str, object]:
        return {"line": self.line, "source": self.source, "why": self.why, "text": self.text}

    def __str__(self) -> str:
        where = f"{self.source}, line {self.line}" if self.source else f"line {self.line}"
        return f"{where}: {self.why} — {self.text}"


@dataclass
class RankInit:
    """What a rank's ``Init`` line says: its CUDA device, bus id (nvidia-smi form) and host,
    and (NCCL 2.16 and later) its NVML index — nvidia-smi's GPU number, which differs from
    the CUDA device where ``CUDA_VISIBLE_DEVICES`` picks or reorders GPUs."""

    rank: int
    nranks: int
    device: int
    busid: str | None
    host: str | None
    nvml: int | None = None


@dataclass
class NcclLog:
    """Everything :func:`read_log` found in one or more logs."""

    sources: list[str]
    lines: int = 0
    nccl_lines: int = 0
    connections: list[Connection] = field(default_factory=list)
    unread: list[Unread] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    hosts: list[str] = field(default_factory=list)
    env: dict[str, list[str]] = field(default_factory=dict)
    ib_devices: list[str] = field(default_factory=list)
    ib_not_found: bool = False
    networks: list[str] = field(default_factory=list)
    inits: list[RankInit] = field(default_factory=list)
    nnodes: list[int] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    bracket_kind: str = "device"  # "device" | "busid": what the brackets hold in this log

    @property
    def nranks(self) -> list[int]:
        """The distinct communicator sizes the ``Init`` lines name."""
        return sorted({init.nranks for init in self.inits})


def transport_family(raw: str) -> str | None:
    """The family of a transport text: ``P2P/IPC``, ``P2P/CUMEM``, ``P2P/direct``,
    ``SHM``, ``NET/Socket``, ``NET/IB``, ``NET/IBext`` or ``NET/<plugin name>``; None
    when ``raw`` is not, in full, a transport NCCL prints."""
    text = raw.strip()
    if match := _P2P.fullmatch(text):
        return "P2P/direct" if match["mode"] == "direct pointer" else f"P2P/{match['mode']}"
    if _SHM.fullmatch(text) or _SHM_OTHER.fullmatch(text):
        return "SHM"
    if match := _NET.fullmatch(text):
        name = match["name"]
        if name.startswith("IBext"):
            return "NET/IBext"
        return f"NET/{name}"
    return None


def _complete_transport(raw: str) -> bool:
    """True when ``raw`` cannot be the start of a longer transport text (so a line cut
    right after it still says the whole of it)."""
    return raw.endswith(("/read", "/CE", "/GDRDMA", "/Shared")) or _SHM.fullmatch(raw) is not None


def busid_from_nccl(text: str) -> str | None:
    """NCCL's printed bus id (``3e000``: the hex digits of ``0000:3e:00.0``) in
    nvidia-smi's form (``00000000:3E:00.0``); None if it is not hex."""
    try:
        value = int(text, 16)
    except ValueError:
        return None
    function, device, bus, domain = value & 0xF, (value >> 4) & 0xFF, (value >> 12) & 0xFF, value >> 20
    if function > 7 or device > 0x1F:
        return None
    return f"{domain:08X}:{bus:02X}:{device:02X}.{function}"


def _strip(line: str) -> str:
    """A line without its end-of-line, trailing spaces and terminal borders."""
    text = line.rstrip("\r\n").strip()
    while text and text[0] in _BORDERS:
        text = text[1:].lstrip()
    while text and text[-1] in _BORDERS:
        text = text[:-1].rstrip()
    return text


def _segments(text: str) -> list[str]:
    """A line cut where each connection body starts (two processes' lines merged)."""
    starts = [m.start() for m in _START.finditer(text)]
    if len(starts) <= 1:
        return [text[starts[0] :]] if starts else []
    return [text[s:e] for s, e in zip(starts, [*starts[1:], len(text)], strict=True)]


def _prefix_before(text: str, end: int) -> re.Match[str] | None:
    """The last NCCL prefix in ``text`` before ``end``."""
    found = None
    for match in _PREFIX.finditer(text, 0, end):
        found = match
    return found


def read_log(texts: list[tuple[str, str]]) -> NcclLog:
    """Read logs given as ``(text, name)``; line numbers are each text's own (1-based),
    named ``name:line`` in :class:`Unread` texts when more than one log is read."""
    log = NcclLog(sources=[name for _, name in texts])
    for text, name in texts:
        _read_one(log, text, name if len(texts) > 1 else None)
    _decide_brackets(log)
    return log


def _note_host(log: NcclLog, host: str | None) -> None:
    if host is not None and host not in log.hosts:
        log.hosts.append(host)


def _read_one(log: NcclLog, text: str, name: str | None) -> None:
    lines = text.split("\n")
    ends_cut = not text.endswith("\n")
    if not ends_cut:
        lines = lines[:-1]
    log.lines += len(lines)
    filled = [n for n, line in enumerate(lines, 1) if line.strip()]
    if filled and _CUT_PREFIX.match(_strip(lines[filled[-1] - 1])):
        log.unread.append(
            Unread(
                filled[-1],
                "the log ends inside a line's prefix (cut off)",
                _strip(lines[filled[-1] - 1])[:160],
                name,
            )
        )
    for number, line in enumerate(lines, 1):
        last = ends_cut and number == len(lines)
        clean = _strip(line)
        nccl = "NCCL" in clean
        log.nccl_lines += nccl
        prefix = _PREFIX.search(clean) if nccl else None
        _read_facts(log, clean, prefix)
        segments = _segments(clean) if "->" in clean else []
        if not segments:
            if "via" in clean and re.search(r"\bvia\s+(?:P2P|SHM|NET)/", clean) and not _GRAPH.search(clean):
                log.unread.append(
                    Unread(
                        number,
                        "a transport without its `Channel N : a -> b` start",
                        clean[:160],
                        name,
                    )
                )
            continue
        for index, segment in enumerate(segments):  # (several when lines were merged)
            merged = len(segments) > 1 and index < len(segments) - 1
            if len(segments) > 1:
                start = clean.find(segment)
                prefix = _prefix_before(clean, start if start >= 0 else len(clean))
            _read_segment(log, segment, prefix, number, name, merged=merged, last=last)


def _read_segment(
    log: NcclLog,
    segment: str,
    prefix: re.Match[str] | None,
    number: int,
    name: str | None,
    *,
    merged: bool,
    last: bool,
) -> None:
    match = _CONNECTION.search(segment)
    if match is None:
        if not _GRAPH.search(segment):
            why = (
                "cut off before `via …`"
                if "via" not in segment
                else "the pair or its transport cannot be read"
            )
            log.unread.append(Unread(number, why, segment[:160], name))
        return
    via = match["via"]
    glued = _GLUED.search(via)
    if glued is not None:
        via = via[: glued.start()]
    raw = via.strip()
    family = transport_family(raw)
    if family is None:
        why = "merged with another line" if (merged or glued) else f"unknown or cut transport {raw[:40]!r}"
        log.unread.append(Unread(number, why, segment[:160], name))
        return
    if glued is not None and not _complete_transport(raw) and not merged:
        log.unread.append(
            Unread(number, "merged with another line right after the transport", segment[:160], name)
        )
        return
    if last and not _complete_transport(raw):
        log.unread.append(
            Unread(number, "the last line has no line end (it may be cut off)", segment[:160], name)
        )
        return
    host = (prefix["host"] or None) if prefix is not None else None
    pid = int(prefix["pid"]) if prefix is not None else None
    _note_host(log, host)
    form = "ring" if match["form"] == "Ring" else ("channel/conn" if match["conn"] is not None else "channel")
    log.connections.append(
        Connection(
            line=number,
            form=form,
            channel=int(match["channel"]),
            conn=int(match["conn"]) if match["conn"] is not None else None,
            from_rank=int(match["a"]),
            to_rank=int(match["b"]),
            from_bracket=match["abr"],
            to_bracket=match["bbr"],
            side=match["side"],
            raw=raw,
            transport=family,
            host=host,
            pid=pid,
        )
    )


def _read_facts(log: NcclLog, line: str, prefix: re.Match[str] | None) -> None:
    """Version, settings, IB devices, networks, ranks' Init lines, warnings (each regex
    only on lines holding its key words: a 100,000-line log is read in well under 1 s)."""
    if "NCCL version" in line and (match := _VERSION.search(line)) and match["v"] not in log.versions:
        log.versions.append(match["v"])
    if prefix is not None and "NCCL INFO" in line:
        _note_host(log, prefix["host"] or None)
    if "NCCL_" not in line:
        pass
    elif match := _ENV.search(line) or _ENV_SHELL.match(line):
        values = log.env.setdefault(match["name"], [])
        if match["value"] not in values:
            values.append(match["value"])
    if "NET/IB" not in line:
        pass
    elif _IB_NONE.search(line):
        log.ib_not_found = True
    elif match := _IB_USING.search(line):
        for dev in _IB_DEVICE.finditer(match["rest"]):
            if dev["dev"] not in log.ib_devices:
                log.ib_devices.append(dev["dev"])
    if "Using network" in line and (match := _NETWORK.search(line)) and match["name"] not in log.networks:
        log.networks.append(match["name"])
    if "cudaDev" in line and (match := _INIT.search(line)):
        host = (prefix["host"] or None) if prefix is not None else None
        nvml = int(match["nvml"]) if match["nvml"] is not None else None
        init = RankInit(
            int(match["rank"]),
            int(match["nranks"]),
            int(match["dev"]),
            busid_from_nccl(match["busid"]),
            host,
            nvml,
        )
        if all(
            (i.rank, i.nranks, i.device, i.busid, i.host, i.nvml)
            != (init.rank, init.nranks, init.device, init.busid, init.host, init.nvml)
            for i in log.inits
        ):
            log.inits.append(init)
    if "nNodes" in line and (match := _NNODES.search(line)) and int(match["nnodes"]) not in log.nnodes:
        log.nnodes.append(int(match["nnodes"]))
    if (
        "WARN" in line
        and (match := _WARN.search(line))
        and len(log.warnings) < 20
        and match["msg"] not in log.warnings
    ):
        log.warnings.append(match["msg"])


def _decide_brackets(log: NcclLog) -> None:
    """Whether the brackets hold devices or bus ids, for the whole log: bus ids when any
    bracket is plainly one (hex letters, or four digits and more), or when the Init lines
    give every bracketed rank a bus id that equals its bracket and a device that does not."""
    brackets = [(c.from_rank, c.from_bracket) for c in log.connections] + [
        (c.to_rank, c.to_bracket) for c in log.connections
    ]
    texts = [b for _, b in brackets if b is not None]
    if any(len(b) >= 4 or not b.isdigit() for b in texts):
        log.bracket_kind = "busid"
        return
    by_rank = {i.rank: i for i in log.inits}
    votes: Counter[str] = Counter()
    for rank, bracket in brackets:
        init = by_rank.get(rank)
        if bracket is None or init is None:
            continue
        if str(init.device) == bracket:
            votes["device"] += 1
        elif init.busid is not None and busid_from_nccl(bracket) == init.busid:
            votes["busid"] += 1
    if votes["busid"] > votes["device"]:
        log.bracket_kind = "busid"
