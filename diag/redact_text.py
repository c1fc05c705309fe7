"""The scanners behind :class:`gpudiag.redact.Redactor` that a regular expression alone
would make slow or leaky: PEM private-key blocks, credentials in URLs, and the values of
secret-named assignments (``NAME=value``, ``"name": value``, ``--name value``).

Every function here runs in time linear in its text, whatever the text holds (issue 44:
one 300 KB hex line took 94 s through the old patterns): each pattern may start only where
a run of its characters starts (a look-behind), bounds what it may repeat, and every
position is passed over a bounded number of times; what a pattern cannot do in one
forward pass (find the last ``@`` of a URL, the end of a ``[…]`` value) is done with one
``str.find`` / ``rfind`` whose result is reused for every later match in the same stretch.
"""

from __future__ import annotations

import re
from collections.abc import Callable

MARK = "<redacted: set>"
URL_MARK = "<redacted>"

# --- PEM private keys -----------------------------------------------------------------

#: The line that opens a private key: OpenSSH, PKCS#1 (RSA, DSA, EC), PKCS#8 (plain and
#: ENCRYPTED), PGP's ``PRIVATE KEY BLOCK``; a few dashes may be missing (a cut line).
_PEM_BEGIN = re.compile(
    r"-{0,5}BEGIN[ A-Z0-9]{0,40}PRIVATE KEY(?: BLOCK)?-{0,5}"
    # an OpenSSH key's body, whose lines around it were cut: base64 of "openssh-key-v1"
    r"|(?<![A-Za-z0-9+/])b3BlbnNzaC1rZXktdjE"
)
_PEM_END = re.compile(r"-{2,5}END[ A-Z0-9]{0,40}PRIVATE KEY(?: BLOCK)?-{0,5}")
#: What a key's body can hold where its END line is missing (a cut block): base64, blanks,
#: newlines written as ``\n`` in a JSON log line, and the ``Proc-Type: 4,ENCRYPTED`` /
#: ``DEK-Info: AES-128-CBC,…`` header lines of an encrypted PKCS#1 key.
_PEM_BODY = re.compile(r"[A-Za-z0-9+/=\s\\:,.-]*")


def pem_blocks(text: str) -> str:
    """Every private-key block replaced by :data:`MARK`, whole: from its BEGIN line to its
    END line; a block cut after its BEGIN line to the end of its body; an END line without
    its BEGIN (a log cut in front) back to the start of the body before it."""
    if "PRIVATE KEY" not in text and "b3BlbnNzaC1rZXktdjE" not in text:
        return text
    out: list[str] = []
    done = 0
    end_match: re.Match[str] | None = None
    end_searched_from = -1
    pos = 0
    while (begin := _PEM_BEGIN.search(text, pos)) is not None:
        if end_searched_from < 0 or (end_match is not None and end_match.start() < begin.end()):
            end_match = _PEM_END.search(text, begin.end())  # (reused until passed: linear)
            end_searched_from = begin.end()
        if end_match is not None:
            stop = end_match.end()
        else:
            body = _PEM_BODY.match(text, begin.end())
            stop = body.end() if body else begin.end()
            stop = _trim_body(text, begin.end(), stop)
        out += [text[done : begin.start()], MARK]
        done = pos = stop
    text = "".join(out) + text[done:]
    # an END line left without its BEGIN (cut in front): its body goes with it
    out, done = [], 0
    for end in _PEM_END.finditer(text):
        behind = _PEM_BODY.match(text[done : end.start()][::-1])  # (the body, read backwards)
        start = end.start() - (behind.end() if behind else 0)
        while start < end.start() and text[start] in " \t\r\n":
            start += 1
        out += [text[done:start], MARK]
        done = end.end()
    return "".join(out) + text[done:]


def _trim_body(text: str, start: int, stop: int) -> int:
    """A cut body ends at its last base64 character (the blanks after it stay)."""
    while stop > start and text[stop - 1] in " \t\r\n":
        stop -= 1
    return stop


# --- credentials in URLs --------------------------------------------------------------

#: The ``://`` after a URL's scheme (whatever comes before it: ``--urlhttps://``).
_SCHEME = re.compile(r"(?<=[A-Za-z0-9+.-])://")
#: What ends the stretch a URL's userinfo may take: blanks and quotes.
_URL_STOP = re.compile(r"[\s\"'`]")


