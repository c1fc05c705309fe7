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

import functools
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from gpudiag.transport import rx
from gpudiag.transport.records import (
    Record,
    clean_text,
    ends_cut,
    one_record,
    physical_lines,
    records,
    visible,
)

#: A run of NUL bytes (a log written over a sparse or zeroed file).
_NULS = rx.compile(r"\x00++")
#: The body of a connection line, found anywhere in a record (prefixes vary).
_CONNECTION = rx.compile(
    r"\b(?P<form>Ring|Channel)\s++(?P<channel>\d++)(?:/(?P<conn>\d++))?\s*+:\s*+"
    r"(?P<a>\d++)(?:\[(?P<abr>[0-9a-fA-F]++)\])?\s*+->\s*+"
    r"(?P<b>\d++)(?:\[(?P<bbr>[0-9a-fA-F]++)\])?\s*+"
    r"(?:\[(?P<side>send|receive)\]\s*+)?"
    r"via\s++(?P<via>.*+)$"
)
#: Where a connection line starts (to split two merged lines and to spot damaged ones).
_START = rx.compile(r"\b(?:Ring|Channel)\s++\d++(?:/\d++)?\s*+:\s*+\d++(?:\[[0-9a-fA-F]*+\]?)?\s*+->")
#: A graph line: numbers (and arrows) only, never a connection.
_GRAPH = rx.compile(r"\b(?:Ring|Channel)\s++\d++(?:/\d++)?\s*+:(?:\d++|->|\s++)*+$")
#: A second line's prefix glued into a first one.
_GLUED = rx.compile(r":\d++:\d++\s++\[\d++\]\s++NCCL\b|\bNCCL\s++(?:INFO|WARN)\b")
_VIA = rx.compile(r"\bvia\s++(?:P2P|SHM|NET)/")

#: Transport texts as NCCL prints them after ``via``.
_P2P = rx.compile(r"P2P/(?P<mode>IPC|CUMEM|direct pointer)(?P<ext>(?:/(?:read|CE))*+)")
_SHM = rx.compile(r"SHM(?:/(?:direct|CE)/(?:direct|CE))?|direct shared memory")
#: SHM with modes this reader has not seen printed (still shared memory; never "complete").
_SHM_OTHER = rx.compile(r"SHM(?:/[A-Za-z]++){1,2}")
_NET = rx.compile(
    r"NET/(?P<name>[A-Za-z][A-Za-z0-9_ ]*+)/(?P<dev>\d++)(?:\(\d++\))?(?P<ext>(?:/(?:GDRDMA|Shared))*+)"
)

_VERSION = rx.compile(r"NCCL version (?P<v>\d{1,4}+\.\d{1,4}+\.\d{1,4}+)")
_INIT = rx.compile(
    r"\bcomm 0x[0-9a-fA-F]++ rank (?P<rank>\d++) nranks (?P<nranks>\d++) cudaDev (?P<dev>\d++)"
    r"(?: nvmlDev (?P<nvml>\d++))? busId (?P<busid>[0-9a-fA-F]++)"
)
_NNODES = rx.compile(r"\brank (?P<rank>\d++) nRanks (?P<nranks>\d++) nNodes (?P<nnodes>\d++)")
_ENV = rx.compile(r"\b(?P<name>NCCL_[A-Z0-9_]++) set by environment to (?P<value>\S*+)\s*+$")
_ENV_SHELL = rx.compile(r"^\s*+(?:export\s++|-x\s++)?(?P<name>NCCL_[A-Z0-9_]++)=(?P<value>\S*+)\s*+$")
_IB_USING = rx.compile(r"NET/IB\w*+\s*+:\s*+Using\b")
_IB_DEVICE = rx.compile(r"\[\d++\](?P<dev>[\w.-]++:\d++/(?:IB|RoCE|ETH)\w*+)")
_IB_NONE = rx.compile(r"NET/IB\w*+\s*+:\s*+No device found")
_NETWORK = rx.compile(r"\bUsing network (?P<name>.++)")
_WARN = rx.compile(r"\bNCCL WARN\s++(?P<msg>.++)")
#: A last line holding only the start of NCCL's prefix (``host:921``, ``host:1:2 [1] NCCL``).
_CUT_PREFIX = rx.compile(r"^[^\s:]*+:\d++(?::\d*+)?(?:\s++\[\d*+\]?)?(?:\s++NCCL)?(?:\s++INFO)?\s*+$")
_BORDERS = "│┃|║"
#: Distinct facts of one kind kept (versions, networks, warnings, IB devices): a log's real
#: ones are a handful; a hostile input's thousands cost nothing more.
MAX_FACTS = 64
#: A bracket number no CUDA device has (a host has at most a few dozen GPUs): a bus id.
MAX_DEVICE = 32


