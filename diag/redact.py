"""Secrets never leave the machine: the one filter every byte of a report passes through.

A :class:`Redactor` replaces, in any text:

- the values of environment variables whose *names* look secret (:func:`is_secret_name`:
  ``HF_TOKEN``, ``DB_PWD``, ``MY_SERVICE_CREDS``, ``WANDB_API_KEY``, ``PASSWD``, ``AWS_*`` …,
  but not ``max_tokens``, ``session_length``, ``auth_mode``, ``passthrough``) — as
  ``NAME=<redacted: set>`` where the name shows, and the literal value wherever else it
  appears (a rank log that echoes it);
- ``NAME=value``, ``NAME: value``, ``--name=value`` and ``--name value`` for secret names,
  and ``Bearer <token>`` anywhere;
- credentials inside URLs: ``https://user:pass@host`` → ``https://<redacted>@host``;
- token-shaped strings anywhere: Hugging Face ``hf_…``, GitHub ``ghp_…``/``github_pat_…``,
  OpenAI/Anthropic ``sk-…``, AWS access keys ``AKIA…``, Slack ``xox?-…``, JWTs ``eyJ….eyJ….…``;
- GPU UUIDs (``GPU-8c1f…``), as ``torch.utils.collect_env`` does.

With ``anonymize`` it also masks the host name, IPv4/IPv6 addresses, the user name (in
``/home/<user>`` paths and alone) and ``MASTER_ADDR``. The name list follows
``../shared/reference/failure-modes.md`` §4.5.

A JSON file is redacted by walking its parsed data (:meth:`Redactor.bytes`), so no pattern
can cross the end of a string: what was valid JSON stays valid JSON.
"""

from __future__ import annotations

import functools
import getpass
import itertools
import json
import os
import re
from collections.abc import Mapping
from typing import Any

from gpudiag.redact_text import MARK, assignments, pem_blocks, url_credentials

