"""What of an NCCL log goes into a report bundle (``gpudiag report --nccl-log FILE``).

The logs are bounded (:data:`MAX_BUNDLED_BYTES` in all: each log's first bytes, cut at a
line end, the rest dropped and said so), and with ``--anonymize`` every host name NCCL's
line prefixes give (``host:pid:tid``) becomes ``anon-host-N`` — one name per machine, so
pairs on one host stay on one host — before the :class:`~gpudiag.redact.Redactor` (IP
addresses, this machine's name, secrets) passes over them as over every bundle byte. The
check then reads the bundled text, not the original: the result in ``report.json`` and
``gpudiag replay``'s re-reading of the bundle come from the same bytes, so they agree.
Names already anonymised by their author (``<cluster_name>``, ``localhost``) are kept.
"""

from __future__ import annotations

from gpudiag.redact import Redactor
from gpudiag.transport import rx
from gpudiag.transport.analysis import placeholder
from gpudiag.transport.reader import read_log

#: All NCCL logs of one bundle together (bytes of UTF-8); a 64-rank INFO log is ~15 MB.
MAX_BUNDLED_BYTES = 16 << 20
#: Where the logs go inside the bundle.
FOLDER = "nccl"
#: The topology a live run's pairs were placed on, as a machine file inside the bundle.
MACHINE = f"{FOLDER}/machine.json"
_UNSAFE = rx.compile(r"[^A-Za-z0-9._-]+")


def bundle_names(names: list[str]) -> list[str]:
    """A distinct ``nccl/<i>-<name>`` per log (names made of safe characters only)."""
    return [f"{FOLDER}/{i}-{_UNSAFE.sub('_', name).strip('._') or 'log'}" for i, name in enumerate(names, 1)]


def bounded(
    texts: list[tuple[str, str]], limit: int = MAX_BUNDLED_BYTES
) -> tuple[list[tuple[str, str]], list[str]]:
    """``(text, name)`` of each log within ``limit`` bytes in all (each cut at a line end
    where the budget ends), and a note per log that was cut."""
    kept, notes, left = [], [], limit
    for text, name in texts:
        data = text.encode("utf-8", "surrogateescape")
        if len(data) > left:
            cut = data.rfind(b"\n", 0, left) + 1
            notes.append(
                f"{name}: only its first {cut} of {len(data)} bytes were bundled and read "
                f"(a bundle keeps {limit >> 20} MiB of NCCL log in all)"
            )
            data = data[:cut]
        left -= len(data)
        kept.append((data.decode("utf-8", "surrogateescape"), name))
    return kept, notes


#: A word that may be a host name and its domain (``node-7.hpc.example.org``): linear.
_WORD = rx.compile(r"(?<![\w.-])[\w-]++(?:\.[\w-]++)*+")
_WORDS = rx.compile(f"({_WORD.pattern})")
#: A domain label after a host name.
_LABEL = rx.compile(r"\.[A-Za-z][A-Za-z0-9-]*+")
#: A run between spaces and colons: how a host name of other characters stands in a prefix.
_RUNS = rx.compile(r"([^\s:]++)")


def _pseudonyms(texts: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Every host of the logs' NCCL prefixes as ``anon-host-N``, in one pass (no name
    replaced twice), as whole words, in any case (host names are; a launcher's line may
    capitalise it) and with the domain that follows it (``node-7.hpc.example.org``, as
    torchrun's failure summary writes it) — the domain is part of the name. Each text is
    scanned once, word by word, whatever the number of hosts (a set lookup per word)."""
    names: dict[str, str] = {}
    for host in read_log(texts).hosts:
        if len(host) >= 2 and not placeholder(host) and host.lower() not in names:
            names[host.lower()] = f"anon-host-{len(names) + 1}"
    if not names:
        return texts
    odd = {name for name in names if not _WORD.fullmatch(name)}
    out = []
    for text, name in texts:
        parts = _WORDS.split(text)  # (words at the odd places; each distinct word looked at once)
        masked = {word: _masked_word(word, names) for word in set(parts[1::2])}
        parts[1::2] = [masked[word] for word in parts[1::2]]
        text = "".join(parts)
        if odd:
            runs = _RUNS.split(text)
            runs[1::2] = [names.get(run.lower(), run) if run.lower() in odd else run for run in runs[1::2]]
            text = "".join(runs)
        out.append((text, name))
    return out


def _masked_word(word: str, names: dict[str, str]) -> str:
    """``word`` with the longest host name it starts with (ending at a dot or its end)
    and the domain labels after it replaced by the host's pseudonym."""
    if "." not in word:
        return names.get(word.lower(), word)
    cuts = [i for i, ch in enumerate(word) if ch == "."] + [len(word)]
    for cut in reversed(cuts):
        pseudonym = names.get(word[:cut].lower())
        if pseudonym is None:
            continue
        end = cut
        while (label := _LABEL.match(word, end)) is not None and (
            label.end() == len(word) or word[label.end()] == "."
        ):
            end = label.end()
        return pseudonym + word[end:]
    return word


def bundled_logs(
    texts: list[tuple[str, str]], *, anonymize: bool, limit: int = MAX_BUNDLED_BYTES
) -> tuple[list[tuple[str, str]], list[str]]:
    """``(text, bundle name)`` of each log as the bundle holds it (bounded, anonymised,
    redacted), and notes on what was cut."""
    kept, notes = bounded(texts, limit)
    if anonymize:
        kept = _pseudonyms(kept)
    redactor = Redactor(anonymize=anonymize)
    names = bundle_names([name for _, name in kept])
    return [(redactor.text(text), bundled) for (text, _), bundled in zip(kept, names, strict=True)], notes
