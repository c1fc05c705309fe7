"""Secrets never leave the machine: the one filter every byte of a report passes through.

A :class:`Redactor` replaces, in any text:

- the values of environment variables whose *names* look secret (``TOKEN``, ``SECRET``,
  ``PASSWORD``, ``API_KEY``, ``*_KEY``, ``CREDENTIAL``, ``AUTH``, ``COOKIE``, ``SESSION``,
  ``PRIVATE``, ``AWS_*``, ``DATABASE_URL`` …) — as ``NAME=<redacted: set>`` where the name
  shows, and the literal value wherever else it appears (a log that echoes it);
- credentials inside URLs: ``https://user:pass@host`` → ``https://<redacted>@host``;
- token-shaped strings anywhere: Hugging Face ``hf_…``, GitHub ``ghp_…``/``github_pat_…``,
  OpenAI/Anthropic ``sk-…``, AWS access keys ``AKIA…``, Slack ``xox?-…``, JWTs ``eyJ….eyJ….…``;
- GPU UUIDs (``GPU-8c1f…``), as ``torch.utils.collect_env`` does.

With ``anonymize`` it also masks the host name, IPv4/IPv6 addresses, the user name (in
``/home/<user>`` paths and alone) and ``MASTER_ADDR``. The name list follows
``../shared/reference/failure-modes.md`` §4.5.
"""

from __future__ import annotations

import getpass
import os
import re
import socket
from collections.abc import Mapping
from typing import Any

MARK = "<redacted: set>"
URL_MARK = "<redacted>"

#: Variable names whose values are secrets (matched anywhere in the upper-cased name).
_SECRET_NAME = re.compile(
    r"TOKEN|SECRET|PASSWORD|PASSWD|PASS(?:$|_)|API_?KEY|_KEY$|^KEY$|CREDENTIAL|AUTH|COOKIE|SESSION|PRIVATE"
    r"|^AWS_|^AZURE_|^DATABASE_URL$|^GOOGLE_APPLICATION_CREDENTIALS$"
)
#: Token shapes worth scrubbing anywhere, whatever variable or log line holds them.
_TOKENS = re.compile(
    r"\bhf_[A-Za-z0-9]{20,}"
    r"|\b(?:ghp|gho|ghu|ghs|ghr)_[A-Za-z0-9]{20,}|\bgithub_pat_[A-Za-z0-9_]{20,}"
    r"|\bsk-(?:[A-Za-z0-9_-]{2,}-)?[A-Za-z0-9_-]{16,}"
    r"|\bAKIA[0-9A-Z]{16}\b"
    r"|\bxox[abposr]-[A-Za-z0-9-]{10,}"
    r"|\beyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]*"
)
_URL_CREDENTIALS = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/\s:@]+:[^/\s@]+@")
_GPU_UUID = re.compile(r"\b(GPU|MIG)-[0-9a-fA-F]{8}(?:-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}\b")
_IPV4 = re.compile(r"(?<![\d.])(?:\d{1,3}\.){3}\d{1,3}(?![\d.])")
_IPV6 = re.compile(
    r"(?<![\w:])(?:(?:[0-9a-fA-F]{1,4}:){7}[0-9a-fA-F]{1,4}"
    r"|(?:[0-9a-fA-F]{1,4}:)*[0-9a-fA-F]{0,4}::(?:[0-9a-fA-F]{1,4}:)*[0-9a-fA-F]{1,4})(?![\w:])"
)
_HOME = re.compile(r"(/home/|/Users/)([^/\s]+)")
#: Literal values shorter than this are not scrubbed by value (``1``, ``true`` would
#: take half the report with them); their variable still shows as set.
MIN_SECRET_LENGTH = 4


def is_secret_name(name: str) -> bool:
    """Whether a variable called ``name`` holds a secret (``HF_TOKEN``, ``AWS_REGION``…)."""
    return bool(_SECRET_NAME.search(name.upper()))


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
            host = hostname if hostname is not None else _hostname()
            identities = [(host, "<host>"), (host.split(".")[0], "<host>")]
            identities.append((environ.get("MASTER_ADDR", ""), "<master-addr>"))
        #: Host names and MASTER_ADDR, as whole words only (a short host name must not eat
        #: parts of other words).
        self._identities = [
            (re.compile(rf"(?<![\w.-]){re.escape(name)}(?![\w-])"), mark)
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
        """``text`` with every secret (and, anonymizing, identity) replaced."""
        if self._literal is not None:
            text = self._literal.sub(lambda m: self._marks[m.group(0)], text)
        text = _URL_CREDENTIALS.sub(lambda m: f"{m.group('scheme')}{URL_MARK}@", text)
        text = _TOKENS.sub(MARK, text)
        text = _GPU_UUID.sub(lambda m: f"{m.group(1)}-<uuid>", text)
        text = _assignments(text)
        if self.anonymize:
            for pattern, mark in self._identities:
                text = pattern.sub(mark, text)
            text = _IPV4.sub("<ip>", text)
            text = _IPV6.sub("<ip>", text)
            text = _HOME.sub(lambda m: f"{m.group(1)}<user>", text)
            if self.user and len(self.user) >= 3:
                text = re.sub(rf"\b{re.escape(self.user)}\b", "<user>", text)
        return text

    def data(self, value: Any) -> Any:
        """A JSON-like structure with every string (keys included) passed through :meth:`text`;
        mapping entries whose key is a variable name that names a secret get the marker."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, Mapping):
            return {
                self.text(str(k)): MARK
                if isinstance(k, str) and k.isidentifier() and is_secret_name(k) and v
                else self.data(v)
                for k, v in value.items()
            }
        if isinstance(value, (list, tuple)):
            return [self.data(v) for v in value]
        return value

    def bytes(self, data: bytes) -> bytes:
        """Text files are scrubbed; binary files (traces are JSON, so text) pass unchanged
        only if they hold no secret byte string."""
        try:
            return self.text(data.decode("utf-8")).encode("utf-8")
        except UnicodeDecodeError:
            for value, mark in self.replacements:
                data = data.replace(value.encode(), mark.encode())
            return data


#: ``NAME=value`` / ``NAME: value`` / ``export NAME=value`` for secret-looking names in text.
_ASSIGNMENT = re.compile(
    r"(?P<name>\b[A-Za-z_][A-Za-z0-9_]*)(?P<sep>\s*[=:]\s*)(?P<value>\"[^\"]*\"|'[^']*'|\S+)"
)


def _assignments(text: str) -> str:
    def sub(match: re.Match[str]) -> str:
        if not is_secret_name(match.group("name")) or match.group("value") == MARK:
            return match.group(0)
        return f"{match.group('name')}{match.group('sep')}{MARK}"

    return _ASSIGNMENT.sub(sub, text)


def _hostname() -> str:
    try:
        return socket.gethostname()
    except OSError:
        return ""


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return ""