#: Words that make a variable name secret wherever they stand (``HF_TOKEN``, ``DB_CREDS``).
_SECRET_WORDS = frozenset(
    {"TOKEN", "SECRET", "SECRETS", "PASSWORD", "PASSWORDS", "PASSWD", "PASSPHRASE", "PASS", "CREDS"}
    | {"CREDENTIAL", "CREDENTIALS", "COOKIE", "COOKIES", "PRIVATE", "APIKEY", "AUTHORIZATION", "DSN"}
)
#: Words that make a name secret as its last word only (``DB_PWD`` but not ``PWD``, the
#: working directory; ``API_KEY`` but not ``KEY_PATH``; ``BASIC_AUTH`` but not ``auth_mode``).
_SECRET_LAST_WORDS = frozenset({"PWD", "KEY", "AUTH", "SESSION"})
#: Endings that make one word secret (``HFTOKEN``, ``DBPASSWORD``; not ``TOKENS``, ``TOKENIZER``).
_SECRET_ENDINGS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "APIKEY")
_SECRET_PREFIXES = ("AWS_", "AZURE_")
_SECRET_EXACT = frozenset({"DATABASE_URL", "KEY", "AUTH", "SESSION"})
_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")
#: Token shapes worth scrubbing anywhere, whatever variable or log line holds them.
#: What every token shape of :data:`_TOKENS` holds (text without any is not searched).
_TOKEN_FIXED = ("hf_", "gh", "github_pat_", "sk-", "AKIA", "xox", "eyJ")
#: Token shapes; a token may follow a digit or punctuation (``10.0.0.1hf_…`` in a log
#: line), not a letter (then it is part of a longer word).
_TOKENS = re.compile(
    r"(?<![A-Za-z])(?:hf_[A-Za-z0-9]{20,}"
    r"|(?:ghp|gho|ghu|ghs|ghr)_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}"
    r"|sk-(?:[A-Za-z0-9_-]{2,}-)?[A-Za-z0-9_-]{16,}"
    r"|AKIA[0-9A-Z]{16}\b"
    r"|xox[abposr]-[A-Za-z0-9-]{10,}"
    r"|(?<![\w-])eyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]*)"
)
#: ``Bearer <token>`` (an ``Authorization`` header in a log line), whatever precedes it.
_BEARER = re.compile(r"\b(?P<scheme>[Bb]earer)\s+[A-Za-z0-9._~+/=-]{8,}")
_GPU_UUID = re.compile(r"\b(GPU|MIG)-[0-9a-fA-F]{8}(?:-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}\b")
#: A package whose versions have four parts (``nvidia-cublas 13.1.1.3``, ``nvidia-cudnn-cu13
#: 9.24.0.43``): a dotted quad after its name is its version, not an address.
_PACKAGE = (
    r"(?:nvidia-(?!smi\b)[a-z0-9-]+|torch(?:vision|audio)?|triton|numpy|cudnn[a-z0-9-]*|nccl[a-z0-9-]*)"
)
_PACKAGE_NAME = re.compile(_PACKAGE)
_IPV4 = re.compile(r"(?<![\d.])(?:\d{1,3}\.){3}\d{1,3}(?![\d.])")
#: What stands right before a version: a package name and ``==``, ``=``, ``:``, ``|`` or
#: blanks (pip freeze, ``env``'s table, JSON text), or ``v`` / ``version`` — written
#: backwards, matched on the reversed text before a dotted quad (an anchored match:
#: bounded work per address, where a search ending there tried every start).
_VERSION_BEFORE_REVERSED = re.compile(
    r"[\"']?(?:==|[ \t]*[:=|][ \t]*|[ \t]+)[\"']?"
    r"(?:[a-z0-9-]*?[a-z0-9](?<!\bims)-aidivn|(?:noisiv|oidua)?hcrot|notirt|ypmun|[a-z0-9-]*nnduc|[a-z0-9-]*lccn)"
    r"(?![\w.-])"
    r"|(?:[Vv]|[ \t]*[:=]?[ \t]*noisre[Vv])(?!\w)"
)
#: The characters a version's prefix can end with (anything else before a quad: an address).
_VERSION_LAST = frozenset("=:| \t\"'vVn")
_DOTTED_QUAD = re.compile(r"\d{1,3}(?:\.\d{1,3}){3}")
_H = r"[0-9a-fA-F]{1,4}"
_V4 = r"(?:\d{1,3}\.){3}\d{1,3}"
#: Every form of an IPv6 address (RFC 4291 §2.2): eight groups; compressed with ``::``
#: anywhere, also at the end (``2001:db8:85a3::``, ``fe80::``) or the start (``::1``); an
#: IPv4 address in the last 32 bits (``::ffff:192.0.2.1``); a zone id after ``%``
#: (``fe80::1%eth0``: the interface name stays). At most eight groups: bounded work.
_IPV6_BODY = (
    rf"(?:(?:{_H}:){{7}}{_H}|(?:{_H}:){{6}}{_V4}"
    rf"|{_H}(?::{_H}){{0,6}}::(?:(?:{_H}:){{0,5}}{_V4}|{_H}(?::{_H}){{0,6}})?"
    rf"|::(?:(?:{_H}:){{0,5}}{_V4}|{_H}(?::{_H}){{0,6}}))"
    r"(?![\w:]|\.\d)"
)
_IPV6 = re.compile(rf"(?<![\w:.]){_IPV6_BODY}")
#: What every IPv6 address holds: ``::``, or a hex digit on each side of a colon.
_IPV6_HINT = re.compile(r"::|[0-9a-fA-F]:[0-9a-fA-F]")
#: An address after its interface, as NCCL prints them (``[1]ib0:fe80::1%ib0<0>``,
#: ``Using eth0:2001:db8::5<0>``): the colon after the name hid it from :data:`_IPV6`.
_IPV6_AFTER_INTERFACE = re.compile(rf"(?<![\w:.-])(?P<interface>[A-Za-z][\w.-]{{0,30}}:){_IPV6_BODY}")
_HOME = re.compile(r"(/home/|/Users/)([^/\s\"'<>`]+)")
#: Literal values shorter than this are not scrubbed by value (``1``, ``true`` would
#: take half the report with them); their variable still shows as set.
MIN_SECRET_LENGTH = 4


def is_secret_name(name: str) -> bool:
    """Whether a variable, key or option called ``name`` holds a secret, judged by its words
    (split at ``_``, ``-``, ``.`` and camelCase): ``HF_TOKEN``, ``DB_PWD``, ``apiKey``,
    ``--api-key`` and ``SESSION_ID`` do; ``max_tokens``, ``session_length``, ``auth_mode``,
    ``passthrough``, ``bypass`` and ``PWD`` do not."""
    name = name.strip().lstrip("-")
    upper = name.upper().replace("-", "_").replace(".", "_")
    if upper in _SECRET_EXACT or upper.startswith(_SECRET_PREFIXES):
        return True
    words = [w.upper() for w in _WORD.findall(name)]
    if not words:
        return False
    if any(w in _SECRET_WORDS or w.endswith(_SECRET_ENDINGS) for w in words):
        return True
    if len(words) > 1 and words[-1] in _SECRET_LAST_WORDS:
        return True
    # SESSION_ID, SESSION_KEY: a session named by what identifies it
    return any(a == "SESSION" and b in ("ID", "KEY") for a, b in itertools.pairwise(words))