@dataclass(slots=True)
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
    source: str | None = None  # the log's name when several were read

    @property
    def process(self) -> tuple[str | None, str | None, int | None]:
        """The process that printed the line, as far as the log tells: (log, host, pid)."""
        return (self.source, self.host, self.pid)

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
    #: NCCL's ``GPU Direct RDMA Enabled/Disabled for …`` lines (the text after ``NCCL INFO``)
    gdr_lines: list[str] = field(default_factory=list)
    #: NVLS and CollNet lines (NVLink SHARP, in-network reduction), the text after ``NCCL INFO``
    collnet_nvls: list[str] = field(default_factory=list)
    #: NCCL WARN lines in all (``warnings`` keeps the distinct messages, at most MAX_FACTS)
    warn_lines: int = 0
    bracket_kind: str = "device"  # "device" | "busid" | "mixed": what the brackets hold
    #: what each printing process's brackets hold (see :func:`_decide_brackets`)
    kinds: dict[tuple[str | None, str | None, int | None], str] = field(default_factory=dict)
    #: (log, host) of every process that listed InfiniBand devices
    ib_where: set[tuple[str | None, str | None]] = field(default_factory=set)
    #: what the reader did that the user must know (NUL bytes skipped)
    notes: list[str] = field(default_factory=list)
    _seen: set[object] = field(default_factory=set, repr=False)
    _hosts: set[str] = field(default_factory=set, repr=False)

    def kind_of(self, conn: Connection) -> str:
        """``device`` or ``busid``: what ``conn``'s brackets hold."""
        return self.kinds.get(conn.process, "device")

    def add_once(self, items: list[Any], item: Any, limit: int = MAX_FACTS) -> None:
        """Append ``item`` to ``items`` unless it is there (a set keeps this O(1)) or
        ``items`` holds ``limit`` already."""
        key = (id(items), item)
        if key in self._seen or len(items) >= limit:
            return
        self._seen.add(key)
        items.append(item)

    @property
    def nranks(self) -> list[int]:
        """The distinct communicator sizes the ``Init`` lines name."""
        return sorted({init.nranks for init in self.inits})


@functools.lru_cache(maxsize=4096)
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
    if len(text) > 16:
        return None
    try:
        value = int(text, 16)
    except ValueError:
        return None
    function, device, bus, domain = value & 0xF, (value >> 4) & 0xFF, (value >> 12) & 0xFF, value >> 20
    if function > 7 or device > 0x1F:
        return None
    return f"{domain:08X}:{bus:02X}:{device:02X}.{function}"


def _strip(line: str) -> str:
    """A line without its surrounding spaces and terminal borders."""
    text = line.strip()
    while text and text[0] in _BORDERS:
        text = text[1:].lstrip()
    while text and text[-1] in _BORDERS:
        text = text[:-1].rstrip()
    return text