def url_credentials(text: str) -> str:
    """``scheme://user:pass@host`` → ``scheme://<redacted>@host``. The userinfo runs to the
    *last* ``@`` before the next blank or quote, so a password holding ``/`` or ``@``
    (``postgres://bob:pa/ss@db``, ``…:p@ss@db``) goes whole; it is credentials when a ``:``
    comes before the first ``/`` (``git+https://host/repo@v1`` stays)."""
    if "://" not in text:
        return text
    out: list[str] = []
    done = 0
    run_end = last_at = -1
    for scheme in _SCHEME.finditer(text):
        start = scheme.end()
        if start < done:
            continue
        if start > run_end:  # a new stretch: where it ends and its last @, found once
            stop = _URL_STOP.search(text, start)
            run_end = stop.start() if stop else len(text)
            last_at = text.rfind("@", start, run_end)
        if last_at < start:
            continue
        slash = text.find("/", start, last_at)
        colon = text.find(":", start, last_at if slash < 0 else slash)
        if colon < 0 or text[start:last_at] == URL_MARK:
            continue
        out += [text[done:start], URL_MARK]
        done = last_at
    return "".join(out) + text[done:]


# --- secret-named assignments -----------------------------------------------------------

#: ``NAME=`` / ``NAME: `` / ``"name": `` / ``--name=``: a name (at most 128 characters) only
#: where a run of name characters starts, then its separator.
KEY = re.compile(
    r"(?<![\w.-])(?P<quote>[\"']?)(?P<name>-{0,2}[A-Za-z_][\w.-]*)(?P=quote)(?P<sep>[ \t]*[=:][ \t]*)"
)
_SCHEME_WORD = re.compile(r"(?:[Bb]earer|[Bb]asic|[Tt]oken|Digest)[ \t]+")
_ALREADY = re.compile(r"<redacted[^<>\n]{0,20}>")
#: A bare value: up to a blank or a quote; after a quoted name (JSON, a Python dict's
#: repr), also up to ``,]}`` — it becomes a quoted marker and the brace after it stays.
_BARE = re.compile(r"[^\s\"']+")
_BARE_JSON = re.compile(r"[^\s\"',\]}]+")
#: The pieces of a ``[…]`` / ``{…}`` value: a string (to its closing quote, or the line's
#: end), a bracket, a newline; the text between them is skipped by the search.
_CONTAINER = re.compile(r"(?P<q>[\"'])(?:(?!(?P=q))[^\\\n]|\\.)*(?P<close>(?P=q))?|[\[\]{}\n]")
#: ``--name value`` on a command line.
FLAG = re.compile(r"(?<![\w-])(?P<flag>--?[A-Za-z][\w-]*)(?P<sep>[ \t]+)")


#: What every secret name holds, upper-cased (see :func:`gpudiag.redact.is_secret_name`:
#: its words, endings, prefixes and exact names): a name without any is not secret, so
#: only the names around these are looked at.
HINTS = (
    "TOKEN", "SECRET", "PASS", "CRED", "COOKIE", "PRIVATE", "KEY", "AUTH", "DSN", "PWD", "SESSION",
    "AWS", "AZURE", "DATABASE",
)  # fmt: skip
#: The hints, found in the text's ASCII letters upper-cased (:func:`_probe`: same length).
_HINT = re.compile("|".join(HINTS).encode())
#: The ASCII characters of a name (a hint after another one is inside a longer name).
_NAME_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")
#: What a name or its quote can start with (a nested label is looked for only there).
_KEY_STARTS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz_-\"'")
#: Name characters, matched on the reversed text to find where the name around a hint starts.
_NAME_BACK = re.compile(r"[\w.-]*")