def flagged_settings(environ: Mapping[str, str]) -> dict[str, str]:
    """Security-relevant toggles to flag, not hide (``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``
    makes ``torch.load`` unpickle arbitrary objects again)."""
    names = ("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    return {name: environ[name] for name in names if name in environ}


class Redactor:
    """Scrubs secrets (always) and identities (with ``anonymize``) from text and JSON."""

    def __init__(
        self,
        environ: Mapping[str, str] | None = None,
        *,
        anonymize: bool = False,
        hostname: str | None = None,
        user: str | None = None,
    ):
        environ = os.environ if environ is None else environ
        self.anonymize = anonymize
        self.secret_names = sorted(name for name in environ if is_secret_name(name))
        values = {environ[name] for name in self.secret_names}
        values |= {m.group(0) for v in environ.values() for m in _TOKENS.finditer(v)}
        self.replacements: list[tuple[str, str]] = [
            (v, MARK) for v in sorted(values, key=len, reverse=True) if len(v.strip()) >= MIN_SECRET_LENGTH
        ]
        self.user = (user if user is not None else _user()) if anonymize else None
        identities: list[tuple[str, str]] = []
        if anonymize:
            hosts = [hostname] if hostname is not None else _host_names()
            identities = [(name, "<host>") for host in hosts for name in (host, host.split(".")[0])]
            identities.append((environ.get("MASTER_ADDR", ""), "<master-addr>"))
        #: Host names and MASTER_ADDR, as whole words only (a short host name must not eat
        #: parts of other words).
        self._identities = [
            (name, re.compile(rf"(?<![\w.-]){re.escape(name)}(?![\w-])"), mark)
            for name, mark in identities
            if len(name) >= 3
        ]
        self._literal = (
            re.compile("|".join(re.escape(v) for v, _ in self.replacements)) if self.replacements else None
        )
        self._marks = dict(self.replacements)

    def env_value(self, name: str, value: str) -> str:
        """What a report shows for variable ``name``: the marker for secrets, else the
        value scrubbed like any text."""
        if is_secret_name(name):
            return MARK
        if self.anonymize and name == "MASTER_ADDR":
            return "<master-addr>"
        return self.text(value)

    def text(self, text: str) -> str:
        """``text`` with every secret (and, anonymizing, identity) replaced. Idempotent:
        passes repeat until one changes nothing (a replaced address can make the host name
        after it a whole word), so redacting redacted text changes nothing."""
        for _ in range(_MAX_PASSES):
            out = self._pass(text)
            if out == text:
                break
            text = out
        return text

    def _pass(self, text: str) -> str:
        """One pass of every pattern over ``text``. Each pattern runs in linear time
        (:mod:`gpudiag.redact_text`); one whose fixed part the text lacks is not run."""
        text = pem_blocks(text)
        if self._literal is not None:
            text = self._literal.sub(lambda m: self._marks[m.group(0)], text)
        text = url_credentials(text)
        if "earer" in text:
            text = _BEARER.sub(lambda m: f"{m.group('scheme')} {MARK}", text)
        if any(fixed in text for fixed in _TOKEN_FIXED):
            text = _TOKENS.sub(MARK, text)
        if "GPU-" in text or "MIG-" in text:
            text = _GPU_UUID.sub(lambda m: f"{m.group(1)}-<uuid>", text)
        text = assignments(text, _secret_name)
        if self.anonymize:
            for name, pattern, mark in self._identities:
                if name in text:
                    text = pattern.sub(mark, text)
            if _IPV6_HINT.search(text):
                text = _IPV6_AFTER_INTERFACE.sub(lambda m: f"{m.group('interface')}<ip>", text)
                text = _IPV6.sub("<ip>", text)
            if "." in text:
                text = _IPV4.sub(_address, text)
            if "/home/" in text or "/Users/" in text:
                text = _HOME.sub(lambda m: f"{m.group(1)}<user>", text)
            if self.user and len(self.user) >= 3 and self.user in text:
                text = re.sub(rf"\b{re.escape(self.user)}\b", "<user>", text)
        return text

    def data(self, value: Any) -> Any:
        """A JSON-like structure with every string (keys included) passed through :meth:`text`;
        under a key that names a secret (``"HF_TOKEN": …``) or after an option that does
        (``["--api-key", …]``) every string and number, at any depth, gets the marker (a
        list or object keeps its shape). Null stays; so do numbers and booleans elsewhere."""
        return self._walk(value, {})

    def _walk(self, value: Any, seen: dict[str, str]) -> Any:
        """:meth:`data`, scrubbing each distinct string once (traces repeat theirs)."""
        if isinstance(value, str):
            if value not in seen:
                seen[value] = self.text(value)
            return seen[value]
        if isinstance(value, Mapping):
            out = {}
            for k, v in value.items():
                key = self._walk(k if isinstance(k, str) else str(k), seen)
                if isinstance(k, str) and _is_secret_key(k):
                    out[key] = _hidden(v)
                elif isinstance(v, str) and self.anonymize and _is_version(k, v):
                    out[key] = v
                else:
                    out[key] = self._walk(v, seen)
            return out
        if isinstance(value, (list, tuple)):
            out_list = []
            for i, v in enumerate(value):
                before = value[i - 1] if i else None
                secret = isinstance(before, str) and _is_secret_flag(before)
                out_list.append(_hidden(v) if secret else self._walk(v, seen))
            return out_list
        return value

    def bytes(self, data: bytes) -> bytes:
        """A file's bytes redacted. JSON (an object, array or string) is parsed, walked
        with :meth:`data` and written back in its own layout, so its structure survives;
        anything else is scrubbed as text (bytes that are not UTF-8 pass through as they are,
        and secrets around them are still found)."""
        document = _json_document(data)
        if document is not None:
            indent, end = _layout(data)
            return (json.dumps(self.data(document[0]), indent=indent) + end).encode()
        text = data.decode("utf-8", "surrogateescape")
        return self.text(text).encode("utf-8", "surrogateescape")


def _hidden(value: Any) -> Any:
    """What a secret-named key's value becomes: the marker for every string, number and
    boolean in it, at any depth (a key below it too: ``{"<redacted: set 1>": …}``); a list
    or object keeps its length, null and an empty string stay (nothing was set)."""
    if value is None or value == "":
        return value
    if isinstance(value, Mapping):
        if len(value) == 1:
            return {MARK: _hidden(next(iter(value.values())))}
        return {f"<redacted: set {i}>": _hidden(v) for i, v in enumerate(value.values(), 1)}
    if isinstance(value, (list, tuple)):
        return [_hidden(v) for v in value]
    return MARK


def _address(match: re.Match[str]) -> str:
    """``<ip>`` for a dotted quad, unless it is a package's four-part version."""
    text, start = match.string, match.start()
    if start and text[start - 1] in _VERSION_LAST:
        before = text[max(0, start - 80) : start][::-1]
        if _VERSION_BEFORE_REVERSED.match(before):
            return match.group(0)
    return "<ip>"


def _is_version(key: Any, value: str) -> bool:
    """A package's version under its name (``"nvidia-cublas": "13.1.1.3"``): left as it is."""
    return isinstance(key, str) and bool(_PACKAGE_NAME.fullmatch(key) and _DOTTED_QUAD.fullmatch(value))


#: Keys and options longer than this are not names (nor secret ones): a bound on the work
#: and on what the caches below keep alive.
_MAX_NAME = 256


@functools.lru_cache(maxsize=4096)
def _is_secret_key(key: str) -> bool:
    return len(key) <= _MAX_NAME and bool(_NAME.fullmatch(key)) and is_secret_name(key)


@functools.lru_cache(maxsize=4096)
def _is_secret_flag(word: str) -> bool:
    """``--api-key``, ``-token``: an option whose value (the next word) is a secret."""
    if len(word) > _MAX_NAME or not word.startswith("-"):
        return False
    return bool(_NAME.fullmatch(word.lstrip("-"))) and is_secret_name(word)


def _json_document(data: bytes) -> tuple[Any] | None:
    """``(document,)`` when ``data`` is a JSON object, array or string, else None."""
    if data.lstrip()[:1] not in (b"{", b"[", b'"'):
        return None
    try:
        return (json.loads(data),)
    except (ValueError, RecursionError):
        return None


def _layout(data: bytes) -> tuple[int | None, str]:
    """The indent and the trailing newline of a JSON file as it was written."""
    match = re.match(rb"\s*[\[{]\r?\n( *)", data)
    indent = len(match.group(1)) if match and match.group(1) else None
    return indent, "\n" if data.endswith(b"\n") else ""


#: A variable, key or option name: ``HF_TOKEN``, ``api-key``, ``auth.token``.
_NAME = re.compile(r"[A-Za-z_][\w.-]*")
#: Passes of :meth:`Redactor.text` at most (two suffice for every input seen).
_MAX_PASSES = 4


def _secret_name(name: str) -> bool:
    """:func:`is_secret_name`, remembered for names of at most :data:`_MAX_NAME` characters
    (a longer one is judged each time, and never kept)."""
    return _secret_short_name(name) if len(name) <= _MAX_NAME else is_secret_name(name)


@functools.lru_cache(maxsize=4096)
def _secret_short_name(name: str) -> bool:
    return is_secret_name(name)


def _host_names() -> list[str]:
    """The override (``GPUDIAG_HOSTNAME``) and the machine's own name: both are masked."""
    from gpudiag.identity import host_names

    return host_names()


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return ""