def _segments(text: str) -> list[str]:
    """A record cut where each connection body starts (two lines merged without a prefix
    between them)."""
    first = text.find("Ring")
    channel = text.find("Channel")
    first = channel if first < 0 or 0 <= channel < first else first
    if first < 0:
        return []
    starts = [m.start() for m in _START.finditer(text, first)]
    return [text[s:e] for s, e in zip(starts, [*starts[1:], len(text)], strict=False)]


def read_log(texts: list[tuple[str, str]]) -> NcclLog:
    """Read logs given as ``(text, name)``; line numbers are each text's own (1-based),
    named ``name:line`` in :class:`Unread` texts when more than one log is read."""
    log = NcclLog(sources=[visible(name) for _, name in texts])
    for text, name in texts:
        _read_one(log, text, visible(name) if len(texts) > 1 else None)
    _decide_brackets(log)
    return log


def _note_host(log: NcclLog, host: str | None) -> None:
    if host and host not in log._hosts:
        log._hosts.add(host)
        log.hosts.append(host)


def _nul_blocks(log: NcclLog, text: str, name: str | None) -> str:
    """``text`` with each block of NUL characters (a log cut by a crash on a network
    filesystem leaves one) made a line end, and a note saying so."""
    if "\x00" not in text:
        return text
    count = text.count("\x00")
    blocks = _NULS.findall(text)
    log.notes.append(
        f"{name or 'the log'}: {count} NUL byte(s) in {len(blocks)} block(s) skipped "
        "(what a crash leaves in a file that was being written)"
    )
    return _NULS.sub("\n", text)


def _read_one(log: NcclLog, text: str, name: str | None) -> None:
    text = clean_text(_nul_blocks(log, text, name))
    cut = ends_cut(text)
    if not cut and text:
        text = text[:-1]  # (no empty line after the last line end)
    last_number = text.count("\n") + 1 if text else 0
    log.lines += last_number
    end = text.rstrip()
    tail = _strip(end[end.rfind("\n") + 1 :])
    if tail and _CUT_PREFIX.match(tail):
        number = end.count("\n") + 1
        log.unread.append(Unread(number, "the log ends inside a line's prefix (cut off)", tail[:160], name))
    for number, line in physical_lines(text):
        clean = _strip(line)
        if not clean:
            continue
        single = one_record(clean) if "NCCL" in clean else Record(clean, None, None, False)
        if single is not None:
            log.nccl_lines += single.prefixed or "NCCL" in clean
            _read_record(log, single, number, name, last=cut and number == last_number)
            continue
        pieces = records(clean)
        log.nccl_lines += any(r.prefixed for r in pieces) or "NCCL" in clean
        for index, record in enumerate(pieces):
            last = cut and number == last_number and index == len(pieces) - 1
            _read_record(log, record, number, name, last=last)


def _read_record(log: NcclLog, record: Record, number: int, name: str | None, *, last: bool) -> None:
    text = record.text
    _read_facts(log, text, record, name)
    segments = _segments(text) if "->" in text else []
    if not segments:
        if "via" in text and _VIA.search(text) and not _GRAPH.search(text):
            log.unread.append(
                Unread(number, "a transport without its `Channel N : a -> b` start", text[:160], name)
            )
        return
    for index, segment in enumerate(segments):  # (several when lines were merged)
        merged = len(segments) > 1 and index < len(segments) - 1
        _read_segment(log, segment, record, number, name, merged=merged, last=last)


def _read_segment(
    log: NcclLog,
    segment: str,
    record: Record,
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
    host = record.host or None
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
            pid=record.pid,
            source=name,
        )
    )