def assignments(text: str, secret: Callable[[str], bool]) -> str:
    """Values of secret-named assignments and options replaced by :data:`MARK`: a quoted
    value keeps its quotes; a number, ``true``/``false`` or ``[…]``/``{…}`` after a quoted
    name (JSON written as text) becomes ``"<redacted: set>"`` and the ``,``/``}`` after it
    stays. A name that is not secret does not hide what follows it (``cfg: HF_TOKEN=…``),
    and a secret name that labels another (``secret: token: x``) leaves the value to it.

    Only the names around a :data:`HINTS` word are read (each name once: linear), and not
    at all in text without one."""
    probe = text.encode("ascii", "replace").upper()  # (one byte a character: positions agree)
    if not any(hint.encode() in probe for hint in HINTS):
        return text
    reverse = text[::-1]
    out: list[str] = []
    done = pos = 0
    for hint in _HINT.finditer(probe):
        if hint.start() < pos:
            continue
        run = hint.start()
        if run and text[run - 1] in _NAME_CHARS:  # (the name starts before its hint)
            behind = _NAME_BACK.match(reverse, len(text) - run)
            run -= behind.end() - behind.start() if behind else 0
        start = run - 1 if run and text[run - 1] in "\"'" else run
        key = KEY.match(text, start) or (KEY.match(text, run) if start != run else None)
        if key is None or not secret(key.group("name")):
            option = FLAG.match(text, run)
            span = (
                _value(text, option.end(), option["sep"], "") if option and secret(option["flag"]) else None
            )
            if span is not None:
                out += [text[done : span[0]], span[2]]
                done = pos = span[1]
            else:
                ahead = _NAME_BACK.match(text, hint.start())
                pos = ahead.end() if ahead else hint.end()
            continue
        value = key.end()
        while (
            value < len(text)
            and text[value] in _KEY_STARTS
            and (nested := KEY.match(text, value)) is not None
            and secret(nested.group("name"))
        ):
            key, value = nested, nested.end()  # a label before the real one
        span = _value(text, value, key.group("sep"), key.group("quote"))
        if span is None:
            pos = max(value, key.end("name"))
            continue
        begin, end, replacement = span
        out += [text[done:begin], replacement]
        done = pos = end
    return "".join(out) + text[done:]


def _value(text: str, start: int, sep: str, quote: str) -> tuple[int, int, str] | None:
    """Where the value at ``start`` begins and ends and what replaces it, or None when
    there is none to hide (empty, already redacted, an option after blanks)."""
    if start >= len(text):
        return None
    scheme = _SCHEME_WORD.match(text, start) if text[start] in "BbTtD" else None
    if scheme is not None:
        start = scheme.end()
        if start >= len(text):
            return None
    if text[start] == "<" and _ALREADY.match(text, start):
        return None
    first = text[start]
    if first in "\"'":
        close = text.find(first, start + 1)
        if close < 0:
            line = text.find("\n", start + 1)
            return start, len(text) if line < 0 else line, f"{first}{MARK}"
        return start, close + 1, f"{first}{MARK}{first}"
    if first in "[{":
        end = _container_end(text, start)
        if not quote:  # a shell-style value goes on to the next blank
            bare = _BARE.match(text, end)
            end = bare.end() if bare else end
        return start, end, f"{quote}{MARK}{quote}"
    if first in " \t\r\n" or (first == "-" and sep[-1:] in (" ", "\t")):
        return None
    bare = (_BARE_JSON if quote else _BARE).match(text, start)
    if bare is None or (quote and bare.group(0) in ("null", "None")):
        return None
    return start, bare.end(), f"{quote}{MARK}{quote}"


#: Strings and brackets of one ``[…]`` value read at most; past them, it runs to the line's end.
_MAX_PIECES = 4096


def _container_end(text: str, start: int) -> int:
    """The end of the ``[…]`` or ``{…}`` at ``start``: after its matching bracket, or at
    the end of the line (or text) when it is cut. Strings inside are skipped whole."""
    depth = 0
    for count, piece in enumerate(_CONTAINER.finditer(text, start)):
        if count > _MAX_PIECES:  # (bounded work: the rest of the line goes too)
            line = text.find("\n", piece.start())
            return len(text) if line < 0 else line
        token = piece.group(0)
        if token == "\n":
            return piece.start()
        if token in "[{":
            depth += 1
        elif token in "]}":
            depth -= 1
            if depth <= 0:
                return piece.end()
        elif piece.group("close") is None:  # a string cut at the line's end
            line = text.find("\n", piece.end())
            return len(text) if line < 0 else line
    return len(text)