def _read_facts(log: NcclLog, line: str, record: Record, name: str | None) -> None:
    """Version, settings, IB devices, networks, ranks' Init lines, warnings (each regex
    only on lines holding its key words: a 100,000-line log is read in well under 1 s)."""
    host = record.host or None
    if "NCCL version" in line and (match := _VERSION.search(line)):
        log.add_once(log.versions, match["v"])
    if record.prefixed and "NCCL INFO" in line:
        _note_host(log, host)
    if "NCCL_" in line and (match := _ENV.search(line) or _ENV_SHELL.match(line)):
        value = match["value"]
        value = value[:-1] if value.endswith(".") else value
        log.add_once(log.env.setdefault(match["name"], []), value)
    if "NET/IB" not in line or " via " in line:  # (a connection line lists no device)
        pass
    elif _IB_NONE.search(line):
        log.ib_not_found = True
    elif match := _IB_USING.search(line):
        for dev in _IB_DEVICE.finditer(line, match.end()):
            log.add_once(log.ib_devices, dev["dev"])
            log.ib_where.add((name, host))
    if "Using network" in line and (match := _NETWORK.search(line)):
        log.add_once(log.networks, match["name"].strip())
    if "cudaDev" in line and (match := _INIT.search(line)):
        nvml = int(match["nvml"]) if match["nvml"] is not None else None
        init = RankInit(
            int(match["rank"]),
            int(match["nranks"]),
            int(match["dev"]),
            busid_from_nccl(match["busid"]),
            host,
            nvml,
        )
        key = ("init", init.rank, init.nranks, init.device, init.busid, init.host, init.nvml)
        if key not in log._seen:
            log._seen.add(key)
            log.inits.append(init)
    if "nNodes" in line and (match := _NNODES.search(line)):
        log.add_once(log.nnodes, int(match["nnodes"]))
    if ("NVLS" in line or "CollNet" in line or "nvls channels" in line) and "set by environment" not in line:
        start = line.find("NCCL INFO")
        log.add_once(log.collnet_nvls, (line[start + 10 :] if start >= 0 else line)[:200], limit=16)
    if "GPU Direct RDMA" in line:
        log.add_once(log.gdr_lines, line[line.find("GPU Direct RDMA") :][:300])
    if "WARN" in line and (match := _WARN.search(line)):
        log.warn_lines += 1
        log.add_once(log.warnings, match["msg"].strip()[:300])


def _decide_brackets(log: NcclLog) -> None:
    """What the brackets hold, per process that printed them (a device-index log and a
    bus-id log read together, or two runs in one file, are never mixed up): bus ids when
    any of its brackets is plainly one (hex letters, four digits and more, or a number no
    CUDA device has: ``40`` is bus 0x40, ``0000:00:04.0`` on a cloud VM), or when the Init
    lines give its ranks a bus id that equals the bracket and a device that does not;
    else devices. ``bracket_kind`` sums them up (``mixed`` when both occur)."""
    by_process: dict[tuple[str | None, str | None, int | None], list[tuple[int, str]]] = {}
    for c in log.connections:
        found = by_process.setdefault(c.process, [])
        found += [(r, b) for r, b in ((c.from_rank, c.from_bracket), (c.to_rank, c.to_bracket)) if b]
    by_rank: dict[tuple[str | None, int], RankInit] = {}
    for init in log.inits:
        by_rank.setdefault((init.host, init.rank), init)
    for process, brackets in by_process.items():
        log.kinds[process] = _kind(brackets, by_rank, process[1])
    kinds = set(log.kinds.values())
    log.bracket_kind = "mixed" if len(kinds) > 1 else (kinds.pop() if kinds else "device")


def _kind(
    brackets: list[tuple[int, str]], by_rank: dict[tuple[str | None, int], RankInit], host: str | None
) -> str:
    if any(len(b) >= 4 or not b.isdigit() or int(b) >= MAX_DEVICE for _, b in brackets):
        return "busid"
    votes: Counter[str] = Counter()
    for rank, bracket in brackets:
        init = by_rank.get((host, rank))
        if init is None:
            continue
        if str(init.device) == bracket:
            votes["device"] += 1
        elif init.busid is not None and busid_from_nccl(bracket) == init.busid:
            votes["busid"] += 1
    return "busid" if votes["busid"] > votes["device"] else "device"
